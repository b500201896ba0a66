// The quantized matvec on AVX-512 VNNI (quant_body.hpp): vpdpbusd multiplies unsigned by signed
// bytes and adds each group of 4 products into an int32 lane in one instruction, with no int16
// step (the 256-bit form, AVX512VL). Compiled with -march=x86-64-v4 -mavx512vnni and reached only
// through the avx512_vnni table (simd/kernels.cpp), which a CPU without VNNI never gets.
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#if !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "quant_avx512_vnni.cpp must be compiled with AVX-512 VL and VNNI flags"
#endif

#include "simd/kernels.hpp"
#include "simd/x86/x86_kernels.hpp"

namespace kvsift::simd {
namespace {

struct DotOps {
  static __m256i dot_u4(__m256i init, __m256i u, __m256i s) noexcept {
    return _mm256_dpbusd_epi32(init, u, s);
  }
  static __m256i dot_s8(__m256i w, __m256i a) noexcept {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
  }
};

#include "simd/x86/quant_body.hpp"

}  // namespace

void matvec_quant_avx512_vnni(BlockFormat format, const std::byte* w, std::size_t rows,
                              std::size_t cols, const QuantizedVectors& x, std::size_t n_vectors,
                              float* y, std::size_t y_stride) noexcept {
  matvec_quant(format, w, rows, cols, x, n_vectors, y, y_stride);
}

}  // namespace kvsift::simd
