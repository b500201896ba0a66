// S4R's numerical core (docs/methods.md, S4R; How each is tested): the rank from the memory
// model, the hybrid sample, the basis against LAPACK's SVD, projection and reconstruction, the
// latent relevance and top-k against float64 references written here, and the argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "lib/core/error.hpp"
#include "lib/core/thread_pool.hpp"
#include "lib/select/s4r_core.hpp"
#include "simd/half.hpp"
#include "simd/kernels.hpp"
#include "test_util.hpp"

// LAPACK (reference BLAS/LAPACK 3.11, gfortran ABI: hidden string lengths last).
extern "C" {
void dgesvd_(const char* jobu, const char* jobvt, const int* m, const int* n, double* a,
             const int* lda, double* s, double* u, const int* ldu, double* vt, const int* ldvt,
             double* work, const int* lwork, int* info, std::size_t jobu_len,
             std::size_t jobvt_len);
}

using namespace kvsift;
namespace s4r = kvsift::select::s4r;
using simd::Dtype;
using simd::Level;

namespace {

const simd::Kernels& best_kernels() {
  return simd::kernels_for(simd::best_level(simd::detect_features()));
}

float decode_value(uint16_t h, Dtype dtype) {
  return dtype == Dtype::f16 ? simd::f16_to_f32(h) : simd::bf16_to_f32(h);
}

std::vector<uint16_t> encode_values(const std::vector<float>& x, Dtype dtype) {
  std::vector<uint16_t> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    out[i] = dtype == Dtype::f16 ? simd::f32_to_f16(x[i]) : simd::f32_to_bf16(x[i]);
  return out;
}

// Expects fn to throw kvsift::Error(invalid_argument) whose message contains `needle`.
void expect_invalid(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no exception; expected one naming " << needle;
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::invalid_argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// Rows x dim with a few strong directions over noise, so the leading subspace is well separated.
std::vector<float> spiked_rows(uint64_t n, uint32_t dim, uint64_t stride, uint32_t spikes,
                               uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> directions(std::size_t{spikes} * dim);
  for (float& x : directions) x = normal(rng);
  std::vector<float> rows(n * stride, 0.0f);
  for (uint64_t i = 0; i < n; ++i) {
    float* row = rows.data() + i * stride;
    for (uint32_t c = 0; c < dim; ++c) row[c] = 0.3f * normal(rng);
    for (uint32_t s = 0; s < spikes; ++s) {
      const float w = normal(rng) * (4.0f / float(1 + s));
      for (uint32_t c = 0; c < dim; ++c) row[c] += w * directions[s * dim + c];
    }
    row[0] *= 1.0f + float(i % 7);  // uneven row norms, which the normalisation must remove
  }
  return rows;
}

// The sampled rows with nonzero norm, each scaled to unit norm: [n_used, dim] row-major.
std::vector<double> normalised_sample(const std::vector<float>& rows, uint32_t dim, uint64_t stride,
                                      const std::vector<uint32_t>& sample) {
  std::vector<double> x;
  for (uint32_t id : sample) {
    const float* row = rows.data() + id * stride;
    double norm2 = 0.0;
    for (uint32_t c = 0; c < dim; ++c) norm2 += double(row[c]) * row[c];
    if (norm2 == 0.0) continue;
    for (uint32_t c = 0; c < dim; ++c) x.push_back(row[c] / std::sqrt(norm2));
  }
  return x;
}

struct LapackSvd {
  std::vector<double> singular_values;  // [min(n, dim)]
  std::vector<double> right;            // [dim, min(n, dim)] column-major: right vector k at k*dim
};

// The SVD of x [n, dim] row-major, which LAPACK reads as x^T [dim, n] column-major: x's right
// singular vectors are the left ones of x^T.
LapackSvd lapack_svd(std::vector<double> x, uint64_t n, uint32_t dim) {
  const int m = static_cast<int>(dim), cols = static_cast<int>(n), k = std::min(m, cols);
  LapackSvd out;
  out.singular_values.resize(k);
  out.right.resize(std::size_t{dim} * k);
  double vt_unused = 0.0, query = 0.0;
  int lwork = -1, info = 0, one = 1;
  dgesvd_("S", "N", &m, &cols, x.data(), &m, out.singular_values.data(), out.right.data(), &m,
          &vt_unused, &one, &query, &lwork, &info, 1, 1);
  std::vector<double> work(static_cast<std::size_t>(query) + 1);
  lwork = static_cast<int>(work.size());
  dgesvd_("S", "N", &m, &cols, x.data(), &m, out.singular_values.data(), out.right.data(), &m,
          &vt_unused, &one, work.data(), &lwork, &info, 1, 1);
  EXPECT_EQ(info, 0);
  return out;
}

// max |B^T B - I|.
double orthonormality_error(const s4r::Basis& b) {
  double worst = 0.0;
  for (uint32_t i = 0; i < b.rank; ++i)
    for (uint32_t j = 0; j < b.rank; ++j) {
      double dot = 0.0;
      for (uint32_t c = 0; c < b.dim; ++c)
        dot += double(b.columns[i * b.dim + c]) * b.columns[j * b.dim + c];
      worst = std::max(worst, std::fabs(dot - (i == j ? 1.0 : 0.0)));
    }
  return worst;
}

// ||B B^T - V V^T||_F with V the first `rank` columns of LAPACK's right vectors.
double projector_difference(const s4r::Basis& b, const LapackSvd& svd) {
  const uint32_t d = b.dim, r = b.rank;
  double diff = 0.0;
  for (uint32_t i = 0; i < d; ++i)
    for (uint32_t j = 0; j < d; ++j) {
      double ours = 0.0, theirs = 0.0;
      for (uint32_t k = 0; k < r; ++k) {
        ours += double(b.columns[k * b.dim + i]) * b.columns[k * b.dim + j];
        theirs += svd.right[std::size_t{k} * d + i] * svd.right[std::size_t{k} * d + j];
      }
      diff += (ours - theirs) * (ours - theirs);
    }
  return std::sqrt(diff);
}

// ---- Memory model ----------------------------------------------------------------------------

// The paper's examples, D' = 1024, G = 4, W = 32, s = 4 (docs/methods.md, S4R: memory model).
TEST(S4rRank, reproduces_the_papers_examples) {
  EXPECT_NEAR(s4r::rank_for_compression(1024, 120000, 4, 4, 32, 5.0), 202.9, 0.1);
  EXPECT_NEAR(s4r::rank_for_compression(1024, 32768, 4, 4, 32, 5.0), 198.3, 0.5);
  EXPECT_NEAR(s4r::rank_for_compression(1024, 120000, 4, 4, 32, 2.5), 405.9, 0.1);
  EXPECT_EQ(s4r::solve_rank(1024, 120000, 4, 4, 32, 5.0), 200u);
  EXPECT_EQ(s4r::solve_rank(1024, 120000, 4, 4, 32, 2.5), 400u);
  EXPECT_EQ(s4r::solve_rank(1024, 120000, 4, 4, 32, 5.0, 1), 202u);
  EXPECT_NEAR(s4r::memory_ratio(1024, 120000, 4, 4, 32, 203), 0.2, 0.0002);
}

// The formula against a float64 transcription, and the solved rank is the largest multiple whose
// ratio stays within the target.
TEST(S4rRank, solved_rank_is_the_largest_multiple_within_the_target) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 500; ++trial) {
    const uint32_t dim = 64u << (rng() % 5), sinks = rng() % 8, groups = 1 + rng() % 8,
                   window = 1 + rng() % 64, multiple = rng() % 2 ? 8 : 16;
    const uint64_t tokens = 1 + rng() % 200000;
    const double compression = 1.0 + (rng() % 1000) / 100.0;
    SCOPED_TRACE(testing::Message() << "D'=" << dim << " L=" << tokens << " s=" << sinks
                                    << " G=" << groups << " W=" << window << " c=" << compression);
    const double eta = 1.0 / compression;
    const double want = dim * (eta * (sinks + double(tokens)) - sinks) /
                        (double(tokens) + groups * window / 2.0 + dim);
    const double got = s4r::rank_for_compression(dim, tokens, sinks, groups, window, compression);
    EXPECT_NEAR(got, want, 1e-9 * std::max(1.0, std::fabs(want)));
    const uint32_t r = s4r::solve_rank(dim, tokens, sinks, groups, window, compression, multiple);
    EXPECT_EQ(r % multiple, 0u);
    EXPECT_GE(r, multiple);
    EXPECT_LE(r, dim);
    auto ratio = [&](uint32_t rank) {
      return (sinks * double(dim) + double(tokens) * rank + groups * window * rank / 2.0 +
              double(dim) * rank) /
             ((sinks + double(tokens)) * dim);
    };
    EXPECT_NEAR(s4r::memory_ratio(dim, tokens, sinks, groups, window, r), ratio(r), 1e-12);
    if (r > multiple && r < dim) {
      EXPECT_LE(ratio(r), eta + 1e-12);
    }
    if (r < dim && r + multiple <= dim && want >= multiple) {
      EXPECT_GT(ratio(r + multiple), eta);
    }
  }
  EXPECT_EQ(s4r::solve_rank(1024, 10, 4, 4, 32, 5.0), 8u) << "tiny L clamps up to the multiple";
  // Even uncompressed, the window and the bases cost memory: 1024 * 1e5 / (1e5 + 64 + 1024).
  EXPECT_EQ(s4r::solve_rank(1024, 100000, 4, 4, 32, 1.0), 1008u);
  EXPECT_EQ(s4r::solve_rank(4, 100000, 0, 1, 1, 1.0), 4u) << "D' below the multiple";
}

