// Dequantization against blocks built by hand from the layouts in docs/eval.md (ggml block
// layouts).
// Expected values come from the chosen quantized values and scales, never from the code under
// test; scales are powers of two (or a noted fp16 value) so every expected float is exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "lib/core/error.hpp"
#include "lib/core/thread_pool.hpp"
#include "lib/model/dequantize.hpp"
#include "lib/model/llama_weights.hpp"
#include "simd/quant.hpp"

using namespace kvsift;
using namespace kvsift::model;

namespace {

// IEEE binary16 bit patterns.
constexpr uint16_t kHalfOne = 0x3c00;
constexpr uint16_t kHalfHalf = 0x3800;             // 0.5
constexpr uint16_t kHalfQuarter = 0x3400;          // 0.25
constexpr uint16_t kHalfMinusQuarter = 0xb400;     // -0.25
constexpr uint16_t kHalfMinusOneAndHalf = 0xbe00;  // -1.5
constexpr uint16_t kHalfMinusTwo = 0xc000;
// 0x2e66: exponent 11 - 15 = -4, mantissa 614/1024: (1 + 614/1024) / 16 = 0.0999755859375.
constexpr uint16_t kHalfTenth = 0x2e66;
constexpr float kTenth = 0.0999755859375f;

void put_half(std::vector<uint8_t>& bytes, std::size_t at, uint16_t h) {
  bytes[at] = static_cast<uint8_t>(h & 0xff);
  bytes[at + 1] = static_cast<uint8_t>(h >> 8);
}

std::vector<float> run(GgmlType type, const std::vector<uint8_t>& bytes, std::size_t n) {
  std::vector<float> out(n, -12345.0f);
  dequantize(type, bytes.data(), out.data(), n);
  return out;
}

}  // namespace

TEST(Dequantize, block_sizes_match_the_ggml_layouts) {
  EXPECT_EQ(block_elements(GgmlType::f32), 1u);
  EXPECT_EQ(block_bytes(GgmlType::f32), 4u);
  EXPECT_EQ(block_bytes(GgmlType::f16), 2u);
  EXPECT_EQ(block_bytes(GgmlType::bf16), 2u);
  EXPECT_EQ(block_elements(GgmlType::q4_0), 32u);
  EXPECT_EQ(block_bytes(GgmlType::q4_0), 18u);
  EXPECT_EQ(block_bytes(GgmlType::q4_1), 20u);
  EXPECT_EQ(block_bytes(GgmlType::q8_0), 34u);
  EXPECT_EQ(block_elements(GgmlType::q4_k), 256u);
  EXPECT_EQ(block_bytes(GgmlType::q4_k), 144u);
  EXPECT_EQ(block_elements(GgmlType::q6_k), 256u);
  EXPECT_EQ(block_bytes(GgmlType::q6_k), 210u);
  EXPECT_FALSE(is_supported(static_cast<GgmlType>(6)));  // q5_0
  EXPECT_EQ(block_elements(static_cast<GgmlType>(6)), 0u);
}

TEST(Dequantize, row_bytes_counts_whole_blocks_and_rejects_partial_ones) {
  EXPECT_EQ(row_bytes(GgmlType::q4_1, 576), 18u * 20u);
  EXPECT_EQ(row_bytes(GgmlType::q8_0, 576), 18u * 34u);
  EXPECT_EQ(row_bytes(GgmlType::f32, 576), 2304u);
  EXPECT_EQ(row_bytes(GgmlType::q6_k, 512), 420u);
  try {
    row_bytes(GgmlType::q4_k, 576);
    FAIL() << "576 is not a whole number of 256-element blocks";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::invalid_file);
    EXPECT_NE(std::string(e.what()).find("q4_K blocks of 256"), std::string::npos) << e.what();
  }
  try {
    row_bytes(static_cast<GgmlType>(13), 256);
    FAIL() << "q5_K is not supported";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::invalid_file);
    EXPECT_NE(std::string(e.what()).find("q5_K"), std::string::npos) << e.what();
  }
}

