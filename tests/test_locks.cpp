// LOCKS page summaries (docs/methods.md, LOCKS; How each is tested): the small eigensolver against
// LAPACK, the record's size, the factorisation's exactness and SVD properties, the residual
// bound's soundness, and every ISA's locks_score kernel (the AVX-512 VNNI int8-query one too)
// against the float64 reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "lib/core/aligned.hpp"
#include "lib/core/error.hpp"
#include "lib/select/locks_summary.hpp"
#include "lib/select/symmetric_eigen.hpp"
#include "simd/half.hpp"
#include "simd/kernels.hpp"
#include "simd/locks_record.hpp"
#include "test_util.hpp"

// LAPACK (reference BLAS/LAPACK 3.11, gfortran ABI: hidden string lengths last).
extern "C" {
void dsyev_(const char* jobz, const char* uplo, const int* n, double* a, const int* lda, double* w,
            double* work, const int* lwork, int* info, std::size_t jobz_len, std::size_t uplo_len);
void dgesvd_(const char* jobu, const char* jobvt, const int* m, const int* n, double* a,
             const int* lda, double* s, double* u, const int* ldu, double* vt, const int* ldvt,
             double* work, const int* lwork, int* info, std::size_t jobu_len,
             std::size_t jobvt_len);
}

using namespace kvsift;
using select::LocksShape;
using simd::Dtype;
using simd::Level;

namespace {

// ---- Eigensolver
// -------------------------------------------------------------------------------------

// LAPACK's eigenvalues of a symmetric matrix, descending.
std::vector<double> lapack_eigenvalues(std::vector<double> a, uint32_t n) {
  const int N = static_cast<int>(n);
  std::vector<double> w(n), work(std::max<std::size_t>(1, 3 * std::size_t{n} * n + 64));
  const int lwork = static_cast<int>(work.size());
  int info = 0;
  dsyev_("N", "U", &N, a.data(), &N, w.data(), work.data(), &lwork, &info, 1, 1);
  EXPECT_EQ(info, 0);
  std::reverse(w.begin(), w.end());
  return w;
}

double frobenius(const std::vector<double>& a) {
  double s = 0.0;
  for (double x : a) s += x * x;
  return std::sqrt(s);
}

// Checks symmetric_eigen on a against LAPACK: eigenvalues, A v = lambda v, orthonormal rows, and
// the sign convention. tol is relative to ||a||_F.
void check_eigen(const std::vector<double>& a, uint32_t n, double tol) {
  SCOPED_TRACE(testing::Message() << "n=" << n);
  std::vector<double> values(n), vectors(std::size_t{n} * n);
  select::symmetric_eigen(n, a.data(), values.data(), vectors.data());
  const double norm = std::max(frobenius(a), 1e-300);
  const auto want = lapack_eigenvalues(a, n);
  for (uint32_t k = 0; k < n; ++k) {
    EXPECT_NEAR(values[k], want[k], tol * norm) << "eigenvalue " << k;
    if (k > 0) {
      EXPECT_GE(values[k - 1], values[k]);
    }
  }
  double worst_residual = 0.0, worst_orth = 0.0;
  for (uint32_t k = 0; k < n; ++k) {
    const double* v = vectors.data() + std::size_t{k} * n;
    for (uint32_t i = 0; i < n; ++i) {
      double av = 0.0;
      for (uint32_t j = 0; j < n; ++j) av += a[std::size_t{i} * n + j] * v[j];
      worst_residual = std::max(worst_residual, std::fabs(av - values[k] * v[i]));
    }
    for (uint32_t l = 0; l < n; ++l) {
      const double* w = vectors.data() + std::size_t{l} * n;
      const double dot = std::inner_product(v, v + n, w, 0.0);
      worst_orth = std::max(worst_orth, std::fabs(dot - (k == l ? 1.0 : 0.0)));
    }
    const auto largest =
        std::max_element(v, v + n, [](double x, double y) { return std::fabs(x) < std::fabs(y); });
    EXPECT_GT(*largest, 0.0) << "eigenvector " << k << " sign";
  }
  EXPECT_LE(worst_residual, tol * norm) << "A v = lambda v";
  EXPECT_LE(worst_orth, 1e-13 * n) << "orthonormality";
}

std::vector<double> random_symmetric(uint32_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist;
  std::vector<double> a(std::size_t{n} * n);
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t j = 0; j <= i; ++j) a[i * n + j] = a[j * n + i] = dist(rng);
  return a;
}

// X X^T with X [n, rank]: positive semi-definite of rank `rank`, entries scaled like a key Gram.
std::vector<double> random_psd(uint32_t n, uint32_t rank, uint32_t seed, double scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> x(std::size_t{n} * rank), a(std::size_t{n} * n, 0.0);
  for (double& v : x) v = dist(rng);
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t j = 0; j < n; ++j)
      for (uint32_t k = 0; k < rank; ++k) a[i * n + j] += x[i * rank + k] * x[j * rank + k];
  return a;
}

}  // namespace

TEST(SymmetricEigen, matches_lapack_on_random_symmetric_matrices) {
  uint32_t seed = 10;
  for (uint32_t n : {1u, 2u, 3u, 5u, 8u, 13u, 16u, 17u, 32u, 64u})
    for (int rep = 0; rep < 3; ++rep) check_eigen(random_symmetric(n, ++seed), n, 1e-13);
}

