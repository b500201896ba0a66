// The x86-64 tables and kernels that portable code names (simd/kernels.cpp, where the levels map
// to tables). Each is defined in a translation unit of this folder compiled with its level's
// flags: call one only on a CPU with that level's features (cpu_has in simd/isa.hpp).
#pragma once

#include "simd/kernels.hpp"
#include "simd/louver_kernels.hpp"

namespace kvsift::simd {

const Kernels& avx2_kernels() noexcept;    // attend_avx2.cpp
const Kernels& avx512_kernels() noexcept;  // attend_avx512.cpp
// LOCKS scores of int8-query jobs (job.int8_query must be true) on AVX-512 VNNI: z = V^T q~ and
// mu . q~ exact in integers, the rest in float32 (locks_avx512_vnni.cpp).
void locks_score_avx512_vnni(const LocksScoreJob& job) noexcept;
// Decode attention of q8 jobs (job.layout.dtype must be q8) on AVX-512 VNNI: q rounded per head to
// int8 and each page's softmax weights times V's scales to u8, both products taken exactly in
// integers (attend_avx512_vnni.cpp).
void attend_q8_avx512_vnni(const AttendJob& job) noexcept;
const LouverKernels& louver_avx512_kernels() noexcept;  // louver_avx512.cpp
void gemm_f32_avx2(const GemmJob& job) noexcept;        // gemm_avx2.cpp
void gemm_f32_avx512(const GemmJob& job) noexcept;      // gemm_avx512.cpp
// matvec_quant of the avx2 and avx512 tables (quant_avx2.cpp) and of the avx512_vnni table
// (quant_avx512_vnni.cpp).
void matvec_quant_avx2(BlockFormat format, const std::byte* w, std::size_t rows, std::size_t cols,
                       const QuantizedVectors& x, std::size_t n_vectors, float* y,
                       std::size_t y_stride) noexcept;
void matvec_quant_avx512_vnni(BlockFormat format, const std::byte* w, std::size_t rows,
                              std::size_t cols, const QuantizedVectors& x, std::size_t n_vectors,
                              float* y, std::size_t y_stride) noexcept;

}  // namespace kvsift::simd
