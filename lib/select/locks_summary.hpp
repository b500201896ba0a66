// LOCKS page summaries (docs/methods.md, LOCKS): per sealed (page, KV head), a rank-r factorisation
// of the page's centered keys, quantised into a fixed-size record, and the page score the
// selector ranks pages by. The record layout is stated once, in simd/locks_record.hpp; the fast
// scorer is Kernels::locks_score (simd/kernels.hpp).
//
// Build (docs/methods.md, LOCKS: summary build), for the page's keys k_1..k_B (B = page_tokens, d =
// head_dim):
//   mu = mean_i k_i (float32); D = K - mu (B x d); M = D D^T (B x B, float64);
//   M = U diag(lambda) U^T with lambda descending (symmetric_eigen); for j < r:
//   sigma_j = sqrt(max(lambda_j, 1e-10)), C = U_r diag(sigma) (B x r, row i = c_i),
//   V = D^T U_r diag(1/sigma) (d x r, orthonormal columns), so D ~ C V^T (the rank-r truncated
//   SVD). Quantised: V int4 per column (scale max|col|/7, clamp [-8, 7]), C int8 per token
//   (max|c_i|/127), mu int8 (max|mu|/127), every scale stored as bf16 and the codes rounded
//   (to nearest even) against the float32 scale before that rounding, as the authors' build.
// Plus, for certified selection, e = max_i ||k_i - (mu + V c_i)|| with the dequantised mu, V, C
// (what scoring uses), computed in float64 and rounded up to float32, so that for every query q
// and token i of the page, exactly: q . k_i <= q . (mu + V c_i) + ||q|| * e. It bounds the
// summary's error for the q it is given: with int8_query the score uses q~, not q, and a caller
// certifying against q must add its own bound on |(q - q~) . k_i|; the float32 rounding of the
// kernels is not covered either.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/kernels.hpp"

namespace kvsift::select {

inline constexpr uint32_t kLocksDefaultRank = 8;  // docs/methods.md, LOCKS: parameters

struct LocksShape {
  uint32_t head_dim = 128;            // 64, 128 or 256
  uint32_t page_tokens = 16;          // 16, 32 or 64
  uint32_t rank = kLocksDefaultRank;  // 1 .. page_tokens - 1
};

// Throws Error(invalid_argument) naming the first field out of range.
void locks_check_shape(const LocksShape& shape);

// The paper's summary bytes per (page, KV head): r*d*4/8 + 2r + B*r + 2B + d + 2 (818 at d = 128,
// B = 16, r = 8; 978 at B = 32). Excludes the residual bound and the padding.
std::size_t locks_paper_bytes(const LocksShape& shape) noexcept;
// Bytes of one stored record: the paper's bytes, the residual bound, padding to 64 (832 at d =
// 128, B = 16, r = 8). Records of consecutive pool slots lie this far apart.
std::size_t locks_record_bytes(const LocksShape& shape) noexcept;

// The unquantised factorisation, caller-owned arrays (what locks_build quantises; exposed for
// tests and for unquantised ablations).
struct LocksFactors {
  float* mu;            // [head_dim] mean key
  float* coeffs;        // [page_tokens, rank]: row i = c_i
  float* basis;         // [rank, head_dim]: row j = column j of V, a unit vector
  double* eigenvalues;  // [page_tokens] of D D^T, descending (all of them, not just r)
};

// Factorises one page. keys: [page_tokens, head_dim] float32 (the page as the cache reads it
// back: simd::load_rows). The shape must have passed locks_check_shape. No allocation (fixed
// stack arrays sized for the largest shape: about 200 KB of stack, the eigensolver's included);
// reentrant.
void locks_factor(const LocksShape& shape, const float* keys, const LocksFactors& out) noexcept;
// The same from k: [page_tokens, head_dim] keys in a 16-bit dtype (f16 or bf16).
void locks_factor(const LocksShape& shape, const uint16_t* k, simd::Dtype dtype,
                  const LocksFactors& out) noexcept;

// Builds the record of one page: keys as for locks_factor; record: out, locks_record_bytes(shape)
// bytes (padding zeroed). No allocation (about 290 KB of stack at the largest shape, so call it
// on threads with the usual 2-8 MB stacks); reentrant.
void locks_build(const LocksShape& shape, const float* keys, std::byte* record) noexcept;
// The same from k: [page_tokens, head_dim] keys in a 16-bit dtype (f16 or bf16).
void locks_build(const LocksShape& shape, const uint16_t* k, simd::Dtype dtype,
                 std::byte* record) noexcept;

// The record's bound e on max_i ||k_i - (mu + V c_i)|| (see the top of this file).
float locks_residual_bound(const LocksShape& shape, const std::byte* record) noexcept;

// The record's dequantised fields, exactly (every code times its bf16 scale is a float32):
//   mu: [head_dim]; coeffs: [page_tokens, rank], row i = c_i; basis: [rank, head_dim], row j =
//   column j of V.
void locks_dequantize(const LocksShape& shape, const std::byte* record, float* mu, float* coeffs,
                      float* basis) noexcept;

// The page score, straight from the formula in float64 on the dequantised record: the reference
// Kernels::locks_score is tested against. For each of `group` query heads q[g] ([group, head_dim],
// unscaled): lse[g] = log sum_i exp(scale * (c_i . (V^T q~) + mu . q~)), q~ as in LocksScoreJob.
void locks_score_reference(const LocksShape& shape, const std::byte* record, const float* q,
                           uint32_t group, bool int8_query, float scale, float* lse) noexcept;

}  // namespace kvsift::select