TEST(Dequantize, f32_is_copied_as_is) {
  const std::array<float, 3> values{1.5f, -0.0f, std::numeric_limits<float>::infinity()};
  std::vector<uint8_t> bytes(sizeof values);
  std::memcpy(bytes.data(), values.data(), sizeof values);
  const auto out = run(GgmlType::f32, bytes, 3);
  EXPECT_EQ(out[0], 1.5f);
  EXPECT_TRUE(std::signbit(out[1]));
  EXPECT_EQ(out[2], std::numeric_limits<float>::infinity());
}

TEST(Dequantize, f16_converts_normals_subnormals_and_specials) {
  const std::array<uint16_t, 6> halves{kHalfOne, kHalfMinusTwo, 0x0001, 0x7bff, 0x8000, 0x7c00};
  std::vector<uint8_t> bytes(2 * halves.size());
  for (std::size_t i = 0; i < halves.size(); ++i) put_half(bytes, 2 * i, halves[i]);
  const auto out = run(GgmlType::f16, bytes, halves.size());
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -2.0f);
  EXPECT_EQ(out[2], 0x1p-24f);  // smallest subnormal
  EXPECT_EQ(out[3], 65504.0f);  // largest finite
  EXPECT_EQ(out[4], 0.0f);
  EXPECT_TRUE(std::signbit(out[4]));
  EXPECT_EQ(out[5], std::numeric_limits<float>::infinity());
}

TEST(Dequantize, bf16_is_the_top_half_of_a_float) {
  // 0x3f80 -> 0x3f800000 = 1; 0xc040 -> 0xc0400000 = -3; 0x4049 -> 0x40490000 = 3.140625.
  const std::vector<uint8_t> bytes{0x80, 0x3f, 0x40, 0xc0, 0x49, 0x40};
  const auto out = run(GgmlType::bf16, bytes, 3);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], -3.0f);
  EXPECT_EQ(out[2], 3.140625f);
}

TEST(Dequantize, q8_0_scales_signed_bytes_by_d) {
  std::vector<uint8_t> bytes(34);
  put_half(bytes, 0, kHalfHalf);
  const std::array<int8_t, 32> q{-128, -1,  0,   1,   127, 2,  -2, 64, 100, -100, 5,
                                 6,    7,   8,   9,   10,  11, 12, 13, 14,  15,   16,
                                 -17,  -18, -19, -20, 21,  22, 23, 24, 25,  26};
  std::memcpy(bytes.data() + 2, q.data(), 32);
  const auto out = run(GgmlType::q8_0, bytes, 32);
  EXPECT_EQ(out[0], -64.0f);
  EXPECT_EQ(out[1], -0.5f);
  EXPECT_EQ(out[2], 0.0f);
  EXPECT_EQ(out[4], 63.5f);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(out[j], 0.5f * q[j]) << j;
}

TEST(Dequantize, q8_0_reads_an_fp16_scale_with_a_fraction_and_a_negative_one) {
  std::vector<uint8_t> bytes(2 * 34, 0);
  put_half(bytes, 0, kHalfTenth);
  bytes[2] = 10;
  bytes[3] = 0xf6;  // -10
  put_half(bytes, 34, kHalfMinusQuarter);
  bytes[36] = 4;
  bytes[67] = 0x80;  // -128, last element of block 2
  const auto out = run(GgmlType::q8_0, bytes, 64);
  EXPECT_EQ(out[0], 10 * kTenth);
  EXPECT_EQ(out[1], -10 * kTenth);
  EXPECT_EQ(out[32], -1.0f);
  EXPECT_EQ(out[63], 32.0f);
  EXPECT_EQ(out[33], 0.0f);
}

TEST(Dequantize, q4_0_puts_low_nibbles_first_and_subtracts_8) {
  std::vector<uint8_t> bytes(18);
  put_half(bytes, 0, kHalfMinusQuarter);
  for (int j = 0; j < 16; ++j) bytes[2 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  const auto out = run(GgmlType::q4_0, bytes, 32);
  EXPECT_EQ(out[0], 2.0f);     // q 0: -0.25 * (0 - 8)
  EXPECT_EQ(out[15], -1.75f);  // q 15: -0.25 * 7
  EXPECT_EQ(out[16], -1.75f);  // high nibble of qs[0] is 15
  EXPECT_EQ(out[31], 2.0f);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[j], -0.25f * (j - 8)) << j;
    EXPECT_EQ(out[j + 16], -0.25f * (15 - j - 8)) << j;
  }
}

