// Every ISA's kernels against the scalar reference (and the float64 attention reference) on
// fresh random inputs of odd sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

#include "lib/core/aligned.hpp"
#include "simd/half.hpp"
#include "simd/kernels.hpp"
#include "simd/page_rows.hpp"
#include "test_util.hpp"
#include "tests/reference_attention.hpp"

using namespace kvsift;
using simd::Dtype;
using simd::Level;

namespace {

class Kernels : public test::IsaTest {};

using test::isa_test_name;

// A pool of random pages for one (sequence, KV head), stored through the scalar table (so every
// ISA reads identical bytes), with shuffled slot ids like a real pool.
struct Pages {
  simd::PageLayout layout;
  uint32_t page_tokens, head_dim;
  uint64_t tokens;
  AlignedVector<std::byte> pool;
  std::vector<uint32_t> table;
  std::vector<float> raw_k, raw_v;  // [tokens, head_dim] the values given to the store
  std::vector<float> k, v;          // [tokens, head_dim] the stored values as float

  Pages(uint64_t n_tokens, uint32_t B, uint32_t d, Dtype dt, uint32_t seed)
      : layout{B, d, dt}, page_tokens(B), head_dim(d), tokens(n_tokens) {
    const uint32_t n_pages = static_cast<uint32_t>((n_tokens + B - 1) / B);
    pool.assign(layout.slot_bytes() * (n_pages + 1), std::byte{0});
    table.resize(n_pages);
    std::vector<uint32_t> slots(n_pages + 1);  // one spare: the pool has a hole, like a real one
    std::iota(slots.begin(), slots.end(), 0u);
    std::shuffle(slots.begin(), slots.end(), std::mt19937(seed));
    std::copy_n(slots.begin(), n_pages, table.begin());
    raw_k = test::random_floats(n_tokens * d, seed, 2.0f);
    raw_v = test::random_floats(n_tokens * d, seed + 1);
    k.resize(raw_k.size());
    v.resize(raw_v.size());
    const simd::Kernels& scalar = simd::scalar_kernels();
    using simd::SlotPart;
    for (uint64_t t = 0; t < n_tokens; ++t) {
      std::byte* slot = layout.slot(pool.data(), table[t / B]);
      const auto row = static_cast<uint32_t>(t % B);
      simd::store_rows(scalar, layout, slot, SlotPart::key, row, 1, raw_k.data() + t * d, d);
      simd::store_rows(scalar, layout, slot, SlotPart::value, row, 1, raw_v.data() + t * d, d);
      simd::load_rows(scalar, layout, slot, SlotPart::key, row, 1, k.data() + t * d);
      simd::load_rows(scalar, layout, slot, SlotPart::value, row, 1, v.data() + t * d);
    }
  }

  uint32_t n_pages() const { return static_cast<uint32_t>(table.size()); }

  // Runs one kernel over the given logical pages (null: all) and normalises: [G, d].
  std::vector<float> attend(const simd::Kernels& kernels, const std::vector<float>& q, uint32_t G,
                            const std::vector<uint32_t>* logical) const {
    const std::size_t d = head_dim;
    AlignedVector<float> q_scaled(q.size()), m(G), l(G), acc(G * d), scratch(G * page_tokens);
    for (std::size_t i = 0; i < q.size(); ++i) q_scaled[i] = q[i] / std::sqrt(float(d));
    simd::AttendJob job{};
    job.q = q_scaled.data();
    job.group = G;
    job.layout = layout;
    job.pool = pool.data();
    job.table = table.data();
    job.logical = logical ? logical->data() : nullptr;
    job.first = 0;
    job.count = logical ? static_cast<uint32_t>(logical->size()) : n_pages();
    job.seq_tokens = tokens;
    job.m = m.data();
    job.l = l.data();
    job.acc = acc.data();
    job.scratch = scratch.data();
    kernels.attend(job);
    std::vector<float> out(G * d);
    for (uint32_t g = 0; g < G; ++g)
      for (std::size_t c = 0; c < d; ++c) out[g * d + c] = acc[g * d + c] / l[g];
    return out;
  }

