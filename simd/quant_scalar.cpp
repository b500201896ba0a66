// Portable quantized matvec and the activation quantizer (simd/quant.hpp). Compiled without ISA
// flags.
#include <cmath>
#include <cstring>

#include "simd/half.hpp"
#include "simd/quant.hpp"

namespace kvsift::simd {
namespace {

float load_f16(const std::byte* p) noexcept {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return f16_to_f32(bits);
}

// Block b's code i (0..31) of a Q4 block's 16 bytes: the low nibbles first, then the high ones.
int nibble(const std::byte* qs, int i) noexcept {
  const auto byte = static_cast<uint8_t>(qs[i & 15]);
  return i < 16 ? (byte & 0x0f) : (byte >> 4);
}

// One block's term: the integer dot product, exact in int32 (at most 32 * 128 * 127 in
// magnitude), then scaled in float32.
template <BlockFormat F>
float block_term(const std::byte* w, const int8_t* q, float scale, int32_t sum) noexcept {
  int32_t dot = 0;
  if constexpr (F == BlockFormat::q8_0) {
    const auto* wq = reinterpret_cast<const int8_t*>(w + 2);
    for (std::size_t i = 0; i < kQuantBlock; ++i) dot += int32_t{wq[i]} * q[i];
  } else {
    const std::byte* qs = w + (F == BlockFormat::q4_0 ? 2 : 4);
    for (int i = 0; i < 32; ++i) dot += nibble(qs, i) * q[i];
    if constexpr (F == BlockFormat::q4_0) dot -= 8 * sum;  // sum (n - 8) q = sum n q - 8 sum q
  }
  float term = load_f16(w) * scale * static_cast<float>(dot);
  if constexpr (F == BlockFormat::q4_1)  // sum (d n + m) s q = d s sum n q + m s sum q
    term += load_f16(w + 2) * scale * static_cast<float>(sum);
  return term;
}

// One row against one vector: the block terms summed in float32, blocks in order.
template <BlockFormat F>
float row_dot(const std::byte* w, std::size_t blocks, const int8_t* q, const float* scale,
              const int32_t* sum) noexcept {
  constexpr std::size_t bytes = block_format_bytes(F);
  float acc = 0.0f;
  for (std::size_t b = 0; b < blocks; ++b, w += bytes, q += kQuantBlock)
    acc += block_term<F>(w, q, scale[b], sum[b]);
  return acc;
}

template <BlockFormat F>
void matvec_rows(const std::byte* w, std::size_t rows, std::size_t cols, const QuantizedVectors& x,
                 std::size_t n_vectors, float* y, std::size_t y_stride) noexcept {
  const std::size_t blocks = cols / kQuantBlock, row_bytes = blocks * block_format_bytes(F);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t m = 0; m < n_vectors; ++m)
      y[m * y_stride + r] = row_dot<F>(w + r * row_bytes, blocks, x.q + m * cols,
                                       x.scale + m * blocks, x.sum + m * blocks);
}

// q4_0x16's block record (simd/kernels.hpp, BlockFormat): 4 code bytes of each row per 64-byte
// quarter, then the rows' d.
constexpr std::size_t kQ4Bytes = 18, kQ4Codes = 16;
constexpr std::size_t kRecordBytes = kInterleavedRows * kQ4Bytes;
constexpr std::size_t kRecordScales = kInterleavedRows * kQ4Codes;

// Row r's Q4_0 block out of the group's block record, and back.
void gather_block(const std::byte* record, std::size_t r, std::byte* block) noexcept {
  std::memcpy(block, record + kRecordScales + 2 * r, 2);
  for (std::size_t j = 0; j < 4; ++j)
    std::memcpy(block + 2 + 4 * j, record + kInterleavedRows * 4 * j + 4 * r, 4);
}
void scatter_block(const std::byte* block, std::size_t r, std::byte* record) noexcept {
  std::memcpy(record + kRecordScales + 2 * r, block, 2);
  for (std::size_t j = 0; j < 4; ++j)
    std::memcpy(record + kInterleavedRows * 4 * j + 4 * r, block + 2 + 4 * j, 4);
}

// The reference reads each interleaved row back as Q4_0 blocks and sums them as a Q4_0 row: the
// same terms in the same order, so its results equal the Q4_0 reference's bit for bit.
void matvec_q4_0x16(const std::byte* w, std::size_t rows, std::size_t cols,
                    const QuantizedVectors& x, std::size_t n_vectors, float* y,
                    std::size_t y_stride) noexcept {
  const std::size_t blocks = cols / kQuantBlock, row_bytes = blocks * kQ4Bytes;
  const std::size_t full = rows / kInterleavedRows * kInterleavedRows;
  for (std::size_t g = 0; g < full; g += kInterleavedRows)
    for (std::size_t r = 0; r < kInterleavedRows; ++r)
      for (std::size_t m = 0; m < n_vectors; ++m) {
        float acc = 0.0f;
        for (std::size_t b = 0; b < blocks; ++b) {
          std::byte block[kQ4Bytes];
          gather_block(w + g * row_bytes + b * kRecordBytes, r, block);
          acc += block_term<BlockFormat::q4_0>(block, x.q + m * cols + b * kQuantBlock,
                                               x.scale[m * blocks + b], x.sum[m * blocks + b]);
        }
        y[m * y_stride + g + r] = acc;
      }
  matvec_rows<BlockFormat::q4_0>(w + full * row_bytes, rows - full, cols, x, n_vectors, y + full,
                                 y_stride);
}

}  // namespace

