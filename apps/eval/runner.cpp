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

int32_t greedy(std::span<const float> logits) {
  return model::Sampler(model::SamplerParams{}).sample(logits);
}

}  // namespace

Runner::Runner(model::LlamaModel& model, std::vector<Config> configs, uint32_t max_new)
    : model_(model), configs_(std::move(configs)), max_new_(max_new), probe_(model, max_new) {
  if (configs_.empty() || configs_.front().policy.kind != select::Kind::dense)
    throw std::invalid_argument("the first configuration must be dense");
}

Prompt Runner::prefill(std::span<const int32_t> tokens) {
  // Prefill under dense so no selector summarises the pages the prefill seals.
  model_.set_selector(configs_.front().policy);
  Prompt p;
  p.seq = model_.create_sequence();
  p.tokens = tokens.size();
  try {
    const auto start = Clock::now();
    model_.prefill(p.seq, tokens, nullptr, nullptr, nullptr);
    p.prefill_seconds = seconds_since(start);
    p.first_token = greedy(model_.logits(p.seq));
  } catch (...) {
    model_.free_sequence(p.seq);
    throw;
  }
  return p;
}

void Runner::release(const Prompt& prompt) {
  if (probe_prompt_ == prompt.seq) probe_prompt_ = -1;
  model_.free_sequence(prompt.seq);
}

ConfigResult Runner::decode(const Sample& sample, const Prompt& prompt, std::size_t config,
                            const ConfigResult* dense) {
  if (sample.max_new > max_new_)
    throw std::invalid_argument("sample " + sample.id + " asks for more new tokens than planned");
  if (probe_prompt_ != prompt.seq) {
    probe_.set_prompt(prompt.seq);
    probe_prompt_ = prompt.seq;
  }
  const model::Tokenizer& tokenizer = model_.tokenizer();
  ConfigResult r;
  r.ran = true;
  const auto setup_start = Clock::now();
  // Fork under dense, which keeps no summaries: the previous configuration's selector would
  // otherwise summarise the fork's pages only to be replaced.
  model_.set_selector(configs_.front().policy);
  const SequenceGuard fork{model_, model_.fork_sequence(prompt.seq)};
  if (config > 0) model_.set_selector(configs_[config].policy);
  r.setup_seconds = seconds_since(setup_start);

  probe_.begin(fork.seq);
  model_.set_observer(&probe_);
  int32_t next = prompt.first_token;
  try {
    while (!tokenizer.is_end_of_generation(next)) {
      r.tokens.push_back(next);
      if (r.tokens.size() == sample.max_new) break;
      const double probe_before = probe_.totals().seconds;
      const auto step_start = Clock::now();
      model_.decode({&fork.seq, 1}, {&next, 1});
      r.decode_seconds += seconds_since(step_start) - (probe_.totals().seconds - probe_before);
      r.steps += 1;
      r.kv_bytes += model_.stats().last_step.kv_bytes_read;
      r.tokens_per_pair += static_cast<double>(model_.stats().last_step.tokens_read) /
                           static_cast<double>(model_.stats().last_step.pairs);
      r.index_bytes += model_.stats().last_step.index_bytes_read;
      next = greedy(model_.logits(fork.seq));
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
  r.agrees = dense == nullptr || r.tokens == dense->tokens;
  return r;
}

}  // namespace kvsift::eval
