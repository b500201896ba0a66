// The quantized matvec on AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes and adds each
// group of 4 products into an int32 lane in one instruction, with no int16 step. Compiled with
// -march=x86-64-v4 -mavx512vnni and reached only through the avx512_vnni table
// (simd/kernels.cpp), which a CPU without VNNI never gets.
//
// Q4_0 and Q4_1 take 512-bit registers, 16 blocks of a row at a time (q4_group below); q4_0x16
// (Q4_0 repacked at load, 16 rows interleaved) 16 rows a block at a time (q4_0x16_group_512); Q8_0
// the 256-bit body shared with AVX2 (quant_body.hpp), which already runs it at the read bandwidth
// on 2 threads (bench/bench_quant.cpp).
#include <immintrin.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "quant_avx512_vnni.cpp must be compiled with AVX-512 BW, VL and VNNI flags"
#endif

#include "simd/kernels.hpp"
#include "simd/x86/x86_kernels.hpp"

namespace kvsift::simd {
namespace {

struct DotOps {
  static __m256i dot_u4(__m256i init, __m256i u, __m256i s) noexcept {
    return _mm256_dpbusd_epi32(init, u, s);
  }
  static __m256i dot_s8(__m256i w, __m256i a) noexcept {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
  }
};

#include "simd/x86/quant_body.hpp"

// ---- Q4_0 and Q4_1, 16 blocks at a time ------------------------------------------------------
//
// The 256-bit body spends as much per block on its float step (the fp16 scale converted, times the
// activation scale, broadcast, 8 lanes converted and FMA'd) and on unpacking nibbles as on the dot
// product itself, which caps it near 18 GB/s of weights a core (bench/bench_quant.cpp). Here the
// per-block work is integer, with few shuffles, and the float work is batched per 16 blocks:
//  1. Two blocks b, b+1 per 512-bit register: each block's 16 code bytes broadcast to two 128-bit
//     quarters, [b, b, b+1, b+1] (broadcast loads: no shuffle), ANDed with [0x0f, 0xf0, 0x0f,
//     0xf0] per quarter: codes 0-15 of b (the low nibbles), codes 16-31 of b times 16 (the high
//     nibbles left in place), the same for b+1. That is the activations' own order (codes 0-15,
//     16-31 of b, then of b+1), so one vpdpbusd against them gives 16 int32 lanes, quarter by
//     quarter: b's low, b's high times 16, b+1's low, b+1's high times 16. Exact: a lane holds 4
//     products of at most 240 * 127.
//  2. The 8 registers of 16 blocks are reduced to one register of 16 per-block sums by unpacks and
//     adds within quarters; at the last step the high quarters (exact multiples of 16) are shifted
//     right by 4, exactly, and added to the low ones. The lanes come out in lane_block's order.
//  3. Q4_0's offset, sum (n - 8) q = sum n q - 8 sum q, is taken out in int32 with the activation
//     block sums (exact). Then one conversion to float32 and one FMA by d * s per lane add the 16
//     blocks into the row's 16-lane accumulator (Q4_1: one more FMA for its m * s * sum q term).
//     The fp16 d (and m) of the 16 blocks are picked out of the blocks' bytes by word permutes.
// The 16 lanes are summed once at the end of the row. A row's last blocks (cols / 32 not a
// multiple of 16) go through the same steps from a zero-padded copy, whose zero weights, codes and
// scales add exact zeros. Each row is summed on its own, in the same order whatever rows a call
// covers.
//
// Measured against three other designs (bench/bench_quant.cpp, Zen 5): building each pair's
// register by 128-bit inserts ([b, b+1], the 256-bit half repeated, the activations' quarters
// reordered to match) ran 5-10% slower in L2; the same steps taking 4 or 8 rows per activation
// load ran 15-25% faster in L2 but 1.7-2.5x slower with the weights in DRAM, on 2 threads (4 or 8
// interleaved row streams a core instead of one, software prefetch or not); the 256-bit body
// taking 4 rows per activation load, its float step per block kept, ran at 20-21 GB/s in L2
// against this one's 33 in the same runs.

constexpr std::size_t kGroup = 16;  // blocks a step takes

// The block (0..15) whose sum lane i of step 2's register holds.
constexpr int lane_block(int i) { return 8 * (i >> 3) + 2 * (i & 3) + ((i >> 2) & 1); }

// vpermw indices picking, for each lane's block, the fp16 word at byte offset `field` of the block
// (blocks `bytes` apart), out of the register pair that holds it (the low 6 bits index a pair of
// 32-word registers: the group's words 0-63, 64-127, 128-159).
template <std::size_t bytes, std::size_t field>
constexpr std::array<int16_t, 32> field_words() {
  std::array<int16_t, 32> idx{};
  for (int i = 0; i < 16; ++i)
    idx[i] = static_cast<int16_t>((lane_block(i) * bytes + field) / 2 % 64);
  return idx;
}

// Lanes whose word lies at or above `from` (a mask of 16-bit lanes).
template <std::size_t bytes, std::size_t field>
constexpr __mmask32 lanes_from(std::size_t from) {
  __mmask32 mask = 0;
  for (int i = 0; i < 16; ++i)
    if ((lane_block(i) * bytes + field) / 2 >= from) mask |= __mmask32{1} << i;
  return mask;
}

// The fp16 field (d at 0, Q4_1's m at 2) of a group's 16 blocks, in lane order, as float32, from
// the group's bytes read as five registers.
template <std::size_t bytes, std::size_t field>
__m512 group_field(const __m512i (&words)[5]) noexcept {
  static constexpr std::array<int16_t, 32> kIdx = field_words<bytes, field>();
  const __m512i idx = _mm512_loadu_si512(kIdx.data());
  __m512i r = _mm512_permutex2var_epi16(words[0], idx, words[1]);
  r = _mm512_mask_blend_epi16(lanes_from<bytes, field>(64), r,
                              _mm512_permutex2var_epi16(words[2], idx, words[3]));
  r = _mm512_mask_blend_epi16(lanes_from<bytes, field>(128), r,
                              _mm512_permutexvar_epi16(idx, words[4]));
  return _mm512_cvtph_ps(_mm512_castsi512_si256(r));
}

// Pairwise unpack-and-add steps of the reduction (step 2), within 128-bit quarters.
__m512i add_dwords(__m512i a, __m512i b) noexcept {
  return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}
__m512i add_qwords(__m512i a, __m512i b) noexcept {
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}

// acc + the 16 blocks at w against activation codes q (512 of them), scales and sums.
template <BlockFormat F>
__m512 q4_group(const std::byte* w, const int8_t* q, const float* scale, const int32_t* sum,
                __m512 acc) noexcept {
  constexpr std::size_t bytes = block_format_bytes(F), codes = F == BlockFormat::q4_0 ? 2 : 4;
  const __m512i keep = _mm512_broadcast_i64x4(_mm256_set_epi64x(
      -0x0f0f0f0f0f0f0f10, -0x0f0f0f0f0f0f0f10, 0x0f0f0f0f0f0f0f0f, 0x0f0f0f0f0f0f0f0f));
  __m512i pair[8];
  for (int j = 0; j < 8; ++j) {
    const auto* p = reinterpret_cast<const __m128i*>(w + 2 * j * bytes + codes);
    const auto* p1 = reinterpret_cast<const __m128i*>(w + (2 * j + 1) * bytes + codes);
    const __m512i both = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128(p)),
                                                     0xff00, _mm_loadu_si128(p1));
    pair[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(both, keep),
                                  _mm512_loadu_si512(q + 64 * j));
  }
  const __m512i u0 = add_qwords(add_dwords(pair[0], pair[1]), add_dwords(pair[2], pair[3]));
  const __m512i u1 = add_qwords(add_dwords(pair[4], pair[5]), add_dwords(pair[6], pair[7]));
  // Quarters 0 and 2 of u0 and u1: low-nibble sums; 1 and 3: high-nibble sums times 16.
  __m512i dot = _mm512_add_epi32(
      _mm512_shuffle_i64x2(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
      _mm512_srai_epi32(_mm512_shuffle_i64x2(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)), 4));

