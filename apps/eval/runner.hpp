// Runs samples under every configuration: one dense prefill per sample, kept while its
// configurations run; per configuration a fork of the prefilled sequence, the configuration's
// selector, and a greedy decode measured against exact attention (attention_probe.hpp).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "attention_probe.hpp"
#include "lib/model/llama_model.hpp"
#include "sample.hpp"

namespace kvsift::eval {

// A selector at a budget. The first configuration of a run is always dense (budget reported 1:
// every token).
struct Config {
  std::string selector;  // select::kind_name of policy.kind
  double budget = 1.0;   // as given: a fraction of the context (<= 1) or tokens
  select::Policy policy;
};

struct ConfigResult {
  bool ran = false;             // false: skipped (dense cannot do the task at this length)
  std::vector<int32_t> tokens;  // greedy output, end-of-generation token excluded
  std::string text;
  double score = 0.0;
  bool agrees = false;           // same greedy tokens as the dense configuration
  uint32_t steps = 0;            // decode steps run (and measured)
  double setup_seconds = 0.0;    // forking the prompt and setting the selector (its summaries)
  double decode_seconds = 0.0;   // in the model's decode, the probe's time taken out
  uint64_t kv_bytes = 0;         // K/V bytes the attention read, summed over steps
  double tokens_per_pair = 0.0;  // tokens attended per (layer, KV head), summed over steps
  uint64_t index_bytes = 0;      // bytes the selector read, summed over steps
  ProbeTotals probe;
  bool probe_failed = false;
};

// A prefilled prompt: its sequence stays in the model until release().
struct Prompt {
  int32_t seq = -1;
  int32_t first_token = -1;  // greedy choice after the prompt (the same for every configuration)
  uint64_t tokens = 0;
  double prefill_seconds = 0.0;
};

class Runner {
 public:
  // configs[0] must be dense. max_new: the largest max_new of the samples to run. The model must
  // have room for the prompts kept at once plus one fork, and outlive the runner.
  Runner(model::LlamaModel& model, std::vector<Config> configs, uint32_t max_new);

  const std::vector<Config>& configs() const noexcept { return configs_; }

  // Throws Error from the model (a prompt longer than its context, no room for a sequence).
  Prompt prefill(std::span<const int32_t> tokens);
  // Configuration `config` on a prefilled prompt; `dense` is the dense result of the same
  // sample (for agreement), null when config is 0.
  ConfigResult decode(const Sample& sample, const Prompt& prompt, std::size_t config,
                      const ConfigResult* dense);
  void release(const Prompt& prompt);

 private:
  model::LlamaModel& model_;
  std::vector<Config> configs_;
  uint32_t max_new_;
  AttentionProbe probe_;
  int32_t probe_prompt_ = -1;  // the sequence whose K/V the probe holds
};

}  // namespace kvsift::eval
