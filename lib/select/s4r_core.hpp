// The numerical core of S4R (docs/methods.md, S4R): rank from the memory target, hybrid sampling,
// the low-rank basis, projection and reconstruction, and the per-step latent relevance with its
// top-k. Plain arrays in and out; this file knows nothing of the cache, the model or the selector.
//
// Layouts (all row-major, floats unless stated):
// - rows (keys, values or queries of one layer, all KV heads concatenated, pre-RoPE): [n_rows, dim]
//   with row r at rows + r * row_stride (row_stride >= dim, in floats); dim is D' of
//   docs/methods.md.
// - Basis::columns [rank, dim]: row j is the j-th right singular vector, column j of B
//   (docs/methods.md, S4R: prefill); the array is B^T.
// - coefficients [n_tokens, rank] in a storage dtype (fp16 or bf16), token t at t * rank: C = S B.
// - query coefficients [n_queries, groups, rank] float32: C_Q = Q~ B_K, oldest query first.
//
// Costs and allocation. fit_basis and project are the prefill (once per prompt and layer) and may
// allocate; the rest is the decode step: it allocates nothing and writes only the caller's outputs
// and workspaces. Argument checks are O(1) (fit_basis: O(n_sample)) and throw kvsift::Error
// (invalid_argument) naming the argument. Every function is reentrant; a ThreadPool is used by one
// thread at a time.
//
// Parallelism: project, reconstruct and relevance split their rows over the pool they are given
// (the calling thread alone for nullptr), and their results do not depend on the number of
// threads; project and reconstruct run the kernel table's float32 product (simd/kernels.hpp:
// gemm_f32). fit_basis updates its Gram through Eigen's products in tiles spread over the pool
// (each tile summed in the same order for any number of threads) and runs the eigen-decomposition
// on the calling thread.
#pragma once

#include <cstdint>
#include <vector>

#include "lib/core/thread_pool.hpp"
#include "simd/kernels.hpp"

