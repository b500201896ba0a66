// CPU features, the kernel levels defined by them, and the process-wide cap. Private to kvsift.
//
// A level is a named set of kernels (one table each, simd/kernels.hpp) together with the CPU
// features its code may execute. Levels are not ranked by a number: a level is available when the
// CPU has every feature it requires, the cap allows a level whose features are a subset of the cap
// level's, and "best" is the last level of kLevels that is available and allowed. An architecture
// adds its levels to Level and kLevels, its features to Feature, and its detection to
// detect_features (simd/isa.cpp); nothing outside simd/ ranks or names levels.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

namespace kvsift::simd {

// The CPU features kvsift's kernels use. The x86 objects are compiled with -march=x86-64-v3 or
// -v4, which lets the compiler emit any instruction of that level anywhere in them (BMI, LZCNT,
// MOVBE besides the vector extensions), so a level requires those too, not only the extensions
// its intrinsics name. x86-64-v2's features (SSE4.2, POPCNT) come with every AVX2 CPU. No kernel
// uses AVX512-FP16 or AVX512-BF16, so neither is a feature here.
enum class Feature : uint8_t {
  avx,
  avx2,
  fma,
  f16c,
  bmi1,
  bmi2,
  lzcnt,
  movbe,
  avx512f,
  avx512cd,
  avx512bw,
  avx512dq,
  avx512vl,
  avx512vnni,
  count,
};

// A set of Features, one bit each.
class FeatureSet {
 public:
  constexpr FeatureSet() noexcept = default;
  constexpr FeatureSet(std::initializer_list<Feature> features) noexcept {
    for (Feature f : features) bits_ |= bit(f);
  }
  static constexpr FeatureSet from_bits(uint32_t bits) noexcept {
    FeatureSet s;
    s.bits_ = bits & ((1u << static_cast<unsigned>(Feature::count)) - 1u);
    return s;
  }
  constexpr uint32_t bits() const noexcept { return bits_; }
  constexpr bool has(Feature f) const noexcept { return (bits_ & bit(f)) != 0; }
  // Every feature of `other` is in this set.
  constexpr bool contains(FeatureSet other) const noexcept {
    return (bits_ & other.bits_) == other.bits_;
  }
  constexpr FeatureSet operator|(FeatureSet other) const noexcept {
    return from_bits(bits_ | other.bits_);
  }
  constexpr FeatureSet operator&(FeatureSet other) const noexcept {
    return from_bits(bits_ & other.bits_);
  }
  constexpr FeatureSet without(Feature f) const noexcept { return from_bits(bits_ & ~bit(f)); }
  // Written out, not defaulted: gpu/'s .cu files include this header and compile as C++17.
  constexpr bool operator==(const FeatureSet& other) const noexcept { return bits_ == other.bits_; }

 private:
  static constexpr uint32_t bit(Feature f) noexcept { return 1u << static_cast<unsigned>(f); }
  uint32_t bits_ = 0;
};

// Every feature kvsift knows: the cap of "best", and the request of "best".
inline constexpr FeatureSet kAllFeatures =
    FeatureSet::from_bits((1u << static_cast<unsigned>(Feature::count)) - 1u);

// The features of this CPU and OS. __builtin_cpu_supports checks CPUID and that the OS saves the
// vector state (XCR0); xsimd 8.1's own detector misreads AVX on Zen 5 and skips XCR0. Read once.
FeatureSet detect_features() noexcept;

// The kernel levels. `best` is only a request (and a cap meaning "no cap"): no table has it.
enum class Level : uint8_t {
  scalar = 0,       // portable code, baseline x86-64
  avx2 = 1,         // x86-64-v3: AVX2, FMA, F16C (simd/x86/attend_avx2.cpp)
  avx512 = 2,       // x86-64-v4: AVX-512 F/CD/BW/DQ/VL (simd/x86/attend_avx512.cpp, ...)
  avx512_vnni = 3,  // avx512 with the int8 LOCKS scorer and q8 attention on VNNI
                    // (simd/x86/locks_avx512_vnni.cpp, simd/x86/attend_avx512_vnni.cpp)
  best = 255,
};

// Every level this build has a table for (simd/kernels.cpp), in order of preference: best last.
inline constexpr Level kLevels[] = {
    Level::scalar,
#if defined(__x86_64__)
    Level::avx2,
    Level::avx512,
    Level::avx512_vnni,
#endif
};

// What a level's code may execute (kAllFeatures for `best`).
FeatureSet level_features(Level level) noexcept;

// Whether this CPU has every feature the level requires (true for scalar and best).
bool cpu_has(Level level) noexcept;

// The last level of kLevels whose features `available` holds (scalar needs none).
Level best_level(FeatureSet available) noexcept;

// The level a request gets on a CPU with `cpu` under `cap` (best: no cap): the best level whose
// features the CPU has and that needs nothing beyond the cap's and the request's features. A
// named level the CPU or the cap refuses thus falls back to the best level below it (avx512_vnni
// to avx512 on a CPU without VNNI, avx512 to avx2 without AVX-512, anything to scalar).
Level choose_level(Level request, FeatureSet cpu, Level cap) noexcept;

// The cap: KVSIFT_MAX_ISA at first use, then whatever set_max_level stored (best: none). A value
// of the variable that is neither a level name nor "best" leaves no cap and is reported by
// env_max_level_error(), which handle creation turns into an invalid_argument error.
Level max_level() noexcept;
// Replaces the cap, and with it any complaint about KVSIFT_MAX_ISA.
void set_max_level(Level cap) noexcept;
// Non-empty when KVSIFT_MAX_ISA holds a value that is not a level name: the message names the
// variable, the value and the names it takes.
std::string_view env_max_level_error() noexcept;

// choose_level(request, detect_features(), max_level()).
Level resolve_level(Level request) noexcept;

// "scalar", "avx2", "avx512", "avx512_vnni", "best"; "unknown" for other values.
const char* level_name(Level level) noexcept;
// A name of level_name (best included) back to its level.
std::optional<Level> parse_level(std::string_view name) noexcept;
// The names parse_level takes, comma-separated: for messages.
std::string level_names();

}  // namespace kvsift::simd
