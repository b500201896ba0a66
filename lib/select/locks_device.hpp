// The device mirror of the LOCKS selector (policy.device >= 0; gpu/locks_scorer.hpp): the records
// the CPU builds are copied to the device (the slots summarised since the last upload travel in
// prepare(), or in select() when prepare() could not send them), and select() runs the scoring,
// combine and top-b of every pair of the call there in one batch. Should the device fail at
// select time, the caller runs the step on the CPU (the records are still there) and fallbacks()
// counts it; a query that is not finite also takes the CPU path (the device does not repeat the
// CPU's NaN handling), uncounted. lib/select/locks_selector.cpp owns one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/locks_scorer.hpp"
#include "lib/core/aligned.hpp"
#include "lib/select/selector.hpp"

namespace kvsift::select {

class LocksDevice {
 public:
  // The scorer on policy.device for pages of `rank`, combined by `combine`. Throws Error
  // (unsupported without CUDA or the device, invalid_argument for a policy the device does not
  // serve).
  // kernels: the handle's, which dequantize a q8 cache's open pages.
  LocksDevice(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
              uint32_t rank, GqaCombine combine, float scale, const simd::Kernels& kernels);

  // Marks slots whose records were (re)built: the next upload sends them.
  void summaries_built(const uint32_t* slots, std::size_t n) noexcept;
  // Room to name the call's tables, so that select() allocates nothing.
  void reserve_names(const SelectCall& call);
  // Sends the records marked since the last upload (records: the host's slot-indexed array);
  // they stay pending on failure.
  bool upload_pending(const std::byte* records) noexcept;
  // The whole call on the device, records already built; false (out untouched) when the CPU must
  // run it. summary_bytes: the CPU path's index bytes per sealed page.
  bool select(const SelectCall& call, const std::byte* records, std::size_t summary_bytes,
              Selection& out) noexcept;
  // A sequence's sealed table entries change only when it is freed (its id may come back with
  // other pages) or its pages are released: its tables get new names for the scorer then.
  void rename_tables(int32_t seq) noexcept;

  uint64_t fallbacks() const noexcept { return fallbacks_; }
  uint64_t device_bytes() const noexcept { return scorer_.device_bytes(); }

 private:
  // The first of the names of a sequence's tables (one per layer and KV head) for the scorer; 0
  // (unnamed: sent whole) for an id prepare() did not see.
  uint64_t table_name(int32_t seq) noexcept;

  // The open page's keys of pair i for the scorer: the slot's own for a 16-bit cache; for a q8
  // cache, its dequantized rows (simd/page_rows.hpp) in fp16 (CacheGeometry::row_dtype) in
  // open_keys_ at i * page_tokens * head_dim, through open_rows_.
  const uint16_t* open_keys(uint32_t i, uint32_t slot, uint32_t open) noexcept;

  KvCache& cache_;
  Policy policy_;
  const simd::Kernels& kernels_;
  gpu::LocksScorer scorer_;
  // The slots summarised since the last upload (each listed once), the call's pairs.
  AlignedVector<uint32_t> upload_slots_;
  std::vector<uint8_t> upload_marked_;
  std::size_t n_upload_ = 0;
  std::vector<gpu::LocksPair> pairs_;
  std::vector<uint16_t> open_keys_;    // q8 only: [max_pairs, page_tokens, head_dim]
  std::vector<float> open_rows_;       // q8 only: [page_tokens, head_dim]
  std::vector<uint64_t> table_names_;  // per sequence id: table_name()'s, 0 until named
  uint64_t next_table_name_ = 1;
  uint64_t fallbacks_ = 0;
};

}  // namespace kvsift::select
