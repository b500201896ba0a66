#include "lib/model/dequantize.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "lib/core/error.hpp"
#include "simd/half.hpp"

// Scalar code on purpose: it runs once per model load, and written this way GCC vectorizes the
// inner loops well enough (the 98 MB SmolLM2 file dequantizes in a fraction of a second; see
// tests/test_dequantize.cpp). The arithmetic order follows ggml-quants.c so results match ggml's
// bit for bit.

namespace kvsift::model {

namespace {

// Block sizes (ggml-common.h).
constexpr std::size_t kQ4_0Bytes = 2 + 16;
constexpr std::size_t kQ4_1Bytes = 2 + 2 + 16;
constexpr std::size_t kQ8_0Bytes = 2 + 32;
constexpr std::size_t kQ4_KBytes = 2 + 2 + 12 + 128;
constexpr std::size_t kQ6_KBytes = 128 + 64 + 16 + 2;
constexpr std::size_t kQuantBlock = 32;
constexpr std::size_t kSuperBlock = 256;

inline float load_f16(const uint8_t* p) noexcept {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return simd::f16_to_f32(bits);
}

void dequantize_f16(const uint8_t* src, float* dst, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = load_f16(src + 2 * i);
}

void dequantize_bf16(const uint8_t* src, float* dst, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    uint16_t bits;
    std::memcpy(&bits, src + 2 * i, sizeof bits);
    dst[i] = simd::bf16_to_f32(bits);
  }
}

// d; qs[16]: element j is the low nibble of qs[j], element j + 16 the high nibble; d * (q - 8).
void dequantize_q4_0(const uint8_t* src, float* dst, std::size_t blocks) noexcept {
  for (std::size_t b = 0; b < blocks; ++b, src += kQ4_0Bytes, dst += kQuantBlock) {
    const float d = load_f16(src);
    const uint8_t* qs = src + 2;
    for (int j = 0; j < 16; ++j) dst[j] = static_cast<float>((qs[j] & 0x0f) - 8) * d;
    for (int j = 0; j < 16; ++j) dst[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
  }
}

// d; m; qs[16], nibbles as Q4_0; d * q + m.
void dequantize_q4_1(const uint8_t* src, float* dst, std::size_t blocks) noexcept {
  for (std::size_t b = 0; b < blocks; ++b, src += kQ4_1Bytes, dst += kQuantBlock) {
    const float d = load_f16(src);
    const float m = load_f16(src + 2);
    const uint8_t* qs = src + 4;
    for (int j = 0; j < 16; ++j) dst[j] = static_cast<float>(qs[j] & 0x0f) * d + m;
    for (int j = 0; j < 16; ++j) dst[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
  }
}

// d; qs[32] int8; d * q.
void dequantize_q8_0(const uint8_t* src, float* dst, std::size_t blocks) noexcept {
  for (std::size_t b = 0; b < blocks; ++b, src += kQ8_0Bytes, dst += kQuantBlock) {
    const float d = load_f16(src);
    const auto* qs = reinterpret_cast<const int8_t*>(src + 2);
    for (int j = 0; j < 32; ++j) dst[j] = static_cast<float>(qs[j]) * d;
  }
}

// 6-bit scale and min of sub-block j (0..7) from Q4_K's 12 packed bytes (ggml get_scale_min_k4).
inline void q4_k_scale_min(int j, const uint8_t* s, uint8_t& scale, uint8_t& min) noexcept {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = static_cast<uint8_t>((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4));
    min = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// d; dmin; scales[12]; qs[128]. Four chunks of 64: chunk c reads qs[32c..32c+31], low nibbles
// are sub-block 2c, high nibbles sub-block 2c+1; d * scale * q - dmin * min.
void dequantize_q4_k(const uint8_t* src, float* dst, std::size_t blocks) noexcept {
  for (std::size_t b = 0; b < blocks; ++b, src += kQ4_KBytes) {
    const float d = load_f16(src);
    const float dmin = load_f16(src + 2);
    const uint8_t* scales = src + 4;
    const uint8_t* qs = src + 16;
    for (int chunk = 0; chunk < 4; ++chunk, qs += 32, dst += 64) {
      uint8_t scale, min;
      q4_k_scale_min(2 * chunk, scales, scale, min);
      const float d_low = d * scale, m_low = dmin * min;
      q4_k_scale_min(2 * chunk + 1, scales, scale, min);
      const float d_high = d * scale, m_high = dmin * min;
      for (int l = 0; l < 32; ++l) dst[l] = d_low * static_cast<float>(qs[l] & 0x0f) - m_low;
      for (int l = 0; l < 32; ++l) dst[l + 32] = d_high * static_cast<float>(qs[l] >> 4) - m_high;
    }
  }
}

// ql[128]; qh[64]; scales[16] int8; d. Two halves of 128; in each, value l + 32k (k = 0..3) takes
// a nibble of ql (low of ql[l], low of ql[l+32], high of ql[l], high of ql[l+32]) and bits 2k..2k+1
// of qh[l] as its bits 4-5; d * scale[l/16 + 2k] * (q - 32).
void dequantize_q6_k(const uint8_t* src, float* dst, std::size_t blocks) noexcept {
  for (std::size_t b = 0; b < blocks; ++b, src += kQ6_KBytes) {
    const uint8_t* ql = src;
    const uint8_t* qh = src + 128;
    const auto* scales = reinterpret_cast<const int8_t*>(src + 192);
    const float d = load_f16(src + 208);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, scales += 8, dst += 128) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q0 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q1 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q2 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q3 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        dst[l] = d * scales[is + 0] * static_cast<float>(q0);
        dst[l + 32] = d * scales[is + 2] * static_cast<float>(q1);
        dst[l + 64] = d * scales[is + 4] * static_cast<float>(q2);
        dst[l + 96] = d * scales[is + 6] * static_cast<float>(q3);
      }
    }
  }
}

}  // namespace