// ---- Sampling --------------------------------------------------------------------------------

// |I| = count, 70% a contiguous most-recent block, 30% spread evenly over the earlier positions;
// ascending, distinct, deterministic (docs/methods.md, S4R: prefill).
TEST(S4rSampling, takes_the_recent_block_and_spreads_the_rest_evenly) {
  struct Case {
    uint64_t first, end;
    double eta, share;
  };
  for (const Case& c : {Case{4, 8004, 0.2, 0.7}, Case{4, 14, 1.0 / 3, 0.7}, Case{0, 100, 0.1, 0.7},
                        Case{4, 131076, 0.2, 0.7}, Case{4, 4100, 0.4, 0.6}, Case{4, 1000, 0.2, 1.0},
                        Case{4, 1000, 0.2, 0.0}, Case{16, 17, 0.5, 0.7}}) {
    const uint64_t T = c.end - c.first, count = static_cast<uint64_t>(c.eta * double(T));
    SCOPED_TRACE(testing::Message()
                 << "[" << c.first << ", " << c.end << ") count=" << count << " share=" << c.share);
    const auto ids = s4r::hybrid_sample(c.first, c.end, count, c.share);
    ASSERT_EQ(ids.size(), count);
    EXPECT_EQ(ids, s4r::hybrid_sample(c.first, c.end, count, c.share)) << "deterministic";
    if (count == 0) continue;
    EXPECT_TRUE(std::is_sorted(ids.begin(), ids.end()));
    EXPECT_EQ(std::adjacent_find(ids.begin(), ids.end()), ids.end()) << "distinct";
    EXPECT_GE(ids.front(), c.first);
    EXPECT_LT(ids.back(), c.end);
    const uint64_t recent = static_cast<uint64_t>(std::llround(std::ceil(c.share * count - 1e-9)));
    const uint64_t uniform = count - recent;
    for (uint64_t i = 0; i < recent; ++i) {
      EXPECT_EQ(ids[uniform + i], c.end - recent + i);
    }
    if (uniform > 0) {
      EXPECT_LT(ids[uniform - 1], c.end - recent) << "uniform picks are earlier";
      EXPECT_LE(double(ids[0] - c.first), double(T - recent) / double(uniform) / 2);
    }
    // Evenly spaced: the gaps are floor or ceil of the spacing, centred in the range.
    const double spacing = double(T - recent) / double(std::max<uint64_t>(uniform, 1));
    for (uint64_t i = 1; i < uniform; ++i) {
      const double gap = double(ids[i]) - ids[i - 1];
      EXPECT_GE(gap, std::floor(spacing));
      EXPECT_LE(gap, std::ceil(spacing));
    }
  }
  // 0.7 * 10 is 7 (not 8 from rounding up 7.000000000000001).
  const auto ten = s4r::hybrid_sample(0, 1000, 10, 0.7);
  EXPECT_EQ(ten[3], 993u);
  EXPECT_EQ(ten[2], 827u);
  // count >= the range takes every position; count 0 none.
  EXPECT_EQ(s4r::hybrid_sample(5, 9, 100, 0.7), (std::vector<uint32_t>{5, 6, 7, 8}));
  EXPECT_TRUE(s4r::hybrid_sample(5, 9, 0, 0.7).empty());
  EXPECT_TRUE(s4r::hybrid_sample(5, 5, 3, 0.7).empty());
}

