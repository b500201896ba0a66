// Keys with the structure real ones have, for the selector benchmarks: each page of each KV head
// a rank-4 mixture of 64 topic directions plus noise, four outlier channels, and RoPE (Llama-3's
// theta 500000, adjacent pairs) by position, or left before RoPE for a cache that rotates them.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "bench/bench_util.hpp"

namespace kvsift::bench {

inline constexpr float kRopeTheta = 500000.0f;

class KeyMaker {
 public:
  static constexpr uint32_t kTopics = 64;                    // directions per KV head
  static constexpr uint32_t kPageRank = 4;                   // topics mixed in one page
  static constexpr uint32_t kOutliers[] = {5, 37, 70, 101};  // channels with a constant offset

  KeyMaker(const Shape& shape, uint64_t seed, bool rotate = true)
      : shape_(shape), random_(seed), rotate_(rotate) {
    topics_.resize(std::size_t{shape.n_kv_heads} * kTopics * shape.head_dim);
    for (float& x : topics_) x = 2.0f * random_.uniform();
    // Filling a long context calls rope() for every key: the frequencies once, not per call.
    for (uint32_t i = 0; i < shape.head_dim / 2; ++i)
      inv_freq_.push_back(std::pow(double{kRopeTheta}, -2.0 * i / shape.head_dim));
  }

  // K/V of one layer, [n, H, d], for positions [first, first + n) of a sequence.
  void make(uint64_t first, uint32_t n, std::vector<float>& k, std::vector<float>& v) {
    const uint32_t H = shape_.n_kv_heads, d = shape_.head_dim;
    k.assign(std::size_t{n} * H * d, 0.0f);
    v.resize(k.size());
    random_.fill(v);
    uint32_t picks[kPageRank] = {};
    for (uint32_t i = 0; i < n; ++i) {
      const uint64_t pos = first + i;
      for (uint32_t h = 0; h < H; ++h) {
        if (pos % kPageTokens == 0 || i == 0)
          for (uint32_t& p : picks)
            p = static_cast<uint32_t>((random_.uniform() + 1.0f) * 0.5f * kTopics) % kTopics;
        float* row = k.data() + (std::size_t{i} * H + h) * d;
        for (uint32_t p : picks) {
          const float weight = random_.uniform();
          const float* topic = topics_.data() + (std::size_t{h} * kTopics + p) * d;
          for (uint32_t c = 0; c < d; ++c) row[c] += weight * topic[c];
        }
        for (uint32_t c = 0; c < d; ++c) row[c] += 0.2f * random_.uniform();
        for (uint32_t c : kOutliers)
          if (c < d) row[c] += 6.0f;  // a head of 64 channels (SmolLM2's) has the first two
        if (rotate_) rope(row, pos);
      }
    }
  }

 private:
  void rope(float* x, uint64_t pos) const {
    const uint32_t d = shape_.head_dim;
    for (uint32_t i = 0; i < d / 2; ++i) {
      const double angle = static_cast<double>(pos) * inv_freq_[i];
      const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
      const float a = x[2 * i], b = x[2 * i + 1];
      x[2 * i] = a * c - b * s;
      x[2 * i + 1] = a * s + b * c;
    }
  }

  Shape shape_;
  Random random_;
  bool rotate_;
  std::vector<float> topics_;     // [H, kTopics, d]
  std::vector<double> inv_freq_;  // [d / 2]: theta^(-2i/d)
};

inline constexpr uint32_t kNeedles = 3;  // stored tokens each query looks for

// Queries that attend to a few needle tokens, so that a selector has pages worth finding: each
// query head of one sequence adds 0.3 times kNeedles stored keys of its KV head (read back from
// layer 0 of the cache, positions drawn from `random` over the context), plus noise.
//   q: [n_kv_heads * group_size, head_dim], added to.
inline void add_needle_queries(kvsift_cache* cache, int32_t seq_id, const Shape& shape,
                               uint64_t context, Random& random, float* q) {
  const uint32_t d = shape.head_dim;
  std::vector<float> needle(d);
  for (uint32_t h = 0; h < shape.n_kv_heads; ++h)
    for (uint32_t g = 0; g < shape.group_size; ++g) {
      float* row = q + (std::size_t{h} * shape.group_size + g) * d;
      for (uint32_t j = 0; j < kNeedles; ++j) {
        const auto pos = static_cast<uint64_t>((random.uniform() + 1.0f) * 0.5f * context);
        const uint64_t at = pos < context ? pos : context - 1;
        kvsift_read_tokens(cache, seq_id, 0, h, at, 1, needle.data(), nullptr);
        for (uint32_t c = 0; c < d; ++c) row[c] += 0.3f * needle[c];
      }
      for (uint32_t c = 0; c < d; ++c) row[c] += 0.3f * random.uniform();
    }
}

}  // namespace kvsift::bench