TEST(SymmetricEigen, matches_lapack_on_rank_deficient_positive_semidefinite_matrices) {
  uint32_t seed = 100;
  for (uint32_t n : {4u, 16u, 32u, 64u})
    for (uint32_t rank : {1u, n / 2, n - 1})
      for (double scale : {1e-3, 1.0, 30.0}) {
        SCOPED_TRACE(testing::Message() << "rank=" << rank << " scale=" << scale);
        const auto a = random_psd(n, rank, ++seed, scale);
        check_eigen(a, n, 1e-13);
        // The null space comes out as (numerically) zero eigenvalues, never negative beyond
        // rounding.
        std::vector<double> values(n), vectors(std::size_t{n} * n);
        select::symmetric_eigen(n, a.data(), values.data(), vectors.data());
        for (uint32_t k = rank; k < n; ++k) EXPECT_LE(std::fabs(values[k]), 1e-13 * frobenius(a));
      }
}

TEST(SymmetricEigen, handles_zero_diagonal_and_repeated_eigenvalues) {
  check_eigen(std::vector<double>(16 * 16, 0.0), 16, 1e-15);
  std::vector<double> diagonal(16 * 16, 0.0);
  for (uint32_t i = 0; i < 16; ++i) diagonal[i * 16 + i] = double(i % 4);
  check_eigen(diagonal, 16, 1e-15);
  // A rotation of diag(5, 5, 5, 1, ...): a repeated top eigenvalue with an arbitrary basis.
  auto a = random_psd(16, 3, 7, 1.0);
  std::vector<double> values(16), vectors(256);
  select::symmetric_eigen(16, a.data(), values.data(), vectors.data());
  std::fill(a.begin(), a.end(), 0.0);
  for (uint32_t k = 0; k < 16; ++k) {
    const double lambda = k < 3 ? 5.0 : 1.0;
    for (uint32_t i = 0; i < 16; ++i)
      for (uint32_t j = 0; j < 16; ++j)
        a[i * 16 + j] += lambda * vectors[k * 16 + i] * vectors[k * 16 + j];
  }
  check_eigen(a, 16, 1e-14);
}

// ---- Pages --------------------------------------------------------------------------------------

namespace {

enum class PageKind { random, low_rank, outlier_channel, constant, spike };

// One page of keys as the cache stores them, and the same values as float.
struct Page {
  LocksShape shape;
  Dtype dtype;
  std::vector<uint16_t> stored;  // [page_tokens, head_dim]
  std::vector<float> keys;       // decoded stored values

  Page(const LocksShape& s, Dtype dt, PageKind kind, uint32_t seed) : shape(s), dtype(dt) {
    const uint32_t B = s.page_tokens, d = s.head_dim;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    std::vector<float> raw(std::size_t{B} * d), offset(d);
    // Post-RoPE keys have channels with large means: every kind keeps a per-channel offset.
    for (float& x : offset) x = 3.0f * normal(rng);
    switch (kind) {
      case PageKind::random:
        for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = offset[i % d] + 2.0f * normal(rng);
        break;
      case PageKind::low_rank: {
        std::vector<float> dirs(4 * std::size_t{d});
        for (float& x : dirs) x = normal(rng);
        for (uint32_t i = 0; i < B; ++i) {
          float a[4];
          for (float& x : a) x = 3.0f * normal(rng);
          for (uint32_t c = 0; c < d; ++c) {
            float v = offset[c] + 0.02f * normal(rng);
            for (int j = 0; j < 4; ++j) v += a[j] * dirs[j * d + c];
            raw[i * d + c] = v;
          }
        }
        break;
      }
      case PageKind::outlier_channel:
        for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = offset[i % d] + normal(rng);
        for (uint32_t i = 0; i < B; ++i)
          raw[i * d + 3] = (i % 3 == 0 ? 60.0f : -45.0f) + normal(rng);
        break;
      case PageKind::constant:
        for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = offset[i % d];
        break;
      case PageKind::spike:  // token 0 far from the rest: logits spread by hundreds
        for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = offset[i % d] + normal(rng);
        raw[3] = 2000.0f;
        break;
    }
    stored.resize(raw.size());
    keys.resize(raw.size());
    for (std::size_t i = 0; i < raw.size(); ++i) {
      stored[i] = dt == Dtype::f16 ? simd::f32_to_f16(raw[i]) : simd::f32_to_bf16(raw[i]);
      keys[i] = dt == Dtype::f16 ? simd::f16_to_f32(stored[i]) : simd::bf16_to_f32(stored[i]);
    }
  }

  std::vector<std::byte> record() const {
    std::vector<std::byte> out(select::locks_record_bytes(shape), std::byte{0xcd});
    select::locks_build(shape, stored.data(), dtype, out.data());
    return out;
  }
};

struct Factors {
  std::vector<float> mu, coeffs, basis;
  std::vector<double> eigenvalues;
  explicit Factors(const Page& page) {
    const LocksShape& s = page.shape;
    mu.resize(s.head_dim);
    coeffs.resize(std::size_t{s.page_tokens} * s.rank);
    basis.resize(std::size_t{s.rank} * s.head_dim);
    eigenvalues.resize(s.page_tokens);
    select::locks_factor(s, page.stored.data(), page.dtype,
                         {mu.data(), coeffs.data(), basis.data(), eigenvalues.data()});
  }
};

// Exact page LSE of the stored keys, float64.
double exact_lse(const Page& page, const float* q, double scale) {
  const uint32_t B = page.shape.page_tokens, d = page.shape.head_dim;
  std::vector<double> logits(B);
  for (uint32_t i = 0; i < B; ++i) {
    double s = 0.0;
    for (uint32_t c = 0; c < d; ++c) s += double(q[c]) * page.keys[i * d + c];
    logits[i] = scale * s;
  }
  const double m = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (double l : logits) sum += std::exp(l - m);
  return m + std::log(sum);
}

std::vector<LocksShape> all_shapes(uint32_t rank) {
  std::vector<LocksShape> shapes;
  for (uint32_t d : {64u, 128u, 256u})
    for (uint32_t B : {16u, 32u, 64u}) shapes.push_back({d, B, rank == 0 ? B - 1 : rank});
  return shapes;
}

}  // namespace

