// Helpers of the AVX-512 VNNI kernels (locks_avx512_vnni.cpp, attend_avx512_vnni.cpp): the int8
// query scale both share with their float64 references, a transpose-add, and a base-2 exp.
// Include only from a translation unit compiled with AVX-512 and VNNI flags; everything here has
// internal linkage (no weak symbol: tests/check_isa_symbols.cmake).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kvsift::simd {
namespace {

constexpr uint32_t W = 16;

// q rounded as the float64 reference does it: s_q = max|q| / 127 in float (query_scale), codes
// round(q / s_q) to nearest even (cvtps uses the default rounding, as nearbyint), all zero when
// q = 0.
inline float query_scale(const float* q, uint32_t d) noexcept {
  __m512 amax = _mm512_setzero_ps();
  for (uint32_t c = 0; c < d; c += W)
    amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(q + c)));
  return _mm512_reduce_max_ps(amax) / 127.0f;
}
inline float quantize_query(const float* q, uint32_t d, int8_t* codes) noexcept {
  const float s_q = query_scale(q, d);
  for (uint32_t c = 0; c < d; c += W) {
    const __m512i code =
        s_q > 0.0f ? _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(q + c), _mm512_set1_ps(s_q)))
                   : _mm512_setzero_si512();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + c), _mm512_cvtsepi32_epi8(code));
  }
  return s_q;
}

// 128-bit lane k of the result: [sum of a's lane k, b's, c's, d's] (four int32 each).
inline __m512i sum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) noexcept {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

// s[m] lane 4k + h holds 128-bit quarter k's part of row 4m + h's sum: lane i of the result is
// row i's total (the last stage of a 16-row transpose-add).
inline __m512 add_quarters_ps(const __m512* s) noexcept {
  const __m512 a =
      _mm512_add_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x44), _mm512_shuffle_f32x4(s[0], s[1], 0xEE));
  const __m512 b =
      _mm512_add_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x44), _mm512_shuffle_f32x4(s[2], s[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

// 2^x for |x| <= 125, to within 2.3e-7 relative (measured in float32 over [-0.5, 0.5]): x = n + f,
// n = round(x) by the 1.5 * 2^23 shift (n lands in the sum's low mantissa bits), 2^f by a degree-5
// minimax polynomial (Remez, relative error 7.5e-8), 2^n added to the exponent field in integers.
// Nothing here runs on the multiply pipes but the five FMAs: vscalefps and vrndscaleps would
// (measured on Zen 4: vscalefps takes two cycles of them).
inline __m512 exp2_ps(__m512 x) noexcept {
  const __m512 shifter = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_add_ps(x, shifter);
  const __m512 f = _mm512_sub_ps(x, _mm512_sub_ps(t, shifter));
  __m512 p = _mm512_set1_ps(1.3276472e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6755413e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5507133e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022120e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314697e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000001f));
  return _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_castps_si512(t), 23)));
}

// x with its magnitude clamped to 125 (sign kept), in one vrangeps: the domain of exp2_ps.
inline __m512 clamp125(__m512 x) noexcept {
  // imm 0x02: the smaller magnitude, the sign of the first operand.
  return _mm512_range_ps(x, _mm512_set1_ps(125.0f), 0x02);
}

}  // namespace
}  // namespace kvsift::simd