bool is_supported(GgmlType type) noexcept {
  return block_elements(type) != 0;
}

std::size_t block_elements(GgmlType type) noexcept {
  switch (type) {
    case GgmlType::f32:
    case GgmlType::f16:
    case GgmlType::bf16: return 1;
    case GgmlType::q4_0:
    case GgmlType::q4_1:
    case GgmlType::q8_0: return kQuantBlock;
    case GgmlType::q4_k:
    case GgmlType::q6_k: return kSuperBlock;
  }
  return 0;
}

std::size_t block_bytes(GgmlType type) noexcept {
  switch (type) {
    case GgmlType::f32: return 4;
    case GgmlType::f16:
    case GgmlType::bf16: return 2;
    case GgmlType::q4_0: return kQ4_0Bytes;
    case GgmlType::q4_1: return kQ4_1Bytes;
    case GgmlType::q8_0: return kQ8_0Bytes;
    case GgmlType::q4_k: return kQ4_KBytes;
    case GgmlType::q6_k: return kQ6_KBytes;
  }
  return 0;
}

std::size_t row_bytes(GgmlType type, uint64_t n) {
  if (!is_supported(type))
    fail(Status::invalid_file, "ggml type id ", static_cast<uint32_t>(type), " (",
         ggml_type_name(type), ") is not one kvsift can read");
  const std::size_t block = block_elements(type);
  if (n % block != 0)
    fail(Status::invalid_file, "a row of ", n, " elements is not a whole number of ",
         ggml_type_name(type), " blocks of ", block);
  if (n / block > std::numeric_limits<std::size_t>::max() / block_bytes(type))
    fail(Status::invalid_file, "a row of ", n, " ", ggml_type_name(type),
         " elements does not fit in memory");
  return n / block * block_bytes(type);
}

void dequantize(GgmlType type, const void* src, float* dst, std::size_t n) noexcept {
  if (n == 0) return;  // src and dst may be null then, which memcpy does not allow
  const auto* in = static_cast<const uint8_t*>(src);
  switch (type) {
    case GgmlType::f32: std::memcpy(dst, in, n * sizeof(float)); return;
    case GgmlType::f16: dequantize_f16(in, dst, n); return;
    case GgmlType::bf16: dequantize_bf16(in, dst, n); return;
    case GgmlType::q4_0: dequantize_q4_0(in, dst, n / kQuantBlock); return;
    case GgmlType::q4_1: dequantize_q4_1(in, dst, n / kQuantBlock); return;
    case GgmlType::q8_0: dequantize_q8_0(in, dst, n / kQuantBlock); return;
    case GgmlType::q4_k: dequantize_q4_k(in, dst, n / kSuperBlock); return;
    case GgmlType::q6_k: dequantize_q6_k(in, dst, n / kSuperBlock); return;
  }
  // Callers validate types (GgufFile rejects tensors of other types); NaN makes a slip visible.
  std::fill(dst, dst + n, std::numeric_limits<float>::quiet_NaN());
}

}  // namespace kvsift::model