TEST(Locks, record_bytes_follow_the_paper_formula) {
  EXPECT_EQ(select::locks_paper_bytes({128, 16, 8}), 818u);
  EXPECT_EQ(select::locks_paper_bytes({128, 32, 8}), 978u);
  EXPECT_EQ(select::locks_record_bytes({128, 16, 8}), 832u);
  for (uint32_t r : {1u, 4u, 8u, 15u})
    for (const LocksShape& s : all_shapes(r)) {
      const std::size_t d = s.head_dim, B = s.page_tokens;
      EXPECT_EQ(select::locks_paper_bytes(s), r * d * 4 / 8 + 2 * r + B * r + 2 * B + d + 2);
      const std::size_t stored = select::locks_record_bytes(s);
      EXPECT_EQ(stored % 64, 0u);
      EXPECT_GE(stored, select::locks_paper_bytes(s) + 4);
      EXPECT_LT(stored, select::locks_paper_bytes(s) + 4 + 64);
      EXPECT_NO_THROW(select::locks_check_shape(s));
    }
  EXPECT_THROW(select::locks_check_shape({96, 16, 8}), Error);
  EXPECT_THROW(select::locks_check_shape({128, 8, 4}), Error);
  EXPECT_THROW(select::locks_check_shape({128, 16, 16}), Error);
  EXPECT_THROW(select::locks_check_shape({128, 16, 0}), Error);
}

// At r = B - 1 the centered page is reproduced exactly, so the unquantised score is the exact page
// LSE (docs/methods.md, LOCKS: summary build).
TEST(Locks, full_rank_unquantised_score_equals_the_exact_page_lse) {
  uint32_t seed = 1000;
  for (Dtype dtype : {Dtype::f16, Dtype::bf16})
    for (const LocksShape& s : all_shapes(0)) {
      SCOPED_TRACE(testing::Message()
                   << "d=" << s.head_dim << " B=" << s.page_tokens << " dtype=" << int(dtype));
      const Page page(s, dtype, PageKind::random, ++seed);
      const Factors f(page);
      const double scale = 1.0 / std::sqrt(double(s.head_dim));
      for (int rep = 0; rep < 4; ++rep) {
        const auto q = test::random_floats(s.head_dim, ++seed);
        const uint32_t d = s.head_dim, r = s.rank;
        std::vector<double> z(r, 0.0);
        double mu_q = 0.0;
        for (uint32_t j = 0; j < r; ++j)
          for (uint32_t c = 0; c < d; ++c) z[j] += double(f.basis[j * d + c]) * q[c];
        for (uint32_t c = 0; c < d; ++c) mu_q += double(f.mu[c]) * q[c];
        std::vector<double> logits(s.page_tokens);
        for (uint32_t i = 0; i < s.page_tokens; ++i) {
          double cz = 0.0;
          for (uint32_t j = 0; j < r; ++j) cz += double(f.coeffs[i * r + j]) * z[j];
          logits[i] = scale * (cz + mu_q);
        }
        const double m = *std::max_element(logits.begin(), logits.end());
        double sum = 0.0;
        for (double l : logits) sum += std::exp(l - m);
        EXPECT_NEAR(m + std::log(sum), exact_lse(page, q.data(), scale), 1e-4);
      }
    }
}

// V^T V = I, C V^T is the rank-r truncated SVD of D (LAPACK's dgesvd), and the squared residuals
// sum to the tail eigenvalues (docs/methods.md, LOCKS: summary build).
TEST(Locks, factors_are_the_truncated_svd_of_the_centered_page) {
  uint32_t seed = 2000;
  for (PageKind kind : {PageKind::random, PageKind::low_rank, PageKind::outlier_channel})
    for (const LocksShape& s : all_shapes(8)) {
      SCOPED_TRACE(testing::Message()
                   << "d=" << s.head_dim << " B=" << s.page_tokens << " kind=" << int(kind));
      const Page page(s, Dtype::f16, kind, ++seed);
      const Factors f(page);
      const uint32_t d = s.head_dim, B = s.page_tokens, r = s.rank;
      double worst_orth = 0.0;
      for (uint32_t j = 0; j < r; ++j)
        for (uint32_t l = 0; l < r; ++l) {
          double dot = 0.0;
          for (uint32_t c = 0; c < d; ++c) dot += double(f.basis[j * d + c]) * f.basis[l * d + c];
          worst_orth = std::max(worst_orth, std::fabs(dot - (j == l ? 1.0 : 0.0)));
        }
      EXPECT_LT(worst_orth, 1e-5) << "V^T V = I";

      // D^T is [d, B] column-major = D row-major; its SVD is W S U^T.
      std::vector<double> centered(std::size_t{B} * d), a;
      double energy = 0.0;
      for (uint32_t i = 0; i < B; ++i)
        for (uint32_t c = 0; c < d; ++c) {
          centered[i * d + c] = double(page.keys[i * d + c]) - f.mu[c];
          energy += centered[i * d + c] * centered[i * d + c];
        }
      a = centered;
      const int m = static_cast<int>(d), n = static_cast<int>(B);
      std::vector<double> sv(B), w(std::size_t{d} * B), ut(std::size_t{B} * B), work(1 << 16);
      const int lwork = static_cast<int>(work.size());
      int info = 0;
      dgesvd_("S", "S", &m, &n, a.data(), &m, sv.data(), w.data(), &m, ut.data(), &n, work.data(),
              &lwork, &info, 1, 1);
      ASSERT_EQ(info, 0);
      double diff = 0.0, residual = 0.0, tail = 0.0;
      for (uint32_t i = 0; i < B; ++i)
        for (uint32_t c = 0; c < d; ++c) {
          double svd = 0.0, ours = 0.0;
          for (uint32_t k = 0; k < r; ++k) {
            svd += sv[k] * ut[k + std::size_t{i} * B] * w[c + std::size_t{k} * d];
            ours += double(f.coeffs[i * r + k]) * f.basis[k * d + c];
          }
          diff += (svd - ours) * (svd - ours);
          residual += (centered[i * d + c] - ours) * (centered[i * d + c] - ours);
        }
      for (uint32_t k = r; k < B; ++k) tail += f.eigenvalues[k];
      EXPECT_LT(std::sqrt(diff / energy), 1e-5) << "C V^T = truncated SVD";
      EXPECT_NEAR(residual, tail, 1e-5 * energy) << "residual energy = tail eigenvalues";
      for (uint32_t k = 0; k < B; ++k)
        EXPECT_NEAR(f.eigenvalues[k], sv[k] * sv[k], 1e-9 * energy) << "eigenvalue " << k;
    }
}

