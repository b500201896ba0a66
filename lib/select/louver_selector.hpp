// Louver (papers.md section 1) as a token-level selector: per (sequence, layer, KV head) an exact
// range-search index over the keys (louver_index.hpp) returns every token with q . k >= tau, and
// attention runs over exactly those tokens plus the sink and window pages.
//
// The index of a (sequence, layer, KV head) is built the first time the pair is selected for
// (prepare(): after a prefill, over the whole prompt) and then takes every new key as it is
// stored (into its buffer, clustered when full). Per step, tau comes from the index's 512-key
// sample at the policy's token budget less the mandatory pages' tokens (LouverTau::token_budget),
// shared by the G query heads of the group (LouverGroupMode::shared_tau: measured in
// louver_index.hpp to keep more mass per token than the union of per-head sets). The returned
// tokens outside the mandatory pages are gathered from the cache, in storage form, into row
// chunks. Louver proves no bound on the dropped mass and makes no estimate of it (NaN).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "lib/select/louver_index.hpp"
#include "lib/select/selector.hpp"

namespace kvsift::select {

class LouverSelector final : public Selector {
 public:
  LouverSelector(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
                 int n_threads);

  void on_page_sealed(const SealedPage&) noexcept override {}
  void on_sequence_freed(int32_t seq_id) noexcept override;
  void prepare(const SelectCall& call, Selection& out) override;
  void select(const SelectCall& call, Selection& out) noexcept override;
  // The indexes' centers, radii, assignments and samples (their key copies are not counted: the
  // cache holds the same keys).
  uint64_t held_bytes() const noexcept override;

 protected:
  bool selects_rows() const noexcept override { return true; }

 private:
  // [sequence id][layer * n_kv_heads + kv_head]; built when first prepared.
  std::vector<std::vector<std::optional<LouverIndex>>> indexes_;
  LouverParams params_;
  std::vector<float> key_;  // [head_dim] one key read back from the cache
};

}  // namespace kvsift::select
