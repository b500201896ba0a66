// Runs one sample under every configuration: one dense prefill, then per configuration a fork of
// the prefilled sequence, the configuration's selector, and a greedy decode measured against
// exact attention (attention_probe.hpp).
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
  std::vector<int32_t> tokens;  // greedy output, end-of-generation token excluded
  std::string text;
  double score = 0.0;
  bool agrees = false;          // same greedy tokens as the dense configuration
  uint32_t steps = 0;           // decode steps run (and measured)
  double decode_seconds = 0.0;  // in the model's decode, the probe's time taken out
  uint64_t kv_bytes = 0;        // K/V bytes the attention read, summed over steps
  uint64_t index_bytes = 0;     // bytes the selector read, summed over steps
  ProbeTotals probe;
  bool probe_failed = false;
};

struct SampleResult {
  uint64_t prompt_tokens = 0;
  double prefill_seconds = 0.0;
  std::vector<ConfigResult> configs;  // in the runner's configuration order
};

class Runner {
 public:
  // configs[0] must be dense. max_new: the largest max_new of the samples to run. The model must
  // have room for two sequences (max_seqs >= 2) and outlive the runner.
  Runner(model::LlamaModel& model, std::vector<Config> configs, uint32_t max_new);

  const std::vector<Config>& configs() const noexcept { return configs_; }

  // Throws Error from the model (a prompt longer than its context, ...).
  SampleResult run(const Sample& sample, std::span<const int32_t> prompt);

 private:
  model::LlamaModel& model_;
  std::vector<Config> configs_;
  uint32_t max_new_;
  AttentionProbe probe_;
};

}  // namespace kvsift::eval