// The stored bound is sound and tight: it covers every token's residual against the dequantised
// record and exceeds the largest one by rounding only.
TEST(Locks, residual_bound_is_the_largest_dequantised_residual) {
  uint32_t seed = 3000;
  for (PageKind kind :
       {PageKind::random, PageKind::low_rank, PageKind::outlier_channel, PageKind::constant})
    for (Dtype dtype : {Dtype::f16, Dtype::bf16})
      for (const LocksShape& s : all_shapes(8)) {
        SCOPED_TRACE(testing::Message() << "d=" << s.head_dim << " B=" << s.page_tokens
                                        << " kind=" << int(kind) << " dtype=" << int(dtype));
        const Page page(s, dtype, kind, ++seed);
        const auto record = page.record();
        EXPECT_EQ(record, page.record()) << "deterministic, padding included";
        const uint32_t d = s.head_dim, B = s.page_tokens, r = s.rank;
        std::vector<float> mu(d), coeffs(std::size_t{B} * r), basis(std::size_t{r} * d);
        select::locks_dequantize(s, record.data(), mu.data(), coeffs.data(), basis.data());
        double worst = 0.0, key_norm = 0.0;
        for (uint32_t i = 0; i < B; ++i) {
          double e2 = 0.0;
          for (uint32_t c = 0; c < d; ++c) {
            long double recon = mu[c];
            for (uint32_t j = 0; j < r; ++j)
              recon += (long double)coeffs[i * r + j] * basis[j * d + c];
            const double e = double(page.keys[i * d + c] - recon);
            e2 += e * e;
            key_norm = std::max(key_norm, std::fabs(double(page.keys[i * d + c])));
          }
          worst = std::max(worst, std::sqrt(e2));
        }
        const float bound = select::locks_residual_bound(s, record.data());
        ASSERT_TRUE(std::isfinite(bound));
        EXPECT_GE(double(bound), worst);
        EXPECT_LE(double(bound), worst * (1 + 1e-6) + 1e-12 * key_norm * d);
        // The quantised summary still scores like the page: within a loose bound of the exact LSE.
        const auto q = test::random_floats(d, ++seed);
        float lse = 0.0f;
        const float scale = 1.0f / std::sqrt(float(d));
        select::locks_score_reference(s, record.data(), q.data(), 1, false, scale, &lse);
        double qnorm = 0.0;
        for (float x : q) qnorm += double(x) * x;
        EXPECT_LE(std::fabs(lse - exact_lse(page, q.data(), scale)),
                  scale * std::sqrt(qnorm) * bound + 1e-4);
      }
}