  // The float64 reference over the listed pages' tokens: their stored values, or (stored false)
  // the values given to the store.
  std::vector<double> reference(const std::vector<float>& q, uint32_t G,
                                const std::vector<uint32_t>* logical, bool stored = true) const {
    const std::vector<float>& k = stored ? this->k : raw_k;
    const std::vector<float>& v = stored ? this->v : raw_v;
    std::vector<float> ks, vs;
    for (uint32_t p = 0; p < n_pages(); ++p) {
      if (logical && std::find(logical->begin(), logical->end(), p) == logical->end()) continue;
      const uint64_t end = std::min<uint64_t>(tokens, uint64_t{p + 1} * page_tokens);
      for (uint64_t t = uint64_t{p} * page_tokens; t < end; ++t) {
        ks.insert(ks.end(), k.begin() + t * head_dim, k.begin() + (t + 1) * head_dim);
        vs.insert(vs.end(), v.begin() + t * head_dim, v.begin() + (t + 1) * head_dim);
      }
    }
    std::vector<double> out(std::size_t{G} * head_dim);
    reference_attention(q.data(), ks.data(), vs.data(), ks.size() / head_dim, G, head_dim,
                        out.data());
    return out;
  }

  // What the avx512_vnni level's q8 kernel (simd/x86/attend_avx512_vnni.cpp) rounds, against the
  // float64 attention over the stored values (all [G, head_dim]):
  //   rounded: the float64 attention over the stored values with each head's scaled query
  //     rounded as the kernel rounds it (to multiples of s_q / 128, s_q = max|q| / 127 in float32,
  //     to nearest even);
  //   weights: a bound on what rounding each page's weights w_t = p_t * v_scale_t to u8 codes of
  //     step w_max / 255 adds to the output: half a step times |code| per token, over l,
  //     sum_pages (w_max / 510) sum_{t in page} |vcode[t, c]| / sum_t p_t (p_t about the final
  //     max);
  //   query: a bound on what the query's rounding moves the exact output: a logit moves by at
  //     most delta_t = sum_c |q_c - q~_c| |k_t,c| and each normalised weight pi_t then within
  //     pi_t * max(e^delta_t / Z- - 1, 1 - e^-delta_t / Z+), Z-+ = sum_u pi_u e^-+delta_u.
  struct IntegerProducts {
    std::vector<double> rounded, weights, query;
  };
  IntegerProducts integer_products(const std::vector<float>& q, uint32_t G,
                                   const std::vector<uint32_t>* logical) const {
    const uint32_t d = head_dim, B = page_tokens;
    std::vector<uint64_t> tokens_in;  // the listed pages' tokens, in page order
    for (uint32_t p = 0; p < n_pages(); ++p) {
      if (logical && std::find(logical->begin(), logical->end(), p) == logical->end()) continue;
      const uint64_t end = std::min<uint64_t>(tokens, uint64_t{p + 1} * B);
      for (uint64_t t = uint64_t{p} * B; t < end; ++t) tokens_in.push_back(t);
    }
    const std::size_t n = tokens_in.size();
    IntegerProducts out{std::vector<double>(std::size_t{G} * d, 0.0),
                        std::vector<double>(std::size_t{G} * d, 0.0),
                        std::vector<double>(std::size_t{G} * d, 0.0)};
    if (n == 0) return out;
    std::vector<double> exact(n), rounded(n), delta(n), pi(n);
    for (uint32_t g = 0; g < G; ++g) {
      std::vector<float> qs(d);
      float amax = 0.0f;
      for (uint32_t c = 0; c < d; ++c) {
        qs[c] = q[std::size_t{g} * d + c] / std::sqrt(float(d));  // as Pages::attend scales it
        amax = std::max(amax, std::fabs(qs[c]));
      }
      const float s_q = amax / 127.0f;
      std::vector<double> qr(d);
      for (uint32_t c = 0; c < d; ++c)
        qr[c] = s_q > 0.0f ? double(s_q / 128.0f) * std::nearbyint(qs[c] / s_q * 128.0f) : 0.0;
      double m_exact = -INFINITY, m_rounded = -INFINITY;
      for (std::size_t i = 0; i < n; ++i) {
        const float* kt = k.data() + tokens_in[i] * d;
        double e = 0.0, r = 0.0, dl = 0.0;
        for (uint32_t c = 0; c < d; ++c) {
          e += double(qs[c]) * kt[c];
          r += qr[c] * kt[c];
          dl += std::fabs(double(qs[c]) - qr[c]) * std::fabs(kt[c]);
        }
        exact[i] = e, rounded[i] = r, delta[i] = dl;
        m_exact = std::max(m_exact, e), m_rounded = std::max(m_rounded, r);
      }
      double l_exact = 0.0, l_rounded = 0.0;
      for (std::size_t i = 0; i < n; ++i) {
        pi[i] = std::exp(exact[i] - m_exact), l_exact += pi[i];
        rounded[i] = std::exp(rounded[i] - m_rounded), l_rounded += rounded[i];
      }
      double z_lo = 0.0, z_hi = 0.0;
      for (std::size_t i = 0; i < n; ++i) {
        pi[i] /= l_exact;
        z_lo += pi[i] * std::exp(-delta[i]), z_hi += pi[i] * std::exp(delta[i]);
      }
      double* o = out.rounded.data() + std::size_t{g} * d;
      double* wb = out.weights.data() + std::size_t{g} * d;
      double* qb = out.query.data() + std::size_t{g} * d;
      for (std::size_t i0 = 0; i0 < n;) {  // one page of tokens_in at a time
        std::size_t i1 = i0;
        while (i1 < n && tokens_in[i1] / B == tokens_in[i0] / B) ++i1;
        double w_max = 0.0;
        for (std::size_t i = i0; i < i1; ++i) {
          const uint64_t t = tokens_in[i];
          const std::byte* slot = layout.slot(pool.data(), table[t / B]);
          w_max = std::max(w_max, rounded[i] * layout.value_scales(slot)[t % B]);
        }
        for (std::size_t i = i0; i < i1; ++i) {
          const uint64_t t = tokens_in[i];
          const std::byte* slot = layout.slot(pool.data(), table[t / B]);
          const int8_t* codes = layout.value_codes(slot, static_cast<uint32_t>(t % B));
          const double dpi =
              pi[i] * std::max(std::exp(delta[i]) / z_lo - 1.0, 1.0 - std::exp(-delta[i]) / z_hi);
          for (uint32_t c = 0; c < d; ++c) {
            o[c] += rounded[i] / l_rounded * v[t * d + c];
            wb[c] += w_max / 510.0 * std::abs(codes[c]) / l_rounded;
            qb[c] += dpi * std::fabs(v[t * d + c]);
          }
        }
        i0 = i1;
      }
    }
    return out;
  }
};

// An integer-product kernel's output against the float64 attention over the stored values
// (Pages::integer_products): within the weights' rounding bound of the float64 attention with the
// rounded query, plus 1e-5 of the output's largest value for the float32 arithmetic (the float
// kernels' tolerance); and within that plus the query's bound of the exact one.
void expect_within_integer_bounds(const Pages& pages, const std::vector<float>& got,
                                  const std::vector<float>& q, uint32_t G,
                                  const std::vector<uint32_t>* logical) {
  const auto ref = pages.reference(q, G, logical);
  const auto bounds = pages.integer_products(q, G, logical);
  double largest = 0.0;
  for (double x : ref) largest = std::max(largest, std::fabs(x));
  const double slack = 1e-5 * largest;
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(got[i] - bounds.rounded[i]), bounds.weights[i] + slack) << "i=" << i;
    ASSERT_LE(std::fabs(got[i] - ref[i]), bounds.weights[i] + bounds.query[i] + slack) << "i=" << i;
  }
}

}  // namespace

