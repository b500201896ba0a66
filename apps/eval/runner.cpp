#include "runner.hpp"

#include <chrono>
#include <stdexcept>

#include "lib/model/sampler.hpp"

namespace kvsift::eval {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Frees a sequence on every way out of a scope.
struct SequenceGuard {
  model::LlamaModel& model;
  int32_t seq;
  ~SequenceGuard() { model.free_sequence(seq); }
};

}  // namespace

Runner::Runner(model::LlamaModel& model, std::vector<Config> configs, uint32_t max_new)
    : model_(model), configs_(std::move(configs)), max_new_(max_new), probe_(model, max_new) {
  if (configs_.empty() || configs_.front().policy.kind != select::Kind::dense)
    throw std::invalid_argument("the first configuration must be dense");
}

SampleResult Runner::run(const Sample& sample, std::span<const int32_t> prompt) {
  if (sample.max_new > max_new_)
    throw std::invalid_argument("sample " + sample.id + " asks for more new tokens than planned");
  const model::Tokenizer& tokenizer = model_.tokenizer();
  model::Sampler greedy(model::SamplerParams{});
  SampleResult result;
  result.prompt_tokens = prompt.size();

  // Prefill under the dense selector so no selector summarises pages the prefill seals.
  model_.set_selector(configs_.front().policy);
  const SequenceGuard base{model_, model_.create_sequence()};
  const auto prefill_start = Clock::now();
  model_.prefill(base.seq, prompt, nullptr, nullptr, nullptr);
  result.prefill_seconds = seconds_since(prefill_start);
  probe_.set_prompt(base.seq);
  const int32_t first = greedy.sample(model_.logits(base.seq));

  for (const Config& config : configs_) {
    ConfigResult r;
    const SequenceGuard fork{model_, model_.fork_sequence(base.seq)};
    model_.set_selector(config.policy);
    probe_.begin(fork.seq);
    model_.set_observer(&probe_);
    int32_t next = first;
    try {
      while (!tokenizer.is_end_of_generation(next)) {
        r.tokens.push_back(next);
        if (r.tokens.size() == sample.max_new) break;
        const double probe_before = probe_.totals().seconds;
        const auto step_start = Clock::now();
        model_.decode({&fork.seq, 1}, {&next, 1});
        r.decode_seconds += seconds_since(step_start) - (probe_.totals().seconds - probe_before);
        r.steps += 1;
        r.kv_bytes += model_.stats().last_step_kv_bytes_read;
        r.index_bytes += model_.stats().last_step_index_bytes_read;
        next = greedy.sample(model_.logits(fork.seq));
      }
    } catch (...) {
      model_.set_observer(nullptr);
      throw;
    }
    model_.set_observer(nullptr);
    r.probe = probe_.totals();
    r.probe_failed = probe_.failed();
    r.text = tokenizer.decode(r.tokens);
    r.score = score_output(sample, r.text);
    r.agrees = result.configs.empty() || r.tokens == result.configs.front().tokens;
    result.configs.push_back(std::move(r));
  }
  return result;
}

}  // namespace kvsift::eval
