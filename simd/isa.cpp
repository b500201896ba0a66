#include "simd/isa.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>

namespace kvsift::simd {

Isa detect_isa() noexcept {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  // The AVX-512 kernels also use F16C/FMA encodings, which every AVX-512 CPU has; keep the check
  // explicit so a strange VM that hides F16C falls back instead of faulting.
  if (avx512 && avx2) return Isa::avx512;
  if (avx2) return Isa::avx2;
  return Isa::scalar;
}

const char* isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "unknown";
}

std::optional<Isa> parse_isa(std::string_view name) noexcept {
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (name == isa_name(isa)) return isa;
  return std::nullopt;
}

namespace {

struct Cap {
  std::atomic<int> value;
  std::string env_error;
  Cap() : value(static_cast<int>(Isa::avx512)) {
    const char* env = std::getenv("KVSIFT_MAX_ISA");
    if (env == nullptr || *env == '\0') return;
    if (auto isa = parse_isa(env)) {
      value = static_cast<int>(*isa);
    } else {
      env_error =
          std::string("KVSIFT_MAX_ISA='") + env + "' is not one of scalar, avx2, avx512; ignored";
    }
  }
};

Cap& cap() {
  static Cap instance;  // read once, on first use: the environment is not re-read
  return instance;
}

}  // namespace

Isa max_isa() noexcept {
  return static_cast<Isa>(cap().value.load());
}
void set_max_isa(Isa isa) noexcept {
  cap().value = static_cast<int>(isa);
}
std::string_view env_max_isa_error() noexcept {
  return cap().env_error;
}

Isa resolve_isa(Isa requested) noexcept {
  static const Isa detected = detect_isa();
  return std::min({requested, detected, max_isa()});
}

}  // namespace kvsift::simd