TEST_P(Kernels, encode_and_decode_match_the_scalar_reference_bit_for_bit) {
  for (Dtype dtype : {Dtype::f16, Dtype::bf16}) {
    for (std::size_t n : {1u, 3u, 7u, 17u, 64u, 1005u}) {
      auto x = test::random_floats(n, 100 + static_cast<uint32_t>(n), 300.0f);
      x[0] = 65519.0f;  // rounding edge cases ride along
      if (n > 2) x[1] = 0x1.8p-25f, x[2] = -0.0f;
      std::vector<uint16_t> got(n), want(n);
      k().encode(x.data(), got.data(), n, dtype);
      simd::scalar_kernels().encode(x.data(), want.data(), n, dtype);
      ASSERT_EQ(got, want) << "n=" << n << " dtype=" << int(dtype);
      std::vector<float> back(n), back_want(n);
      k().decode(got.data(), back.data(), n, dtype);
      simd::scalar_kernels().decode(want.data(), back_want.data(), n, dtype);
      ASSERT_EQ(0, std::memcmp(back.data(), back_want.data(), n * sizeof(float)));
    }
  }
}

TEST_P(Kernels, attention_over_odd_sizes_matches_scalar_and_float64) {
  uint32_t seed = 1;
  for (Dtype dtype : {Dtype::f16, Dtype::bf16, Dtype::q8})
    for (uint32_t d : {64u, 128u, 256u})
      for (uint32_t B : {16u, 32u, 64u})
        for (uint32_t G : {1u, 3u, 4u, 5u, 8u, 37u})  // 37: more heads than one VNNI pass
          for (uint64_t tokens : {1u, 3u, 7u, 17u, 200u}) {
            const Pages pages(tokens, B, d, dtype, ++seed);
            const auto q = test::random_floats(std::size_t{G} * d, ++seed);
            const auto got = pages.attend(k(), q, G, nullptr);
            const auto scalar = pages.attend(simd::scalar_kernels(), q, G, nullptr);
            const auto ref = pages.reference(q, G, nullptr);
            SCOPED_TRACE(testing::Message() << "d=" << d << " B=" << B << " G=" << G
                                            << " tokens=" << tokens << " dtype=" << int(dtype));
            if (test::attends_with_integer_products(GetParam(), dtype)) {
              expect_within_integer_bounds(pages, got, q, G, nullptr);
              continue;
            }
            // Same stored inputs: only float32 arithmetic order differs.
            EXPECT_LT(test::relative_error(got.data(), scalar.data(), got.size()), 1e-5);
            EXPECT_LT(test::relative_error(got.data(), ref.data(), got.size()), 1e-5);
          }
}