// ---- Basis -----------------------------------------------------------------------------------

// The SVD against LAPACK's dgesvd on random matrices: singular values to 1e-5 relative, the same
// leading subspace, B^T B = I; a zero row in the sample is skipped.
TEST(S4rBasis, matches_lapack_svd_on_random_matrices) {
  struct Case {
    uint64_t n_rows;
    uint32_t dim, stride_pad, rank;
    bool spiked;
  };
  uint32_t seed = 100;
  for (const Case& c :
       {Case{500, 64, 0, 16, false}, Case{3000, 192, 8, 80, false}, Case{100, 128, 0, 32, false},
        Case{2100, 96, 3, 96, false}, Case{4000, 128, 0, 8, true}, Case{6000, 192, 0, 24, true}}) {
    const uint64_t stride = c.dim + c.stride_pad;
    SCOPED_TRACE(testing::Message() << "n=" << c.n_rows << " dim=" << c.dim << " r=" << c.rank
                                    << (c.spiked ? " spiked" : " gaussian"));
    auto rows = c.spiked ? spiked_rows(c.n_rows, c.dim, stride, 8, ++seed)
                         : test::random_floats(c.n_rows * stride, ++seed);
    std::fill(rows.begin() + 7 * stride, rows.begin() + 7 * stride + c.dim, 0.0f);
    const auto sample = s4r::hybrid_sample(0, c.n_rows, c.n_rows * 3 / 4, 0.7);
    const s4r::Basis b =
        s4r::fit_basis(rows.data(), c.n_rows, c.dim, stride, sample.data(), sample.size(), c.rank);
    const auto x = normalised_sample(rows, c.dim, stride, sample);
    const uint64_t used = x.size() / c.dim;
    EXPECT_EQ(b.rows_used, used);
    EXPECT_EQ(b.rows_used + (std::find(sample.begin(), sample.end(), 7u) != sample.end()),
              sample.size());
    const LapackSvd svd = lapack_svd(x, used, c.dim);
    ASSERT_EQ(b.singular_values.size(), c.dim);
    for (std::size_t k = 0; k < svd.singular_values.size(); ++k)
      EXPECT_NEAR(b.singular_values[k], svd.singular_values[k], 1e-5 * svd.singular_values[k])
          << "singular value " << k;
    EXPECT_LT(orthonormality_error(b), 1e-5) << "B^T B = I";
    if (c.rank < svd.singular_values.size()) {
      // Davis-Kahan: the subspace error scales with 1 / (relative gap at the rank).
      const double gap =
          (svd.singular_values[c.rank - 1] - svd.singular_values[c.rank]) / svd.singular_values[0];
      EXPECT_LT(projector_difference(b, svd), 1e-6 / gap) << "relative gap " << gap;
    } else {
      EXPECT_LT(projector_difference(b, svd), 1e-5) << "the whole space";
    }
  }
}

