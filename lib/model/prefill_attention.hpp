// Causal attention for a prefill chunk: queries at positions [start, start + T) of one sequence
// over the cache's tokens [0, start + T) of one layer, every query head. Matrix-shaped, so it
// runs as two oneDNN products per KV head (scores, then values) with an exact float32 softmax
// between them; the G query heads of a group are stacked so each K/V head is read once.
#pragma once

#include <cstdint>

#include "lib/cache/kv_cache.hpp"
#include "lib/core/aligned.hpp"
#include "lib/model/matmul.hpp"
#include "lib/core/thread_pool.hpp"

namespace kvsift {

class PrefillAttention {
 public:
  // Workspace for chunks of up to max_chunk queries over up to max_context tokens:
  // (G * max_chunk) * max_context floats of scores plus K/V copies. Throws out_of_memory.
  PrefillAttention(const CacheGeometry& geometry, uint32_t max_chunk, uint64_t max_context);

  // q, out: [T, n_query_heads, head_dim]. The cache must hold exactly start + T tokens of the
  // layer (the chunk's own K/V appended first). The softmax runs on `pool`, the products on
  // matmul's. Throws invalid_argument on sizes beyond the plan.
  void run(const KvCache& cache, int32_t seq_id, uint32_t layer, uint64_t start, uint32_t T,
           const float* q, float* out, Matmul& matmul, ThreadPool& pool);

 private:
  CacheGeometry geometry_;
  uint32_t max_chunk_;
  uint64_t max_context_;
  AlignedVector<float> k_, v_;      // [max_context, head_dim] of one KV head
  AlignedVector<float> q_group_;    // [G * max_chunk, head_dim], rows (g, t)
  AlignedVector<float> scores_;     // [G * max_chunk, max_context]
  AlignedVector<float> out_group_;  // [G * max_chunk, head_dim]
};

}  // namespace kvsift
