// The shape of a KV cache, fixed when it is created.
//
// Data layout (stated once, here): a page holds page_tokens consecutive tokens of one
// (sequence, layer, KV head); its pool slot stores K as [page_tokens, head_dim] followed by V as
// [page_tokens, head_dim], in the storage dtype (simd/kernels.hpp reads exactly this).
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/kernels.hpp"

namespace kvsift {

struct CacheGeometry {
  uint32_t n_layers = 1;
  uint32_t n_kv_heads = 1;
  uint32_t group_size = 1;    // query heads per KV head
  uint32_t head_dim = 128;    // 64, 128 or 256
  uint32_t page_tokens = 16;  // 16, 32 or 64
  simd::Dtype dtype = simd::Dtype::f16;

  // Throws Error(invalid_argument) naming the first field out of range.
  void validate() const;

  uint32_t n_query_heads() const noexcept { return n_kv_heads * group_size; }
  std::size_t page_elems() const noexcept { return std::size_t{page_tokens} * head_dim; }
  // K page + V page, 2 bytes per element.
  std::size_t slot_bytes() const noexcept { return 2 * page_elems() * sizeof(uint16_t); }
  std::size_t token_bytes() const noexcept { return 2 * std::size_t{head_dim} * sizeof(uint16_t); }
  // Pages that hold `tokens` tokens (the last one possibly partial).
  uint64_t pages_for(uint64_t tokens) const noexcept {
    return (tokens + page_tokens - 1) / page_tokens;
  }
};

// Bounds that keep every index product inside 64 bits and every page id inside 32 bits.
inline constexpr uint32_t kMaxLayers = 1024;
inline constexpr uint32_t kMaxKvHeads = 1024;
inline constexpr uint32_t kMaxGroupSize = 64;
inline constexpr uint64_t kMaxPages = (uint64_t{1} << 32) - 1;

}  // namespace kvsift
