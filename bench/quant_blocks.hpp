// Weights in ggml's block formats (simd/kernels.hpp, BlockFormat) for the matrix-vector
// benchmarks (bench_quant.cpp, bench/ggml/bench_ggml.cpp), and the input they multiply.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "lib/core/aligned.hpp"
#include "simd/half.hpp"
#include "simd/kernels.hpp"
#include "simd/quant.hpp"

namespace kvsift::bench {

// Fills `bytes` (whole blocks) with valid blocks of the format: random codes, each block's fp16
// scale 0.01. A pattern of 509 random blocks (a prime, so rows do not repeat it in step) is
// tiled over the buffer: gigabytes fill in well under a second.
inline void fill_quant_blocks(simd::BlockFormat format, std::byte* data, std::size_t bytes) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> byte_dist(0, 255);
  const std::size_t block = simd::block_format_bytes(format);
  std::vector<std::byte> pattern(block * 509);
  for (std::byte& b : pattern) b = static_cast<std::byte>(byte_dist(rng));
  const uint16_t scale = simd::f32_to_f16(0.01f);
  for (std::size_t b = 0; b < pattern.size() / block; ++b)
    std::memcpy(pattern.data() + b * block, &scale, 2);
  for (std::size_t i = 0; i + block <= bytes; i += block)
    std::memcpy(data + i, pattern.data() + i % pattern.size() / block * block, block);
}

// One decode-step input x of `cols` values (normal, fixed seed) and the buffers quantize_vectors
// fills from it, as the runner keeps them (CpuForwardPass::matvec_quantized).
struct MatvecInput {
  explicit MatvecInput(std::size_t cols)
      : x(cols), codes(cols), scales(cols / simd::kQuantBlock), sums(cols / simd::kQuantBlock) {
    std::mt19937 rng(3);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (float& v : x) v = dist(rng);
  }
  // Quantizes x per block of 32 (the product's first step, timed with it).
  simd::QuantizedVectors quantize() noexcept {
    simd::quantize_vectors(x.data(), 1, x.size(), codes.data(), scales.data(), sums.data());
    return {codes.data(), scales.data(), sums.data()};
  }

  std::vector<float> x;
  AlignedVector<int8_t> codes;
  AlignedVector<float> scales;
  AlignedVector<int32_t> sums;
};

}  // namespace kvsift::bench
