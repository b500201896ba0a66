// The exact check, the brute-force scan and the scores of the Louver tables, written once around
// an ISA's score function (louver_scalar.cpp, louver_avx512.cpp). check and scan call the same
// function for a key, which is what louver_kernels.hpp's exactness contract rests on. Internal
// linkage, like everything in an ISA translation unit (check_isa_symbols.cmake).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvsift::simd {
namespace {

template <auto score>
struct LouverLoops {
  static bool passes(const float* q, uint32_t group, const float* tau, const uint16_t* k,
                     uint32_t d) noexcept {
    for (uint32_t g = 0; g < group; ++g)
      if (score(q + std::size_t{g} * d, k, d) >= tau[g]) return true;
    return false;
  }

  static uint32_t check(const float* q, uint32_t group, const float* tau, const uint16_t* keys,
                        uint32_t d, const uint32_t* ids, uint32_t n, uint32_t* out) noexcept {
    uint32_t count = 0;
    for (uint32_t i = 0; i < n; ++i) {
      // The ids are scattered: the hardware prefetcher cannot follow them.
      if (i + 4 < n) __builtin_prefetch(keys + std::size_t{ids[i + 4]} * d, 0, 3);
      out[count] = ids[i];
      count += passes(q, group, tau, keys + std::size_t{ids[i]} * d, d);
    }
    return count;
  }

  static uint32_t scan(const float* q, uint32_t group, const float* tau, const uint16_t* keys,
                       uint32_t d, uint32_t first, uint32_t n, uint32_t* out) noexcept {
    uint32_t count = 0;
    for (uint32_t i = first; i < first + n; ++i) {
      out[count] = i;
      count += passes(q, group, tau, keys + std::size_t{i} * d, d);
    }
    return count;
  }

  static void scores(const float* q, const uint16_t* keys, uint32_t d, const uint32_t* ids,
                     uint32_t n, float* out) noexcept {
    for (uint32_t i = 0; i < n; ++i) out[i] = score(q, keys + std::size_t{ids[i]} * d, d);
  }
};

}  // namespace
}  // namespace kvsift::simd
