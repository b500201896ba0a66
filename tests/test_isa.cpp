// Levels from feature sets: the choice on fabricated CPUs (this machine is one CPU), the cap,
// detection against the compiler's own probe, and KVSIFT_MAX_ISA through the C API.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "kvsift/kvsift.h"
#include "lib/core/error.hpp"
#include "lib/core/kernel_runtime.hpp"
#include "simd/isa.hpp"
#include "simd/kernels.hpp"
#include "simd/louver_kernels.hpp"

using namespace kvsift::simd;
using kvsift::KernelRuntime;

#if defined(__x86_64__)

namespace {

// Fabricated CPUs, by the features real ones have.
const FeatureSet kHaswell{Feature::avx,  Feature::avx2, Feature::fma,   Feature::f16c,
                          Feature::bmi1, Feature::bmi2, Feature::lzcnt, Feature::movbe};
const FeatureSet kSkylakeX =
    kHaswell | FeatureSet{Feature::avx512f, Feature::avx512cd, Feature::avx512bw, Feature::avx512dq,
                          Feature::avx512vl};
const FeatureSet kIceLake = kSkylakeX | FeatureSet{Feature::avx512vnni};
// A Xeon Phi: AVX-512 F/CD without BW/DQ/VL (and so not the avx512 level).
const FeatureSet kKnightsLanding = kHaswell | FeatureSet{Feature::avx512f, Feature::avx512cd};

}  // namespace

TEST(Isa, every_level_name_parses_back_and_others_do_not) {
  for (Level level : kLevels) EXPECT_EQ(parse_level(level_name(level)), level);
  EXPECT_EQ(parse_level("best"), Level::best);
  EXPECT_FALSE(parse_level("sse2").has_value());
  EXPECT_FALSE(parse_level("AVX2").has_value());
  EXPECT_FALSE(parse_level("").has_value());
  EXPECT_EQ(level_names(), "scalar, avx2, avx512, avx512_vnni, best");
}

TEST(Isa, levels_are_defined_by_their_features) {
  EXPECT_EQ(level_features(Level::scalar), FeatureSet{});
  EXPECT_EQ(level_features(Level::avx2), kHaswell);
  EXPECT_EQ(level_features(Level::avx512), kSkylakeX);
  // The VNNI variant is avx512 plus one feature.
  EXPECT_EQ(level_features(Level::avx512_vnni), kIceLake);
  EXPECT_EQ(level_features(Level::avx512_vnni).without(Feature::avx512vnni),
            level_features(Level::avx512));
}

TEST(Isa, best_is_the_last_level_whose_features_the_cpu_has) {
  EXPECT_EQ(best_level(FeatureSet{}), Level::scalar);
  EXPECT_EQ(best_level(kHaswell), Level::avx2);
  EXPECT_EQ(best_level(kSkylakeX), Level::avx512);
  EXPECT_EQ(best_level(kIceLake), Level::avx512_vnni);
  EXPECT_EQ(best_level(kKnightsLanding), Level::avx2);
  // One missing feature of a level loses the level, whichever it is.
  EXPECT_EQ(best_level(kHaswell.without(Feature::f16c)), Level::scalar);
  EXPECT_EQ(best_level(kHaswell.without(Feature::bmi2)), Level::scalar);
  EXPECT_EQ(best_level(kIceLake.without(Feature::avx512bw)), Level::avx2);
  // VNNI without the rest of AVX-512 is no level.
  EXPECT_EQ(best_level(kHaswell | FeatureSet{Feature::avx512vnni}), Level::avx2);
}

