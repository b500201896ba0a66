// Levels to tables. Each architecture's branch names its own tables only, so that a build for
// another architecture compiles and links none of them (simd/CMakeLists.txt compiles simd/x86/
// exactly where __x86_64__ is defined).
#include "simd/kernels.hpp"

#include "simd/louver_kernels.hpp"

#if defined(__x86_64__)
#include "simd/x86/x86_kernels.hpp"
#endif

namespace kvsift::simd {

#if defined(__x86_64__)

namespace {

// avx512_vnni's LOCKS scorer: int8 queries on VNNI, exact queries (the certified selector's) on
// the AVX-512 float kernel. Baseline code: it only forwards to the two.
void locks_score_vnni_level(const LocksScoreJob& job) noexcept {
  if (job.int8_query)
    locks_score_avx512_vnni(job);
  else
    avx512_kernels().locks_score(job);
}

// avx512_vnni's attention: q8 caches on the integer kernel, the 16-bit dtypes on the AVX-512 one.
void attend_vnni_level(const AttendJob& job) noexcept {
  if (job.layout.dtype == Dtype::q8)
    attend_q8_avx512_vnni(job);
  else
    avx512_kernels().attend(job);
}

// avx512's table with q8 attention, the int8 LOCKS scorer and the quantized matvec replaced: VNNI
// adds kernels, not a table.
const Kernels& avx512_vnni_kernels() noexcept {
  static const Kernels table = [] {
    Kernels t = avx512_kernels();
    t.level = Level::avx512_vnni;
    t.matvec_quant = matvec_quant_avx512_vnni;
    t.locks_score = locks_score_vnni_level;
    t.attend = attend_vnni_level;
    return t;
  }();
  return table;
}

}  // namespace

#endif

const Kernels& kernels_for(Level level) noexcept {
  switch (level) {
#if defined(__x86_64__)
    case Level::avx2: return avx2_kernels();
    case Level::avx512: return avx512_kernels();
    case Level::avx512_vnni: return avx512_vnni_kernels();
#endif
    default: break;
  }
  return scalar_kernels();
}

const LouverKernels& louver_kernels_for(Level level) noexcept {
  switch (level) {
#if defined(__x86_64__)
    case Level::avx512:
    case Level::avx512_vnni: return louver_avx512_kernels();
#endif
    default: break;
  }
  return louver_scalar_kernels();
}

}  // namespace kvsift::simd