  static constexpr std::array<int32_t, 16> kOrder = [] {
    std::array<int32_t, 16> order{};
    for (int i = 0; i < 16; ++i) order[i] = lane_block(i);
    return order;
  }();
  const __m512i order = _mm512_loadu_si512(kOrder.data());
  const __m512i sums = _mm512_permutexvar_epi32(order, _mm512_loadu_si512(sum));
  const __m512 s = _mm512_permutexvar_ps(order, _mm512_loadu_ps(scale));
  if constexpr (F == BlockFormat::q4_0) dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(sums, 3));
  // The group's bytes (288 or 320), the fifth register masked to the group's end, which may be the
  // matrix's.
  __m512i words[5];
  for (int i = 0; i < 4; ++i) words[i] = _mm512_loadu_si512(w + 64 * i);
  constexpr auto last = static_cast<__mmask32>((uint64_t{1} << (kGroup * bytes / 2 - 128)) - 1);
  words[4] = _mm512_maskz_loadu_epi16(last, w + 256);
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(group_field<bytes, 0>(words), s),
                        acc);
  if constexpr (F == BlockFormat::q4_1)
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums),
                          _mm512_mul_ps(group_field<bytes, 2>(words), s), acc);
  return acc;
}

template <BlockFormat F>
float q4_row(const std::byte* w, std::size_t blocks, const int8_t* q, const float* scale,
             const int32_t* sum) noexcept {
  constexpr std::size_t bytes = block_format_bytes(F);
  __m512 acc = _mm512_setzero_ps();
  std::size_t b = 0;
  for (; b + kGroup <= blocks; b += kGroup)
    acc = q4_group<F>(w + b * bytes, q + b * kQuantBlock, scale + b, sum + b, acc);
  if (const std::size_t left = blocks - b; left > 0) {
    alignas(64) std::byte w_pad[kGroup * bytes] = {};
    alignas(64) int8_t q_pad[kGroup * kQuantBlock] = {};
    alignas(64) float scale_pad[kGroup] = {};
    alignas(64) int32_t sum_pad[kGroup] = {};
    std::memcpy(w_pad, w + b * bytes, left * bytes);
    std::memcpy(q_pad, q + b * kQuantBlock, left * kQuantBlock);
    std::memcpy(scale_pad, scale + b, left * sizeof(float));
    std::memcpy(sum_pad, sum + b, left * sizeof(int32_t));
    acc = q4_group<F>(w_pad, q_pad, scale_pad, sum_pad, acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// ---- q4_0x16 on 512-bit registers --------------------------------------------------------------
//
// quant_body.hpp's q4_0x16_group with a whole 64-byte quarter of a block record, 4 code bytes of
// each of the 16 rows, in one register: per block 8 vpdpbusd (4 on the low nibbles, 4 on the high
// ones, two chains), one conversion and one FMA for the 16 rows.
void q4_0x16_group_512(const std::byte* w, std::size_t blocks, const int8_t* q, const float* scale,
                       const int32_t* sum, float* y) noexcept {
  constexpr std::size_t record = kInterleavedRows * block_format_bytes(BlockFormat::q4_0);
  constexpr std::size_t scales = kInterleavedRows * 16;  // the record's d, after its codes
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512 acc = _mm512_setzero_ps();
  for (std::size_t b = 0; b < blocks; ++b, w += record, q += kQuantBlock) {
    __m512i lo = _mm512_set1_epi32(-8 * sum[b]), hi = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      // Broadcast loads (a load port, no shuffle port), where set1 of a loaded int went through
      // a general register and a shuffle.
      const __m512i a_lo = _mm512_broadcastd_epi32(_mm_loadu_si32(q + 4 * j));
      const __m512i a_hi = _mm512_broadcastd_epi32(_mm_loadu_si32(q + 16 + 4 * j));
      const __m512i raw = _mm512_loadu_si512(w + 64 * j);
      lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(raw, low), a_lo);
      hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low), a_hi);
    }
    const __m512 d =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + scales)));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)),
                          _mm512_mul_ps(d, _mm512_set1_ps(scale[b])), acc);
  }
  _mm512_storeu_ps(y, acc);
}

}  // namespace

void matvec_quant_avx512_vnni(BlockFormat format, const std::byte* w, std::size_t rows,
                              std::size_t cols, const QuantizedVectors& x, std::size_t n_vectors,
                              float* y, std::size_t y_stride) noexcept {
  switch (format) {
    case BlockFormat::q8_0: matvec_quant(format, w, rows, cols, x, n_vectors, y, y_stride); return;
    case BlockFormat::q4_0:
      matvec_rows<BlockFormat::q4_0, q4_row<BlockFormat::q4_0>>(w, rows, cols, x, n_vectors, y,
                                                              y_stride);
      return;
    case BlockFormat::q4_1:
      matvec_rows<BlockFormat::q4_1, q4_row<BlockFormat::q4_1>>(w, rows, cols, x, n_vectors, y,
                                                              y_stride);
      return;
    case BlockFormat::q4_0x16:
      matvec_q4_0x16<q4_0x16_group_512, q4_row<BlockFormat::q4_0>>(w, rows, cols, x, n_vectors,
                                                                  y, y_stride);
      return;
  }
}

}  // namespace kvsift::simd
