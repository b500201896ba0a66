#include "lib/select/s4r_core.hpp"

#include <Eigen/Eigenvalues>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include "lib/core/error.hpp"

namespace kvsift::select::s4r {

namespace {

// Rows per Gram update: a block of the normalised sample is [1024, dim] doubles (8 MB at dim
// 1024), enough for each tile's product to run at Eigen's matrix-product speed.
constexpr uint64_t kGramRows = 1024;
// Columns of a Gram tile: each block's update is a product per tile of the lower triangle (36 at
// dim 1024), spread over the pool; a tile is always one task's, so its sums run in block order
// whatever the number of threads.
constexpr Eigen::Index kGramTile = 128;
// Rows per product in project(): their float32 coefficients (4096 x rank) before rounding.
constexpr uint64_t kProjectRows = 4096;
// Decode kernels: a block of key tokens is decoded and transposed once and then serves every
// (query, group) row; 16 tokens keep each row's 16 logits in four SSE registers. Coefficients are
// taken kRankChunk at a time so the per-thread buffers stay on the stack (2 x 16 KB) for any rank.
constexpr uint32_t kLogitTokens = 16;
constexpr uint32_t kRankChunk = 256;
// Tokens reconstructed per product: their float32 coefficients (256 x rank) are the workspace.
constexpr uint32_t kReconstructTokens = 256;
// Fewest rows of a product worth a thread of their own: each thread packs all of B (rank x dim)
// for itself, which costs about as much as 8 rows of the product (simd/gemm_body.hpp).
constexpr uint64_t kRowsPerThread = 32;

// body(first, last) over [0, m) in parts of at least kRowsPerThread rows spread over the pool's
// threads (the calling thread alone when pool is nullptr or m is small). The split changes no
// result: gemm_f32 sums each element in the same order for any split (simd/kernels.hpp).
template <class Body>
void split_rows(uint64_t m, ThreadPool* pool, const Body& body) {
  const uint64_t parts = std::max<uint64_t>(1, m / kRowsPerThread);
  parallel_static(pool, parts, [&](uint64_t p0, uint64_t p1, int) noexcept {
    body(m * p0 / parts, m * p1 / parts);
  });
}

// Rows [first, last) of a product.
simd::GemmJob rows_of(simd::GemmJob job, uint64_t first, uint64_t last) {
  job.a += first * job.lda;
  job.c += first * job.ldc;
  job.m = last - first;
  return job;
}

void check_dim_rank(uint32_t dim, uint32_t rank, const char* where) {
  require(dim > 0, where, ": dim must be > 0");
  require(rank > 0, where, ": rank must be > 0");
  require(rank <= dim, where, ": rank=", rank, " exceeds dim=", dim);
}

void check_basis(const Basis& basis, const char* where) {
  check_dim_rank(basis.dim, basis.rank, where);
  require(basis.columns.size() == std::size_t{basis.dim} * basis.rank, where,
          ": the basis is not [dim, rank] (not made by fit_basis?)");
}

// Transposes rows x cols (row-major, ld_in) into cols x rows (row-major, ld_out), in tiles so
// both sides stream through whole cache lines.
void transpose(const float* in, uint64_t rows, uint64_t cols, uint64_t ld_in, float* out,
               uint64_t ld_out) {
  constexpr uint64_t kTile = 32;
  for (uint64_t r0 = 0; r0 < rows; r0 += kTile)
    for (uint64_t c0 = 0; c0 < cols; c0 += kTile) {
      const uint64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (uint64_t r = r0; r < r1; ++r)
        for (uint64_t c = c0; c < c1; ++c) out[c * ld_out + r] = in[r * ld_in + c];
    }
}

// Four floats in one SSE register. The auto-vectoriser turned the plain loops of logits_block
// into shuffles across k (1.7 GMAC/s on one Zen 4 core); spelling the registers out keeps two
// rows' 16 logits in eight registers and runs at the compute speed of baseline x86-64.
using Vec4 = float __attribute__((vector_size(16)));

Vec4 load4(const float* p) {
  Vec4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

void store4(float* p, Vec4 v) {
  std::memcpy(p, &v, sizeof v);
}

// max of x[0, n), n > 0, four lanes at a time (std::max_element runs one float per cycle).
float row_max(const float* x, uint64_t n) {
  float m = x[0];
  uint64_t i = 0;
  if (n >= 4) {
    Vec4 v = load4(x);
    for (i = 4; i + 4 <= n; i += 4) {
      const Vec4 w = load4(x + i);
      v = v > w ? v : w;
    }
    m = std::max(std::max(v[0], v[1]), std::max(v[2], v[3]));
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// Logits of one block of up to kLogitTokens tokens for every (query, group) row, unscaled
// partial sums over the rank chunks, stored at z[row * n_tokens + t0 ..].
void logits_block(const float* query_coeffs, uint32_t n_rows, uint32_t rank,
                  const uint16_t* key_coeffs, simd::Dtype dtype, uint64_t n_tokens, uint64_t t0,
                  float scale, const simd::Kernels& kernels, float* z) {
  static_assert(kLogitTokens == 16, "the register blocking below is written for 16 tokens");
  const uint32_t tokens = static_cast<uint32_t>(std::min<uint64_t>(kLogitTokens, n_tokens - t0));
  alignas(64) float decoded[kLogitTokens * kRankChunk];
  alignas(64) float ct[kRankChunk * kLogitTokens];  // [k][token]
  alignas(64) float partial[2][kLogitTokens];
  for (uint32_t k0 = 0; k0 < rank; k0 += kRankChunk) {
    const uint32_t kn = std::min(kRankChunk, rank - k0);
    for (uint32_t t = 0; t < tokens; ++t)
      kernels.decode(key_coeffs + (t0 + t) * rank + k0, decoded + t * kn, kn, dtype);
    std::fill(decoded + tokens * kn, decoded + kLogitTokens * kn, 0.0f);
    transpose(decoded, kLogitTokens, kn, kn, ct, kLogitTokens);
    const bool first = k0 == 0;
    const float s = k0 + kn == rank ? scale : 1.0f;
    for (uint32_t row = 0; row < n_rows; row += 2) {
      // An odd last row is computed twice (row and row) and stored once.
      const uint32_t row1 = std::min(row + 1, n_rows - 1);
      const float* a0 = query_coeffs + std::size_t{row} * rank + k0;
      const float* a1 = query_coeffs + std::size_t{row1} * rank + k0;
      float* out0 = z + row * n_tokens + t0;
      float* out1 = z + row1 * n_tokens + t0;
      Vec4 x0 = {}, x1 = {}, x2 = {}, x3 = {}, y0 = {}, y1 = {}, y2 = {}, y3 = {};
      for (uint32_t k = 0; k < kn; ++k) {
        const float* c = ct + k * kLogitTokens;
        const Vec4 c0 = load4(c), c1 = load4(c + 4), c2 = load4(c + 8), c3 = load4(c + 12);
        const Vec4 p = Vec4{} + a0[k], q = Vec4{} + a1[k];
        x0 += p * c0, x1 += p * c1, x2 += p * c2, x3 += p * c3;
        y0 += q * c0, y1 += q * c1, y2 += q * c2, y3 += q * c3;
      }
      store4(partial[0], x0), store4(partial[0] + 4, x1), store4(partial[0] + 8, x2);
      store4(partial[0] + 12, x3), store4(partial[1], y0), store4(partial[1] + 4, y1);
      store4(partial[1] + 8, y2), store4(partial[1] + 12, y3);
      for (uint32_t j = 0; j < tokens; ++j) {
        out0[j] = (first ? partial[0][j] : out0[j] + partial[0][j]) * s;
        if (row1 != row) out1[j] = (first ? partial[1][j] : out1[j] + partial[1][j]) * s;
      }
    }
  }
}

}  // namespace

// ---- Memory model ----------------------------------------------------------------------------

double rank_for_compression(uint32_t feature_dim, uint64_t tokens, uint32_t sinks, uint32_t groups,
                            uint32_t window, double compression) {
  require(feature_dim > 0, "rank_for_compression: feature_dim must be > 0");
  require(compression >= 1.0, "rank_for_compression: compression=", compression,
          " must be >= 1 (it is dense bytes over S4R bytes)");
  const double eta = 1.0 / compression, D = feature_dim, L = static_cast<double>(tokens), s = sinks;
  return D * (eta * (s + L) - s) / (L + 0.5 * double(groups) * double(window) + D);
}

uint32_t solve_rank(uint32_t feature_dim, uint64_t tokens, uint32_t sinks, uint32_t groups,
                    uint32_t window, double compression, uint32_t multiple) {
  require(multiple > 0, "solve_rank: multiple must be > 0");
  const double r = rank_for_compression(feature_dim, tokens, sinks, groups, window, compression);
  uint64_t rank = multiple;
  if (r >= double(feature_dim))
    rank = feature_dim;
  else if (r > double(multiple))
    rank = static_cast<uint64_t>(r) / multiple * multiple;
  return static_cast<uint32_t>(std::min<uint64_t>(rank, feature_dim));
}

double memory_ratio(uint32_t feature_dim, uint64_t tokens, uint32_t sinks, uint32_t groups,
                    uint32_t window, uint32_t rank) {
  require(feature_dim > 0, "memory_ratio: feature_dim must be > 0");
  require(tokens + sinks > 0, "memory_ratio: sinks + tokens must be > 0");
  const double D = feature_dim, L = static_cast<double>(tokens), s = sinks, r = rank;
  return (s * D + L * r + 0.5 * double(groups) * double(window) * r + D * r) / ((s + L) * D);
}

// ---- Sampling --------------------------------------------------------------------------------

std::vector<uint32_t> hybrid_sample(uint64_t first, uint64_t end, uint64_t count,
                                    double recent_share) {
  require(first <= end, "hybrid_sample: first=", first, " > end=", end);
  require(end <= (uint64_t{1} << 32), "hybrid_sample: end=", end, " does not fit uint32 ids");
  require(recent_share >= 0.0 && recent_share <= 1.0, "hybrid_sample: recent_share=", recent_share,
          " is outside [0, 1]");
  const uint64_t total = end - first;
  std::vector<uint32_t> ids;
  if (count >= total) {
    ids.resize(total);
    for (uint64_t i = 0; i < total; ++i) ids[i] = static_cast<uint32_t>(first + i);
    return ids;
  }
  const uint64_t recent = std::min<uint64_t>(
      count, static_cast<uint64_t>(std::ceil(recent_share * double(count) - 1e-9)));
  const uint64_t uniform = count - recent, earlier = total - recent;
  ids.reserve(count);
  // uniform <= earlier (count < total), so consecutive picks differ by at least one position.
  for (uint64_t i = 0; i < uniform; ++i)
    ids.push_back(static_cast<uint32_t>(
        first + static_cast<uint64_t>((static_cast<unsigned __int128>(2 * i + 1) * earlier) /
                                      (2 * uniform))));
  for (uint64_t p = end - recent; p < end; ++p) ids.push_back(static_cast<uint32_t>(p));
  return ids;
}

// ---- Basis -----------------------------------------------------------------------------------

// Why the Gram route: on the 2-core dev box (Zen 4, load average 3-5 from other builds) Eigen's
// BDCSVD of the sample took 0.55 s at 6,000 x 192 and 13.4 s at 20,000 x 1024 in float64 (0.28 s
// and 7.5 s in float32); this function takes 0.02-0.04 s and 2.0-2.9 s (the Gram about two
// thirds, the eigen-decomposition 1.0 s). A float32 Gram through oneDNN halved the Gram's time, but
// its rounding (a few 1e-9 of lambda_1) moved the singular values near sigma_1 / 80 by over 1e-5
// relative against LAPACK, so the Gram is float64.
Basis fit_basis(const float* rows, uint64_t n_rows, uint32_t dim, uint64_t row_stride,
                const uint32_t* sample, uint64_t n_sample, uint32_t rank, ThreadPool* pool) {
  check_dim_rank(dim, rank, "fit_basis");
  require(n_sample > 0, "fit_basis: n_sample must be > 0 (no rows to fit the basis to)");
  require(row_stride >= dim, "fit_basis: row_stride=", row_stride, " < dim=", dim);
  for (uint64_t i = 0; i < n_sample; ++i)
    require(sample[i] < n_rows, "fit_basis: sample[", i, "]=", sample[i], " >= n_rows=", n_rows);

  using RowMajor = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  RowMajor block(static_cast<Eigen::Index>(std::min(kGramRows, n_sample)), dim);
  Eigen::MatrixXd gram = Eigen::MatrixXd::Zero(dim, dim);
  Eigen::Index filled = 0;
  uint64_t used = 0;
  // The lower triangle's tiles (row tile >= column tile); the eigen-solver reads only that.
  std::vector<std::pair<Eigen::Index, Eigen::Index>> tiles;
  const Eigen::Index width = dim;
  for (Eigen::Index i = 0; i < width; i += kGramTile)
    for (Eigen::Index j = 0; j <= i; j += kGramTile) tiles.emplace_back(i, j);
  auto flush = [&] {
    const auto sampled = block.topRows(filled);
    bool failed = false;  // Eigen's product may allocate; the pool's tasks may not throw
    parallel_static(pool, tiles.size(), [&](uint64_t t0, uint64_t t1, int) noexcept {
      try {
        for (uint64_t t = t0; t < t1; ++t) {
          const auto [i, j] = tiles[t];
          const Eigen::Index rows_i = std::min(kGramTile, width - i);
          const Eigen::Index cols_j = std::min(kGramTile, width - j);
          gram.block(i, j, rows_i, cols_j).noalias() +=
              sampled.middleCols(i, rows_i).transpose() * sampled.middleCols(j, cols_j);
        }
      } catch (const std::bad_alloc&) {
        std::atomic_ref<bool>(failed).store(true, std::memory_order_relaxed);
      }
    });
    if (failed) throw std::bad_alloc();
    filled = 0;
  };
  for (uint64_t i = 0; i < n_sample; ++i) {
    const float* row = rows + sample[i] * row_stride;
    double norm2 = 0.0;
    for (uint32_t c = 0; c < dim; ++c) norm2 += double(row[c]) * double(row[c]);
    if (norm2 == 0.0) continue;
    const double inv = 1.0 / std::sqrt(norm2);
    for (uint32_t c = 0; c < dim; ++c) block(filled, c) = double(row[c]) * inv;
    ++used;
    if (++filled == block.rows()) flush();
  }
  if (filled > 0) flush();

  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(gram, Eigen::ComputeEigenvectors);
  require(solver.info() == Eigen::Success, "fit_basis: the eigen-decomposition did not converge");
  Basis basis;
  basis.dim = dim;
  basis.rank = rank;
  basis.rows_used = used;
  basis.singular_values.resize(dim);
  basis.columns.resize(std::size_t{dim} * rank);
  // Eigen sorts ascending; the basis wants the largest first.
  for (uint32_t k = 0; k < dim; ++k)
    basis.singular_values[k] = std::sqrt(std::max(0.0, solver.eigenvalues()(dim - 1 - k)));
  for (uint32_t k = 0; k < rank; ++k) {
    const auto v = solver.eigenvectors().col(dim - 1 - k);
    uint32_t largest = 0;
    for (uint32_t c = 1; c < dim; ++c)
      if (std::fabs(v(c)) > std::fabs(v(largest))) largest = c;
    const double sign = v(largest) < 0.0 ? -1.0 : 1.0;
    for (uint32_t c = 0; c < dim; ++c) {
      const float x = static_cast<float>(sign * v(c));
      basis.columns[std::size_t{k} * dim + c] = x;
    }
  }
  return basis;
}

// ---- Projection and reconstruction -----------------------------------------------------------

void project(const float* rows, uint64_t n_rows, uint64_t row_stride, const Basis& basis,
             uint16_t* coeffs_out, simd::Dtype dtype, const simd::Kernels& kernels,
             ThreadPool* pool) {
  check_basis(basis, "project");
  const uint32_t dim = basis.dim, rank = basis.rank;
  require(row_stride >= dim, "project: row_stride=", row_stride, " < dim=", dim);
  if (n_rows == 0) return;
  const uint64_t block = std::min(kProjectRows, n_rows);
  std::vector<float> product(block * rank);
  for (uint64_t r0 = 0; r0 < n_rows; r0 += block) {
    const uint64_t m = std::min(block, n_rows - r0);
    // C = S B: the basis rows are B's columns, the outputs (B^T stored).
    const simd::GemmJob job{rows + r0 * row_stride, row_stride, basis.columns.data(), dim,
                            simd::GemmB::n_by_k, product.data(), rank, m, dim, rank};
    split_rows(m, pool, [&](uint64_t first, uint64_t last) noexcept {
      kernels.gemm_f32(rows_of(job, first, last));
      kernels.encode(product.data() + first * rank, coeffs_out + (r0 + first) * rank,
                     (last - first) * rank, dtype);
    });
  }
}

void project_to_float(const float* rows, uint32_t n, uint64_t row_stride, const Basis& basis,
                      float* out) {
  check_basis(basis, "project_to_float");
  const uint32_t dim = basis.dim, rank = basis.rank;
  require(row_stride >= dim, "project_to_float: row_stride=", row_stride, " < dim=", dim);
  for (uint32_t i = 0; i < n; ++i) {
    const float* x = rows + i * row_stride;
    float* y = out + std::size_t{i} * rank;
    for (uint32_t j = 0; j < rank; ++j) {
      const float* b = basis.columns.data() + std::size_t{j} * dim;
      float sum = 0.0f;
      for (uint32_t c = 0; c < dim; ++c) sum += x[c] * b[c];
      y[j] = sum;
    }
  }
}

uint64_t reconstruct_workspace_floats(const Basis& basis) {
  return uint64_t{kReconstructTokens} * basis.rank;
}

void reconstruct(const uint16_t* coeffs, simd::Dtype dtype, const Basis& basis,
                 const uint32_t* token_ids, uint32_t n, float* rows_out,
                 const simd::Kernels& kernels, float* workspace, ThreadPool* pool) {
  check_basis(basis, "reconstruct");
  const uint32_t dim = basis.dim, rank = basis.rank;
  float* c = workspace;  // [block, rank]: the block's coefficients in float32
  for (uint32_t i0 = 0; i0 < n; i0 += kReconstructTokens) {
    const uint32_t m = std::min(kReconstructTokens, n - i0);
    // rows = C B^T: the basis [rank, dim] is B^T's rows, i.e. [K, N] as stored.
    const simd::GemmJob job{c, rank, basis.columns.data(), dim, simd::GemmB::k_by_n,
                            rows_out + std::size_t{i0} * dim, dim, m, rank, dim};
    split_rows(m, pool, [&](uint64_t first, uint64_t last) noexcept {
      for (uint64_t t = first; t < last; ++t)
        kernels.decode(coeffs + std::size_t{token_ids[i0 + t]} * rank, c + t * rank, rank, dtype);
      kernels.gemm_f32(rows_of(job, first, last));
    });
  }
}

// ---- Latent relevance and selection ----------------------------------------------------------

uint64_t relevance_workspace_floats(uint32_t n_queries, uint32_t groups, uint64_t n_tokens) {
  const uint64_t rows = uint64_t{n_queries} * groups;
  return (rows + groups) * n_tokens + rows;
}

void relevance(const float* query_coeffs, uint32_t n_queries, uint32_t groups, uint32_t rank,
               const uint16_t* key_coeffs, simd::Dtype dtype, uint64_t n_tokens,
               uint32_t pool_kernel, Pooling pooling, GroupAggregation aggregation,
               const simd::Kernels& kernels, float* workspace, float* relevance_out, bool causal,
               ThreadPool* pool) {
  require(rank > 0, "relevance: rank must be > 0");
  require(groups > 0, "relevance: groups must be > 0");
  require(n_queries > 0, "relevance: n_queries must be > 0");
  require(pool_kernel % 2 == 1, "relevance: pool_kernel=", pool_kernel,
          " must be odd (a window centred on each token)");
  if (n_tokens == 0) return;
  const uint32_t n_rows = n_queries * groups;
  const uint64_t L = n_tokens;
  // Workspace: z [n_rows, L] logits, then probabilities in place; acc [groups, L]; inv [n_rows].
  float* z = workspace;
  float* acc = z + uint64_t{n_rows} * L;
  float* inv = acc + uint64_t{groups} * L;
  // Tokens query q sees (a prefix): causal queries are those of tokens L - n_queries .. L - 1.
  auto visible = [&](uint32_t q) -> uint64_t {
    if (!causal) return L;
    const int64_t v = int64_t(L) - int64_t(n_queries) + int64_t(q) + 1;
    return v <= 0 ? 0 : static_cast<uint64_t>(v);
  };
  uint32_t seeing = 0;  // >= 1: the newest query sees every token
  for (uint32_t q = 0; q < n_queries; ++q) seeing += visible(q) > 0;

  const float scale = 1.0f / std::sqrt(static_cast<float>(rank));
  const uint64_t logit_blocks = (L + kLogitTokens - 1) / kLogitTokens;
  parallel_static(pool, logit_blocks, [&](uint64_t first, uint64_t last, int) noexcept {
    for (uint64_t b = first; b < last; ++b)
      logits_block(query_coeffs, n_rows, rank, key_coeffs, dtype, L, b * kLogitTokens, scale,
                   kernels, z);
  });

  // Softmax of each row over the tokens its query sees, in place; inv folds in the query mean.
  parallel_static(pool, n_rows, [&](uint64_t first, uint64_t last, int) noexcept {
    for (uint64_t row = first; row < last; ++row) {
      const uint64_t seen = visible(static_cast<uint32_t>(row / groups));
      float* zr = z + row * L;
      if (seen == 0) {
        inv[row] = 0.0f;
        continue;
      }
      const float m = row_max(zr, seen);
      double sum = 0.0;
      for (uint64_t t = 0; t < seen; ++t) {
        zr[t] = std::exp(zr[t] - m);
        sum += zr[t];
      }
      inv[row] = static_cast<float>(1.0 / (sum * seeing));
    }
  });

  constexpr uint64_t kAccTokens = 1024;
  const uint64_t acc_blocks = (L + kAccTokens - 1) / kAccTokens;
  parallel_static(pool, acc_blocks, [&](uint64_t first, uint64_t last, int) noexcept {
    for (uint64_t b = first; b < last; ++b) {
      const uint64_t t0 = b * kAccTokens, t1 = std::min(L, t0 + kAccTokens);
      for (uint32_t g = 0; g < groups; ++g) {
        float* a = acc + uint64_t{g} * L;
        std::fill(a + t0, a + t1, 0.0f);
        for (uint32_t q = 0; q < n_queries; ++q) {
          const uint32_t row = q * groups + g;
          const float* zr = z + uint64_t{row} * L;
          const float w = inv[row];
          const uint64_t end = std::min(t1, visible(q));
          for (uint64_t t = t0; t < end; ++t) a[t] += zr[t] * w;
        }
      }
    }
  });

  const int64_t half = pool_kernel / 2;
  const float inv_groups = 1.0f / static_cast<float>(groups);
  parallel_static(pool, L, [&](uint64_t first, uint64_t last, int) noexcept {
    for (int64_t t = int64_t(first); t < int64_t(last); ++t) {
      const int64_t lo = std::max<int64_t>(0, t - half), hi = std::min<int64_t>(L - 1, t + half);
      float out =
          aggregation == GroupAggregation::max ? -std::numeric_limits<float>::infinity() : 0;
      for (uint32_t g = 0; g < groups; ++g) {
        const float* a = acc + uint64_t{g} * L;
        float pooled;
        if (pooling == Pooling::max) {
          pooled = a[lo];
          for (int64_t u = lo + 1; u <= hi; ++u) pooled = std::max(pooled, a[u]);
        } else {
          float sum = 0.0f;
          for (int64_t u = lo; u <= hi; ++u) sum += a[u];
          pooled = sum / static_cast<float>(hi - lo + 1);
        }
        out = aggregation == GroupAggregation::max ? std::max(out, pooled) : out + pooled;
      }
      relevance_out[t] = aggregation == GroupAggregation::max ? out : out * inv_groups;
    }
  });
}

void top_k(const float* scores, uint64_t n, uint32_t k, uint32_t* workspace, uint32_t* ids_out) {
  require(n <= (uint64_t{1} << 32), "top_k: n=", n, " does not fit uint32 ids");
  require(k <= n, "top_k: k=", k, " exceeds n=", n);
  if (k == 0) return;
  for (uint64_t i = 0; i < n; ++i) workspace[i] = static_cast<uint32_t>(i);
  // A strict total order (NaN below -inf, then the lower id), so the selection is deterministic.
  auto key = [&](uint32_t i) {
    const float s = scores[i];
    return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s;
  };
  auto better = [&](uint32_t a, uint32_t b) {
    const float ka = key(a), kb = key(b);
    if (ka != kb) return ka > kb;
    const bool na = std::isnan(scores[a]), nb = std::isnan(scores[b]);
    if (na != nb) return nb;
    return a < b;
  };
  std::nth_element(workspace, workspace + k - 1, workspace + n, better);
  std::sort(workspace, workspace + k);
  std::copy(workspace, workspace + k, ids_out);
}

}  // namespace kvsift::select::s4r