TEST_P(Kernels, explicit_page_lists_attend_only_the_listed_pages) {
  for (Dtype dtype : {Dtype::f16, Dtype::q8}) {
    const Pages pages(16 * 9 + 5, 16, 128, dtype, 77);
    const std::vector<uint32_t> lists[] = {{0}, {9}, {0, 2, 9}, {1, 3, 4, 5, 8}};
    for (const auto& list : lists) {
      const auto q = test::random_floats(4 * 128, 78);
      const auto got = pages.attend(k(), q, 4, &list);
      if (test::attends_with_integer_products(GetParam(), dtype)) {
        expect_within_integer_bounds(pages, got, q, 4, &list);
        continue;
      }
      const auto ref = pages.reference(q, 4, &list);
      EXPECT_LT(test::relative_error(got.data(), ref.data(), got.size()), 1e-5);
    }
  }
}

TEST_P(Kernels, q8_attention_ignores_what_the_unused_rows_of_a_partial_page_hold) {
  for (uint32_t B : {16u, 64u}) {
    Pages pages(3 * B + 5, B, 128, Dtype::q8, 31 + B);
    const auto q = test::random_floats(4 * 128, 32);
    const auto clean = pages.attend(k(), q, 4, nullptr);
    std::byte* last = pages.layout.slot(pages.pool.data(), pages.table.back());
    for (uint32_t t = 5; t < B; ++t) {  // stale codes and scales that are not numbers
      std::memset(pages.layout.key_codes(last, t), 0x7f, 128);
      std::memset(pages.layout.value_codes(last, t), 0x81, 128);
      pages.layout.key_scales(last)[t] = std::numeric_limits<float>::quiet_NaN();
      pages.layout.value_scales(last)[t] = std::numeric_limits<float>::infinity();
    }
    const auto dirty = pages.attend(k(), q, 4, nullptr);
    EXPECT_EQ(0, std::memcmp(clean.data(), dirty.data(), clean.size() * sizeof(float)))
        << "B=" << B;
  }
}