// The Gram's tiles spread over a pool give the basis of the calling thread alone, bit for bit: dim
// 320 is two whole 128-column tiles and a partial one, 2,500 sampled rows two whole 1024-row
// blocks and a partial one.
TEST(S4rBasis, the_basis_is_the_same_bits_for_any_number_of_threads) {
  const uint32_t dim = 320, rank = 24;
  const uint64_t n = 4000;
  const auto rows = spiked_rows(n, dim, dim, 12, 9);
  const auto sample = s4r::hybrid_sample(0, n, 2500, 0.7);
  const s4r::Basis alone =
      s4r::fit_basis(rows.data(), n, dim, dim, sample.data(), sample.size(), rank);
  EXPECT_LT(orthonormality_error(alone), 1e-5);
  for (uint32_t threads : {1u, 2u, 3u, 5u}) {
    SCOPED_TRACE(testing::Message() << threads << " threads");
    ThreadPool pool(threads);
    const s4r::Basis split =
        s4r::fit_basis(rows.data(), n, dim, dim, sample.data(), sample.size(), rank, &pool);
    EXPECT_EQ(split.rows_used, alone.rows_used);
    EXPECT_EQ(split.singular_values, alone.singular_values);
    EXPECT_EQ(split.columns, alone.columns);
  }
}

// B^T B = I and the sampled rows' reconstruction error is the SVD tail energy; the normalisation
// acts on the sampled rows only, scaling a row changes nothing (docs/methods.md, S4R: prefill).
TEST(S4rBasis, sample_reconstruction_error_is_the_tail_energy) {
  const uint32_t dim = 128;
  const uint64_t n = 5000;
  auto rows = spiked_rows(n, dim, dim, 12, 7);
  const auto sample = s4r::hybrid_sample(4, n, 1000, 0.7);
  for (uint32_t rank : {4u, 12u, 40u}) {
    SCOPED_TRACE(testing::Message() << "rank " << rank);
    const s4r::Basis b =
        s4r::fit_basis(rows.data(), n, dim, dim, sample.data(), sample.size(), rank);
    EXPECT_LT(orthonormality_error(b), 1e-5);
    const auto x = normalised_sample(rows, dim, dim, sample);
    double residual = 0.0, tail = 0.0;
    for (uint64_t i = 0; i < x.size() / dim; ++i) {
      std::vector<double> coeff(rank, 0.0);
      for (uint32_t k = 0; k < rank; ++k)
        for (uint32_t c = 0; c < dim; ++c) coeff[k] += x[i * dim + c] * b.columns[k * b.dim + c];
      for (uint32_t c = 0; c < dim; ++c) {
        double rec = 0.0;
        for (uint32_t k = 0; k < rank; ++k) rec += coeff[k] * b.columns[k * b.dim + c];
        residual += (x[i * dim + c] - rec) * (x[i * dim + c] - rec);
      }
    }
    for (uint32_t k = rank; k < dim; ++k) tail += b.singular_values[k] * b.singular_values[k];
    const double energy = double(x.size() / dim);  // unit rows
    EXPECT_NEAR(residual, tail, 1e-5 * energy);
    EXPECT_GT(tail, 0.0);

    auto scaled = rows;
    for (uint32_t c = 0; c < dim; ++c) scaled[sample[5] * dim + c] *= 1000.0f;
    const s4r::Basis s =
        s4r::fit_basis(scaled.data(), n, dim, dim, sample.data(), sample.size(), rank);
    EXPECT_LT(test::relative_error(s.columns.data(), b.columns.data(), b.columns.size()), 1e-4)
        << "a row's norm does not weigh in the basis";
  }
}

