// Level avx2: the kernels instantiated for AVX2 + FMA + F16C. Compiled with -march=x86-64-v3 only.
#include <immintrin.h>

#include <xsimd/xsimd.hpp>

#if !XSIMD_WITH_AVX2 || !XSIMD_WITH_FMA3_AVX2
#error "attend_avx2.cpp must be compiled with AVX2 and FMA flags"
#endif

#include "simd/kernels.hpp"
#include "simd/x86/x86_kernels.hpp"

namespace kvsift::simd {
namespace {

struct IsaOps {
  using batch = xsimd::batch<float, xsimd::fma3<xsimd::avx2>>;

  static float hmax(batch x) noexcept {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  }
  static batch load_f16(const uint16_t* p) noexcept {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static batch load_bf16(const uint16_t* p) noexcept {
    const __m256i wide =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(batch x, uint16_t* p, Dtype dtype) noexcept {
    __m128i out;
    if (dtype == Dtype::f16) {
      out = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      const __m256i bits = _mm256_castps_si256(x);
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
      const __m256i rounded =
          _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
      const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
      const __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x400000));
      const __m256i chosen = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(nan));
      // The top halves fit 16 bits, so unsigned saturation in packus is exact; packus works per
      // 128-bit lane, so gather the two lanes' results with a 64-bit permute.
      const __m256i packed =
          _mm256_packus_epi32(_mm256_srli_epi32(chosen, 16), _mm256_setzero_si256());
      out = _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), out);
  }
  // 8 int8 values to float.
  static batch load_i8(const std::byte* p) noexcept {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // 8 bytes of two int4 values each: the low nibbles and the high nibbles, sign-extended.
  static void load_nibbles(const std::byte* p, batch& lo, batch& hi) noexcept {
    const __m256i bytes =
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(bytes, 28), 28));
    hi = _mm256_cvtepi32_ps(_mm256_srai_epi32(bytes, 4));
  }
};

}  // namespace
}  // namespace kvsift::simd

#include "simd/attend_body.hpp"

namespace kvsift::simd {

const Kernels& avx2_kernels() noexcept {
  static const Kernels table{
      Level::avx2,          Body<IsaOps>::encode,      Body<IsaOps>::decode,
      Body<IsaOps>::attend, Body<IsaOps>::matvec_bf16, matvec_quant_avx2,
      Body<IsaOps>::locks_score, Body<IsaOps>::exp_sum, gemm_f32_avx2};
  return table;
}

}  // namespace kvsift::simd