// The certificate the certified selector relies on: q . k_i <= q . (mu + V c_i) + |q| e for every
// token and query, over more than 10^6 (token, query) pairs of random and structured pages, with
// adversarial queries (each token's own residual direction) among them. In long double, as
// q . (k_i - (mu + V c_i)), so the test's own rounding stays far below the bound's margin.
TEST(Locks, residual_bound_holds_for_every_token_and_query) {
  uint32_t seed = 4000;
  uint64_t checks = 0;
  double tightest = 0.0;  // largest q.(k - recon) / (|q| e) seen
  for (PageKind kind : {PageKind::random, PageKind::low_rank, PageKind::outlier_channel})
    for (const LocksShape& s : all_shapes(8))
      for (int rep = 0; rep < 3; ++rep) {
        const Dtype dtype = rep == 1 ? Dtype::bf16 : Dtype::f16;
        const Page page(s, dtype, kind, ++seed);
        const auto record = page.record();
        const uint32_t d = s.head_dim, B = s.page_tokens, r = s.rank;
        std::vector<float> mu(d), coeffs(std::size_t{B} * r), basis(std::size_t{r} * d);
        select::locks_dequantize(s, record.data(), mu.data(), coeffs.data(), basis.data());
        std::vector<long double> residual(std::size_t{B} * d);
        for (uint32_t i = 0; i < B; ++i)
          for (uint32_t c = 0; c < d; ++c) {
            long double recon = mu[c];
            for (uint32_t j = 0; j < r; ++j)
              recon += (long double)coeffs[i * r + j] * basis[j * d + c];
            residual[i * d + c] = page.keys[i * d + c] - recon;
          }
        const long double bound = select::locks_residual_bound(s, record.data());
        const uint32_t n_queries = 12288 / B;
        std::mt19937 rng(++seed);
        std::normal_distribution<float> normal;
        std::vector<float> q(d);
        for (uint32_t t = 0; t < n_queries + B; ++t) {
          if (t < n_queries) {
            const float spread = t % 2 == 0 ? 1.0f : 30.0f;
            for (float& x : q) x = spread * normal(rng);
          } else {  // the residual direction of token t - n_queries: the worst case
            const long double* e = residual.data() + std::size_t{t - n_queries} * d;
            for (uint32_t c = 0; c < d; ++c) q[c] = float(e[c]);
          }
          long double qnorm = 0.0L;
          for (float x : q) qnorm += (long double)x * x;
          qnorm = std::sqrt(qnorm);
          for (uint32_t i = 0; i < B; ++i) {
            const long double* e = residual.data() + std::size_t{i} * d;
            long double s0 = 0.0L, s1 = 0.0L;  // two chains: x87 adds are slow
            for (uint32_t c = 0; c < d; c += 2) {
              s0 += q[c] * e[c];
              s1 += q[c + 1] * e[c + 1];
            }
            const long double gap = s0 + s1;
            ASSERT_LE(gap, qnorm * bound) << "d=" << d << " B=" << B << " kind=" << int(kind)
                                          << " query " << t << " token " << i;
            if (qnorm * bound > 0) tightest = std::max(tightest, double(gap / (qnorm * bound)));
            ++checks;
          }
        }
      }
  EXPECT_GE(checks, 1000000u);
  EXPECT_GT(tightest, 0.999) << "the adversarial queries reach the bound";
}

TEST(Locks, degenerate_pages_give_finite_records_and_scores) {
  const LocksShape s{128, 16, 8};
  std::vector<uint16_t> zeros(16 * 128, 0);
  std::vector<std::byte> record(select::locks_record_bytes(s));
  select::locks_build(s, zeros.data(), Dtype::f16, record.data());
  EXPECT_EQ(select::locks_residual_bound(s, record.data()), 0.0f);
  const auto q = test::random_floats(128, 5);
  float lse = 0.0f;
  select::locks_score_reference(s, record.data(), q.data(), 1, true, 0.1f, &lse);
  EXPECT_NEAR(lse, std::log(16.0f), 1e-6);
  const Page constant(s, Dtype::bf16, PageKind::constant, 6);
  const auto rec = constant.record();
  EXPECT_TRUE(std::isfinite(select::locks_residual_bound(s, rec.data())));
  select::locks_score_reference(s, rec.data(), q.data(), 1, false, 0.1f, &lse);
  EXPECT_TRUE(std::isfinite(lse));
  // A non-finite key certifies nothing: the bound is infinite, not a NaN that comparisons skip.
  std::vector<uint16_t> poisoned = constant.stored;
  poisoned[5 * 128 + 7] = 0x7fc0;  // bf16 NaN
  select::locks_build(s, poisoned.data(), Dtype::bf16, record.data());
  EXPECT_EQ(select::locks_residual_bound(s, record.data()), INFINITY);
}

// ---- The kernels --------------------------------------------------------------------------------

namespace {

class LocksKernels : public test::IsaTest {};

using test::isa_test_name;

}  // namespace

TEST_P(LocksKernels, every_page_score_matches_the_float64_reference) {
  uint32_t seed = 5000;
  double worst = 0.0;
  for (const LocksShape& base : all_shapes(8))
    for (uint32_t rank : {1u, 8u, base.page_tokens - 1}) {
      const LocksShape s{base.head_dim, base.page_tokens, rank};
      const uint32_t d = s.head_dim;
      const std::size_t bytes = select::locks_record_bytes(s);
      // A pool of records with shuffled slots and a hole, like the selector's.
      const uint32_t n_pages = 7 + (seed % 3) * 3;
      std::vector<uint32_t> slots(n_pages + 2);
      std::iota(slots.begin(), slots.end(), 0u);
      std::shuffle(slots.begin(), slots.end(), std::mt19937(seed));
      slots.resize(n_pages);
      AlignedVector<std::byte> pool((n_pages + 2) * bytes);
      // The spike makes the kernels' shift (the first token's logit) lie hundreds below or above
      // the others, by the sign of q's channel 3: both the fallback and the plain path run.
      std::vector<PageKind> kinds = {PageKind::random, PageKind::low_rank,
                                     PageKind::outlier_channel, PageKind::spike};
      for (uint32_t p = 0; p < n_pages; ++p) {
        const Page page(s, p % 2 ? Dtype::bf16 : Dtype::f16, kinds[p % 4], ++seed);
        select::locks_build(s, page.stored.data(), page.dtype, pool.data() + slots[p] * bytes);
      }
      for (uint32_t group : {1u, 2u, 3u, 4u, 5u, 7u, 8u, 11u})
        for (bool int8_query : {false, true}) {
          SCOPED_TRACE(testing::Message() << "d=" << d << " B=" << s.page_tokens << " r=" << rank
                                          << " G=" << group << " int8=" << int8_query);
          auto q = test::random_floats(std::size_t{group} * d, ++seed, 1.5f);
          if (group > 2) std::fill(q.begin() + d, q.begin() + 2 * d, 0.0f);  // a zero head
          const float scale = 1.0f / std::sqrt(float(d));
          std::vector<float> lse(std::size_t{group} * n_pages, NAN);
          simd::LocksScoreJob job{};
          job.q = q.data();
          job.group = group;
          job.head_dim = d;
          job.page_tokens = s.page_tokens;
          job.rank = rank;
          job.int8_query = int8_query;
          job.scale = scale;
          job.records = pool.data();
          job.record_bytes = bytes;
          job.slots = slots.data();
          job.count = n_pages;
          job.lse = lse.data();
          k().locks_score(job);
          for (uint32_t p = 0; p < n_pages; ++p) {
            std::vector<float> want(group);
            select::locks_score_reference(s, pool.data() + slots[p] * bytes, q.data(), group,
                                          int8_query, scale, want.data());
            for (uint32_t g = 0; g < group; ++g) {
              const float got = lse[std::size_t{g} * n_pages + p];
              const double err = std::fabs(double(got) - want[g]) / (1.0 + std::fabs(want[g]));
              worst = std::max(worst, err);
              ASSERT_LT(err, 2e-5)
                  << "page " << p << " head " << g << ": " << got << " vs " << want[g];
            }
          }
        }
    }
  RecordProperty("worst_relative_error", std::to_string(worst));
}

