// Exact attention beside the model's decode: for every layer, query head and decode step, the
// float64 softmax over all stored tokens of the sequence, against which the step's selection and
// attention output are measured. Evaluation only; production decode never computes this.
//
//   mass recall   share of the exact softmax mass on the tokens of the selected pages
//   out rel err   ||out - exact out|| / ||exact out||, out being the model's attention output
//
// The prompt's keys and values are read from the cache once per sample (set_prompt) and kept as
// float32; each step reads only the tokens decoded since, so a step costs the two float64
// passes over the context (scores, then the weighted sum of values), spread over OpenMP threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <span>
#include <vector>

#include "lib/model/llama_model.hpp"

namespace kvsift::eval {

// Sums over the observations since begin().
struct ProbeTotals {
  uint64_t heads = 0;  // (step, layer, query head) observations
  double recall_sum = 0.0;
  double recall_min = 1.0;
  double rel_err_sum = 0.0;
  // Per (step, layer, KV head) pair: the selector's estimate of the dropped share (1 - its
  // kept_estimate) and, where it proves one, its bound on the dropped share; a violation is a
  // pair whose measured dropped share, largest over the group's query heads, exceeds the bound.
  uint64_t pairs = 0;
  double estimated_dropped_sum = 0.0;
  uint64_t bounded_pairs = 0;
  double bound_sum = 0.0;
  uint64_t bound_violations = 0;
  double seconds = 0.0;  // spent in on_layer
};

class AttentionProbe final : public model::DecodeObserver {
 public:
  // max_new: most decode steps per sequence after the prompt. The model must outlive the probe.
  AttentionProbe(const model::LlamaModel& model, uint32_t max_new);

  // Copies the K/V of `seq`'s prompt (all its tokens now) out of the cache. Throws Error.
  void set_prompt(int32_t seq);
  // Starts measuring `seq`, a fork of the prompt sequence, and clears the totals.
  void begin(int32_t seq);
  const ProbeTotals& totals() const noexcept { return totals_; }
  // True when a cache read failed inside on_layer (which must not throw); the totals are then
  // incomplete.
  bool failed() const noexcept { return failed_; }

  void on_layer(uint32_t layer, std::span<const int32_t> seq_ids, const float* q,
                const select::Selection& selection, const float* out) noexcept override;

 private:
  const model::LlamaModel& model_;
  uint32_t n_layers_, n_kv_heads_, group_, head_dim_, page_tokens_;
  uint32_t max_new_;
  uint64_t prompt_tokens_ = 0;
  int32_t seq_ = -1;
  // [layer * n_kv_heads + kv_head]: [prompt + max_new, head_dim] float32 K and V; the prompt,
  // then the tokens of the sequence being measured.
  std::vector<std::vector<float>> k_, v_;
  std::vector<uint64_t> filled_;              // per (layer, KV head): tokens in k_, v_
  std::vector<std::vector<double>> scratch_;  // per OpenMP thread: [prompt + max_new]
  std::vector<double> recall_, rel_err_;      // per query head of the current call
  ProbeTotals totals_;
  bool failed_ = false;
};

}  // namespace kvsift::eval
