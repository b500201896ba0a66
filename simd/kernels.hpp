// The kernel table: every hot loop of kvsift, one table per level (simd/isa.hpp), chosen once per
// handle (lib/core/kernel_runtime.hpp).
//
// The kernels address K and V inside a page's pool slot through simd/page_layout.hpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/isa.hpp"
#include "simd/page_layout.hpp"

namespace kvsift::simd {

// The largest head_dim and page_tokens a kernel takes (the jobs below list the sizes): kernels
// size their stack buffers by them.
inline constexpr uint32_t kMaxHeadDim = 256;
inline constexpr uint32_t kMaxPageTokens = 64;

// One unit of decode attention: the G query heads of one KV head over a run of pages of one
// (sequence, layer, KV head). The kernel starts a fresh online-softmax state and leaves the
// unnormalised partial result (running max m, sum l, accumulator acc) for the split-K merge.
struct AttendJob {
  const float* q;           // [group, head_dim], already multiplied by 1/sqrt(head_dim)
  uint32_t group;           // query heads sharing this KV head
  PageLayout layout;        // head_dim 64, 128 or 256; page_tokens 16, 32 or 64; any dtype
  const std::byte* pool;    // base of the slot array (the pool, or a pair's packed row chunks)
  const uint32_t* table;    // slot id of each logical page; nullptr: the slot is the page index
  const uint32_t* logical;  // nullptr: logical pages first .. first+count-1; else logical[first..)
  uint32_t first;
  uint32_t count;
  uint64_t seq_tokens;  // tokens stored: the page holding the last token may be partial
  float* m;             // out: [group] running max of the logits (-inf when count == 0)
  float* l;             // out: [group] sum of exp(logit - m)
  float* acc;           // out: [group, head_dim] sum of exp(logit - m) * v
  float* scratch;       // [group, page_tokens] floats of workspace, 64-byte aligned
};

// LOCKS page scores (docs/methods.md, LOCKS) of the G query heads of one KV head over `count`
// page records (layout: simd/locks_record.hpp), for each head g and page i:
//   lse[g * count + i] = log sum_{t < page_tokens} exp(scale * (c_t . z + mu . q~)),  z = V^T q~,
// with q~ = q[g], or, when int8_query, q rounded per head to s_q * round(q / s_q), s_q = max|q|/127
// (q~ = 0 when q = 0). Computed in float32 from the dequantised record fields, except that the
// int8-query kernel on AVX-512 VNNI takes V^T q~ and mu . q~ exactly in integers.
struct LocksScoreJob {
  const float* q;        // [group, head_dim], not scaled
  uint32_t group;        // any number of query heads (taken in blocks of kLocksHeadBlock)
  uint32_t head_dim;     // 64, 128 or 256
  uint32_t page_tokens;  // 16, 32 or 64
  uint32_t rank;         // 1 .. page_tokens - 1
  bool int8_query;
  float scale;               // attention scale, usually 1/sqrt(head_dim)
  const std::byte* records;  // record of pool slot s at records + s * record_bytes
  std::size_t record_bytes;  // locks_record_layout(head_dim, page_tokens, rank).bytes
  const uint32_t* slots;     // [count] pool slot of each page to score
  uint32_t count;
  float* lse;  // out: [group, count]
};

// ggml's block formats a weight matrix can stay in at decode (ggml's Q8_0, Q4_0 and Q4_1 layouts):
// each row is cols / 32 blocks of 32 weights, and a block is
//   q8_0: fp16 d, int8 q[32]                      w_i = d * q_i               (34 bytes)
//   q4_0: fp16 d, uint8 qs[16]                    w_i = d * (nibble_i - 8)    (18 bytes)
//   q4_1: fp16 d, fp16 m, uint8 qs[16]            w_i = d * nibble_i + m      (20 bytes)
// where nibble_i is the low nibble of qs[i] for i < 16 and the high nibble of qs[i - 16] after.
//
// q4_0x16 is Q4_0 with its rows interleaved 16 at a time (kvsift's own; repack_q4_0x16 in
// simd/quant.hpp makes it from Q4_0 rows): rows / 16 groups of 16 rows, then the rows % 16 rows
// left as plain Q4_0 rows. A group holds its rows' block b for b = 0 .. cols / 32 - 1, 288 bytes
// each:
//   uint8 qs[4][16][4]   qs[j][r][i] = byte 4 j + i of row r's qs (codes 4 j + i and 16 + 4 j + i)
//   fp16 d[16]           d[r] = row r's d
// so a 256-bit or 512-bit load of qs holds 4 codes of each of 8 or 16 rows in one 32-bit lane a
// row: a product sums each row in a lane of its own, against one broadcast group of 4 activation
// codes, with no sums across lanes. A group is as many bytes as its 16 rows in Q4_0 (18 bytes a
// block a row): row r, a multiple of 16, starts at r * row_bytes in both.
enum class BlockFormat : uint8_t { q8_0 = 0, q4_0 = 1, q4_1 = 2, q4_0x16 = 3 };

// Elements of a block, and bytes of a block of a row in each format.
inline constexpr std::size_t kQuantBlock = 32;
constexpr std::size_t block_format_bytes(BlockFormat format) noexcept {
  return format == BlockFormat::q8_0 ? 34 : format == BlockFormat::q4_1 ? 20 : 18;
}
// Rows a q4_0x16 group interleaves.
inline constexpr std::size_t kInterleavedRows = 16;

// Vectors quantized per block of 32 for matvec_quant (quantize_vectors in simd/quant.hpp), as
// ggml quantizes activations (its Q8_0, with Q8_1's block sums): vector m's block b holds codes
// q[m * cols + 32 b + i] in [-127, 127] standing for scale[m * cols / 32 + b] * q, and
// sum[m * cols / 32 + b] is the sum of its 32 codes (the Q4 formats' offset term).
struct QuantizedVectors {
  const int8_t* q;
  const float* scale;
  const int32_t* sum;
};

// How gemm_f32's right-hand matrix B (K x N) is stored; row-major either way.
enum class GemmB : uint8_t {
  k_by_n,  // B itself: B(k, n) at b[k * ldb + n] (S4R's reconstruction: the basis as [rank, dim])
  n_by_k,  // B^T: B(k, n) at b[n * ldb + k] (linear-layer weights; S4R's projection: the basis
           // rows are the outputs)
};

// C[m, n] = sum over k of A(m, k) B(k, n), float32, row-major A and C, C overwritten. Each element
// is one chain of multiply-adds in ascending k from zero, whatever the sizes, the level's blocking
// or how a caller splits the rows between threads: results are bit-identical for any split.
struct GemmJob {
  const float* a;  // A(i, k) at a[i * lda + k]
  std::size_t lda;
  const float* b;  // B by b_layout
  std::size_t ldb;
  GemmB b_layout;
  float* c;  // C(i, j) at c[i * ldc + j]
  std::size_t ldc;
  std::size_t m, k, n;  // any sizes; m or n 0: nothing written; k 0: C = 0
};

struct Kernels {
  Level level;
  // n float32 values to a 16-bit dtype (f16 or bf16; round to nearest even). Slots of any dtype
  // are written and read through simd/page_rows.hpp.
  void (*encode)(const float* src, uint16_t* dst, std::size_t n, Dtype dtype) noexcept;
  // n f16 or bf16 values to float32.
  void (*decode)(const uint16_t* src, float* dst, std::size_t n, Dtype dtype) noexcept;
  void (*attend)(const AttendJob& job) noexcept;
  // y[m, r] = sum_c w[r, c] * x[m, c] for m < n_vectors (1..kMaxVectors), r < rows: bf16 weights
  // [rows, cols] row-major, float32 x [n_vectors, cols], y rows y_stride apart; cols a multiple
  // of 16. The decode-step projection: each weight row is streamed once for all vectors, and every
  // vector is summed in the same order whatever n_vectors is (results do not depend on batching).
  void (*matvec_bf16)(const uint16_t* w, std::size_t rows, std::size_t cols, const float* x,
                      std::size_t n_vectors, float* y, std::size_t y_stride) noexcept;
  // y[m, r] = sum_c w[r, c] * x~[m, c] for m < n_vectors (any number), r < rows: weights in
  // `format`, rows of cols / 32 blocks back to back from w (cols a multiple of 32; q4_0x16: its
  // groups of 16 rows, then its last rows % 16 rows), x~ the quantized vectors of x (each block's
  // weight codes times its activation codes summed exactly in int32, then scaled in float32), y
  // rows y_stride apart. Each vector's sum is taken in the same order whatever n_vectors is, and
  // each row's whatever rows the call covers (results are bit-identical for any split of the rows
  // between threads; q4_0x16 splits at multiples of 16 rows); the order of the block terms is the
  // level's own. The decode-step projection for weights kept in the file's blocks.
  void (*matvec_quant)(BlockFormat format, const std::byte* w, std::size_t rows, std::size_t cols,
                       const QuantizedVectors& x, std::size_t n_vectors, float* y,
                       std::size_t y_stride) noexcept;
  void (*locks_score)(const LocksScoreJob& job) noexcept;
  // out[i] = exp(x[i] - shift) for i < n, and their sum (the SIMD tables add float32 lanes and
  // move them to float64 every kExpSumBlock values; the scalar one adds in float64): the
  // selectors' page masses relative to the best page.
  double (*exp_sum)(const float* x, float shift, float* out, std::size_t n) noexcept;
  // Dense float32 product (GemmJob) on the calling thread, for products too small or too rare to
  // be worth the model layer's oneDNN (S4R's projection and reconstruction). Allocates nothing:
  // its packed panel of B lives on the stack (simd/gemm_body.hpp: kPanelBytes).
  void (*gemm_f32)(const GemmJob& job) noexcept;
};

// Values exp_sum adds in float32 lanes before it moves the partial sums to float64.
inline constexpr std::size_t kExpSumBlock = 256;

// The table of a level of kLevels (scalar's for any other value). Callers choose the level first
// (resolve_level, or cpu_has for a named one): a table's code faults on a CPU without its features.
const Kernels& kernels_for(Level level) noexcept;

// The portable table (simd/attend_scalar.cpp). The others are an architecture's own
// (simd/x86/x86_kernels.hpp) and reached through kernels_for.
const Kernels& scalar_kernels() noexcept;

using LocksScoreFn = void (*)(const LocksScoreJob& job) noexcept;

// Largest group the SIMD kernels take in one pass over a page; larger groups are processed in
// blocks of this many heads (each block re-reads the page from L1/L2, not from DRAM).
inline constexpr uint32_t kHeadBlock = 4;
// Query heads locks_score scores in one pass over the records (a GQA group is rarely larger).
inline constexpr uint32_t kLocksHeadBlock = 8;
// Most vectors matvec_bf16 takes at once.
inline constexpr std::size_t kMaxVectors = 8;

}  // namespace kvsift::simd