TEST(Dequantize, q4_1_adds_the_min_to_scaled_nibbles) {
  std::vector<uint8_t> bytes(2 * 20);
  put_half(bytes, 0, kHalfHalf);
  put_half(bytes, 2, kHalfMinusOneAndHalf);
  for (int j = 0; j < 16; ++j) bytes[4 + j] = static_cast<uint8_t>(j | ((15 - j) << 4));
  put_half(bytes, 20, kHalfTenth);  // second block: d with a fraction, m = 0
  bytes[24] = 0xa3;                 // element 0: 3, element 16: 10
  const auto out = run(GgmlType::q4_1, bytes, 64);
  EXPECT_EQ(out[0], -1.5f);
  EXPECT_EQ(out[15], 6.0f);  // 0.5 * 15 - 1.5
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out[j], 0.5f * j - 1.5f) << j;
    EXPECT_EQ(out[j + 16], 0.5f * (15 - j) - 1.5f) << j;
  }
  EXPECT_EQ(out[32], 3 * kTenth);
  EXPECT_EQ(out[48], 10 * kTenth);
  EXPECT_EQ(out[33], 0.0f);
}

namespace {

// Scales and mins of the 8 sub-blocks; sub-blocks 4..7 have values >= 16 so their top two bits,
// which live in bytes 0..7, matter.
constexpr std::array<int, 8> kQ4KScales{10, 20, 30, 40, 50, 60, 33, 17};
constexpr std::array<int, 8> kQ4KMins{1, 63, 0, 32, 45, 16, 2, 59};
// Packed by hand from the rule in eval-data.md 2.4:
//   s[j]   = sc_j | (sc_{j+4} >> 4) << 6          j = 0..3
//   s[j+4] = mn_j | (mn_{j+4} >> 4) << 6          j = 0..3
//   s[j+4] = (sc_j & 15) | (mn_j & 15) << 4       j = 4..7
// s[0] = 10 | 3<<6 = 0xca   s[1] = 20 | 3<<6 = 0xd4   s[2] = 30 | 2<<6 = 0x9e   s[3] = 40 | 1<<6 =
// 0x68 s[4] =  1 | 2<<6 = 0x81   s[5] = 63 | 1<<6 = 0x7f   s[6] =  0 | 0<<6 = 0x00   s[7] = 32 |
// 3<<6 = 0xe0 s[8] = 2 | 13<<4 = 0xd2   s[9] = 12 | 0<<4 = 0x0c   s[10] = 1 | 2<<4 = 0x21   s[11] =
// 1 | 11<<4 = 0xb1
constexpr std::array<uint8_t, 12> kQ4KPacked{0xca, 0xd4, 0x9e, 0x68, 0x81, 0x7f,
                                             0x00, 0xe0, 0xd2, 0x0c, 0x21, 0xb1};

}  // namespace

TEST(Dequantize, q4_k_unpacks_6_bit_scales_and_mins_of_all_8_sub_blocks) {
  std::vector<uint8_t> bytes(144);
  put_half(bytes, 0, kHalfHalf);     // d
  put_half(bytes, 2, kHalfQuarter);  // dmin
  std::memcpy(bytes.data() + 4, kQ4KPacked.data(), 12);
  // Chunk c (qs[32c..32c+31]): low nibble l % 16 (sub-block 2c), high nibble 15 - l % 16 (2c+1).
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l)
      bytes[16 + 32 * c + l] = static_cast<uint8_t>((l % 16) | ((15 - l % 16) << 4));
  const auto out = run(GgmlType::q4_k, bytes, 256);
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      const int low = 2 * c, high = 2 * c + 1;
      EXPECT_EQ(out[64 * c + l], 0.5f * kQ4KScales[low] * (l % 16) - 0.25f * kQ4KMins[low])
          << "chunk " << c << " l " << l;
      EXPECT_EQ(out[64 * c + 32 + l],
                0.5f * kQ4KScales[high] * (15 - l % 16) - 0.25f * kQ4KMins[high])
          << "chunk " << c << " l " << l;
    }
  }
  // Spot checks worked out fully: sub-block 0, q 1: 0.5*10*1 - 0.25*1 = 4.75.
  EXPECT_EQ(out[1], 4.75f);
  // Sub-block 4 (j >= 4: sc 50, mn 45), q 0: -11.25; sub-block 7 (sc 17, mn 59), q 15 at
  // element 224: 0.5*17*15 - 0.25*59 = 127.5 - 14.75 = 112.75.
  EXPECT_EQ(out[128], -11.25f);
  EXPECT_EQ(out[224], 112.75f);
}