// ---- Projection and reconstruction -----------------------------------------------------------

class S4rProjection : public test::IsaTest {};

// C = S B on unnormalised rows, rounded once to the dtype; the decode path's float version
// agrees; with rank = dim, reconstruct(project(x)) = x to the dtype's rounding.
TEST_P(S4rProjection, full_rank_round_trip_returns_the_rows) {
  ThreadPool pool(2);  // the rows split over threads, as the selector runs them
  uint32_t seed = 300;
  for (Dtype dtype : {Dtype::f16, Dtype::bf16})
    for (uint32_t dim : {64u, 192u}) {
      for (uint32_t rank : {dim, dim / 4}) {
        SCOPED_TRACE(testing::Message()
                     << "dtype=" << int(dtype) << " dim=" << dim << " rank=" << rank);
        const uint64_t n = 5000, stride = dim + (dim == 192 ? 5 : 0);
        const auto rows = spiked_rows(n, dim, stride, 16, ++seed);
        const auto sample = s4r::hybrid_sample(0, n, 1000, 0.7);
        const s4r::Basis b =
            s4r::fit_basis(rows.data(), n, dim, stride, sample.data(), sample.size(), rank);
        std::vector<uint16_t> coeffs(n * rank);
        s4r::project(rows.data(), n, stride, b, coeffs.data(), dtype, k(), &pool);

        const float ulp = dtype == Dtype::f16 ? 0x1p-11f : 0x1p-8f;
        double worst = 0.0;
        for (uint64_t i = 0; i < n; i += 7)  // every 7th row: both blocks and the tail
          for (uint32_t j = 0; j < rank; ++j) {
            double want = 0.0, scale = 0.0;
            for (uint32_t c = 0; c < dim; ++c) {
              want += double(rows[i * stride + c]) * b.columns[j * b.dim + c];
              scale += std::fabs(double(rows[i * stride + c]) * b.columns[j * b.dim + c]);
            }
            const double got = decode_value(coeffs[i * rank + j], dtype);
            worst = std::max(worst, std::fabs(got - want) / (ulp * std::fabs(want) + 1e-6 * scale));
          }
        EXPECT_LE(worst, 1.01) << "coefficients are C = S B rounded once";

        std::vector<float> floats(std::size_t{7} * rank);
        s4r::project_to_float(rows.data() + 100 * stride, 7, stride, b, floats.data());
        for (uint32_t i = 0; i < 7; ++i)
          for (uint32_t j = 0; j < rank; ++j) {
            const double want = decode_value(coeffs[(100 + i) * rank + j], dtype);
            EXPECT_NEAR(floats[i * rank + j], want, ulp * std::fabs(want) + 1e-4);
          }

        std::vector<uint32_t> ids(n);
        std::iota(ids.begin(), ids.end(), 0u);
        std::vector<float> back(n * dim);
        std::vector<float> workspace(s4r::reconstruct_workspace_floats(b));
        s4r::reconstruct(coeffs.data(), dtype, b, ids.data(), static_cast<uint32_t>(n), back.data(),
                         k(), workspace.data(), &pool);
        if (rank == dim) {
          for (uint64_t i = 0; i < n; i += 97)
            EXPECT_LT(test::relative_error(back.data() + i * dim, rows.data() + i * stride, dim),
                      2 * ulp)
                << "row " << i;
        } else {  // most of the energy lies in 16 directions: a quarter of the rank keeps it
          EXPECT_LT(test::relative_error(back.data() + 3 * dim, rows.data() + 3 * stride, dim),
                    0.2);
        }
      }
    }
}

