#include "simd/isa.hpp"

#include <atomic>
#include <cstdlib>

namespace kvsift::simd {

FeatureSet detect_features() noexcept {
  static const FeatureSet detected = [] {
    FeatureSet s;
#if defined(__x86_64__)
    __builtin_cpu_init();
    // The names __builtin_cpu_supports takes, in the order of Feature.
    const struct {
      Feature feature;
      bool present;
    } probes[] = {
        {Feature::avx, __builtin_cpu_supports("avx") != 0},
        {Feature::avx2, __builtin_cpu_supports("avx2") != 0},
        {Feature::fma, __builtin_cpu_supports("fma") != 0},
        {Feature::f16c, __builtin_cpu_supports("f16c") != 0},
        {Feature::bmi1, __builtin_cpu_supports("bmi") != 0},
        {Feature::bmi2, __builtin_cpu_supports("bmi2") != 0},
        {Feature::lzcnt, __builtin_cpu_supports("lzcnt") != 0},
        {Feature::movbe, __builtin_cpu_supports("movbe") != 0},
        {Feature::avx512f, __builtin_cpu_supports("avx512f") != 0},
        {Feature::avx512cd, __builtin_cpu_supports("avx512cd") != 0},
        {Feature::avx512bw, __builtin_cpu_supports("avx512bw") != 0},
        {Feature::avx512dq, __builtin_cpu_supports("avx512dq") != 0},
        {Feature::avx512vl, __builtin_cpu_supports("avx512vl") != 0},
        {Feature::avx512vnni, __builtin_cpu_supports("avx512vnni") != 0},
    };
    for (const auto& probe : probes)
      if (probe.present) s = s | FeatureSet{probe.feature};
#endif
    return s;
  }();
  return detected;
}

FeatureSet level_features(Level level) noexcept {
  constexpr FeatureSet v3{Feature::avx,  Feature::avx2, Feature::fma,   Feature::f16c,
                          Feature::bmi1, Feature::bmi2, Feature::lzcnt, Feature::movbe};
  constexpr FeatureSet v4 = v3 | FeatureSet{Feature::avx512f, Feature::avx512cd, Feature::avx512bw,
                                            Feature::avx512dq, Feature::avx512vl};
  switch (level) {
    case Level::scalar: return {};
    case Level::avx2: return v3;
    case Level::avx512: return v4;
    case Level::avx512_vnni: return v4 | FeatureSet{Feature::avx512vnni};
    case Level::best: break;
  }
  return kAllFeatures;
}

bool cpu_has(Level level) noexcept {
  return level == Level::best || detect_features().contains(level_features(level));
}

Level best_level(FeatureSet available) noexcept {
  Level chosen = Level::scalar;
  for (Level level : kLevels)
    if (available.contains(level_features(level))) chosen = level;
  return chosen;
}

Level choose_level(Level request, FeatureSet cpu, Level cap) noexcept {
  return best_level(cpu & level_features(cap) & level_features(request));
}

const char* level_name(Level level) noexcept {
  switch (level) {
    case Level::scalar: return "scalar";
    case Level::avx2: return "avx2";
    case Level::avx512: return "avx512";
    case Level::avx512_vnni: return "avx512_vnni";
    case Level::best: return "best";
  }
  return "unknown";
}

std::optional<Level> parse_level(std::string_view name) noexcept {
  for (Level level : kLevels)
    if (name == level_name(level)) return level;
  if (name == level_name(Level::best)) return Level::best;
  return std::nullopt;
}

std::string level_names() {
  std::string names;
  for (Level level : kLevels) names += std::string(level_name(level)) + ", ";
  return names + level_name(Level::best);
}

namespace {

struct Cap {
  std::atomic<Level> value{Level::best};
  std::string env_error;  // written once, before any reader can see the Cap
  Cap() {
    const char* env = std::getenv("KVSIFT_MAX_ISA");
    if (env == nullptr || *env == '\0') return;
    if (auto level = parse_level(env))
      value = *level;
    else
      env_error = std::string("KVSIFT_MAX_ISA='") + env + "' is not one of " + level_names();
  }
};

Cap& cap() {
  static Cap instance;  // read once, on first use: the environment is not re-read
  return instance;
}

// set_max_level clears the complaint; a handle being created may read it meanwhile.
std::atomic<bool> g_env_error_cleared{false};

}  // namespace

Level max_level() noexcept {
  return cap().value.load();
}

void set_max_level(Level level) noexcept {
  cap().value = level;
  g_env_error_cleared = true;
}

std::string_view env_max_level_error() noexcept {
  const Cap& c = cap();
  if (g_env_error_cleared.load()) return {};
  return c.env_error;
}

Level resolve_level(Level request) noexcept {
  return choose_level(request, detect_features(), max_level());
}

}  // namespace kvsift::simd
