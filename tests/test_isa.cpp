#include <gtest/gtest.h>

#include "simd/isa.hpp"
#include "simd/kernels.hpp"

using namespace kvsift::simd;

TEST(Isa, names_parse_back_to_the_same_isa) {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512}) EXPECT_EQ(parse_isa(isa_name(isa)), isa);
  EXPECT_FALSE(parse_isa("sse2").has_value());
}

TEST(Isa, detection_agrees_with_the_cpu_features) {
  __builtin_cpu_init();
  const Isa isa = detect_isa();
  if (isa >= Isa::avx2) {
    EXPECT_TRUE(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"));
  }
  if (isa == Isa::avx512) {
    EXPECT_TRUE(__builtin_cpu_supports("avx512bw"));
  }
  if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512cd") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c")) {
    EXPECT_EQ(isa, Isa::avx512);
  }
}

TEST(Isa, the_cap_lowers_the_resolved_isa_and_can_be_lifted) {
  const Isa before = max_isa();
  set_max_isa(Isa::scalar);
  EXPECT_EQ(resolve_isa(Isa::avx512), Isa::scalar);
  EXPECT_EQ(kernels_for(resolve_isa(Isa::avx512)).isa, Isa::scalar);
  set_max_isa(Isa::avx512);
  EXPECT_EQ(resolve_isa(Isa::avx512), detect_isa());
  EXPECT_EQ(resolve_isa(Isa::avx2), std::min(Isa::avx2, detect_isa()));
  set_max_isa(before);
}
