// The decode step of one layer for a batch of sequences, owned in one place: the selection of the
// pages (and token rows) each (sequence, KV head) attends to, the exact attention over them, and
// the step's statistics. The C API's cache handle (lib/capi/capi.cpp) and the model runner
// (lib/model/llama_model.hpp) each hold one engine and call it; neither repeats the step.
//
// Where attention runs is the engine's backend: DecodeAttention on the CPU, or, with a device,
// OffloadAttention (lib/offload/offload_attention.hpp), which keeps the KV cache in host memory and
// moves only the listed pages. Neither backend knows about selectors: the engine plans (selects),
// the backend runs; the engine alone tells a selector that its backend reconstructs S4R's rows
// from coefficients on the device (SelectCall::latent_rows). On a device the engine cuts a batch
// into parts and selects part i + 1 while the device moves and attends part i (the backend's
// begin/enqueue/finish).
#pragma once

#include <cstdint>
#include <memory>

#include "lib/attend/decode_attention.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/core/thread_pool.hpp"
#include "lib/select/selector.hpp"

namespace kvsift {

class OffloadAttention;

struct EngineOptions {
  uint32_t max_batch = 1;  // most sequences per step
  int n_threads = 0;       // the handle's thread pool (0: the CPUs of the affinity mask)
  // Most pages one (sequence, layer, KV head) holds; 0: the pool's capacity, for a caller that
  // may fill the pool from one layer (the C API's cache). A decoder knows its context.
  uint64_t max_pages_per_pair = 0;
  // A CUDA device for attention (offload mode), or -1 for the CPU. The cache's pool must be
  // pinned then.
  int device = -1;
  // Offload mode: device page cache slots per layer (as many again are reserved for token rows);
  // 0: the device holds a copy of the whole pool, every page resident
  // (OffloadOptions::cache_pages).
  uint32_t device_cache_pages = 0;
  // Offload mode: the parts a batch is cut into so that selection overlaps the device (1..4; at
  // most the batch).
  uint32_t device_step_parts = 2;
};

// One layer step's telemetry (attend, attend_selected or select), summed over its parts.
struct LayerStepStats {
  uint64_t pairs = 0;                         // (sequence, KV head) pairs selected for
  uint64_t pages_chosen = 0;                  // summed over the pairs
  uint64_t index_bytes_read = 0;              // what the selection read
  double kept_estimate_sum = 0.0;             // over the pairs (Selection::kept_estimate)
  double dropped_bound = 0.0;                 // the worst pair's; NaN when some pair proves none
  AttendStats attended;                       // what the attention read
  double select_us = 0.0;                     // CPU selection
  double attend_us = 0.0;                     // CPU attention, or the device's kernel
  double transfer_us = 0.0;                   // offload: the device's page and list transfers
  double plan_us = 0.0;                       // offload: the host's planning of the moves
  double overlap_us = 0.0;                    // offload: device attention hidden behind selection
  uint64_t h2d_bytes = 0;                     // offload: bytes host to device
  uint64_t row_h2d_bytes = 0;                 // offload: of them the token rows' (or coefficients)
  uint64_t rows_equivalent_bytes = 0;         // offload: those rows' bytes as values
  uint64_t cache_hits = 0, cache_misses = 0;  // offload: device page cache, (page, KV head) units
};

class DecodeEngine {
 public:
  // Registers the offload backend and the selector with the cache as listeners; the engine must
  // not outlive the cache. kernels: the handle's table (lib/core/kernel_runtime.hpp), which the
  // engine hands its attention and its selectors. Starts with the dense selector. Throws Error:
  // invalid_argument (options out of range), unsupported (a device without CUDA in the build or a
  // usable device), out_of_memory.
  DecodeEngine(KvCache& cache, const simd::Kernels& kernels, const EngineOptions& options);
  ~DecodeEngine();
  DecodeEngine(const DecodeEngine&) = delete;
  DecodeEngine& operator=(const DecodeEngine&) = delete;

  // Makes later attend_selected() steps use the policy. All or nothing: the new selector is built
  // beside the current one (both listen to seals meanwhile) and replaces it only when everything
  // succeeded, so a refused policy leaves the previous selector, and whatever it holds (S4R's
  // compressed tokens), in place. Throws Error (invalid_argument, unsupported, out_of_memory).
  void set_selector(const select::Policy& policy);
  const select::Selector& selector() const noexcept { return *selector_; }
  // Builds the summaries of the pages sealed since the last build (a selection would first): the
  // model runner calls it after each prefill layer, so that the prompt's summaries are built as
  // the prefill proceeds (in offload mode, while the device computes).
  void build_summaries() noexcept { selector_->build_summaries(); }

  // Exact attention over every stored page, or call.pages and call.rows. Validates first (nothing
  // is written when it throws); non-finite queries are the caller's to refuse.
  void attend(const AttendCall& call);
  // The layer step: selection for call's sequences, then attention over what it chose (call.pages
  // and call.rows are ignored). whole_batch: select the batch in one piece even on a device, so
  // that selection() afterwards describes every sequence (an observer reads it); otherwise a
  // device step selects in parts and selection() holds the last part's choice, and a dense one
  // attends every page without selecting (selection() is left as it was). Throws Error: bad
  // arguments (before anything ran), what the selector's prepare() throws, internal for a device
  // failure.
  void attend_selected(const AttendCall& call, bool whole_batch = false);
  // Selection alone, for the whole batch, into selection() and last_step(): what an engine with
  // its own attention kernel asks for. call.out, pages and rows are not used. Throws as
  // attend_selected() before its attention.
  void select(const AttendCall& call);

  // The checks attend_selected() makes before it selects (layer, sizes, pointers, live ids).
  void validate_sequences(const AttendCall& call) const { cpu_.validate_sequences(cache_, call); }

  const select::Selection& selection() const noexcept { return selection_; }
  const LayerStepStats& last_step() const noexcept { return last_; }
  const AttentionBackend& backend() const noexcept;
  // The offload backend, or nullptr on the CPU.
  const OffloadAttention* offload() const noexcept { return offload_.get(); }
  OffloadAttention* offload() noexcept { return offload_.get(); }
  ThreadPool& pool() const noexcept { return cpu_.pool(); }
  uint32_t max_batch() const noexcept { return cpu_.max_batch(); }
  int n_threads() const noexcept { return cpu_.n_threads(); }

 private:
  AttentionBackend& mutable_backend() noexcept;
  // Whether attend_selected() asks for token rows as coefficients (SelectCall::latent_rows).
  bool latent_rows() const noexcept;
  // Selection of one part of a batch, its telemetry added to last_.
  void select_part(const select::SelectCall& call);
  // Validates and attends, then records the attention's half of last_.
  void run_attention(const AttendCall& call);
  void record_attention(double cpu_us) noexcept;
  void attend_in_parts(const AttendCall& call);

  KvCache& cache_;
  const simd::Kernels& kernels_;
  DecodeAttention cpu_;
  std::unique_ptr<OffloadAttention> offload_;  // after cache_, which it listens to
  uint64_t selector_max_pages_;
  std::unique_ptr<select::Selector> selector_;
  select::Selection selection_;
  LayerStepStats last_;
};

}  // namespace kvsift