TEST_P(Kernels, q8_rows_round_trip_within_half_a_scale) {
  const simd::PageLayout layout{16, 128, Dtype::q8};
  AlignedVector<std::byte> slot(layout.slot_bytes());
  for (float spread : {1e-30f, 1e-3f, 1.0f, 3e4f, 1e38f}) {
    auto x =
        test::random_floats(16 * 128, 900 + static_cast<uint32_t>(std::log2(spread) + 200), spread);
    std::fill_n(x.begin() + 3 * 128, 128, 0.0f);  // a zero row: scale 0, zero codes
    x[5 * 128 + 7] = 2.0f * spread;               // the row's absmax is exactly a code
    for (simd::SlotPart part : {simd::SlotPart::key, simd::SlotPart::value}) {
      simd::store_rows(k(), layout, slot.data(), part, 0, 16, x.data(), 128);
      std::vector<float> back(16 * 128);
      simd::load_rows(k(), layout, slot.data(), part, 0, 16, back.data());
      const float* scales = part == simd::SlotPart::key ? layout.key_scales(slot.data())
                                                        : layout.value_scales(slot.data());
      for (uint32_t t = 0; t < 16; ++t) {
        float absmax = 0.0f;
        for (uint32_t c = 0; c < 128; ++c) absmax = std::max(absmax, std::fabs(x[t * 128 + c]));
        ASSERT_EQ(scales[t], absmax / 127.0f) << "spread=" << spread << " t=" << t;
        for (uint32_t c = 0; c < 128; ++c) {
          const double err = std::fabs(double(x[t * 128 + c]) - back[t * 128 + c]);
          // Half a scale from rounding the code, and one float32 rounding of scale * code.
          ASSERT_LE(err, 0.5 * scales[t] + 0x1p-24 * std::fabs(back[t * 128 + c]))
              << "spread=" << spread << " t=" << t << " c=" << c;
        }
      }
    }
  }
}

// The q8 kernel's two errors at the Llama-3.1-8B head shape (d 128, G 4, pages of 16, 4099
// tokens: a partial last page; uniform keys in [-2, 2], values in [-1, 1]), as relative L2 errors
// (test::relative_error) of the 4 heads' outputs, measured on the dev box (the test records them
// as properties: --gtest_output=xml):
//   against float64 attention over the dequantized stored values, the kernel's own float32
//     error: 1.2e-6 on avx2/avx512, 2.5e-6 on scalar (one serial sum per dot); on avx512_vnni,
//     whose kernel rounds the query to 15 bits and each page's weights to u8 (simd/x86/
//     attend_avx512_vnni.cpp), 1.4e-3: 1.3e-4 from the query, the rest from the weights;
//   against float64 attention over the float32 inputs given to the store, the int8 quantization
//     error: 1.6e-2 on every level; the same inputs stored as fp16 err by 8.8e-4.
TEST_P(Kernels, q8_attention_errors_against_the_stored_and_the_original_values) {
  const uint32_t G = 4, d = 128;
  const Pages pages(4099, 16, d, Dtype::q8, 4242);
  const auto q = test::random_floats(std::size_t{G} * d, 4243, 2.0f);
  const auto got = pages.attend(k(), q, G, nullptr);
  const double own =
      test::relative_error(got.data(), pages.reference(q, G, nullptr).data(), got.size());
  const double quantization = test::relative_error(
      got.data(), pages.reference(q, G, nullptr, /*stored=*/false).data(), got.size());
  const Pages half(4099, 16, d, Dtype::f16, 4242);  // the same inputs in fp16
  const auto got_f16 = half.attend(k(), q, G, nullptr);
  const double f16_error = test::relative_error(
      got_f16.data(), half.reference(q, G, nullptr, /*stored=*/false).data(), got_f16.size());
  RecordProperty("kernel_error", testing::PrintToString(own));
  RecordProperty("quantization_error", testing::PrintToString(quantization));
  RecordProperty("f16_storage_error", testing::PrintToString(f16_error));
  const bool integer = test::attends_with_integer_products(GetParam(), Dtype::q8);
  EXPECT_LT(own, integer ? 3e-3 : 2e-5);
  EXPECT_LT(quantization, 5e-2);
  EXPECT_GT(quantization, (integer ? 5 : 10) * own);  // int8 storage, not the kernel, dominates
  EXPECT_GT(quantization, f16_error);
}

