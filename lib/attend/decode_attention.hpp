// Exact decode attention over the paged cache: a batch of sequences, one query token each, all
// query heads of one layer, over every stored page or over explicit page lists.
//
// Parallel over (sequence x KV head x split of the pages) on the attention's thread pool, then a
// split-K merge, so every thread streams pages even at batch 1 with one KV head. Each K/V page is
// read once per GQA group. The workspace is sized at construction: run() does not allocate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "lib/cache/kv_cache.hpp"
#include "lib/core/aligned.hpp"
#include "lib/core/thread_pool.hpp"

namespace kvsift {

// Compressed-row page lists over the n_seqs * n_kv_heads (sequence, KV head) pairs,
// sequence-major (the C API's kvsift_page_list).
struct PageLists {
  const uint32_t* offsets = nullptr;   // [pairs + 1]
  const uint32_t* page_ids = nullptr;  // ascending logical page ids per pair
};

// Token rows attended besides the pages, per (sequence, KV head) pair: rows a selector gathered
// from the cache or reconstructed, packed as the cache packs pages (chunks of page_tokens rows, K
// then V, in the storage dtype, geometry.slot_bytes() each), so one kernel reads both.
struct RowChunks {
  const std::byte* chunks = nullptr;
  const uint32_t* chunk_offsets = nullptr;  // [pairs + 1] the first chunk of each pair
  const uint32_t* row_counts = nullptr;     // [pairs]; a pair's last chunk may be partial
};

// Token rows given by their S4R coefficients (docs/methods.md, S4R: decode;
// lib/select/s4r_selector.hpp) rather than their values, for a backend that reconstructs them
// itself next to the attention: OffloadAttention, which keeps the bases on the device so that per
// step only coefficients and positions cross PCIe (lib/offload/offload_attention.hpp).
// DecodeAttention refuses them: on the CPU the selector reconstructs, as before. The rows sit
// where the call's RowChunks places them (its chunk_offsets and row_counts; its chunks are not
// read); a unit says what its rows are.
//
// A unit is one basis pair over heads_per_unit consecutive KV heads of one sequence (all of the
// layer's, or one: S4rPolicy::per_head_bases). Units are sequence-major, n_seqs * n_kv_heads /
// heads_per_unit of them; unit u of sequence i spans pairs i * n_kv_heads + u * heads_per_unit
// onwards, which all hold the unit's rows. A unit without rows (its pairs have none) is not read.
struct LatentUnit {
  // Names the bases for as long as they stay as they are, nonzero: a backend that keeps a copy
  // sends them again when the id of its (sequence, layer, unit) changes.
  uint64_t basis_id = 0;
  uint32_t rank = 0;                   // 1..heads_per_unit * head_dim
  const float* key_basis = nullptr;    // [rank, heads_per_unit * head_dim] float32: B_K^T
  const float* value_basis = nullptr;  // B_V^T, the same shape
  // [n_tokens, rank] in the cache's row_dtype(): coefficient row j is token position first + j.
  const uint16_t* key_coeffs = nullptr;
  const uint16_t* value_coeffs = nullptr;
  uint64_t first = 0, n_tokens = 0;
  // [the unit's rows] each row's token position, in first .. first + n_tokens - 1, in the rows'
  // order: the K row is reconstructed, then rotated by RoPE at this position.
  const uint32_t* positions = nullptr;
};

struct LatentRows {
  uint32_t heads_per_unit = 0;
  const LatentUnit* units = nullptr;  // [n_seqs * n_kv_heads / heads_per_unit]
};

struct AttendCall {
  uint32_t layer = 0;
  uint32_t n_seqs = 0;
  const int32_t* seq_ids = nullptr;  // [n_seqs]
  const float* q = nullptr;          // [n_seqs, n_query_heads, head_dim]
  float* out = nullptr;              // [n_seqs, n_query_heads, head_dim]
  const PageLists* pages = nullptr;  // nullptr: every stored page
  const RowChunks* rows = nullptr;   // nullptr: no rows besides the pages
  // With rows: their values as coefficients (the rows' chunks are not read); nullptr: rows->chunks
  // holds them. Only a backend that reconstructs accepts it.
  const LatentRows* latent = nullptr;
};

struct AttendStats {
  uint64_t pages_read = 0;   // (page, KV head) units
  uint64_t tokens_read = 0;  // summed over (sequence, KV head)
  uint64_t bytes_read = 0;   // K + V bytes
};

// Where decode attention runs, one interface over the two places (one interface across the
// CPU-only and GPU-offload modes): DecodeAttention below attends on the CPU;
// OffloadAttention (lib/offload/offload_attention.hpp) keeps the KV cache in host memory and
// attends on a CUDA device over the pages it moved there. Both take the same AttendCall and write
// the same output (to fp32 rounding), so the model runner and the C API hold an AttentionBackend
// and need not care which. One virtual call per layer and step, never per token.
class AttentionBackend {
 public:
  virtual ~AttentionBackend() = default;