TEST(Dequantize, q4_k_honours_negative_d_and_fp16_fractions) {
  std::vector<uint8_t> bytes(144, 0);
  put_half(bytes, 0, kHalfMinusTwo);  // d
  put_half(bytes, 2, kHalfTenth);     // dmin
  bytes[4] = 3;                       // sc_0 = 3
  bytes[8] = 5;                       // mn_0 = 5
  bytes[16] = 0x07;                   // element 0: q 7; element 32 (sub-block 1, sc 0): q 0
  const auto out = run(GgmlType::q4_k, bytes, 256);
  EXPECT_EQ(out[0], -2.0f * 3 * 7 - kTenth * 5);
  EXPECT_EQ(out[1], -kTenth * 5);
  EXPECT_EQ(out[32], 0.0f);
}

namespace {

// Packs 256 values in 0..63 into Q6_K's ql/qh, written from the rule in eval-data.md 2.4
// (the inverse direction of the code under test).
void pack_q6_k(const std::array<int, 256>& q, std::vector<uint8_t>& bytes) {
  for (int half = 0; half < 2; ++half) {
    uint8_t* ql = bytes.data() + 64 * half;
    uint8_t* qh = bytes.data() + 128 + 32 * half;
    const int* v = q.data() + 128 * half;
    for (int l = 0; l < 32; ++l) {
      ql[l] = static_cast<uint8_t>((v[l] & 15) | (v[l + 64] & 15) << 4);
      ql[l + 32] = static_cast<uint8_t>((v[l + 32] & 15) | (v[l + 96] & 15) << 4);
      qh[l] = static_cast<uint8_t>((v[l] >> 4) | (v[l + 32] >> 4) << 2 | (v[l + 64] >> 4) << 4 |
                                   (v[l + 96] >> 4) << 6);
    }
  }
}

// A Q4_0 weight the loader repacked to q4_0x16 (Linear, lib/model/llama_weights.hpp) reads back
// row by row as the file's rows: the groups of 16 and the plain rows after them.
TEST(Dequantize, q4_0x16_rows_read_back_as_the_files_q4_0_rows) {
  const std::size_t rows = 37, cols = 96, row_bytes = cols / 32 * 18;
  std::vector<std::byte> file(rows * row_bytes), packed(rows * row_bytes);
  for (std::size_t i = 0; i < file.size(); ++i) file[i] = static_cast<std::byte>(i * 131 % 251);
  for (std::size_t b = 0; b < rows * cols / 32; ++b) {  // finite fp16 scales
    file[b * 18] = std::byte{0x00};
    file[b * 18 + 1] = static_cast<std::byte>(0x20 + b % 16);
  }
  simd::repack_q4_0x16(file.data(), rows, cols, packed.data());
  const BlockRows part{packed.data(), rows, row_bytes, simd::BlockFormat::q4_0x16, GgmlType::q4_0};
  std::vector<float> want(cols), got(cols);
  for (std::size_t r = 0; r < rows; ++r) {
    dequantize(GgmlType::q4_0, file.data() + r * row_bytes, want.data(), cols);
    dequantize_row(part, r, cols, got.data());
    EXPECT_EQ(got, want) << "row " << r;
  }
}

// The runner's split of a product's rows: every row once, each chunk starting at a multiple of
// 16 (never inside a q4_0x16 group).
TEST(Dequantize, row_groups_cover_every_row_once_from_multiples_of_16) {
  ThreadPool pool(2);
  for (uint64_t rows : {1u, 16u, 37u, 1024u, 4100u}) {
    std::vector<int> seen(rows, 0);
    std::atomic<bool> aligned{true};
    parallel_row_groups(pool, rows, [&](uint64_t first, uint64_t last, int) noexcept {
      if (first % 16 != 0 || first >= last) aligned = false;
      for (uint64_t r = first; r < last; ++r) ++seen[r];  // chunks are disjoint: no race
    });
    EXPECT_TRUE(aligned) << rows;
    EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), static_cast<std::ptrdiff_t>(rows)) << rows;
  }
}

}  // namespace

