// The quantized-weight matvec (simd/kernels.hpp, matvec_quant) of every level this CPU has, and the
// activation quantizer (simd/quant.hpp), against float64 products of the dequantized weights.
//
// Tolerances, derived rather than tuned. Write x~ for the quantized activations (block scale s_b
// times codes q_i) and w_i for a dequantized weight.
//  1. Float32 rounding. The kernel's integer dot product of each block is exact (|lane| <= 4 * 128
//     * 127), so its only errors are float32 roundings: each block contributes one term (two for
//     Q4_1: the m term), a float32 scale (d * s_b, one rounding) times an exact integer (another),
//     and the terms are summed (FMAs into accumulators, then 16 lanes into one: at most
//     terms + 8 additions along any path). With u = 2^-24 and n terms, the error is below
//     (n + 10) * 2u * T, where T bounds the sum of the terms' magnitudes:
//     T = sum_b |d_b s_b| * sum_i c_i |q_i| (+ sum_b |m_b s_b| |sum_i q_i| for Q4_1), c_i the
//     magnitude of the weight code as the kernel multiplies it (|q| for Q8_0, nibble + 8 for Q4_0,
//     whose offset is subtracted in the integer lanes, the nibble for Q4_1).
//  2. Activation quantization. |x_i - x~_i| <= s_b / 2 (round to nearest; the float32 x / s_b
//     differs from the exact quotient by at most 127 * 2^-23 code units, covered by taking
//     0.50002 s_b), so |sum w_i x_i - sum w_i x~_i| <= sum_b 0.50002 s_b sum_{i in b} |w_i|.
// Each product is checked against sum w x~ within (1), which any slip in the layouts or the integer
// arithmetic exceeds by orders of magnitude, and against sum w x (the unquantized activations)
// within (1) + (2).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "lib/core/aligned.hpp"
#include "lib/model/dequantize.hpp"
#include "simd/half.hpp"
#include "simd/kernels.hpp"
#include "simd/quant.hpp"
#include "test_util.hpp"

using namespace kvsift;
using simd::BlockFormat;

namespace {

constexpr std::size_t kBlock = simd::kQuantBlock;

// A random [rows, cols] weight matrix in `format`, and its values and code magnitudes in float64.
struct Weights {
  BlockFormat format;
  std::size_t rows, cols;
  std::vector<std::byte> bytes;
  std::vector<double> value;     // [rows, cols] dequantized
  std::vector<double> code_mag;  // [rows, cols] c_i of the header comment
  std::vector<double> d, m;      // [rows, cols / 32] per block (m: Q4_1 only)

  // q4_0x16: the Q4_0 weights of the same seed, repacked (simd::repack_q4_0x16).
  Weights(BlockFormat stored, std::size_t n, std::size_t k, uint32_t seed)
      : format(stored), rows(n), cols(k), value(n * k), code_mag(n * k), d(n * k / kBlock),
        m(n * k / kBlock) {
    const BlockFormat f = stored == BlockFormat::q4_0x16 ? BlockFormat::q4_0 : stored;
    std::mt19937 rng(seed);
    std::normal_distribution<float> scale_dist(0.0f, 0.02f);
    std::uniform_int_distribution<int> byte_dist(0, 255);
    const std::size_t bb = simd::block_format_bytes(f);
    bytes.resize(n * k / kBlock * bb);
    for (std::size_t b = 0; b < n * k / kBlock; ++b) {
      std::byte* blk = bytes.data() + b * bb;
      const uint16_t d_bits = simd::f32_to_f16(scale_dist(rng));
      std::memcpy(blk, &d_bits, 2);
      d[b] = simd::f16_to_f32(d_bits);
      if (f == BlockFormat::q4_1) {
        const uint16_t m_bits = simd::f32_to_f16(8.0f * scale_dist(rng));
        std::memcpy(blk + 2, &m_bits, 2);
        m[b] = simd::f16_to_f32(m_bits);
      }
      const std::size_t codes = f == BlockFormat::q8_0 ? 2 : f == BlockFormat::q4_0 ? 2 : 4;
      for (std::size_t j = 0; j < bb - codes; ++j)
        blk[codes + j] = static_cast<std::byte>(byte_dist(rng));
      for (std::size_t i = 0; i < kBlock; ++i) {
        const std::size_t at = b * kBlock + i;
        const auto* qs = reinterpret_cast<const uint8_t*>(blk + codes);
        if (f == BlockFormat::q8_0) {
          const int q = static_cast<int8_t>(qs[i]);
          value[at] = d[b] * q;
          code_mag[at] = std::abs(q);
        } else {
          const int nib = i < 16 ? qs[i] & 0x0f : qs[i - 16] >> 4;
          value[at] = f == BlockFormat::q4_0 ? d[b] * (nib - 8) : d[b] * nib + m[b];
          code_mag[at] = f == BlockFormat::q4_0 ? nib + 8 : nib;
        }
      }
    }
    if (stored == BlockFormat::q4_0x16) {
      const std::vector<std::byte> rows_q4_0 = bytes;
      simd::repack_q4_0x16(rows_q4_0.data(), n, k, bytes.data());
    }
  }

