#include "lib/select/locks_summary.hpp"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>

#include "lib/core/error.hpp"
#include "lib/select/symmetric_eigen.hpp"
#include "simd/half.hpp"
#include "simd/locks_record.hpp"

namespace kvsift::select {
namespace {

using simd::kMaxHeadDim;
using simd::kMaxPageTokens;
constexpr uint32_t kMaxRank = kMaxPageTokens - 1;
static_assert(kMaxPageTokens <= kSymmetricEigenMaxOrder);
// The sigma floor, as the authors' build (docs/methods.md, LOCKS: summary build).
constexpr double kMinEigenvalue = 1e-10;

simd::LocksRecordLayout layout_of(const LocksShape& shape) noexcept {
  return simd::locks_record_layout(shape.head_dim, shape.page_tokens, shape.rank);
}

// n key values to float32. Every ISA's decode is exact, so the best one the CPU has is used
// (the scalar fp16 decode cost as much as the Gram).
void decode(const uint16_t* k, std::size_t n, simd::Dtype dtype, float* out) noexcept {
  static const simd::Kernels& kernels = simd::kernels_for(simd::resolve_level(simd::Level::best));
  kernels.decode(k, out, n, dtype);
}

uint16_t load_u16(const std::byte* p) noexcept {
  uint16_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

void store_u16(std::byte* p, uint16_t x) noexcept {
  std::memcpy(p, &x, sizeof x);
}

// The scale absmax / levels, stored as bf16, and each value's code against the float32 scale
// before that rounding (to nearest even, then clamped), as the authors' build does
// (tests/test_locks_peer.cpp checks the codes against theirs; rounding against the stored bf16
// scale instead moved ~1% of the codes by one and every page score by ~0.01 nats).
// A zero (or underflowed) scale gives zero codes, and so does a NaN value.
template <class Code>
uint16_t quantize(const float* x, std::size_t n, float levels, int lowest, int highest,
                  Code&& store_code) noexcept {
  float absmax = 0.0f;
  for (std::size_t i = 0; i < n; ++i) absmax = std::max(absmax, std::fabs(x[i]));
  const float scale = absmax / levels;
  const uint16_t scale_bits = simd::f32_to_bf16(scale);
  const bool usable = scale > 0.0f && std::isfinite(scale);
  for (std::size_t i = 0; i < n; ++i) {
    const float code = usable ? std::nearbyint(x[i] / scale) : 0.0f;
    store_code(i, std::isnan(code)
                      ? 0
                      : static_cast<int>(std::clamp(code, float(lowest), float(highest))));
  }
  return scale_bits;
}

}  // namespace

void locks_check_shape(const LocksShape& shape) {
  require(shape.head_dim == 64 || shape.head_dim == 128 || shape.head_dim == 256,
          "LOCKS head_dim=", shape.head_dim, " is not 64, 128 or 256");
  require(shape.page_tokens == 16 || shape.page_tokens == 32 || shape.page_tokens == 64,
          "LOCKS page_tokens=", shape.page_tokens, " is not 16, 32 or 64");
  require(shape.rank >= 1 && shape.rank < shape.page_tokens, "LOCKS rank=", shape.rank,
          " is not in [1, page_tokens - 1 = ", shape.page_tokens - 1, "]");
}

std::size_t locks_paper_bytes(const LocksShape& shape) noexcept {
  return layout_of(shape).paper_bytes;
}

std::size_t locks_record_bytes(const LocksShape& shape) noexcept {
  return layout_of(shape).bytes;
}

void locks_factor(const LocksShape& shape, const float* keys, const LocksFactors& out) noexcept {
  const uint32_t d = shape.head_dim, B = shape.page_tokens, r = shape.rank;
  float centered[kMaxPageTokens * kMaxHeadDim];  // D, token-major
  std::copy_n(keys, std::size_t{B} * d, centered);
  double mean[kMaxHeadDim];
  std::fill_n(mean, d, 0.0);
  for (uint32_t i = 0; i < B; ++i)
    for (uint32_t c = 0; c < d; ++c) mean[c] += centered[i * d + c];
  for (uint32_t c = 0; c < d; ++c) out.mu[c] = static_cast<float>(mean[c] / B);
  for (uint32_t i = 0; i < B; ++i)
    for (uint32_t c = 0; c < d; ++c) centered[i * d + c] -= out.mu[c];

  // Float64 from here: V = D^T U / sigma divides by sigma, so the Gram's and the eigenvectors'
  // rounding is amplified by lambda_1 / lambda_r in V's orthonormality; float32 would lose it on
  // pages with a fast-decaying spectrum, float64 keeps V^T V = I to ~1e-12 (tests/test_locks.cpp).
  // The lower triangle (all symmetric_eigen reads) as a sum of per-channel outer products: the
  // inner loop has no reduction, so it vectorises (a float64 dot product would not, without
  // -ffast-math).
  double gram[kMaxPageTokens * kMaxPageTokens];
  std::fill_n(gram, B * B, 0.0);
  for (uint32_t c = 0; c < d; c += 2) {  // two channels per pass: half the row loads and stores
    double x[kMaxPageTokens], y[kMaxPageTokens];
    for (uint32_t i = 0; i < B; ++i) {
      x[i] = centered[i * d + c];
      y[i] = centered[i * d + c + 1];
    }
    for (uint32_t i = 0; i < B; ++i) {
      double* row = gram + i * B;
      const double xi = x[i], yi = y[i];
      for (uint32_t j = 0; j <= i; ++j) row[j] += xi * x[j] + yi * y[j];
    }
  }
  double vectors[kMaxPageTokens * kMaxPageTokens];
  symmetric_eigen(B, gram, out.eigenvalues, vectors);

  for (uint32_t j = 0; j < r; ++j) {
    const double sigma = std::sqrt(std::max(out.eigenvalues[j], kMinEigenvalue));
    const double* u = vectors + j * B;
    for (uint32_t i = 0; i < B; ++i) out.coeffs[i * r + j] = static_cast<float>(sigma * u[i]);
    double column[kMaxHeadDim];
    std::fill_n(column, d, 0.0);
    for (uint32_t i = 0; i < B; ++i) {
      const double w = u[i];
      const float* row = centered + i * d;
      for (uint32_t c = 0; c < d; ++c) column[c] += w * row[c];
    }
    for (uint32_t c = 0; c < d; ++c) out.basis[j * d + c] = static_cast<float>(column[c] / sigma);
  }
}

void locks_factor(const LocksShape& shape, const uint16_t* k, simd::Dtype dtype,
                  const LocksFactors& out) noexcept {
  float keys[kMaxPageTokens * kMaxHeadDim];
  decode(k, std::size_t{shape.page_tokens} * shape.head_dim, dtype, keys);
  locks_factor(shape, keys, out);
}

void locks_build(const LocksShape& shape, const uint16_t* k, simd::Dtype dtype,
                 std::byte* record) noexcept {
  float keys[kMaxPageTokens * kMaxHeadDim];
  decode(k, std::size_t{shape.page_tokens} * shape.head_dim, dtype, keys);
  locks_build(shape, keys, record);
}

void locks_build(const LocksShape& shape, const float* keys, std::byte* record) noexcept {
  const uint32_t d = shape.head_dim, B = shape.page_tokens, r = shape.rank;
  const simd::LocksRecordLayout layout = layout_of(shape);
  float mu[kMaxHeadDim], coeffs[kMaxPageTokens * kMaxRank], basis[kMaxRank * kMaxHeadDim];
  double eigenvalues[kMaxPageTokens];
  locks_factor(shape, keys, LocksFactors{mu, coeffs, basis, eigenvalues});

  std::memset(record, 0, layout.bytes);
  auto* v_codes = reinterpret_cast<uint8_t*>(record + layout.v_codes);
  for (uint32_t j = 0; j < r; ++j) {
    uint8_t* column = v_codes + j * d / 2;
    const uint16_t scale = quantize(basis + j * d, d, 7.0f, -8, 7, [&](std::size_t c, int code) {
      column[c / 2] |= static_cast<uint8_t>((code & 0xf) << (c % 2 == 0 ? 0 : 4));
    });
    store_u16(record + layout.v_scales + 2 * j, scale);
  }
  auto* c_codes = reinterpret_cast<int8_t*>(record + layout.c_codes);
  for (uint32_t i = 0; i < B; ++i) {
    const uint16_t scale =
        quantize(coeffs + i * r, r, 127.0f, -127, 127,
                 [&](std::size_t j, int code) { c_codes[j * B + i] = static_cast<int8_t>(code); });
    store_u16(record + layout.c_scales + 2 * i, scale);
  }
  auto* mu_codes = reinterpret_cast<int8_t*>(record + layout.mu_codes);
  store_u16(record + layout.mu_scale,
            quantize(mu, d, 127.0f, -127, 127,
                     [&](std::size_t c, int code) { mu_codes[c] = static_cast<int8_t>(code); }));

  // The residual bound, against exactly what scoring reads. Per component, float64 evaluation
  // of k - mu - sum_j V_j c_ij errs by at most (r + 2) u (u = DBL_EPSILON / 2) times the sum of
  // the terms' magnitudes (Higham's summation bound); over the vector that is at most
  // (r + 2) u (|k| + |mu| + sum_j |c_ij| |V_j|) by the triangle inequality, and twice that is
  // added back. The final float32 rounding goes up.
  locks_dequantize(shape, record, mu, coeffs, basis);
  double mu_norm2 = 0.0, basis_norm[kMaxRank];
  for (uint32_t c = 0; c < d; ++c) mu_norm2 += double(mu[c]) * mu[c];
  for (uint32_t j = 0; j < r; ++j) {
    double norm2 = 0.0;
    for (uint32_t c = 0; c < d; ++c) norm2 += double(basis[j * d + c]) * basis[j * d + c];
    basis_norm[j] = std::sqrt(norm2);
  }
  double worst = 0.0;
  for (uint32_t i = 0; i < B; ++i) {
    const float* key = keys + std::size_t{i} * d;
    double residual[kMaxHeadDim];
    for (uint32_t c = 0; c < d; ++c) residual[c] = double(key[c]) - mu[c];
    double magnitude = std::sqrt(mu_norm2);
    for (uint32_t j = 0; j < r; ++j) {
      const double w = coeffs[i * r + j];
      const float* v = basis + j * d;
      for (uint32_t c = 0; c < d; ++c) residual[c] -= w * v[c];
      magnitude += std::fabs(w) * basis_norm[j];
    }
    double norm2 = 0.0, key_norm2 = 0.0;
    for (uint32_t c = 0; c < d; ++c) {
      norm2 += residual[c] * residual[c];
      key_norm2 += double(key[c]) * key[c];
    }
    magnitude += std::sqrt(key_norm2);
    const double slack = (r + 2) * DBL_EPSILON * magnitude;
    const double token_bound = std::sqrt(norm2) * (1.0 + d * DBL_EPSILON) + slack;
    // A NaN (a non-finite key) must not be skipped by max: it makes the bound infinite.
    worst = token_bound <= worst ? worst : std::isnan(token_bound) ? HUGE_VAL : token_bound;
  }
  float bound = static_cast<float>(worst);
  if (!(worst <= double(std::numeric_limits<float>::max())))  // NaN or overflow: no bound
    bound = std::numeric_limits<float>::infinity();
  else if (double(bound) < worst)
    bound = std::nextafter(bound, std::numeric_limits<float>::infinity());
  std::memcpy(record + layout.residual, &bound, sizeof bound);
}

float locks_residual_bound(const LocksShape& shape, const std::byte* record) noexcept {
  float bound;
  std::memcpy(&bound, record + layout_of(shape).residual, sizeof bound);
  return bound;
}

void locks_dequantize(const LocksShape& shape, const std::byte* record, float* mu, float* coeffs,
                      float* basis) noexcept {
  const uint32_t d = shape.head_dim, B = shape.page_tokens, r = shape.rank;
  const simd::LocksRecordLayout layout = layout_of(shape);
  const float mu_scale = simd::bf16_to_f32(load_u16(record + layout.mu_scale));
  const auto* mu_codes = reinterpret_cast<const int8_t*>(record + layout.mu_codes);
  for (uint32_t c = 0; c < d; ++c) mu[c] = mu_codes[c] * mu_scale;
  const auto* c_codes = reinterpret_cast<const int8_t*>(record + layout.c_codes);
  for (uint32_t i = 0; i < B; ++i) {
    const float scale = simd::bf16_to_f32(load_u16(record + layout.c_scales + 2 * i));
    for (uint32_t j = 0; j < r; ++j) coeffs[i * r + j] = c_codes[j * B + i] * scale;
  }
  const auto* v_codes = reinterpret_cast<const uint8_t*>(record + layout.v_codes);
  for (uint32_t j = 0; j < r; ++j) {
    const float scale = simd::bf16_to_f32(load_u16(record + layout.v_scales + 2 * j));
    for (uint32_t b = 0; b < d / 2; ++b) {
      const uint8_t byte = v_codes[j * d / 2 + b];
      const int lo = (byte & 0xf) >= 8 ? (byte & 0xf) - 16 : (byte & 0xf);
      const int hi = (byte >> 4) >= 8 ? (byte >> 4) - 16 : (byte >> 4);
      basis[j * d + 2 * b] = lo * scale;
      basis[j * d + 2 * b + 1] = hi * scale;
    }
  }
}

void locks_score_reference(const LocksShape& shape, const std::byte* record, const float* q,
                           uint32_t group, bool int8_query, float scale, float* lse) noexcept {
  const uint32_t d = shape.head_dim, B = shape.page_tokens, r = shape.rank;
  float mu[kMaxHeadDim], coeffs[kMaxPageTokens * kMaxRank], basis[kMaxRank * kMaxHeadDim];
  locks_dequantize(shape, record, mu, coeffs, basis);
  for (uint32_t g = 0; g < group; ++g) {
    const float* qg = q + std::size_t{g} * d;
    double qt[kMaxHeadDim];
    float amax = 0.0f;
    for (uint32_t c = 0; c < d; ++c) amax = std::max(amax, std::fabs(qg[c]));
    const float s_q = amax / 127.0f;  // in float, as the kernels, so the codes agree exactly
    for (uint32_t c = 0; c < d; ++c)
      qt[c] = !int8_query ? qg[c] : s_q > 0.0f ? std::nearbyint(qg[c] / s_q) * double(s_q) : 0.0;
    double z[kMaxRank], mu_q = 0.0;
    for (uint32_t j = 0; j < r; ++j) {
      z[j] = 0.0;
      for (uint32_t c = 0; c < d; ++c) z[j] += double(basis[j * d + c]) * qt[c];
    }
    for (uint32_t c = 0; c < d; ++c) mu_q += double(mu[c]) * qt[c];
    double logits[kMaxPageTokens], max_logit = -std::numeric_limits<double>::infinity();
    for (uint32_t i = 0; i < B; ++i) {
      double dot_z = 0.0;
      for (uint32_t j = 0; j < r; ++j) dot_z += double(coeffs[i * r + j]) * z[j];
      logits[i] = double(scale) * (dot_z + mu_q);
      max_logit = std::max(max_logit, logits[i]);
    }
    double sum = 0.0;
    for (uint32_t i = 0; i < B; ++i) sum += std::exp(logits[i] - max_logit);
    lse[g] = static_cast<float>(max_logit + std::log(sum));
  }
}

}  // namespace kvsift::select