TEST(Dequantize, q6_k_combines_ql_and_qh_and_uses_signed_scales) {
  std::array<int, 256> q{};
  for (int i = 0; i < 256; ++i) q[i] = (i * 37 + 11) % 64;
  const std::array<int8_t, 16> scales{1, -1, 2, -2, 3, -3, 4, -4, 127, -128, 5, -5, 6, -6, 7, -7};
  std::vector<uint8_t> bytes(210, 0);
  pack_q6_k(q, bytes);
  std::memcpy(bytes.data() + 192, scales.data(), 16);
  put_half(bytes, 208, kHalfQuarter);
  const auto out = run(GgmlType::q6_k, bytes, 256);
  for (int i = 0; i < 256; ++i) {
    // Element i sits in half i / 128, quarter k = (i % 128) / 32, row l = i % 32; its scale is
    // scales[8 * half + l / 16 + 2 * k], i.e. one scale per 16 consecutive elements.
    EXPECT_EQ(out[i], 0.25f * scales[i / 16] * (q[i] - 32)) << i;
  }
}

TEST(Dequantize, q6_k_reads_each_bit_field_from_its_documented_place) {
  std::vector<uint8_t> bytes(210, 0);
  for (int s = 0; s < 16; ++s) bytes[192 + s] = 1;  // every scale 1
  put_half(bytes, 208, kHalfOne);
  bytes[0] = 0x5f;          // ql[0]: low 15 -> element 0, high 5 -> element 64
  bytes[32] = 0x9c;         // ql[32]: low 12 -> element 32, high 9 -> element 96
  bytes[128] = 0b11100100;  // qh[0]: bits 0-1 = 0 (el. 0), 2-3 = 1 (32), 4-5 = 2 (64), 6-7 = 3 (96)
  bytes[64 + 1] = 0x21;     // second half, ql[1]: element 129 low 1, element 193 high 2
  bytes[128 + 32 + 1] = 0x30;  // second half, qh[1]: bits 4-5 = 3 -> element 193 gets +48
  bytes[192 + 15] = 0xfe;      // scales[15] = -2: elements 240..255
  const auto out = run(GgmlType::q6_k, bytes, 256);
  EXPECT_EQ(out[0], 15.0f - 32);
  EXPECT_EQ(out[32], 12.0f + 16 - 32);
  EXPECT_EQ(out[64], 5.0f + 32 - 32);
  EXPECT_EQ(out[96], 9.0f + 48 - 32);
  EXPECT_EQ(out[129], 1.0f - 32);
  EXPECT_EQ(out[193], 2.0f + 48 - 32);
  EXPECT_EQ(out[1], -32.0f);
  EXPECT_EQ(out[255], -2.0f * -32);  // q 0 - 32, scale -2
}

TEST(Dequantize, several_blocks_advance_through_the_input) {
  std::vector<uint8_t> bytes(3 * 210, 0);
  for (int b = 0; b < 3; ++b) {
    for (int s = 0; s < 16; ++s) bytes[210 * b + 192 + s] = static_cast<uint8_t>(b + 1);
    put_half(bytes, 210 * b + 208, kHalfHalf);
  }
  const auto out = run(GgmlType::q6_k, bytes, 768);
  EXPECT_EQ(out[0], 0.5f * 1 * -32);
  EXPECT_EQ(out[256], 0.5f * 2 * -32);
  EXPECT_EQ(out[767], 0.5f * 3 * -32);
}
