// Weights in ggml's block formats (simd/kernels.hpp, BlockFormat) for the matrix-vector
// benchmarks: bench_quant.cpp and bench/ggml/bench_ggml.cpp fill their arenas with them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "simd/half.hpp"
#include "simd/kernels.hpp"

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

}  // namespace kvsift::bench
