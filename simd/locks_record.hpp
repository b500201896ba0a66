// The LOCKS page record: one (page, KV head)'s compact key summary (docs/methods.md, LOCKS),
// written by lib/select/locks_summary.cpp and read by the locks_score kernels. The one statement of
// its layout.
//
// For head_dim d, page_tokens B, rank r (1 <= r < B), all offsets in bytes from the record start:
//   v_codes   0                 V (d x r, orthonormal basis) as int4 in [-8, 7], column-major:
//                               column j is d/2 bytes at v_codes + j*d/2; byte b holds row 2b in
//                               its low nibble and row 2b+1 in its high nibble (two's complement)
//   c_codes   r*d/2             C (B x r, token coefficients) as int8 in [-127, 127], stored
//                               component-major: component j of token i at c_codes + j*B + i
//   mu_codes  c_codes + r*B     mu (d, the page's mean key) as int8 in [-127, 127]
//   residual  mu_codes + d      float32: an upper bound on max_i ||k_i - (mu + V c_i)|| over the
//                               page's keys, with the dequantised mu, V, C
//   v_scales  residual + 4      r bf16: V[:, j] = v_code * v_scale[j]   (max |V[:, j]| / 7)
//   c_scales  v_scales + 2r     B bf16: c_i = c_code * c_scale[i]       (max |c_i| / 127)
//   mu_scale  c_scales + 2B     1 bf16: mu = mu_code * mu_scale         (max |mu| / 127)
//   end       mu_scale + 2      = the paper's bytes + 4; records are padded to
//                               a multiple of 64 bytes: 832 at d = 128, B = 16, r = 8.
// Every field before `residual` is a multiple of 16 bytes long for the supported shapes (d in
// {64, 128, 256}, B in {16, 32, 64}), so the float is aligned. C is component-major (the paper
// stores it token-major; the byte layout is free) so that the kernels load W
// tokens of one component with one load.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvsift::simd {

struct LocksRecordLayout {
  uint32_t v_codes, c_codes, mu_codes, residual, v_scales, c_scales, mu_scale;
  uint32_t paper_bytes;  // r*d*4/8 + 2r + B*r + 2B + d + 2 (the paper's count)
  uint32_t bytes;        // stored size: the fields above, padded to 64
};

// Internal linkage: the ISA translation units include this, and an inline function with external
// linkage could leave them a weak copy (tests/check_isa_symbols.cmake).
namespace {

constexpr LocksRecordLayout locks_record_layout(uint32_t head_dim, uint32_t page_tokens,
                                                uint32_t rank) noexcept {
  LocksRecordLayout layout{};
  layout.v_codes = 0;
  layout.c_codes = rank * head_dim / 2;
  layout.mu_codes = layout.c_codes + rank * page_tokens;
  layout.residual = layout.mu_codes + head_dim;
  layout.v_scales = layout.residual + 4;
  layout.c_scales = layout.v_scales + 2 * rank;
  layout.mu_scale = layout.c_scales + 2 * page_tokens;
  const uint32_t end = layout.mu_scale + 2;
  layout.paper_bytes = end - 4;
  layout.bytes = (end + 63) / 64 * 64;
  return layout;
}

static_assert(locks_record_layout(128, 16, 8).paper_bytes == 818);
static_assert(locks_record_layout(128, 32, 8).paper_bytes == 978);
static_assert(locks_record_layout(128, 16, 8).bytes == 832);

}  // namespace

}  // namespace kvsift::simd