// Reconstruction of an arbitrary id list (unordered, repeated, a count that is not a multiple of
// the token block) against a float64 reference from the stored coefficients.
TEST_P(S4rProjection, reconstruct_matches_the_float64_reference) {
  for (Dtype dtype : {Dtype::f16, Dtype::bf16})
    for (uint32_t rank : {8u, 80u, 264u}) {
      const uint32_t dim = 320;
      const uint64_t n = 700;
      SCOPED_TRACE(testing::Message() << "dtype=" << int(dtype) << " rank=" << rank);
      const auto rows = test::random_floats(n * dim, 40 + rank);
      const auto sample = s4r::hybrid_sample(0, n, n, 0.7);
      const s4r::Basis b =
          s4r::fit_basis(rows.data(), n, dim, dim, sample.data(), sample.size(), rank);
      const auto coeffs =
          encode_values(test::random_floats(n * rank, 50 + rank), dtype);  // any coefficients
      std::vector<uint32_t> ids = {699, 3, 3, 0, 512, 17, 250, 251, 252, 1, 600};
      for (uint32_t i = 0; i < 300; ++i) ids.push_back(i * 37 % n);  // past one 256-token block
      std::vector<float> out(ids.size() * dim);
      std::vector<float> workspace(s4r::reconstruct_workspace_floats(b));
      s4r::reconstruct(coeffs.data(), dtype, b, ids.data(), static_cast<uint32_t>(ids.size()),
                       out.data(), k(), workspace.data());
      // Split over threads, the same bits (each element is summed in one fixed order).
      ThreadPool pool(3);
      std::vector<float> split(out.size());
      s4r::reconstruct(coeffs.data(), dtype, b, ids.data(), static_cast<uint32_t>(ids.size()),
                       split.data(), k(), workspace.data(), &pool);
      EXPECT_EQ(0, std::memcmp(split.data(), out.data(), out.size() * sizeof(float)));
      for (std::size_t i = 0; i < ids.size(); ++i) {
        std::vector<double> want(dim, 0.0);
        for (uint32_t j = 0; j < rank; ++j) {
          const double cj = decode_value(coeffs[ids[i] * rank + j], dtype);
          for (uint32_t c = 0; c < dim; ++c) want[c] += cj * b.columns[j * b.dim + c];
        }
        EXPECT_LT(test::relative_error(out.data() + i * dim, want.data(), dim), 1e-6)
            << "token " << ids[i];
      }
    }
}

INSTANTIATE_TEST_SUITE_P(Isa, S4rProjection, testing::ValuesIn(simd::kLevels),
                         test::isa_test_name);

// ---- Latent relevance and selection ----------------------------------------------------------

// docs/methods.md, S4R: decode, step 2, in float64: logits, causal softmax, query mean, pooling,
// groups.
std::vector<double> reference_relevance(const std::vector<double>& logits /*[q][g][t], scaled*/,
                                        uint32_t nq, uint32_t groups, uint64_t L, uint32_t kernel,
                                        s4r::Pooling pooling, s4r::GroupAggregation aggregation,
                                        bool causal) {
  std::vector<double> a(groups * L, 0.0);
  auto sees = [&](uint32_t q) {
    return causal ? std::min<int64_t>(L, int64_t(L) - nq + q + 1) : int64_t(L);
  };
  uint32_t seeing = 0;
  for (uint32_t q = 0; q < nq; ++q) seeing += sees(q) > 0;
  for (uint32_t q = 0; q < nq; ++q) {
    const int64_t seen = sees(q);
    if (seen <= 0) continue;
    for (uint32_t g = 0; g < groups; ++g) {
      const double* z = logits.data() + (std::size_t{q} * groups + g) * L;
      const double m = *std::max_element(z, z + seen);
      double sum = 0.0;
      for (int64_t t = 0; t < seen; ++t) sum += std::exp(z[t] - m);
      for (int64_t t = 0; t < seen; ++t) a[g * L + t] += std::exp(z[t] - m) / sum / seeing;
    }
  }
  std::vector<double> out(L, 0.0);
  const int64_t h = kernel / 2;
  for (int64_t t = 0; t < int64_t(L); ++t) {
    double agg = aggregation == s4r::GroupAggregation::max ? -1e300 : 0.0;
    for (uint32_t g = 0; g < groups; ++g) {
      double pooled = pooling == s4r::Pooling::max ? -1e300 : 0.0;
      int64_t count = 0;
      for (int64_t u = std::max<int64_t>(0, t - h); u <= std::min<int64_t>(L - 1, t + h); ++u) {
        pooled =
            pooling == s4r::Pooling::max ? std::max(pooled, a[g * L + u]) : pooled + a[g * L + u];
        ++count;
      }
      if (pooling == s4r::Pooling::avg) pooled /= double(count);
      agg = aggregation == s4r::GroupAggregation::max ? std::max(agg, pooled) : agg + pooled;
    }
    out[t] = aggregation == s4r::GroupAggregation::max ? agg : agg / groups;
  }
  return out;
}

class S4rRelevance : public test::IsaTest {};