TEST(Isa, a_request_gets_its_level_or_the_best_below_it) {
  for (Level cap : {Level::best, Level::avx512_vnni}) {
    EXPECT_EQ(choose_level(Level::best, kIceLake, cap), Level::avx512_vnni);
    EXPECT_EQ(choose_level(Level::avx512_vnni, kIceLake, cap), Level::avx512_vnni);
    EXPECT_EQ(choose_level(Level::avx512, kIceLake, cap), Level::avx512);
    EXPECT_EQ(choose_level(Level::avx2, kIceLake, cap), Level::avx2);
    EXPECT_EQ(choose_level(Level::scalar, kIceLake, cap), Level::scalar);
  }
  // Named levels the CPU lacks fall back (no error here: the C API refuses them first).
  EXPECT_EQ(choose_level(Level::avx512_vnni, kSkylakeX, Level::best), Level::avx512);
  EXPECT_EQ(choose_level(Level::avx512_vnni, kHaswell, Level::best), Level::avx2);
  EXPECT_EQ(choose_level(Level::avx512, kHaswell, Level::best), Level::avx2);
  EXPECT_EQ(choose_level(Level::avx2, FeatureSet{}, Level::best), Level::scalar);
}

TEST(Isa, the_cap_allows_levels_within_its_features) {
  EXPECT_EQ(choose_level(Level::best, kIceLake, Level::avx512), Level::avx512);
  EXPECT_EQ(choose_level(Level::avx512_vnni, kIceLake, Level::avx512), Level::avx512);
  EXPECT_EQ(choose_level(Level::best, kIceLake, Level::avx2), Level::avx2);
  EXPECT_EQ(choose_level(Level::avx512, kIceLake, Level::avx2), Level::avx2);
  EXPECT_EQ(choose_level(Level::best, kIceLake, Level::scalar), Level::scalar);
  // A cap above the CPU changes nothing.
  EXPECT_EQ(choose_level(Level::best, kHaswell, Level::avx512_vnni), Level::avx2);
  EXPECT_EQ(choose_level(Level::best, kSkylakeX, Level::avx512_vnni), Level::avx512);
}

TEST(Isa, detection_agrees_with_the_compilers_probe) {
  __builtin_cpu_init();
  const FeatureSet cpu = detect_features();
  EXPECT_EQ(cpu.has(Feature::avx2), __builtin_cpu_supports("avx2") != 0);
  EXPECT_EQ(cpu.has(Feature::f16c), __builtin_cpu_supports("f16c") != 0);
  EXPECT_EQ(cpu.has(Feature::bmi2), __builtin_cpu_supports("bmi2") != 0);
  EXPECT_EQ(cpu.has(Feature::avx512bw), __builtin_cpu_supports("avx512bw") != 0);
  EXPECT_EQ(cpu.has(Feature::avx512vnni), __builtin_cpu_supports("avx512vnni") != 0);
  // The levels' features are those of the x86-64 levels their objects are compiled for.
  EXPECT_EQ(cpu.contains(level_features(Level::avx2)), __builtin_cpu_supports("x86-64-v3") != 0);
  EXPECT_EQ(cpu.contains(level_features(Level::avx512)), __builtin_cpu_supports("x86-64-v4") != 0);
  for (Level level : kLevels) EXPECT_EQ(cpu_has(level), cpu.contains(level_features(level)));
}

TEST(Isa, each_level_has_its_own_table) {
  for (Level level : kLevels) {
    EXPECT_EQ(kernels_for(level).level, level) << level_name(level);
    // Louver has AVX-512 kernels only: the other levels run its scalar ones.
    const bool avx512 = level == Level::avx512 || level == Level::avx512_vnni;
    EXPECT_EQ(louver_kernels_for(level).level, avx512 ? Level::avx512 : Level::scalar)
        << level_name(level);
  }
  // avx512_vnni's table is avx512's with the LOCKS scorer, the quantized matvec and attention
  // (whose q8 jobs it takes itself) replaced.
  const Kernels& avx512 = kernels_for(Level::avx512);
  const Kernels& vnni = kernels_for(Level::avx512_vnni);
  EXPECT_EQ(vnni.encode, avx512.encode);
  EXPECT_EQ(vnni.decode, avx512.decode);
  EXPECT_NE(vnni.attend, avx512.attend);
  EXPECT_EQ(vnni.matvec_bf16, avx512.matvec_bf16);
  EXPECT_EQ(vnni.exp_sum, avx512.exp_sum);
  EXPECT_NE(vnni.locks_score, avx512.locks_score);
}

#endif  // __x86_64__: the fabricated CPUs, the compiler's probe and the x86 tables

