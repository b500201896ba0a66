// The quantized matvec on AVX2 (quant_body.hpp): vpmaddubsw multiplies unsigned by signed bytes
// into int16 pairs (at most 2 * 128 * 127 = 32512 in magnitude: no saturation) and vpmaddwd by ones
// widens them to int32. Compiled with -march=x86-64-v3; the avx2 and avx512 tables use it (an
// AVX-512 CPU has every x86-64-v3 feature, and without VNNI 512-bit registers would add only the
// shuffles to build them).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "quant_avx2.cpp must be compiled with AVX2, FMA and F16C flags"
#endif

#include "simd/kernels.hpp"
#include "simd/x86/x86_kernels.hpp"

namespace kvsift::simd {
namespace {

struct DotOps {
  // init + the int32 sums of 4 products of unsigned u by signed s.
  static __m256i dot_u4(__m256i init, __m256i u, __m256i s) noexcept {
    const __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(init, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  // The int32 sums of 4 products of signed w by signed a (a in [-127, 127]).
  static __m256i dot_s8(__m256i w, __m256i a) noexcept {
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
};

#include "simd/x86/quant_body.hpp"

}  // namespace

void matvec_quant_avx2(BlockFormat format, const std::byte* w, std::size_t rows, std::size_t cols,
                       const QuantizedVectors& x, std::size_t n_vectors, float* y,
                       std::size_t y_stride) noexcept {
  matvec_quant(format, w, rows, cols, x, n_vectors, y, y_stride);
}

}  // namespace kvsift::simd
