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
  }
}