TEST_P(S4rRelevance, matches_the_float64_reference) {
  struct Case {
    uint32_t nq, groups, rank;
    uint64_t L;
    uint32_t kernel;
    s4r::Pooling pooling;
    s4r::GroupAggregation aggregation;
    float query_scale;
  };
  using P = s4r::Pooling;
  using A = s4r::GroupAggregation;
  uint32_t seed = 500;
  for (const bool causal : {false, true})
    for (Dtype dtype : {Dtype::f16, Dtype::bf16})
      for (const Case& c : {Case{32, 4, 200, 3001, 7, P::max, A::mean, 1.0f},
                            Case{4, 3, 80, 1000, 7, P::avg, A::max, 3.0f},
                            Case{8, 2, 320, 517, 5, P::max, A::max, 2.0f},
                            Case{1, 1, 8, 16, 1, P::max, A::mean, 1.0f},
                            Case{16, 4, 24, 9, 7, P::avg, A::mean, 4.0f},  // L < kernel and nq
                            Case{32, 4, 64, 20, 15, P::max, A::mean, 1.0f}}) {
        SCOPED_TRACE(testing::Message()
                     << "causal=" << causal << " dtype=" << int(dtype) << " nq=" << c.nq
                     << " G=" << c.groups << " r=" << c.rank << " L=" << c.L << " k=" << c.kernel);
        const auto queries =
            test::random_floats(std::size_t{c.nq} * c.groups * c.rank, ++seed, c.query_scale);
        const auto keys = encode_values(test::random_floats(c.L * c.rank, ++seed), dtype);
        std::vector<float> workspace(s4r::relevance_workspace_floats(c.nq, c.groups, c.L), NAN);
        std::vector<float> out(c.L, NAN);
        s4r::relevance(queries.data(), c.nq, c.groups, c.rank, keys.data(), dtype, c.L, c.kernel,
                       c.pooling, c.aggregation, k(), workspace.data(), out.data(), causal);

        std::vector<double> logits(std::size_t{c.nq} * c.groups * c.L);
        for (uint32_t row = 0; row < c.nq * c.groups; ++row)
          for (uint64_t t = 0; t < c.L; ++t) {
            double dot = 0.0;
            for (uint32_t j = 0; j < c.rank; ++j)
              dot += double(queries[row * c.rank + j]) * decode_value(keys[t * c.rank + j], dtype);
            logits[row * c.L + t] = dot / std::sqrt(double(c.rank));
          }
        const auto want = reference_relevance(logits, c.nq, c.groups, c.L, c.kernel, c.pooling,
                                              c.aggregation, causal);
        EXPECT_LT(test::relative_error(out.data(), want.data(), c.L), 2e-5);
        double total = 0.0;
        for (float v : out) total += v;
        EXPECT_GT(total, 0.0);
      }
}

// With r = D' the basis is orthonormal and complete, so the latent logits
// C_Q C_K^T are the exact pre-RoPE logits Q K^T, and the relevance is the one of the exact logits
// at temperature 1/sqrt(D') (up to the keys' fp16 coefficients; docs/methods.md, How each is
// tested).
TEST_P(S4rRelevance, full_rank_latent_logits_are_the_exact_logits) {
  const uint32_t dim = 128, groups = 4, nq = 8;
  const uint64_t L = 2000;
  const auto keys = spiked_rows(L, dim, dim, 6, 70);
  const auto queries = test::random_floats(std::size_t{nq} * groups * dim, 71, 0.5f);
  const auto sample = s4r::hybrid_sample(0, L, 400, 0.7);
  const s4r::Basis b = s4r::fit_basis(keys.data(), L, dim, dim, sample.data(), sample.size(), dim);
  std::vector<float> cq(std::size_t{nq} * groups * dim), ck(L * dim);
  s4r::project_to_float(queries.data(), nq * groups, dim, b, cq.data());
  s4r::project_to_float(keys.data(), static_cast<uint32_t>(L), dim, b, ck.data());
  std::vector<double> exact(std::size_t{nq} * groups * L);
  double worst = 0.0;
  for (uint32_t row = 0; row < nq * groups; ++row)
    for (uint64_t t = 0; t < L; ++t) {
      double qk = 0.0, latent = 0.0, norms = 0.0, qn = 0.0, kn = 0.0;
      for (uint32_t c = 0; c < dim; ++c) {
        qk += double(queries[row * dim + c]) * keys[t * dim + c];
        latent += double(cq[row * dim + c]) * ck[t * dim + c];
        qn += double(queries[row * dim + c]) * queries[row * dim + c];
        kn += double(keys[t * dim + c]) * keys[t * dim + c];
      }
      norms = std::sqrt(qn * kn);
      worst = std::max(worst, std::fabs(latent - qk) / norms);
      exact[row * L + t] = qk / std::sqrt(double(dim));
    }
  EXPECT_LT(worst, 1e-5) << "C_Q C_K^T = Q K^T, relative to |q| |k|";

  std::vector<uint16_t> ck16(L * dim);
  s4r::project(keys.data(), L, dim, b, ck16.data(), Dtype::f16, k());
  std::vector<float> workspace(s4r::relevance_workspace_floats(nq, groups, L)), out(L);
  s4r::relevance(cq.data(), nq, groups, dim, ck16.data(), Dtype::f16, L, 7, s4r::Pooling::max,
                 s4r::GroupAggregation::mean, k(), workspace.data(), out.data());
  const auto want = reference_relevance(exact, nq, groups, L, 7, s4r::Pooling::max,
                                        s4r::GroupAggregation::mean, false);
  EXPECT_LT(test::relative_error(out.data(), want.data(), L), 3e-3);
}

