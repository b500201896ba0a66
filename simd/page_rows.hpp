// Token rows in and out of pool slots as float32, for every storage dtype: the one way the cache,
// the selectors and the tests store a token into a slot and read tokens back. 16-bit dtypes go
// through the kernel table's encode/decode; q8 through quantize_q8_row below.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/kernels.hpp"
#include "simd/page_layout.hpp"

namespace kvsift::simd {

// Which half of a slot.
enum class SlotPart : uint8_t { key, value };

// The q8 rule: scale = max_c |x[c]| / 127 (float32), codes[c] = x[c] / scale rounded to nearest
// even and clamped to [-127, 127], so |x[c] - scale * codes[c]| <= scale / 2. A zero row has
// scale 0 and zero codes. x must be finite (the cache checks appends). Returns the scale.
float quantize_q8_row(const float* x, uint32_t head_dim, int8_t* codes) noexcept;

// Stores n rows, row i from src + i * src_stride ([head_dim] float32 each), as tokens
// t0 .. t0 + n - 1 of one part of a slot, in layout.dtype (16-bit: the table's encode).
void store_rows(const Kernels& kernels, const PageLayout& layout, std::byte* slot, SlotPart part,
                uint32_t t0, uint32_t n, const float* src, std::size_t src_stride) noexcept;

// Tokens t0 .. t0 + n - 1 of one part of a slot as float32, [n, head_dim] at dst: the 16-bit
// values exactly, q8 rows as scale * code (rounded once to float32).
void load_rows(const Kernels& kernels, const PageLayout& layout, const std::byte* slot,
               SlotPart part, uint32_t t0, uint32_t n, float* dst) noexcept;

}  // namespace kvsift::simd
