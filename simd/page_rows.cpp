#include "simd/page_rows.hpp"

#include <algorithm>
#include <cmath>

namespace kvsift::simd {

float quantize_q8_row(const float* x, uint32_t head_dim, int8_t* codes) noexcept {
  float absmax = 0.0f;
  for (uint32_t c = 0; c < head_dim; ++c) absmax = std::max(absmax, std::fabs(x[c]));
  const float scale = absmax / 127.0f;
  for (uint32_t c = 0; c < head_dim; ++c) {
    // absmax / 127 can underflow to 0 for a denormal absmax: those rows store as zero.
    const float code = scale > 0.0f ? std::nearbyint(x[c] / scale) : 0.0f;
    codes[c] = static_cast<int8_t>(std::clamp(code, -127.0f, 127.0f));
  }
  return scale;
}

void store_rows(const Kernels& kernels, const PageLayout& layout, std::byte* slot, SlotPart part,
                uint32_t t0, uint32_t n, const float* src, std::size_t src_stride) noexcept {
  const bool key = part == SlotPart::key;
  for (uint32_t i = 0; i < n; ++i) {
    const float* row = src + i * src_stride;
    const uint32_t t = t0 + i;
    if (layout.quantized()) {
      float* scales = key ? layout.key_scales(slot) : layout.value_scales(slot);
      scales[t] = quantize_q8_row(row, layout.head_dim,
                                  key ? layout.key_codes(slot, t) : layout.value_codes(slot, t));
    } else {
      kernels.encode(row, key ? layout.key(slot, t) : layout.value(slot, t), layout.head_dim,
                     layout.dtype);
    }
  }
}

void load_rows(const Kernels& kernels, const PageLayout& layout, const std::byte* slot,
               SlotPart part, uint32_t t0, uint32_t n, float* dst) noexcept {
  const bool key = part == SlotPart::key;
  const uint32_t d = layout.head_dim;
  if (!layout.quantized()) {
    kernels.decode(key ? layout.key(slot, t0) : layout.value(slot, t0), dst, std::size_t{n} * d,
                   layout.dtype);
    return;
  }
  const float* scales = key ? layout.key_scales(slot) : layout.value_scales(slot);
  for (uint32_t i = 0; i < n; ++i) {
    const int8_t* codes = key ? layout.key_codes(slot, t0 + i) : layout.value_codes(slot, t0 + i);
    const float scale = scales[t0 + i];
    float* out = dst + std::size_t{i} * d;
    for (uint32_t c = 0; c < d; ++c) out[c] = scale * static_cast<float>(codes[c]);
  }
}

}  // namespace kvsift::simd