TEST(Isa, the_cap_lowers_the_runtime_level_and_can_be_lifted) {
  const Level before = max_level();
  set_max_level(Level::scalar);
  EXPECT_EQ(resolve_level(Level::best), Level::scalar);
  EXPECT_EQ(KernelRuntime(Level::best).level(), Level::scalar);
  EXPECT_EQ(KernelRuntime(Level::best).kernels().level, Level::scalar);
  set_max_level(Level::best);
  const Level best = best_level(detect_features());
  EXPECT_EQ(KernelRuntime(Level::best).level(), best);
  EXPECT_EQ(KernelRuntime().level(), best);
  EXPECT_EQ(KernelRuntime(Level::avx2).level(), cpu_has(Level::avx2) ? Level::avx2 : Level::scalar);
  set_max_level(before);
}

namespace {

// Whether a message names the variable, its bogus value and the names it takes.
bool names_the_variable(const char* message) {
  const std::string m = message != nullptr ? message : "";
  return m.find("KVSIFT_MAX_ISA") != std::string::npos && m.find("avx9000") != std::string::npos &&
         m.find(level_names()) != std::string::npos;
}

// Run with KVSIFT_MAX_ISA=avx9000 in the environment from the process's start: every handle
// creation fails naming it, until kvsift_set_max_isa sets a cap. Returns the failed checks,
// each reported on stderr.
int bogus_variable_failures() {
  int failures = 0;
  auto check = [&](bool ok, const char* what) {
    if (!ok) std::fprintf(stderr, "failed: %s (last error: %s)\n", what, kvsift_last_error());
    failures += ok ? 0 : 1;
  };
  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  kvsift_cache* cache = nullptr;
  check(kvsift_cache_create(&params, &cache) == KVSIFT_STATUS_INVALID_ARGUMENT && cache == nullptr,
        "kvsift_cache_create returns INVALID_ARGUMENT");
  check(names_the_variable(kvsift_last_error()), "the cache's message names the variable");
  kvsift_model_params model_params;
  kvsift_model_params_init(&model_params);
  kvsift_model* model = nullptr;
  // Refused before the file is opened: the path does not exist.
  check(kvsift_model_load("/nonexistent/model.gguf", &model_params, &model) ==
                KVSIFT_STATUS_INVALID_ARGUMENT &&
            model == nullptr,
        "kvsift_model_load returns INVALID_ARGUMENT");
  check(names_the_variable(kvsift_last_error()), "the model's message names the variable");
  try {
    KernelRuntime runtime(Level::best);
    check(false, "KernelRuntime throws");
  } catch (const kvsift::Error& e) {
    check(e.status() == kvsift::Status::invalid_argument && names_the_variable(e.what()),
          "KernelRuntime throws invalid_argument naming the variable");
  }
  // Setting the cap replaces the variable's value, and its complaint with it.
  check(kvsift_set_max_isa(KVSIFT_ISA_AUTO) == KVSIFT_STATUS_OK, "kvsift_set_max_isa");
  check(kvsift_cache_create(&params, &cache) == KVSIFT_STATUS_OK, "a cache after the cap is set");
  kvsift_cache_free(cache);
  return failures;
}

}  // namespace

// KVSIFT_MAX_ISA is read once per process, so the bogus value is tried in a child process that
// gtest starts afresh (the threadsafe death-test style re-runs this binary with only this test),
// which inherits the variable set here.
TEST(IsaEnv, a_bogus_max_isa_fails_handle_creation_naming_it) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  max_level();  // this process read the variable already (or reads it now)
  const char* outer = std::getenv("KVSIFT_MAX_ISA");
  const std::string saved = outer != nullptr ? outer : "";
  ASSERT_EQ(setenv("KVSIFT_MAX_ISA", "avx9000", 1), 0);
  EXPECT_EXIT(std::exit(bogus_variable_failures() == 0 ? 0 : 1), ::testing::ExitedWithCode(0), "");
  if (outer != nullptr)
    setenv("KVSIFT_MAX_ISA", saved.c_str(), 1);
  else
    unsetenv("KVSIFT_MAX_ISA");
}