TEST_P(LocksKernels, an_empty_job_writes_nothing) {
  simd::LocksScoreJob job{};
  float sentinel = 42.0f;
  job.group = 3;
  job.head_dim = 128;
  job.page_tokens = 16;
  job.rank = 8;
  const std::vector<float> q(3 * 128, 1.0f);
  job.q = q.data();
  job.count = 0;
  job.lse = &sentinel;
  k().locks_score(job);
  EXPECT_EQ(sentinel, 42.0f);
}

INSTANTIATE_TEST_SUITE_P(Locks, LocksKernels, ::testing::ValuesIn(simd::kLevels), isa_test_name);

// ---- The AVX-512 VNNI int8-query kernel ---------------------------------------------------------

namespace {

// Records that real keys rarely produce: every code at its extreme, a token whose logit lies
// thousands away from the others (first or later, above or below by the head's sign), every token
// with the same coefficients, so that all logits lie hundreds above or below the centroid's (by
// the head's sign), where the VNNI kernel's shift, the centroid's logit, fails both ways.
enum class Crafted { extreme_codes, huge_later_token, huge_first_token, same_far_tokens };
constexpr Crafted kCrafted[] = {Crafted::extreme_codes, Crafted::huge_later_token,
                                Crafted::huge_first_token, Crafted::same_far_tokens};

void craft_record(const LocksShape& s, Crafted kind, uint32_t seed, std::byte* rec) {
  const auto layout = simd::locks_record_layout(s.head_dim, s.page_tokens, s.rank);
  std::mt19937 rng(seed);
  auto put_bf16 = [rec](uint32_t offset, float x) {
    const uint16_t h = simd::f32_to_bf16(x);
    std::memcpy(rec + offset, &h, sizeof h);
  };
  auto code = [&rng](int extreme) { return rng() % 2 ? extreme : -extreme; };
  std::memset(rec, 0, layout.bytes);
  const bool extreme = kind == Crafted::extreme_codes;
  for (uint32_t b = 0; b < layout.c_codes; ++b)  // nibbles -8 or 7 (extreme), else any
    rec[b] = extreme ? std::byte((rng() % 2 ? 0x8 : 0x7) | (rng() % 2 ? 0x80 : 0x70))
                     : std::byte(rng() & 0xff);
  for (uint32_t i = 0; i < s.rank * s.page_tokens; ++i)
    rec[layout.c_codes + i] =
        std::byte(static_cast<uint8_t>(extreme ? code(127) : int(rng() % 255) - 127));
  if (kind == Crafted::same_far_tokens)  // C is component-major: one code per component
    for (uint32_t i = 0; i < s.rank * s.page_tokens; ++i)
      rec[layout.c_codes + i] = rec[layout.c_codes + i / s.page_tokens * s.page_tokens];
  for (uint32_t c = 0; c < s.head_dim; ++c)
    rec[layout.mu_codes + c] =
        std::byte(static_cast<uint8_t>(extreme ? code(127) : int(rng() % 255) - 127));
  for (uint32_t j = 0; j < s.rank; ++j) put_bf16(layout.v_scales + 2 * j, 0.02f);
  for (uint32_t t = 0; t < s.page_tokens; ++t) put_bf16(layout.c_scales + 2 * t, 0.05f);
  put_bf16(layout.mu_scale, 0.03f);
  if (kind == Crafted::huge_later_token)
    put_bf16(layout.c_scales + 2 * (s.page_tokens / 2 + 1), 300.0f);
  if (kind == Crafted::huge_first_token) put_bf16(layout.c_scales, 300.0f);
  if (kind == Crafted::same_far_tokens)
    for (uint32_t t = 0; t < s.page_tokens; ++t) put_bf16(layout.c_scales + 2 * t, 2.0f);
}

// scale * max_t (sum_j |c_tj z_j| + |mu . q~|) in float64: the size of the terms a logit sums,
// which bounds its float32 rounding.
double logit_magnitude(const LocksShape& s, const std::byte* rec, const float* q, float scale) {
  const uint32_t d = s.head_dim, B = s.page_tokens, r = s.rank;
  std::vector<float> mu(d), coeffs(std::size_t{B} * r), basis(std::size_t{r} * d);
  select::locks_dequantize(s, rec, mu.data(), coeffs.data(), basis.data());
  float amax = 0.0f;
  for (uint32_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(q[c]));
  const float s_q = amax / 127.0f;
  std::vector<double> qt(d, 0.0);
  if (s_q > 0.0f)
    for (uint32_t c = 0; c < d; ++c) qt[c] = std::nearbyint(q[c] / s_q) * double(s_q);
  double mu_q = 0.0, worst = 0.0;
  for (uint32_t c = 0; c < d; ++c) mu_q += double(mu[c]) * qt[c];
  std::vector<double> z(r, 0.0);
  for (uint32_t j = 0; j < r; ++j)
    for (uint32_t c = 0; c < d; ++c) z[j] += double(basis[j * d + c]) * qt[c];
  for (uint32_t t = 0; t < B; ++t) {
    double sum = std::fabs(mu_q);
    for (uint32_t j = 0; j < r; ++j) sum += std::fabs(double(coeffs[t * r + j]) * z[j]);
    worst = std::max(worst, sum);
  }
  return double(scale) * worst;
}

}  // namespace