  model::GgmlType ggml_type() const {
    return format == BlockFormat::q8_0   ? model::GgmlType::q8_0
           : format == BlockFormat::q4_1 ? model::GgmlType::q4_1
                                         : model::GgmlType::q4_0;
  }
};

// n_vectors vectors of cols values and their quantization.
struct Vectors {
  std::size_t n, cols;
  std::vector<float> x;
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> sum;

  Vectors(std::size_t n_vectors, std::size_t k, uint32_t seed)
      : n(n_vectors), cols(k), x(test::random_floats(n_vectors * k, seed)), q(n_vectors * k),
        scale(n_vectors * k / kBlock), sum(n_vectors * k / kBlock) {
    for (std::size_t i = 0; i < x.size(); i += 97) x[i] *= 8.0f;  // outliers, as activations have
    simd::quantize_vectors(x.data(), n, cols, q.data(), scale.data(), sum.data());
  }
  simd::QuantizedVectors view() const { return {q.data(), scale.data(), sum.data()}; }
};

struct Shape {
  BlockFormat format;
  std::size_t rows, cols, n_vectors;
};

const char* format_name(BlockFormat f) {
  switch (f) {
    case BlockFormat::q8_0: return "q8_0";
    case BlockFormat::q4_0: return "q4_0";
    case BlockFormat::q4_1: return "q4_1";
    case BlockFormat::q4_0x16: return "q4_0x16";
  }
  return "?";
}

constexpr BlockFormat kFormats[] = {BlockFormat::q8_0, BlockFormat::q4_0, BlockFormat::q4_1,
                                    BlockFormat::q4_0x16};

class QuantKernels : public test::IsaTest {};

TEST_P(QuantKernels, matvec_matches_float64_within_the_derived_bounds) {
  uint32_t seed = 1000;
  for (BlockFormat format : kFormats)
    for (std::size_t cols : {32u, 96u, 576u, 1536u})
      for (std::size_t rows : {1u, 7u, 32u, 129u})  // q4_0x16: no group, 2 groups, 8 and a row
        for (std::size_t n_vectors : {1u, 3u}) {
          SCOPED_TRACE(testing::Message() << format_name(format) << " rows=" << rows
                                          << " cols=" << cols << " vectors=" << n_vectors);
          const Weights w(format, rows, cols, ++seed);
          const Vectors x(n_vectors, cols, ++seed);
          const std::size_t stride = rows + 3;  // y rows apart, as the runner's outputs are
          std::vector<float> y(n_vectors * stride, -1.0f);
          k().matvec_quant(format, w.bytes.data(), rows, cols, x.view(), n_vectors, y.data(),
                           stride);
          const std::size_t blocks = cols / kBlock;
          for (std::size_t m = 0; m < n_vectors; ++m)
            for (std::size_t r = 0; r < rows; ++r) {
              double exact_q = 0.0, exact = 0.0, terms = 0.0, quant_bound = 0.0;
              for (std::size_t b = 0; b < blocks; ++b) {
                const std::size_t wb = r * blocks + b, xb = m * blocks + b;
                const double s = x.scale[xb];
                double mag = 0.0, w_abs = 0.0;
                for (std::size_t i = 0; i < kBlock; ++i) {
                  const std::size_t wi = r * cols + b * kBlock + i, xi = m * cols + b * kBlock + i;
                  exact_q += w.value[wi] * (s * x.q[xi]);
                  exact += w.value[wi] * double(x.x[xi]);
                  mag += w.code_mag[wi] * std::abs(x.q[xi]);
                  w_abs += std::abs(w.value[wi]);
                }
                terms += std::abs(w.d[wb] * s) * mag;
                if (format == BlockFormat::q4_1) terms += std::abs(w.m[wb] * s * x.sum[xb]);
                quant_bound += 0.50002 * s * w_abs;
              }
              const double n_terms = format == BlockFormat::q4_1 ? 2.0 * blocks : blocks;
              const double float_bound = (n_terms + 10) * 2.0 * 0x1p-24 * terms;
              const float got = y[m * stride + r];
              EXPECT_LE(std::abs(got - exact_q), float_bound) << "row " << r << " vector " << m;
              EXPECT_LE(std::abs(got - exact), float_bound + quant_bound)
                  << "row " << r << " vector " << m;
            }
          for (std::size_t m = 0; m < n_vectors; ++m)  // the gaps between y's rows are untouched
            for (std::size_t r = rows; r < stride; ++r) EXPECT_EQ(y[m * stride + r], -1.0f);
        }
}

TEST_P(QuantKernels, each_vector_sums_the_same_whatever_the_batch) {
  for (BlockFormat format : kFormats) {
    const std::size_t rows = 23, cols = 576, n = 5;
    const Weights w(format, rows, cols, 77);
    const Vectors x(n, cols, 78);
    std::vector<float> together(n * rows);
    k().matvec_quant(format, w.bytes.data(), rows, cols, x.view(), n, together.data(), rows);
    for (std::size_t m = 0; m < n; ++m) {
      const simd::QuantizedVectors one{x.q.data() + m * cols, x.scale.data() + m * cols / kBlock,
                                       x.sum.data() + m * cols / kBlock};
      std::vector<float> alone(rows);
      k().matvec_quant(format, w.bytes.data(), rows, cols, one, 1, alone.data(), rows);
      for (std::size_t r = 0; r < rows; ++r)
        EXPECT_EQ(alone[r], together[m * rows + r]) << format_name(format) << " " << m << " " << r;
    }
  }
}

// The runner splits a projection's rows between threads (lib/model/cpu_forward_pass.cpp): a row's
// result is the same bit for bit whatever range of rows it is computed in, should a kernel take
// several rows at once. Split at 1, 3 and 5 (9 rows: any step of up to 8 rows is cut somewhere),
// with cols = 1088 (34 blocks: full and partial groups of 16 blocks). q4_0x16 splits at multiples
// of 16 rows (41 rows: 2 groups and 9 rows).
TEST_P(QuantKernels, each_row_sums_the_same_whatever_the_split) {
  for (BlockFormat format : kFormats) {
    const bool interleaved = format == BlockFormat::q4_0x16;
    const std::size_t rows = interleaved ? 41 : 9, cols = 1088, n = 2;
    const std::size_t row_bytes = cols / kBlock * simd::block_format_bytes(format);
    const Weights w(format, rows, cols, 91);
    const Vectors x(n, cols, 92);
    std::vector<float> whole(n * rows);
    k().matvec_quant(format, w.bytes.data(), rows, cols, x.view(), n, whole.data(), rows);
    for (std::size_t split :
         interleaved ? std::vector<std::size_t>{16, 32} : std::vector<std::size_t>{1, 3, 5}) {
      std::vector<float> parts(n * rows);
      k().matvec_quant(format, w.bytes.data(), split, cols, x.view(), n, parts.data(), rows);
      k().matvec_quant(format, w.bytes.data() + split * row_bytes, rows - split, cols, x.view(), n,
                       parts.data() + split, rows);
      for (std::size_t i = 0; i < n * rows; ++i)
        EXPECT_EQ(parts[i], whole[i]) << format_name(format) << " split " << split << " " << i;
    }
  }
}

// On the scalar level q4_0x16 is read back as Q4_0 and summed as Q4_0 (simd/quant_scalar.cpp):
// the same results bit for bit, whichever layout the rows are in.
TEST(QuantReference, scalar_q4_0x16_equals_scalar_q4_0) {
  const std::size_t rows = 37, cols = 1536, n = 2;
  const Weights plain(BlockFormat::q4_0, rows, cols, 31),
      packed(BlockFormat::q4_0x16, rows, cols, 31);
  const Vectors x(n, cols, 32);
  std::vector<float> a(n * rows), b(n * rows);
  const simd::Kernels& k = simd::scalar_kernels();
  k.matvec_quant(BlockFormat::q4_0, plain.bytes.data(), rows, cols, x.view(), n, a.data(), rows);
  k.matvec_quant(BlockFormat::q4_0x16, packed.bytes.data(), rows, cols, x.view(), n, b.data(),
                 rows);
  EXPECT_EQ(a, b);
}

// Every row of a repacked matrix reads back as the Q4_0 row it was (odd block counts, a group
// and a tail of rows).
TEST(QuantizeVectors, q4_0x16_rows_read_back_as_their_q4_0_rows) {
  for (std::size_t cols : {32u, 96u, 1088u}) {
    const std::size_t rows = 21, row_bytes = cols / kBlock * 18;
    const Weights plain(BlockFormat::q4_0, rows, cols, 41),
        packed(BlockFormat::q4_0x16, rows, cols, 41);
    ASSERT_EQ(packed.bytes.size(), plain.bytes.size());
    std::vector<std::byte> row(row_bytes);
    for (std::size_t r = 0; r < 16; ++r) {
      simd::q4_0x16_row(packed.bytes.data(), cols, r, row.data());
      EXPECT_EQ(std::memcmp(row.data(), plain.bytes.data() + r * row_bytes, row_bytes), 0) << r;
    }
    EXPECT_EQ(std::memcmp(packed.bytes.data() + 16 * row_bytes, plain.bytes.data() + 16 * row_bytes,
                          5 * row_bytes),
              0);
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, QuantKernels, ::testing::ValuesIn(simd::kLevels),
                         test::isa_test_name);

TEST(QuantizeVectors, codes_scales_and_sums_within_half_a_step) {
  const std::size_t n = 3, cols = 1536;
  Vectors v(n, cols, 5);
  for (std::size_t b = 0; b < n * cols / kBlock; ++b) {
    float amax = 0.0f;
    int32_t total = 0;
    for (std::size_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::abs(v.x[b * kBlock + i]));
    EXPECT_EQ(v.scale[b], amax / 127.0f);
    for (std::size_t i = 0; i < kBlock; ++i) {
      const std::size_t at = b * kBlock + i;
      EXPECT_LE(std::abs(int{v.q[at]}), 127);
      EXPECT_LE(std::abs(double(v.x[at]) - double(v.scale[b]) * v.q[at]), 0.50002 * v.scale[b]);
      total += v.q[at];
    }
    EXPECT_EQ(v.sum[b], total);
  }
  // An all-zero block: zero scale, zero codes (no division by zero).
  std::vector<float> zeros(kBlock, 0.0f);
  std::vector<int8_t> q(kBlock, 1);
  float scale = 1.0f;
  int32_t sum = 1;
  simd::quantize_vectors(zeros.data(), 1, kBlock, q.data(), &scale, &sum);
  EXPECT_EQ(scale, 0.0f);
  EXPECT_EQ(sum, 0);
  for (int8_t c : q) EXPECT_EQ(c, 0);
}

// The test's own reading of the block layouts agrees with the loader's (lib/model/dequantize.cpp)
// bit for bit: both read ggml's layouts, independently written.
TEST(QuantizeVectors, test_layouts_agree_with_the_loaders_dequantizer) {
  for (BlockFormat format : {BlockFormat::q8_0, BlockFormat::q4_0, BlockFormat::q4_1}) {
    const Weights w(format, 3, 96, 9);
    std::vector<float> out(3 * 96);
    model::dequantize(w.ggml_type(), w.bytes.data(), out.data(), out.size());
    for (std::size_t i = 0; i < out.size(); ++i)
      EXPECT_EQ(out[i], static_cast<float>(w.value[i])) << format_name(format) << " " << i;
  }
}

}  // namespace
