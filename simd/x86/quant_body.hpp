// The quantized matvec (simd/kernels.hpp, matvec_quant) over 256-bit integer dot products, shared
// by the avx2 object (quant_avx2.cpp) and the VNNI one (quant_avx512_vnni.cpp): each includes this
// header inside its own anonymous namespace after defining `DotOps`, so every function here has
// internal linkage and no copy compiled for one level can be linked into the other
// (tests/check_isa_symbols.cmake). Intrinsics only, no xsimd, for the same reason.
//
// Per block of 32: one 256-bit vector of the block's weight codes against the 32 activation codes,
// multiplied and added in groups into int32 lanes (DotOps::dot_u4 / dot_s8), the eight lanes
// converted to float32 and added with one FMA by the block's scale (weight d times activation
// scale) into one of two accumulators (even and odd blocks, hiding the FMA latency); the sixteen
// lanes are summed at the end of the row. The int32 lanes are exact: a lane holds 4 products of at
// most 128 * 127.
//
// Unsigned times signed: both x86 instructions (vpmaddubsw, vpdpbusd) multiply unsigned bytes by
// signed ones. The Q4 nibbles are unsigned already (0..15) and go in as they are; the Q4_0 offset
// (n - 8) is taken out afterwards as -8 * (sum of the block's activation codes), an exact integer
// put into lane 0 of the block's sum. Q8_0's weights are signed: the sign trick multiplies |w|
// (unsigned; -128 reads as 128) by sign(w) * a, which is exact because the activation codes are in
// [-127, 127] (their negation never overflows). Adding 128 to the activations instead would need
// each block's weight sum, one more dot product per block.
// The including file includes <cstring> and <immintrin.h> first, outside any namespace.

// Block b of a row (at w) against its 32 activation codes (at q): acc + the block's 8 int32 lanes
// in float32 times d * scale[b]; Q4_1's m term is added to m_acc.
template <BlockFormat F>
__m256 block_step(const std::byte* w, const int8_t* q, float scale, int32_t sum, __m256 acc,
                  float& m_acc) noexcept {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  __m256i dot;
  if constexpr (F == BlockFormat::q8_0) {
    dot = DotOps::dot_s8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2)), a);
  } else {
    constexpr std::size_t codes = F == BlockFormat::q4_0 ? 2 : 4;
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + codes));
    const __m256i nibbles = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw),
                                             _mm256_set1_epi8(0x0f));
    const __m256i init = F == BlockFormat::q4_0
                             ? _mm256_setr_epi32(-8 * sum, 0, 0, 0, 0, 0, 0, 0)
                             : _mm256_setzero_si256();
    dot = DotOps::dot_u4(init, nibbles, a);
  }
  uint16_t d_bits;
  std::memcpy(&d_bits, w, sizeof d_bits);
  if constexpr (F == BlockFormat::q4_1) {
    uint16_t m_bits;
    std::memcpy(&m_bits, w + 2, sizeof m_bits);
    m_acc += _cvtsh_ss(m_bits) * scale * static_cast<float>(sum);
  }
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(_cvtsh_ss(d_bits) * scale), acc);
}

template <BlockFormat F>
float row_dot(const std::byte* w, std::size_t blocks, const int8_t* q, const float* scale,
              const int32_t* sum) noexcept {
  constexpr std::size_t bytes = block_format_bytes(F);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  float m_acc = 0.0f;  // Q4_1: the m terms
  std::size_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    acc0 = block_step<F>(w + b * bytes, q + b * kQuantBlock, scale[b], sum[b], acc0, m_acc);
    acc1 = block_step<F>(w + (b + 1) * bytes, q + (b + 1) * kQuantBlock, scale[b + 1],
                         sum[b + 1], acc1, m_acc);
  }
  if (b < blocks)
    acc0 = block_step<F>(w + b * bytes, q + b * kQuantBlock, scale[b], sum[b], acc0, m_acc);
  const __m256 total = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h) + m_acc;
}

// One row (blocks of F from w) against one quantized vector (codes, block scales, block sums).
using RowDot = float (*)(const std::byte* w, std::size_t blocks, const int8_t* q,
                         const float* scale, const int32_t* sum) noexcept;

// Every row against every vector, each by `dot` (the including file may bring its own).
template <BlockFormat F, RowDot dot = row_dot<F>>
void matvec_rows(const std::byte* w, std::size_t rows, std::size_t cols, const QuantizedVectors& x,
                 std::size_t n_vectors, float* y, std::size_t y_stride) noexcept {
  const std::size_t blocks = cols / kQuantBlock, row_bytes = blocks * block_format_bytes(F);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t m = 0; m < n_vectors; ++m)
      y[m * y_stride + r] = dot(w + r * row_bytes, blocks, x.q + m * cols, x.scale + m * blocks,
                                x.sum + m * blocks);
}

