// Level avx512: the kernels instantiated for AVX-512 F/CD/DQ/BW/VL. Compiled with -march=x86-64-v4
// only. Level avx512_vnni starts from this table (simd/kernels.cpp).
#include <immintrin.h>

#include <xsimd/xsimd.hpp>

#if !XSIMD_WITH_AVX512BW
#error "attend_avx512.cpp must be compiled with AVX-512 flags"
#endif

#include "simd/kernels.hpp"
#include "simd/x86/x86_kernels.hpp"

namespace kvsift::simd {
namespace {

// xsimd 8.1 has no half or bfloat16 batch: convert with intrinsics and wrap the __m512.
struct IsaOps {
  using batch = xsimd::batch<float, xsimd::avx512bw>;

  static float hmax(batch x) noexcept { return _mm512_reduce_max_ps(x); }
  static batch load_f16(const uint16_t* p) noexcept {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static batch load_bf16(const uint16_t* p) noexcept {
    const __m512i wide =
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store(batch x, uint16_t* p, Dtype dtype) noexcept {
    __m256i out;
    if (dtype == Dtype::f16) {
      out = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
      const __m512i bits = _mm512_castps_si512(x);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i rounded =
          _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      const __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x400000));
      out =
          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_mask_mov_epi32(rounded, nan, quiet), 16));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
  }
  // 16 int8 values to float.
  static batch load_i8(const std::byte* p) noexcept {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // 16 bytes of two int4 values each: the low nibbles and the high nibbles as floats. vpermps
  // reads only an index's low 4 bits, so a 16-entry table decodes a nibble with no masking or
  // sign extension: 5 uops per 32 values against 7 for shifts and conversions.
  static void load_nibbles(const std::byte* p, batch& lo, batch& hi) noexcept {
    const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_permutexvar_ps(bytes, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  }
};

}  // namespace
}  // namespace kvsift::simd

#include "simd/attend_body.hpp"

namespace kvsift::simd {

const Kernels& avx512_kernels() noexcept {
  static const Kernels table{
      Level::avx512,        Body<IsaOps>::encode,      Body<IsaOps>::decode,
      Body<IsaOps>::attend, Body<IsaOps>::matvec_bf16, matvec_quant_avx2,
      Body<IsaOps>::locks_score, Body<IsaOps>::exp_sum, gemm_f32_avx512};
  return table;
}

}  // namespace kvsift::simd