INSTANTIATE_TEST_SUITE_P(Isa, S4rRelevance, testing::ValuesIn(simd::kLevels),
                         test::isa_test_name);

// The k best ids ascending, ties to the lower id, NaN below everything, against a full sort.
TEST(S4rTopK, matches_a_sorted_reference) {
  std::mt19937 rng(900);
  for (uint64_t n : {1u, 7u, 100u, 5000u})
    for (uint32_t k : {0u, 1u, 3u, 50u, 4999u, 5000u}) {
      if (k > n) continue;
      SCOPED_TRACE(testing::Message() << "n=" << n << " k=" << k);
      std::vector<float> scores(n);
      for (float& s : scores) s = float(rng() % 20) / 4.0f;  // many ties
      if (n > 3) scores[2] = NAN;
      if (n > 5) scores[5] = -std::numeric_limits<float>::infinity();
      std::vector<uint32_t> order(n);
      std::iota(order.begin(), order.end(), 0u);
      auto key = [&](uint32_t i) {
        return std::isnan(scores[i]) ? -std::numeric_limits<double>::infinity() : double(scores[i]);
      };
      std::stable_sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
        if (key(a) != key(b)) return key(a) > key(b);
        if (std::isnan(scores[a]) != std::isnan(scores[b])) return std::isnan(scores[b]);
        return false;
      });
      std::vector<uint32_t> want(order.begin(), order.begin() + k);
      std::sort(want.begin(), want.end());
      std::vector<uint32_t> workspace(n), got(k);
      s4r::top_k(scores.data(), n, k, workspace.data(), got.data());
      EXPECT_EQ(got, want);
    }
}

// Bad arguments throw kvsift::Error(invalid_argument) naming what is wrong.
TEST(S4rCore, bad_arguments_throw_with_a_clear_message) {
  const auto rows = test::random_floats(100 * 16, 1);
  const std::vector<uint32_t> sample = {1, 2, 3};
  auto fit = [&](uint32_t dim, uint64_t stride, uint64_t n_sample, uint32_t rank,
                 const uint32_t* ids) {
    return [&, dim, stride, n_sample, rank, ids] {
      s4r::fit_basis(rows.data(), 100, dim, stride, ids, n_sample, rank);
    };
  };
  expect_invalid(fit(16, 16, 3, 0, sample.data()), "rank must be > 0");
  expect_invalid(fit(16, 16, 3, 17, sample.data()), "rank=17 exceeds dim=16");
  expect_invalid(fit(16, 16, 0, 4, sample.data()), "n_sample must be > 0");
  expect_invalid(fit(16, 8, 3, 4, sample.data()), "row_stride=8 < dim=16");
  const std::vector<uint32_t> far = {1, 100};
  expect_invalid(fit(16, 16, 2, 4, far.data()), "sample[1]=100 >= n_rows=100");

  std::vector<float> scores(10, 1.0f);
  std::vector<uint32_t> ids(11);
  expect_invalid([&] { s4r::top_k(scores.data(), 10, 11, ids.data(), ids.data()); },
                 "k=11 exceeds n=10");

  const s4r::Basis empty;
  std::vector<uint16_t> coeffs(16);
  expect_invalid(
      [&] {
        s4r::project(rows.data(), 1, 16, empty, coeffs.data(), Dtype::f16, best_kernels());
      },
      "project: dim must be > 0");
  std::vector<float> out(16), workspace(1000);
  auto rel = [&](uint32_t rank, uint32_t groups, uint32_t nq, uint32_t kernel) {
    return [&, rank, groups, nq, kernel] {
      s4r::relevance(out.data(), nq, groups, rank, coeffs.data(), Dtype::f16, 2, kernel,
                     s4r::Pooling::max, s4r::GroupAggregation::mean, best_kernels(),
                     workspace.data(), out.data());
    };
  };
  expect_invalid(rel(0, 1, 1, 7), "rank must be > 0");
  expect_invalid(rel(4, 0, 1, 7), "groups must be > 0");
  expect_invalid(rel(4, 1, 0, 7), "n_queries must be > 0");
  expect_invalid(rel(4, 1, 1, 6), "pool_kernel=6 must be odd");

  expect_invalid([] { s4r::solve_rank(1024, 1000, 4, 4, 32, 0.5); }, "compression=0.5");
  expect_invalid([] { s4r::solve_rank(0, 1000, 4, 4, 32, 5); }, "feature_dim must be > 0");
  expect_invalid([] { s4r::solve_rank(1024, 1000, 4, 4, 32, 5, 0); }, "multiple must be > 0");
  expect_invalid([] { s4r::hybrid_sample(0, 10, 5, 1.5); }, "recent_share=1.5");
  expect_invalid([] { s4r::hybrid_sample(10, 5, 5, 0.7); }, "first=10 > end=5");
}

}  // namespace