// The integer parts (V^T q~ and mu . q~) are exact; the logits and the log-sum-exp are float32,
// so the tolerance is the float32 one of the other kernels plus the rounding of logits whose
// terms are large and cancel.
TEST(LocksVnniKernel, int8_query_scores_match_the_float64_reference) {
  if (!simd::cpu_has(Level::avx512_vnni)) GTEST_SKIP() << "CPU lacks AVX-512 VNNI";
  // The avx512_vnni level's scorer runs the VNNI kernel on int8-query jobs.
  const simd::LocksScoreFn vnni = simd::kernels_for(Level::avx512_vnni).locks_score;
  uint32_t seed = 7000;
  double worst = 0.0;
  for (const LocksShape& base : all_shapes(8))
    for (uint32_t rank : {1u, 8u, base.page_tokens - 1}) {
      const LocksShape s{base.head_dim, base.page_tokens, rank};
      const uint32_t d = s.head_dim, B = s.page_tokens;
      const std::size_t bytes = select::locks_record_bytes(s);
      // Built pages of every kind, the crafted records and a page of zero keys, in shuffled slots
      // with holes; odd counts leave the kernel's 16-row reduction part-filled.
      const std::vector<PageKind> kinds = {PageKind::random, PageKind::low_rank,
                                           PageKind::outlier_channel, PageKind::spike,
                                           PageKind::constant};
      const uint32_t n_built = 13, n_pages = n_built + 1 + std::size(kCrafted);
      std::vector<uint32_t> slots(n_pages + 3);
      std::iota(slots.begin(), slots.end(), 0u);
      std::shuffle(slots.begin(), slots.end(), std::mt19937(seed));
      slots.resize(n_pages);
      AlignedVector<std::byte> pool((n_pages + 3) * bytes, std::byte{0xcd});
      for (uint32_t p = 0; p < n_built; ++p) {
        const Page page(s, p % 2 ? Dtype::bf16 : Dtype::f16, kinds[p % kinds.size()], ++seed);
        select::locks_build(s, page.stored.data(), page.dtype, pool.data() + slots[p] * bytes);
      }
      const std::vector<uint16_t> zeros(std::size_t{B} * d, 0);
      select::locks_build(s, zeros.data(), Dtype::f16, pool.data() + slots[n_built] * bytes);
      for (Crafted kind : kCrafted)
        craft_record(s, kind, ++seed, pool.data() + slots[n_built + 1 + int(kind)] * bytes);

      for (uint32_t group = 1; group <= 11; ++group)
        for (uint32_t count : {1u, 7u, n_pages}) {
          SCOPED_TRACE(testing::Message() << "d=" << d << " B=" << B << " r=" << rank
                                          << " G=" << group << " count=" << count);
          auto q = test::random_floats(std::size_t{group} * d, ++seed, 1.5f);
          if (group > 1) std::fill(q.begin() + d, q.begin() + 2 * d, 0.0f);  // a zero head
          if (group > 2)                                                     // every code +-127
            for (uint32_t c = 0; c < d; ++c) q[2 * d + c] = (c * 7 + seed) % 3 ? 1.0f : -1.0f;
          if (group > 3) q[3 * d + seed % d] = 1e4f;  // one channel: the rest round to 0
          const float scale = 1.0f / std::sqrt(float(d));
          // The last `count` pages: the crafted ones are always in.
          const uint32_t* job_slots = slots.data() + (n_pages - count);
          std::vector<float> lse(std::size_t{group} * count, NAN);
          simd::LocksScoreJob job{};
          job.q = q.data();
          job.group = group;
          job.head_dim = d;
          job.page_tokens = B;
          job.rank = rank;
          job.int8_query = true;
          job.scale = scale;
          job.records = pool.data();
          job.record_bytes = bytes;
          job.slots = job_slots;
          job.count = count;
          job.lse = lse.data();
          vnni(job);
          for (uint32_t p = 0; p < count; ++p) {
            const std::byte* rec = pool.data() + std::size_t{job_slots[p]} * bytes;
            std::vector<float> want(group);
            select::locks_score_reference(s, rec, q.data(), group, true, scale, want.data());
            for (uint32_t g = 0; g < group; ++g) {
              const float got = lse[std::size_t{g} * count + p];
              const double mag = logit_magnitude(s, rec, q.data() + std::size_t{g} * d, scale);
              const double err = std::fabs(double(got) - want[g]);
              const double tol = 2e-5 * (1.0 + std::fabs(want[g])) + 1e-6 * mag;
              worst = std::max(worst, err / tol);
              ASSERT_LE(err, tol) << "page " << p << " (slot " << job_slots[p] << ") head " << g
                                  << ": " << got << " vs " << want[g] << ", terms " << mag;
            }
          }
        }
    }
  RecordProperty("worst_error_over_tolerance", std::to_string(worst));
}

