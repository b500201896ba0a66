// Quantized-weight matrix-vector products (the kernel table's matvec_quant, simd/kernels.hpp): the
// portable half. Vectors are quantized here, once per product and the same at every level, so that
// levels differ only in how their kernels sum; the scalar kernel is the reference the SIMD ones are
// tested against (tests/test_quant_kernels.cpp).
//
// Why kvsift has its own kernels: oneDNN 2.6 (the Debian build lib/model/matmul.hpp uses) has int8
// products with per-tensor or per-output-channel scales only, no per-block-of-32 scales (ggml's
// Q8_0 format), and no int4 weights at all; xsimd 8.1 and Eigen have no integer dot products.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/kernels.hpp"

namespace kvsift::simd {

// Quantizes n_vectors vectors of cols values (cols a multiple of kQuantBlock) per block of 32, as
// ggml quantizes activations: per block, scale = max|x| / 127, q = round(x / scale) to nearest
// even (|q| <= 127, and 0 for an all-zero block), sum = the block's sum of q. Outputs as
// QuantizedVectors lays them out: q [n_vectors, cols], scale and sum [n_vectors, cols / 32].
// Each value's error |x - scale * q| is at most scale / 2 (plus float32 rounding of x / scale).
void quantize_vectors(const float* x, std::size_t n_vectors, std::size_t cols, int8_t* q,
                      float* scale, int32_t* sum) noexcept;

// Q4_0 rows (rows of cols / 32 blocks, cols a multiple of 32) to q4_0x16 (BlockFormat in
// simd/kernels.hpp), the same number of bytes; src and dst must not overlap. The model loader's
// repack (lib/model/llama_weights.cpp), done once per weight.
void repack_q4_0x16(const std::byte* src, std::size_t rows, std::size_t cols,
                    std::byte* dst) noexcept;

// Row r (0..15) of a q4_0x16 group of cols columns (at group) as a plain Q4_0 row (cols / 32
// blocks of 18 bytes at row): what a reader of single rows (a dequantizer) needs.
void q4_0x16_row(const std::byte* group, std::size_t cols, std::size_t r, std::byte* row) noexcept;

// The scalar table's matvec_quant (simd/quant_scalar.cpp).
void matvec_quant_scalar(BlockFormat format, const std::byte* w, std::size_t rows, std::size_t cols,
                         const QuantizedVectors& x, std::size_t n_vectors, float* y,
                         std::size_t y_stride) noexcept;

}  // namespace kvsift::simd
