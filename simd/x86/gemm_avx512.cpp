// Level avx512's float32 product (simd/gemm_body.hpp). Compiled with -march=x86-64-v4 only.
#include <xsimd/xsimd.hpp>

#if !XSIMD_WITH_AVX512BW
#error "gemm_avx512.cpp must be compiled with AVX-512 flags"
#endif

#include "simd/gemm_body.hpp"
#include "simd/x86/x86_kernels.hpp"

namespace kvsift::simd {

// 6 rows x 4 vectors (64 columns): 24 of the 32 zmm registers accumulate, 4 hold the panel's
// row and one the broadcast of A.
void gemm_f32_avx512(const GemmJob& job) noexcept {
  GemmBody<xsimd::batch<float, xsimd::avx512bw>, 6, 4>::gemm_f32(job);
}

}  // namespace kvsift::simd
