// Scalar fp16 / bf16 <-> fp32 conversions, bit-exact with the hardware instructions (F16C
// vcvtps2ph with round-to-nearest-even, and the usual bf16 RNE rounding) for finite values.
// These are the reference the SIMD conversions are tested against.
#pragma once

#include <bit>
#include <cstdint>

namespace kvsift::simd {

inline float f16_to_f32(uint16_t h) noexcept {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24 is exact in fp32
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t f32_to_f16(float value) noexcept {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) {  // inf, or NaN made quiet as F16C does
    const uint32_t nan = magnitude > 0x7f800000u ? 0x200u | ((magnitude >> 13) & 0x3ffu) : 0u;
    return static_cast<uint16_t>(sign | 0x7c00u | nan);
  }
  if (magnitude >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (magnitude < 0x38800000u) {
    // Below 2^-14 the result is subnormal: adding 0.5 puts the value's 2^-24 steps in the low
    // mantissa bits of a float with exponent 2^-1, and the FPU rounds to nearest even for us.
    const float shifted = std::bit_cast<float>(magnitude) + 0.5f;
    return static_cast<uint16_t>(sign | (std::bit_cast<uint32_t>(shifted) - 0x3f000000u));
  }
  const uint32_t odd = (magnitude >> 13) & 1u;
  magnitude += 0xc8000fffu + odd;  // rebias the exponent by -112 and round to nearest even
  return static_cast<uint16_t>(sign | (magnitude >> 13));
}

inline float bf16_to_f32(uint16_t h) noexcept {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

inline uint16_t f32_to_bf16(float value) noexcept {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

}  // namespace kvsift::simd