namespace kvsift::select::s4r {

// ---- Memory model (docs/methods.md, S4R: memory model) ---------------------------------------

// The real-valued rank at which the persistent S4R memory of one layer is the fraction
// 1 / compression of the dense cache: r = D' (eta (s + L) - s) / (L + G W / 2 + D'), eta =
// 1 / compression. May be negative or exceed D' (tiny L, or compression near 1).
//   feature_dim: D' (n_kv_heads * head_dim), > 0. tokens: L, non-sink tokens. sinks: s.
//   groups: G, query heads per KV head. window: W, query window. compression: >= 1 (2.5, 5).
double rank_for_compression(uint32_t feature_dim, uint64_t tokens, uint32_t sinks, uint32_t groups,
                            uint32_t window, double compression);

// rank_for_compression rounded down to a multiple of `multiple` (kernels want whole blocks), then
// clamped to [multiple, feature_dim] (to feature_dim alone when feature_dim < multiple). The
// memory ratio at the result is therefore at most 1 / compression unless the clamp raised it.
// Example (docs/methods.md, S4R: memory model): D' = 1024, G = 4, W = 32, s = 4, L = 120,000,
// compression 5: 202.9 before rounding, 200 after. Throws on feature_dim 0, multiple 0,
// compression < 1.
uint32_t solve_rank(uint32_t feature_dim, uint64_t tokens, uint32_t sinks, uint32_t groups,
                    uint32_t window, double compression, uint32_t multiple = 8);

// Persistent S4R elements over dense elements of one layer at rank r:
// (s D' + L r + G W r / 2 + D' r) / ((s + L) D') (sinks, C_K and C_V, the query window, B_K and
// B_V, each counted once per K/V pair). Throws on feature_dim 0 or s + L = 0.
double memory_ratio(uint32_t feature_dim, uint64_t tokens, uint32_t sinks, uint32_t groups,
                    uint32_t window, uint32_t rank);

// ---- Sampling (docs/methods.md, S4R: prefill) ------------------------------------------------

// `count` distinct positions of [first, end), ascending: the n_recent = ceil(recent_share * count)
// most recent positions as one contiguous block [end - n_recent, end), and the other
// count - n_recent evenly spaced over the earlier positions [first, end - n_recent) (the i-th of
// u at first + floor((2i + 1) E / (2u)), E the number of earlier positions: centred, so neither
// end is favoured). The ceil forgives 1e-9 so that 0.7 * 10 gives 7. Deterministic. count >=
// end - first returns every position; count 0 returns none. The caller picks count
// (docs/methods.md, S4R: prefill). Throws when first > end, end > 2^32 or recent_share is outside
// [0, 1].
std::vector<uint32_t> hybrid_sample(uint64_t first, uint64_t end, uint64_t count,
                                    double recent_share = 0.7);

// ---- Basis (docs/methods.md, S4R: prefill) ---------------------------------------------------

struct Basis {
  uint32_t dim = 0;
  uint32_t rank = 0;
  // [rank, dim]: column j of B (orthonormal) as row j, i.e. B^T; one copy serves projection and
  // reconstruction, so what a compressed cache holds is what the memory model counts.
  std::vector<float> columns;
  // [dim], descending: the singular values of the normalised sample (zeros past its rank); the
  // first `rank` belong to the columns of B. Their squares past `rank` sum to the sample's
  // reconstruction error sum_i |x_i - x_i B B^T|^2 (x_i the normalised rows).
  std::vector<double> singular_values;
  uint64_t rows_used = 0;  // sampled rows with a nonzero norm (the others were skipped)
};

// The top-`rank` right singular vectors of the sampled rows, each first scaled to unit L2 norm
// (rows of zero norm skipped): the basis captures directions, not the few high-norm tokens.
//   rows: [n_rows, dim] with row_stride (floats), read only at the sampled ids.
//   sample: [n_sample] row ids, each < n_rows (repeats count twice); n_sample > 0.
//   rank: 1 .. dim.
// Method: the Gram matrix X^T X of the normalised sample (dim x dim, float64, Eigen's blocked
// rank update), then its eigen-decomposition in float64 (Eigen's SelfAdjointEigenSolver):
// sigma_k = sqrt(lambda_k), B = the leading eigenvectors. Cost n dim^2 / 2 + O(dim^3), where a
// direct SVD (Eigen's BDCSVD) costs about 4 n dim^2 and measured 5-16x slower (s4r_core.cpp). The
// squaring costs relative accuracy only below about 1e-5 sigma_1 (1e-5 relative there), far
// under any singular value a basis keeps. Each column's component of largest magnitude (the
// first, on ties) is positive, so the basis is deterministic. Allocates the dim x dim Gram and a
// 1024-row block. pool: the threads the Gram's tiles are spread over (the basis is the same for
// any number of them); nullptr: the calling thread. Throws on rank 0, rank > dim, n_sample 0, a
// sample id >= n_rows, row_stride < dim.
Basis fit_basis(const float* rows, uint64_t n_rows, uint32_t dim, uint64_t row_stride,
                const uint32_t* sample, uint64_t n_sample, uint32_t rank,
                ThreadPool* pool = nullptr);

// ---- Projection and reconstruction (docs/methods.md, S4R: prefill and S4R: decode) -----------

// Prefill: coefficients C = S B of every row, unnormalised, rounded to the storage dtype.
//   rows: [n_rows, basis.dim] with row_stride (floats). coeffs_out: [n_rows, basis.rank].
//   kernels: the handle's kernel table (its gemm_f32 multiplies, its encode converts to the dtype).
//   pool: the threads the rows are split over; nullptr: the calling thread.
// One product per block of 4096 rows, read in place. Allocates a block's float32 coefficients.
// Throws on row_stride < dim or an empty basis.
void project(const float* rows, uint64_t n_rows, uint64_t row_stride, const Basis& basis,
             uint16_t* coeffs_out, simd::Dtype dtype, const simd::Kernels& kernels,
             ThreadPool* pool = nullptr);

// Decode: the same product for the few vectors of one step (a new key or value, the window's
// queries), kept in float32 and summed in the same order for any n, without allocation.
//   rows: [n, basis.dim] with row_stride. out: [n, basis.rank] float32.
void project_to_float(const float* rows, uint32_t n, uint64_t row_stride, const Basis& basis,
                      float* out);

// Floats of workspace reconstruct() needs for this basis.
uint64_t reconstruct_workspace_floats(const Basis& basis);

// Decode: rows_out[i] = C[token_ids[i]] B^T (K^ or V^ of the selected tokens, before RoPE), 256
// tokens per product (their coefficients decoded to float32 into the workspace first).
//   coeffs: [>= max token id + 1, basis.rank] in dtype. token_ids: [n], any order, repeats
//   allowed. rows_out: [n, basis.dim] float32. workspace: [reconstruct_workspace_floats(basis)].
//   pool: the threads the tokens are split over; nullptr: the calling thread.
void reconstruct(const uint16_t* coeffs, simd::Dtype dtype, const Basis& basis,
                 const uint32_t* token_ids, uint32_t n, float* rows_out,
                 const simd::Kernels& kernels, float* workspace, ThreadPool* pool = nullptr);

// ---- Latent relevance and selection (docs/methods.md, S4R: decode) ---------------------------

enum class Pooling { max, avg };
enum class GroupAggregation { mean, max };

// Floats of workspace relevance() needs: (n_queries + 1) * groups * n_tokens + n_queries * groups.
uint64_t relevance_workspace_floats(uint32_t n_queries, uint32_t groups, uint64_t n_tokens);

// The pooled latent relevance of every compressed (non-sink) token:
//   Z[q, g, t] = C_Q[q, g] . C_K[t] / sqrt(rank) over the tokens t query q sees; P[q, g, :] =
//   softmax over those tokens; A[g, t] = mean over the queries that see at least one token of
//   P[q, g, t] (0 where q does not see t); pooled[g, t] = max (or mean) of A[g, t'] over the
//   pool_kernel tokens t' centred on t that exist (the window is cut at both ends);
//   relevance_out[t] = mean (or max) over g of pooled[g, t].
//   query_coeffs: [n_queries, groups, rank] (pre-RoPE queries projected on B_K), oldest first.
//   key_coeffs: [n_tokens, rank] in dtype.
//   pool_kernel: odd, >= 1 (the paper's 7, max pooling, group mean).
//   workspace: [relevance_workspace_floats(n_queries, groups, n_tokens)].
//   relevance_out: [n_tokens].
//   pool: the threads its passes run on; nullptr: the calling thread.
//   causal: which tokens each query sees.
//     false: every query sees every token, for queries that come after all the scored tokens
//       (kvsift stores decode tokens exactly, so the compressed prompt precedes every window
//       query).
//     true: the queries are those of the last n_queries scored tokens (the paper's setting, where
//       every token is compressed: docs/methods.md, S4R: departures), and query q sees tokens t <=
//       n_tokens - n_queries + q.
// Cost: n_tokens * n_queries * groups * rank multiply-adds, in baseline x86-64 SSE code: 8-11.5
// GMAC/s on one Zen 4 core with other builds running (L = 32K, W = 32, G = 4, r = 200: 73-104
// ms). Throws on rank 0, groups 0, n_queries 0 or an even pool_kernel.
void relevance(const float* query_coeffs, uint32_t n_queries, uint32_t groups, uint32_t rank,
               const uint16_t* key_coeffs, simd::Dtype dtype, uint64_t n_tokens,
               uint32_t pool_kernel, Pooling pooling, GroupAggregation aggregation,
               const simd::Kernels& kernels, float* workspace, float* relevance_out,
               bool causal = false, ThreadPool* pool = nullptr);

// The k highest scores' ids [0, n), ascending by id. Ordered by score, ties to the lower id, NaN
// below everything: deterministic. workspace: [n] uint32. ids_out: [k]. Throws on k > n or
// n > 2^32.
void top_k(const float* scores, uint64_t n, uint32_t k, uint32_t* workspace, uint32_t* ids_out);

}  // namespace kvsift::select::s4r
