// Shared helpers for the test suites: seeded random data and error measures.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <gtest/gtest.h>

#include "lib/core/error.hpp"
#include "lib/core/thread_pool.hpp"
#include "simd/isa.hpp"
#include "simd/kernels.hpp"

namespace kvsift::test {

// A thread pool of n_threads for code a test drives outside a handle (a selector made directly);
// one per count, kept to the end of the run. Not for tests that run threads of their own.
inline ThreadPool& pool(int n_threads) {
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  std::unique_ptr<ThreadPool>& pool = pools[n_threads];
  if (!pool) pool = std::make_unique<ThreadPool>(n_threads);
  return *pool;
}

// The kernel table of a handle created now with the default request (best, under the process
// cap), for code a test drives outside a handle (a cache, an attention or a selector made
// directly). Tests of one level pass that level's table instead (IsaTest::k()).
inline const simd::Kernels& kernels() {
  return simd::kernels_for(simd::resolve_level(simd::Level::best));
}

// Whether a level attends to a dtype with integer products: avx512_vnni over a q8 cache, whose
// kernel rounds the query to 15 bits and each page's weights to u8 (simd/x86/
// attend_avx512_vnni.cpp; each rounding bounded element by element in tests/test_kernels.cpp).
inline bool attends_with_integer_products(simd::Level level, simd::Dtype dtype) {
  return level == simd::Level::avx512_vnni && dtype == simd::Dtype::q8;
}

// The relative L2 error decode attention is held to against float64 attention over the stored
// values: 1e-5 for float32 arithmetic; 1e-2 with integer products, whose roundings moved the
// outputs of these tests by 1.4e-3 to 4.6e-3 (the int8 storage itself moves them by 1.6e-2).
inline double attend_tolerance(simd::Level level, simd::Dtype dtype) {
  return attends_with_integer_products(level, dtype) ? 1e-2 : 1e-5;
}

inline std::vector<float> random_floats(std::size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

// ||a - b||_2 / ||b||_2 (0 when both are zero).
template <class A, class B>
double relative_error(const A* a, const B* b, std::size_t n) {
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    const double e = double(a[i]) - double(b[i]);
    diff += e * e;
    norm += double(b[i]) * double(b[i]);
  }
  if (norm == 0.0) return std::sqrt(diff);
  return std::sqrt(diff / norm);
}

// f() must throw kvsift::Error with `status` and a message containing `needle`.
template <class F>
void expect_error(F&& f, Status status, std::string_view needle) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_NE(std::string_view(e.what()).find(needle), std::string_view::npos) << e.what();
  }
}

// The kernel levels of this build (simd::kLevels) that this CPU has.
inline std::vector<simd::Level> supported_isas() {
  std::vector<simd::Level> levels;
  for (simd::Level level : simd::kLevels)
    if (simd::cpu_has(level)) levels.push_back(level);
  return levels;
}

// A test parameterised over the levels (instantiate it with ::testing::ValuesIn(simd::kLevels)):
// it skips the ones this CPU lacks, and k() is the kernel table of the one it runs on.
class IsaTest : public ::testing::TestWithParam<simd::Level> {
 protected:
  void SetUp() override {
    if (!simd::cpu_has(GetParam())) GTEST_SKIP() << "CPU lacks " << simd::level_name(GetParam());
  }
  const simd::Kernels& k() const { return simd::kernels_for(GetParam()); }
};

inline std::string isa_test_name(const ::testing::TestParamInfo<simd::Level>& info) {
  return simd::level_name(info.param);
}

}  // namespace kvsift::test