  // Throws Error naming the first bad argument, or the limit of this backend the call exceeds
  // (unsupported, capacity_exceeded); writes nothing.
  virtual void validate(const KvCache& cache, const AttendCall& call) const = 0;
  // Writes call.out for a call validate() accepted against the same cache state. The CPU never
  // fails here; a device may: Error{internal} naming the CUDA call, call.out unspecified.
  virtual void attend(const KvCache& cache, const AttendCall& call) = 0;
  // What the last attend() read: pages, tokens and K/V bytes summed over the pairs.
  virtual const AttendStats& last_stats() const noexcept = 0;
  // "cpu" or "cuda:<device>", for logs and summaries.
  virtual const char* name() const noexcept = 0;
};

class DecodeAttention final : public AttentionBackend {
 public:
  // Starts the pool of n_threads threads (0: the CPUs in the process's affinity mask) that the
  // handle owning this attention also lends its selector and its other parallel loops
  // (thread_pool.hpp). kernels: the handle's table (lib/core/kernel_runtime.hpp), a static one.
  // Throws invalid_argument / out_of_memory.
  DecodeAttention(const CacheGeometry& geometry, uint32_t max_batch, int n_threads,
                  const simd::Kernels& kernels);

  // Throws Error naming the first bad argument; writes nothing. Refuses latent rows
  // (unsupported): the CPU attends rows as values.
  void validate(const KvCache& cache, const AttendCall& call) const override;
  // validate() less its refusal of latent rows: the checks of the sequences, the page lists and
  // the rows' placement that every backend shares (rows->chunks may then be NULL).
  void validate_lists(const KvCache& cache, const AttendCall& call) const;
  // The part of validate() a selector needs before it chooses the lists: layer, sizes, pointers
  // and sequence ids.
  void validate_sequences(const KvCache& cache, const AttendCall& call) const;
  // Requires a call that validate() accepted against the same cache state.
  void run(const KvCache& cache, const AttendCall& call) noexcept;
  void attend(const KvCache& cache, const AttendCall& call) override { run(cache, call); }

  const AttendStats& last_stats() const noexcept override { return stats_; }
  const char* name() const noexcept override { return "cpu"; }
  uint32_t max_batch() const noexcept { return max_batch_; }
  int n_threads() const noexcept { return n_threads_; }
  // Stays at one address when the attention moves.
  ThreadPool& pool() const noexcept { return *pool_; }

 private:
  struct Task {
    uint32_t pair;   // seq_index * n_kv_heads + kv_head
    uint32_t first;  // offset into the pair's page range or list, or into its row chunks
    uint32_t count;
    bool rows;  // over the pair's row chunks, not its pages
  };
  uint32_t plan(const KvCache& cache, const AttendCall& call) noexcept;

  CacheGeometry geometry_;
  const simd::Kernels* kernels_;
  uint32_t max_batch_;
  std::unique_ptr<ThreadPool> pool_;
  int n_threads_;
  std::vector<Task> tasks_;           // capacity: most tasks a call can produce
  std::vector<uint32_t> pair_tasks_;  // [pairs + 1] first task of each pair
  std::size_t partial_stride_;        // floats per task: m [G], l [G], pad to a line, acc [G, d]
  std::size_t acc_offset_;
  AlignedVector<float> q_scaled_;  // [max_batch, n_query_heads, head_dim]
  AlignedVector<float> partials_;  // [tasks, partial_stride_]
  AlignedVector<float> scratch_;   // [threads, G * page_tokens]
  AttendStats stats_;
};

}  // namespace kvsift
