#include "lib/model/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/core/error.hpp"

namespace kvsift::model {

Sampler::Sampler(const SamplerParams& params) : params_(params), rng_(params.seed) {
  require(params.temperature >= 0.0f && std::isfinite(params.temperature),
          "temperature=", params.temperature, " must be >= 0");
  require(params.top_p > 0.0f && params.top_p <= 1.0f, "top_p=", params.top_p, " is not in (0, 1]");
}

int32_t Sampler::sample(std::span<const float> logits) {
  // -inf excludes a token (a mask); NaN and +inf have no probability to give, so they are refused
  // rather than ordered arbitrarily. Checked before anything changes, so a refused call leaves the
  // generator where it was.
  std::size_t best = logits.size();
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const float x = logits[i];
    if (std::isnan(x) || x == std::numeric_limits<float>::infinity())
      fail(Status::invalid_argument, "logits[", i, "]=", x, " is not a finite number or -inf");
    if (x != -std::numeric_limits<float>::infinity() && (best == logits.size() || x > logits[best]))
      best = i;
  }
  require(best < logits.size(), "every one of the ", logits.size(), " logits is -inf");
  if (params_.temperature == 0.0f) return static_cast<int32_t>(best);
  candidates_.resize(logits.size());
  const float m = logits[best];
  double total = 0.0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    // (x - m) <= 0 and temperature > 0: p in [0, 1], and p = 1 for the best token.
    const float p = std::exp((logits[i] - m) / params_.temperature);
    candidates_[i] = {p, static_cast<int32_t>(i)};
    total += p;
  }
  std::sort(candidates_.begin(), candidates_.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  std::size_t keep = 0;
  double kept = 0.0;
  while (keep < candidates_.size() && kept < params_.top_p * total)
    kept += candidates_[keep++].first;
  const double u = std::uniform_real_distribution<double>(0.0, kept)(rng_);
  double acc = 0.0;
  for (std::size_t i = 0; i < keep; ++i) {
    acc += candidates_[i].first;
    if (u < acc) return candidates_[i].second;
  }
  return candidates_[keep - 1].second;
}

}  // namespace kvsift::model
