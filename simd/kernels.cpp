#include "simd/kernels.hpp"

namespace kvsift::simd {

const Kernels& kernels_for(Isa isa) noexcept {
  switch (isa) {
    case Isa::avx512: return avx512_kernels();
    case Isa::avx2: return avx2_kernels();
    case Isa::scalar: break;
  }
  return scalar_kernels();
}

LocksScoreFn avx512_vnni_locks_score() noexcept {
  // VNNI is not part of x86-64-v4: Skylake-SP has AVX-512 without it.
  static const bool vnni = detect_isa() == Isa::avx512 && __builtin_cpu_supports("avx512vnni");
  return vnni ? locks_score_avx512_vnni : nullptr;
}

}  // namespace kvsift::simd
