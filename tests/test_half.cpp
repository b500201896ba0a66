#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

#include "simd/half.hpp"

using namespace kvsift::simd;

TEST(Half, every_finite_half_round_trips_through_float) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto half = static_cast<uint16_t>(h);
    if ((half & 0x7c00) == 0x7c00) continue;  // inf and NaN
    ASSERT_EQ(f32_to_f16(f16_to_f32(half)), half) << std::hex << h;
  }
}

TEST(Half, known_values_convert_exactly) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);             // largest finite half
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);             // below the halfway point to 65536
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);             // halfway: ties to even = infinity
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);             // smallest subnormal
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);             // halfway to it: ties to even = zero
  EXPECT_EQ(f32_to_f16(0x1.8p-25f), 0x0001);           // above halfway rounds up
  EXPECT_EQ(f32_to_f16(0x1p-14f), 0x0400);             // smallest normal
  EXPECT_EQ(f32_to_f16(1.0f + 0x1p-11f), 0x3c00);      // tie, even neighbour below
  EXPECT_EQ(f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02);  // tie, even neighbour above
  EXPECT_EQ(f32_to_f16(INFINITY), 0x7c00);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f16_to_f32(0x0001), 0x1p-24f);
  EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(NAN))));
}

TEST(Bf16, conversions_round_to_nearest_even) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);      // tie, even below
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);  // tie, even above
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1.2p-8f), 0x3f81);    // above the tie
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const auto b = static_cast<uint16_t>(h);
    if ((b & 0x7f80) == 0x7f80) continue;
    ASSERT_EQ(f32_to_bf16(bf16_to_f32(b)), b) << std::hex << h;
  }
}