TEST_P(Kernels, exp_sum_matches_float64_over_odd_sizes) {
  for (std::size_t n : {1u, 3u, 7u, 17u, 255u, 256u, 257u, 1000u}) {
    auto x = test::random_floats(n, 300 + static_cast<uint32_t>(n), 30.0f);
    if (n > 2) {
      x[0] = -std::numeric_limits<float>::infinity();  // mass 0
      x[1] = -200.0f;                                  // underflows to 0
    }
    const float shift = *std::max_element(x.begin(), x.end());
    std::vector<float> out(n + 1, -1.0f);
    const double sum = k().exp_sum(x.data(), shift, out.data(), n);
    double want_sum = 0.0;
    for (std::size_t i = 0; i < n; ++i) {
      const double want = std::exp(double(x[i] - shift));  // the kernel subtracts in float32
      want_sum += want;
      EXPECT_NEAR(out[i], want, 4e-7 * want + 1e-30) << "n=" << n << " i=" << i;
    }
    EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum) << "n=" << n;
    EXPECT_EQ(out[n], -1.0f) << "n=" << n << ": written past the end";
  }
}

// Every level of the build, the VNNI variant of avx512 included (its own table).
INSTANTIATE_TEST_SUITE_P(AllIsas, Kernels, ::testing::ValuesIn(simd::kLevels), isa_test_name);

TEST_P(Kernels, bf16_matrix_vector_products_match_float64_for_every_batch) {
  for (std::size_t cols : {16u, 64u, 576u, 1536u}) {
    const std::size_t rows = 37, y_stride = 41;
    const auto wf = test::random_floats(rows * cols, 7 + static_cast<uint32_t>(cols));
    const auto x = test::random_floats(simd::kMaxVectors * cols, 8);
    std::vector<uint16_t> w(wf.size());
    simd::scalar_kernels().encode(wf.data(), w.data(), w.size(), Dtype::bf16);
    std::vector<float> one(rows);
    k().matvec_bf16(w.data(), rows, cols, x.data(), 1, one.data(), rows);
    for (std::size_t n = 1; n <= simd::kMaxVectors; ++n) {
      std::vector<float> y(n * y_stride, -1.0f);
      k().matvec_bf16(w.data(), rows, cols, x.data(), n, y.data(), y_stride);
      for (std::size_t m = 0; m < n; ++m) {
        std::vector<double> want(rows, 0.0);
        for (std::size_t r = 0; r < rows; ++r)
          for (std::size_t c = 0; c < cols; ++c)
            want[r] += double(simd::bf16_to_f32(w[r * cols + c])) * x[m * cols + c];
        EXPECT_LT(test::relative_error(y.data() + m * y_stride, want.data(), rows), 1e-6)
            << "cols=" << cols << " n=" << n << " m=" << m;
      }
      // The first vector's sums do not depend on how many vectors ride along.
      EXPECT_EQ(0, std::memcmp(y.data(), one.data(), rows * sizeof(float))) << "n=" << n;
    }
  }
}

