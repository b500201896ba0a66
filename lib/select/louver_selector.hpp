// Louver (docs/methods.md, Louver) as a token-level selector: per (sequence, layer, KV head) an
// exact range-search index over the keys (louver_index.hpp) returns every token with q . k >= tau,
// and attention runs over exactly those tokens plus the sink and window pages.
//
// The index of a (sequence, layer, KV head) is built the first time the pair is selected for
// (prepare(): after a prefill, over the whole prompt) and then takes every new key as it is
// stored (into its buffer, clustered when full). Per step, tau comes from the index's 512-key
// sample at the policy's token budget less the mandatory pages' tokens (LouverTau::token_budget),
// shared by the G query heads of the group (LouverGroupMode::shared_tau: measured in
// louver_index.hpp to keep more mass per token than the union of per-head sets). The returned
// tokens outside the mandatory pages are gathered from the cache, in storage form, into row
// chunks. Louver proves no bound on the dropped mass and makes no estimate of it (NaN).
//
// Device filter (policy.device >= 0): each index's centers, radii and assignments are
// mirrored on that CUDA device (gpu/louver_filter.hpp; prepare() uploads what a flush added), and
// select() runs the filter pass of every queried (sequence, KV head) of the call there in one
// batch; the host then scores the candidates and the buffered keys exactly
// (LouverIndex::begin_query / finish_query). The exact check decides, so the tokens are the CPU
// mode's (tests/test_gpu_louver.cpp). Should the device fail at select time, the step falls back
// to the CPU filter (same tokens) and device_fallbacks() counts it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "gpu/louver_filter.hpp"
#include "lib/select/louver_index.hpp"
#include "lib/select/selector.hpp"

namespace kvsift::select {

// The arrays of an index a device mirror copies (gpu/louver_filter.hpp); valid until the index's
// next append().
gpu::LouverIndexView louver_device_view(const LouverIndex& index) noexcept;

class LouverSelector final : public Selector {
 public:
  // With policy.device >= 0, throws Error(unsupported) when the build has no CUDA or the
  // device cannot be used (Policy::validate refuses a device below -1).
  LouverSelector(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
                 ThreadPool& pool, const simd::Kernels& kernels);

  void on_page_sealed(const SealedPage&) noexcept override {}
  void on_sequence_freed(int32_t seq_id) noexcept override;
  void prepare(const SelectCall& call, Selection& out) override;
  void select(const SelectCall& call, Selection& out) noexcept override;
  // The indexes' centers, radii, assignments and samples (their key copies are not counted: the
  // cache holds the same keys).
  uint64_t held_bytes() const noexcept override;
  // Steps whose device filter failed and ran on the CPU instead (device mode only).
  uint64_t device_fallbacks() const noexcept { return device_fallbacks_; }
  // Device bytes of the indexes' mirrors (0 in the CPU mode).
  uint64_t device_bytes() const noexcept { return filter_ ? filter_->device_bytes() : 0; }

 private:
  // [sequence id][layer * n_kv_heads + kv_head]; built when first prepared.
  std::vector<std::vector<std::optional<LouverIndex>>> indexes_;
  uint32_t slot_of(int32_t seq, uint32_t layer, uint32_t kv_head) const noexcept;
  // The device filter's batch for one select(): which pairs were queried and how.
  void run_device_filter(const SelectCall& call) noexcept;

  LouverParams params_;
  std::vector<float> key_;  // [head_dim] one key read back from the cache
  // Device mode: the filter and its per-call batch, [max_batch * n_kv_heads] items.
  std::unique_ptr<gpu::LouverFilter> filter_;
  std::vector<gpu::LouverFilterItem> items_;
  std::vector<float> q_norms_, taus_;  // [items, group, kLouverMaxSubspaces], [items, group]
  std::vector<int32_t> item_of_pair_;  // [pairs] the pair's item, or -1 when not queried
  bool device_ok_ = false;             // the last run_device_filter() succeeded
  uint64_t device_fallbacks_ = 0;
};

}  // namespace kvsift::select