// The kernel keeps each (page, head)'s sum of exps in a ring reduced 16 rows at a time, and takes
// the logs and stores the results every 16 reductions: jobs of hundreds of pages (here the same
// records again and again, spikes and far tokens among them) go round it several times, for group
// sizes that fill the rows differently, and every page still gets its own score.
TEST(LocksVnniKernel, long_jobs_score_every_page) {
  if (!simd::cpu_has(Level::avx512_vnni)) GTEST_SKIP() << "CPU lacks AVX-512 VNNI";
  // The avx512_vnni level's scorer runs the VNNI kernel on int8-query jobs.
  const simd::LocksScoreFn vnni = simd::kernels_for(Level::avx512_vnni).locks_score;
  const LocksShape s{128, 16, 8};
  const std::size_t bytes = select::locks_record_bytes(s);
  const std::vector<PageKind> kinds = {PageKind::random, PageKind::low_rank, PageKind::spike,
                                       PageKind::outlier_channel, PageKind::spike};
  const uint32_t n_records = static_cast<uint32_t>(kinds.size()) + 1, count = 600;
  AlignedVector<std::byte> pool(n_records * bytes);
  for (uint32_t p = 0; p < kinds.size(); ++p) {
    const Page page(s, Dtype::bf16, kinds[p], 7500 + p);
    select::locks_build(s, page.stored.data(), page.dtype, pool.data() + p * bytes);
  }
  craft_record(s, Crafted::same_far_tokens, 7599, pool.data() + (n_records - 1) * bytes);
  std::vector<uint32_t> slots(count);
  for (uint32_t i = 0; i < count; ++i) slots[i] = (i * 5 + i / 7) % n_records;
  for (uint32_t group : {1u, 3u, 4u, 8u}) {
    SCOPED_TRACE(testing::Message() << "G=" << group);
    const auto q = test::random_floats(std::size_t{group} * s.head_dim, 7600 + group, 1.5f);
    const float scale = 1.0f / std::sqrt(float(s.head_dim));
    std::vector<float> want(std::size_t{n_records} * group);
    for (uint32_t p = 0; p < n_records; ++p)
      select::locks_score_reference(s, pool.data() + p * bytes, q.data(), group, true, scale,
                                    want.data() + std::size_t{p} * group);
    std::vector<float> lse(std::size_t{group} * count, NAN);
    simd::LocksScoreJob job{};
    job.q = q.data();
    job.group = group;
    job.head_dim = s.head_dim;
    job.page_tokens = s.page_tokens;
    job.rank = s.rank;
    job.int8_query = true;
    job.scale = scale;
    job.records = pool.data();
    job.record_bytes = bytes;
    job.slots = slots.data();
    job.count = count;
    job.lse = lse.data();
    vnni(job);
    for (uint32_t i = 0; i < count; ++i)
      for (uint32_t g = 0; g < group; ++g) {
        const float expected = want[std::size_t{slots[i]} * group + g];
        const float got = lse[std::size_t{g} * count + i];
        const double mag = logit_magnitude(s, pool.data() + slots[i] * bytes,
                                           q.data() + std::size_t{g} * s.head_dim, scale);
        ASSERT_LE(std::fabs(double(got) - expected),
                  2e-5 * (1.0 + std::fabs(expected)) + 1e-6 * mag)
            << "page " << i << " (slot " << slots[i] << ") head " << g << ": " << got << " vs "
            << expected;
      }
  }
}

// The avx512_vnni table is avx512's with the int8-query scorer replaced: exact queries keep the
// AVX-512 float kernel.
TEST(LocksVnniKernel, the_vnni_level_replaces_only_the_int8_query_scorer) {
  if (!simd::cpu_has(Level::avx512_vnni)) GTEST_SKIP() << "CPU lacks AVX-512 VNNI";
  // The avx512_vnni level's scorer runs the VNNI kernel on int8-query jobs.
  const simd::LocksScoreFn vnni = simd::kernels_for(Level::avx512_vnni).locks_score;
  const LocksShape s{128, 16, 8};
  const std::size_t bytes = select::locks_record_bytes(s);
  const uint32_t count = 9;
  AlignedVector<std::byte> pool(count * bytes);
  for (uint32_t p = 0; p < count; ++p) {
    const Page page(s, Dtype::bf16, PageKind::random, 7900 + p);
    select::locks_build(s, page.stored.data(), page.dtype, pool.data() + p * bytes);
  }
  std::vector<uint32_t> slots(count);
  std::iota(slots.begin(), slots.end(), 0u);
  const auto q = test::random_floats(4 * 128, 7999, 1.5f);
  auto run = [&](simd::LocksScoreFn fn, bool int8_query) {
    std::vector<float> lse(4 * count);
    simd::LocksScoreJob job{};
    job.q = q.data();
    job.group = 4;
    job.head_dim = 128;
    job.page_tokens = 16;
    job.rank = 8;
    job.int8_query = int8_query;
    job.scale = 0.125f;
    job.records = pool.data();
    job.record_bytes = bytes;
    job.slots = slots.data();
    job.count = count;
    job.lse = lse.data();
    fn(job);
    return lse;
  };
  const simd::LocksScoreFn avx512 = simd::kernels_for(Level::avx512).locks_score;
  EXPECT_EQ(run(vnni, false), run(avx512, false));
  // The int8 query's scores on VNNI are not the float kernel's on the rounded query (VNNI ran).
  EXPECT_NE(run(vnni, true), run(avx512, true));
}
