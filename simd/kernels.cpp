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

}  // namespace kvsift::simd
