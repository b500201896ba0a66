// The shape of a KV cache, fixed when it is created.
//
// A page holds page_tokens consecutive tokens of one (sequence, layer, KV head); where each token
// keeps its K and V inside the page's pool slot is simd/page_layout.hpp's alone.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/kernels.hpp"
#include "simd/page_layout.hpp"

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
  simd::PageLayout layout() const noexcept { return {page_tokens, head_dim, dtype}; }
  // The 16-bit dtype selectors keep their own key-derived rows in (Quest's bounds, S4R's
  // coefficients): the cache's own, or fp16 for a q8 cache (fp16's 11-bit significand holds a
  // dequantized q8 value to within 2^-11 of itself).
  simd::Dtype row_dtype() const noexcept {
    return dtype == simd::Dtype::q8 ? simd::Dtype::f16 : dtype;
  }
  std::size_t page_elems() const noexcept { return layout().page_elems(); }
  std::size_t slot_bytes() const noexcept { return layout().slot_bytes(); }
  std::size_t token_bytes() const noexcept { return layout().token_bytes(); }
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
