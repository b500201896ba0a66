// Level avx2's float32 product (simd/gemm_body.hpp). Compiled with -march=x86-64-v3 only.
#include <xsimd/xsimd.hpp>

#if !XSIMD_WITH_FMA3_AVX2
#error "gemm_avx2.cpp must be compiled with AVX2 and FMA flags"
#endif

#include "simd/gemm_body.hpp"
#include "simd/x86/x86_kernels.hpp"

namespace kvsift::simd {

// 6 rows x 2 vectors (16 columns): 12 of the 16 ymm registers accumulate, 2 hold the panel's
// row and one the broadcast of A.
void gemm_f32_avx2(const GemmJob& job) noexcept {
  GemmBody<xsimd::batch<float, xsimd::fma3<xsimd::avx2>>, 6, 2>::gemm_f32(job);
}

}  // namespace kvsift::simd
