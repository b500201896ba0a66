// What the benchmark binaries share: layer shapes, cache sizing, fixed-seed fill.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvsift/kvsift.hpp"

namespace kvsift::bench {

struct Shape {
  const char* name;
  uint32_t n_kv_heads;
  uint32_t group_size;
  uint32_t head_dim;
};

inline constexpr Shape kLlama8b{"llama8b", 8, 4, 128};  // Llama-3-8B: 32 query heads, 8 KV heads
inline constexpr Shape kSmollm2{"smollm2", 3, 3, 64};   // SmolLM2-135M: 9 query heads, 3 KV heads
inline constexpr uint32_t kPageTokens = 16;
// Tokens per kvsift_append: a prefill-sized chunk, so each (sequence, KV head) gets runs of
// consecutive page slots, as after a real prefill.
inline constexpr uint32_t kAppendTokens = 4096;
inline constexpr uint64_t kSeed = 0x6b7673696674;  // "kvsift"

inline uint64_t kv_bytes(const Shape& shape, uint64_t context, uint32_t batch) {
  return context * batch * shape.n_kv_heads * shape.head_dim * 2 /* K, V */ * 2 /* fp16 */;
}

// splitmix64: fast enough to fill gigabytes, and fixed-seed reproducible.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed) {}
  void fill(std::vector<float>& values) {
    for (float& x : values) x = uniform();
  }
  float uniform() {  // [-1, 1)
    uint64_t z = (state_ += 0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
    z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) * 0x1p-23f - 1.0f;
  }

 private:
  uint64_t state_;
};

// Creates a cache into `out`: "" on success, else the C API's message. The benchmarks skip a case
// whose cache cannot be made (SkipWithError) and run the others; their timed loops call the C
// functions on out.get().
inline std::string create_cache(const kvsift_cache_params& params, kvsift::cache& out) {
  try {
    out = kvsift::cache(params);
    return "";
  } catch (const kvsift::error& e) {
    return e.what();
  }
}

// Cache parameters for `batch` sequences of `context` tokens in one layer of the shape.
inline kvsift_cache_params cache_params(const Shape& shape, uint64_t context, uint32_t batch,
                                        int threads, kvsift_dtype dtype = KVSIFT_DTYPE_F16) {
  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  params.n_kv_heads = shape.n_kv_heads;
  params.group_size = shape.group_size;
  params.head_dim = shape.head_dim;
  params.page_tokens = kPageTokens;
  params.dtype = dtype;
  params.max_pages =
      uint64_t{batch} * shape.n_kv_heads * ((context + kPageTokens - 1) / kPageTokens);
  params.max_batch = batch;
  params.n_threads = threads;
  return params;
}

}  // namespace kvsift::bench