// gemm_f32 against a float64 product, both layouts of B, odd sizes (none a multiple of any level's
// vector width or tile), depths beyond one packed panel of every level (AVX-512 128, AVX2 512,
// scalar 2048 rows of k), row strides wider than a row, and C's padding left alone. Tolerance: a
// chain of k fused multiply-adds in float32 is within about k u sum |a b| of the exact sum
// (u = 2^-24), about (k + 1) u when multiply and add round separately (the scalar level); the test
// allows 2 k u sum |a b|, while a wrong or missing term costs about |a b|.
TEST_P(Kernels, f32_products_match_float64_for_odd_sizes_and_both_layouts) {
  const float sentinel = -7.0f;
  uint32_t seed = 100;
  auto check = [&](std::size_t m, std::size_t depth, std::size_t n, simd::GemmB layout) {
    const std::size_t lda = depth + 3, ldc = n + 5;
    const std::size_t ldb = (layout == simd::GemmB::k_by_n ? n : depth) + 2;
    const auto a = test::random_floats(m * lda, ++seed);
    const auto b = test::random_floats((layout == simd::GemmB::k_by_n ? depth : n) * ldb, ++seed);
    std::vector<float> c(m * ldc, sentinel);
    const simd::GemmJob job{a.data(), lda, b.data(), ldb, layout, c.data(), ldc, m, depth, n};
    k().gemm_f32(job);
    auto b_at = [&](std::size_t kk, std::size_t j) {
      return layout == simd::GemmB::k_by_n ? b[kk * ldb + j] : b[j * ldb + kk];
    };
    const std::string where = "m=" + std::to_string(m) + " k=" + std::to_string(depth) +
                              " n=" + std::to_string(n) +
                              (layout == simd::GemmB::k_by_n ? " k_by_n" : " n_by_k");
    for (std::size_t i = 0; i < m; ++i) {
      for (std::size_t j = 0; j < n; ++j) {
        double want = 0.0, magnitude = 0.0;
        for (std::size_t kk = 0; kk < depth; ++kk) {
          want += double(a[i * lda + kk]) * b_at(kk, j);
          magnitude += std::fabs(double(a[i * lda + kk]) * b_at(kk, j));
        }
        ASSERT_NEAR(c[i * ldc + j], want, 2.0 * double(depth) * 0x1p-24 * magnitude)
            << where << " at " << i << "," << j;
      }
      for (std::size_t j = n; j < ldc; ++j)
        ASSERT_EQ(c[i * ldc + j], sentinel) << where << ": written past row " << i;
    }
    // Rows computed in two parts, as a thread pool splits them, give the same bits.
    if (m > 1) {
      std::vector<float> parts(c.size(), sentinel);
      const std::size_t first = m / 2 + 1;
      simd::GemmJob top = job, bottom = job;
      top.c = parts.data();
      top.m = first;
      bottom.a = a.data() + first * lda;
      bottom.c = parts.data() + first * ldc;
      bottom.m = m - first;
      k().gemm_f32(top);
      k().gemm_f32(bottom);
      ASSERT_EQ(0, std::memcmp(parts.data(), c.data(), c.size() * sizeof(float))) << where;
    }
  };
  for (const simd::GemmB layout : {simd::GemmB::k_by_n, simd::GemmB::n_by_k}) {
    for (std::size_t m : {1u, 3u, 17u, 64u, 129u})
      for (std::size_t depth : {1u, 3u, 17u, 64u, 129u, 600u})
        for (std::size_t n : {1u, 3u, 17u, 64u, 129u}) check(m, depth, n, layout);
    check(7, 2100, 33, layout);  // deeper than the scalar level's panel
    check(2, 0, 5, layout);      // an empty sum: C = 0
  }
}
