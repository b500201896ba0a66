#include "lib/model/prefill_attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/core/error.hpp"

namespace kvsift {

PrefillAttention::PrefillAttention(const CacheGeometry& geometry, uint32_t max_chunk,
                                   uint64_t max_context)
    : geometry_(geometry), max_chunk_(max_chunk), max_context_(max_context) {
  require(max_chunk >= 1, "prefill chunk must be >= 1");
  require(max_context >= 1, "max_context must be >= 1");
  const std::size_t d = geometry.head_dim, rows = std::size_t{geometry.group_size} * max_chunk;
  k_.resize(max_context * d);
  v_.resize(max_context * d);
  q_group_.resize(rows * d);
  scores_.resize(rows * max_context);
  out_group_.resize(rows * d);
}

void PrefillAttention::run(const KvCache& cache, int32_t seq_id, uint32_t layer, uint64_t start,
                           uint32_t T, const float* q, float* out, Matmul& matmul,
                           ThreadPool& pool) {
  const uint64_t n = start + T;
  require(T >= 1 && T <= max_chunk_, "chunk of ", T, " tokens is outside 1..", max_chunk_);
  require(n <= max_context_, "context of ", n, " tokens exceeds the planned ", max_context_);
  require(cache.length(seq_id, layer) == n, "the cache holds ", cache.length(seq_id, layer),
          " tokens of layer ", layer, ", expected ", n);
  const uint32_t G = geometry_.group_size, d = geometry_.head_dim, Hq = geometry_.n_query_heads();
  const int64_t rows = int64_t{G} * T;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (uint32_t h = 0; h < geometry_.n_kv_heads; ++h) {
    cache.read_tokens(seq_id, layer, h, 0, n, k_.data(), v_.data());
    for (uint32_t g = 0; g < G; ++g)
      for (uint32_t t = 0; t < T; ++t)
        std::copy_n(q + (std::size_t{t} * Hq + h * G + g) * d, d,
                    q_group_.data() + (std::size_t{g} * T + t) * d);
    // Scores with row stride n: the products are dense [rows, n].
    matmul.run(MatType::f32, q_group_.data(), rows, d, k_.data(), WeightLayout::rows_are_outputs,
               static_cast<int64_t>(n), scores_.data());
    pool.parallel_for(static_cast<uint64_t>(rows), 1, [&](uint64_t r, uint64_t, int) noexcept {
      float* s = scores_.data() + r * n;
      const uint64_t visible = start + r % T + 1;  // causal
      float m = -std::numeric_limits<float>::infinity();
      for (uint64_t j = 0; j < visible; ++j) m = std::max(m, s[j] * scale);
      float sum = 0.0f;
      for (uint64_t j = 0; j < visible; ++j) {
        s[j] = std::exp(s[j] * scale - m);
        sum += s[j];
      }
      const float inv = 1.0f / sum;
      for (uint64_t j = 0; j < visible; ++j) s[j] *= inv;
      for (uint64_t j = visible; j < n; ++j) s[j] = 0.0f;
    });
    matmul.run(MatType::f32, scores_.data(), rows, static_cast<int64_t>(n), v_.data(),
               WeightLayout::rows_are_inputs, d, out_group_.data());
    for (uint32_t g = 0; g < G; ++g)
      for (uint32_t t = 0; t < T; ++t)
        std::copy_n(out_group_.data() + (std::size_t{g} * T + t) * d, d,
                    out + (std::size_t{t} * Hq + h * G + g) * d);
  }
}

}  // namespace kvsift