void quantize_vectors(const float* x, std::size_t n_vectors, std::size_t cols, int8_t* q,
                      float* scale, int32_t* sum) noexcept {
  const std::size_t blocks = n_vectors * (cols / kQuantBlock);
  for (std::size_t b = 0; b < blocks; ++b, x += kQuantBlock, q += kQuantBlock) {
    float amax = 0.0f;
    for (std::size_t i = 0; i < kQuantBlock; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t total = 0;
    for (std::size_t i = 0; i < kQuantBlock; ++i) {
      // Round to nearest even by the 1.5 * 2^23 trick (|x * inv| <= 127 + a few ulp), which
      // vectorizes where nearbyint would be a call per value.
      const float r = (x[i] * inv + 12582912.0f) - 12582912.0f;
      q[i] = static_cast<int8_t>(r);
      total += q[i];
    }
    scale[b] = d;
    sum[b] = total;
  }
}

void repack_q4_0x16(const std::byte* src, std::size_t rows, std::size_t cols,
                    std::byte* dst) noexcept {
  const std::size_t blocks = cols / kQuantBlock, row_bytes = blocks * kQ4Bytes;
  const std::size_t full = rows / kInterleavedRows * kInterleavedRows;
  for (std::size_t g = 0; g < full; g += kInterleavedRows)
    for (std::size_t r = 0; r < kInterleavedRows; ++r)
      for (std::size_t b = 0; b < blocks; ++b)
        scatter_block(src + (g + r) * row_bytes + b * kQ4Bytes, r,
                      dst + g * row_bytes + b * kRecordBytes);
  std::memcpy(dst + full * row_bytes, src + full * row_bytes, (rows - full) * row_bytes);
}

void q4_0x16_row(const std::byte* group, std::size_t cols, std::size_t r, std::byte* row) noexcept {
  for (std::size_t b = 0; b < cols / kQuantBlock; ++b)
    gather_block(group + b * kRecordBytes, r, row + b * kQ4Bytes);
}

void matvec_quant_scalar(BlockFormat format, const std::byte* w, std::size_t rows, std::size_t cols,
                         const QuantizedVectors& x, std::size_t n_vectors, float* y,
                         std::size_t y_stride) noexcept {
  switch (format) {
    case BlockFormat::q8_0: matvec_rows<BlockFormat::q8_0>(w, rows, cols, x, n_vectors, y, y_stride); return;
    case BlockFormat::q4_0: matvec_rows<BlockFormat::q4_0>(w, rows, cols, x, n_vectors, y, y_stride); return;
    case BlockFormat::q4_1: matvec_rows<BlockFormat::q4_1>(w, rows, cols, x, n_vectors, y, y_stride); return;
    case BlockFormat::q4_0x16: matvec_q4_0x16(w, rows, cols, x, n_vectors, y, y_stride); return;
  }
}

}  // namespace kvsift::simd
