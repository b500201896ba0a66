// Next-token choice from logits: greedy, or temperature with nucleus (top-p) truncation from a
// seeded generator, so a run repeats exactly for a given seed.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

namespace kvsift::model {

struct SamplerParams {
  float temperature = 0.0f;  // 0: greedy (argmax, ties to the lower id)
  float top_p = 1.0f;        // keep the smallest set of tokens whose probability reaches top_p
  uint64_t seed = 0;
};

class Sampler {
 public:
  // Throws invalid_argument for a negative temperature or top_p outside (0, 1].
  explicit Sampler(const SamplerParams& params);
  // The chosen index. -inf logits are never chosen; throws invalid_argument (and leaves the
  // generator untouched) for a NaN or +inf logit, or when every logit is -inf.
  int32_t sample(std::span<const float> logits);

 private:
  SamplerParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;
};

}  // namespace kvsift::model
