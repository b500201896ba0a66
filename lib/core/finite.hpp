// Checks of caller numbers before they reach a kernel: a NaN or infinity in a key, value or query
// would otherwise poison every softmax it enters (and every summary built from it) silently.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "lib/core/error.hpp"

namespace kvsift {

// Index of the first NaN or infinity in x[0, n), or n when all are finite. Compares exponent bits
// so that the loop vectorises (the check runs over every appended key and value).
inline std::size_t first_non_finite(const float* x, std::size_t n) noexcept {
  constexpr uint32_t kExponent = 0x7f800000u;
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    uint32_t bits[16];
    std::memcpy(bits, x + i, sizeof(bits));
    bool bad = false;
    for (int j = 0; j < 16; ++j) bad |= (bits[j] & kExponent) == kExponent;
    if (bad) break;
  }
  for (; i < n; ++i)
    if (!std::isfinite(x[i])) return i;
  return n;
}

// Throws invalid_argument naming the array and the first element that is not finite.
inline void require_finite(const float* x, std::size_t n, const char* name) {
  const std::size_t at = first_non_finite(x, n);
  if (at < n) fail(Status::invalid_argument, name, "[", at, "]=", x[at], " is not finite");
}

}  // namespace kvsift