// ---- q4_0x16: 16 rows at a time --------------------------------------------------------------
//
// One int32 lane per row (BlockFormat q4_0x16, simd/kernels.hpp): per block, each 256-bit load
// holds 4 code bytes of each of 8 rows; its low nibbles (codes 4 j..4 j + 3) and its high ones
// (codes 16 + 4 j..) go against the block's activation codes 4 j.. and 16 + 4 j.. broadcast to
// every lane, and the eight products add up each row's dot product in its own lane. Nothing is
// summed across lanes, per block or per row: the row kernel's per-block float step and per-row
// reduction (row_dot, quant_avx512_vnni.cpp's q4_group) become one conversion and one FMA per 8
// rows, and the activation codes are loaded once for 16 rows. The lanes start from the Q4_0
// offset, -8 times the block's activation sum, exactly as block_step does; vpmaddubsw's int16
// pairs stay below 2 * 15 * 127. The avx2 and avx512 tables run this; the avx512_vnni table its
// 512-bit twin (quant_avx512_vnni.cpp, q4_0x16_group_512), all 16 rows in one register.

// One group (16 rows of `blocks` blocks at w) against one vector: y[0..15].
void q4_0x16_group(const std::byte* w, std::size_t blocks, const int8_t* q, const float* scale,
                   const int32_t* sum, float* y) noexcept {
  constexpr std::size_t record = kInterleavedRows * block_format_bytes(BlockFormat::q4_0);
  constexpr std::size_t scales = kInterleavedRows * 16;  // the record's d, after its codes
  const __m256i low = _mm256_set1_epi8(0x0f);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (std::size_t b = 0; b < blocks; ++b, w += record, q += kQuantBlock) {
    __m256i a[8];  // broadcast loads: a load port, no shuffle port
    for (int j = 0; j < 8; ++j) a[j] = _mm256_broadcastd_epi32(_mm_loadu_si32(q + 4 * j));
    const __m256i offset = _mm256_set1_epi32(-8 * sum[b]);
    const __m256 s = _mm256_set1_ps(scale[b]);
    for (int half = 0; half < 2; ++half) {
      __m256i dot = offset;
      for (int j = 0; j < 4; ++j) {
        const __m256i raw =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32 * half));
        dot = DotOps::dot_u4(dot, _mm256_and_si256(raw, low), a[j]);
        dot = DotOps::dot_u4(dot, _mm256_and_si256(_mm256_srli_epi16(raw, 4), low), a[4 + j]);
      }
      const __m256 d = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + scales + 16 * half)));
      acc[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, s), acc[half]);
    }
  }
  _mm256_storeu_ps(y, acc[0]);
  _mm256_storeu_ps(y + 8, acc[1]);
}

// One q4_0x16 group (16 rows of `blocks` blocks) against one quantized vector: y[0..15].
using GroupDot = void (*)(const std::byte* w, std::size_t blocks, const int8_t* q,
                          const float* scale, const int32_t* sum, float* y) noexcept;

// Every group by `group`, then the last rows % 16 rows as Q4_0 rows by `tail` (the including file
// may bring its own).
template <GroupDot group = q4_0x16_group, RowDot tail = row_dot<BlockFormat::q4_0>>
void matvec_q4_0x16(const std::byte* w, std::size_t rows, std::size_t cols,
                    const QuantizedVectors& x, std::size_t n_vectors, float* y,
                    std::size_t y_stride) noexcept {
  const std::size_t blocks = cols / kQuantBlock;
  const std::size_t row_bytes = blocks * block_format_bytes(BlockFormat::q4_0);
  const std::size_t full = rows / kInterleavedRows * kInterleavedRows;
  for (std::size_t g = 0; g < full; g += kInterleavedRows)
    for (std::size_t m = 0; m < n_vectors; ++m)
      group(w + g * row_bytes, blocks, x.q + m * cols, x.scale + m * blocks, x.sum + m * blocks,
            y + m * y_stride + g);
  matvec_rows<BlockFormat::q4_0, tail>(w + full * row_bytes, rows - full, cols, x, n_vectors,
                                       y + full, y_stride);
}

void matvec_quant(BlockFormat format, const std::byte* w, std::size_t rows, std::size_t cols,
                  const QuantizedVectors& x, std::size_t n_vectors, float* y,
                  std::size_t y_stride) noexcept {
  switch (format) {
    case BlockFormat::q8_0:
      matvec_rows<BlockFormat::q8_0>(w, rows, cols, x, n_vectors, y, y_stride);
      return;
    case BlockFormat::q4_0:
      matvec_rows<BlockFormat::q4_0>(w, rows, cols, x, n_vectors, y, y_stride);
      return;
    case BlockFormat::q4_1:
      matvec_rows<BlockFormat::q4_1>(w, rows, cols, x, n_vectors, y, y_stride);
      return;
    case BlockFormat::q4_0x16: matvec_q4_0x16(w, rows, cols, x, n_vectors, y, y_stride); return;
  }
}
