// AVX-512 Louver kernels (F/BW/VL with F16C conversions). Compiled with -march=x86-64-v4 only;
// everything here has internal linkage except the table accessor (check_isa_symbols.cmake).
#include <immintrin.h>

#include "simd/louver_kernels.hpp"
#include "simd/louver_loops.hpp"
#include "simd/x86/x86_kernels.hpp"

namespace kvsift::simd {
namespace {

inline __m512 load_f16(const uint16_t* p) noexcept {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The one score function check and scan share: two accumulators over 16-wide chunks.
inline float score(const float* q, const uint16_t* k, uint32_t d) noexcept {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  uint32_t j = 0;
  for (; j + 32 <= d; j += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), load_f16(k + j), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + j + 16), load_f16(k + j + 16), a1);
  }
  if (j < d) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + j), load_f16(k + j), a0);
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

void ball_bounds(const float* q, const uint16_t* centers, uint32_t width, const float* radius,
                 float q_norm, uint32_t n, float* ub) noexcept {
  const __m512 qn = _mm512_set1_ps(q_norm);
  const uint32_t blocks = (n + 15) / 16;
  for (uint32_t b = 0; b < blocks; ++b) {
    const uint16_t* block = centers + std::size_t{b} * width * 16;
    __m512 a0 = _mm512_mul_ps(qn, _mm512_loadu_ps(radius + b * 16)), a1 = _mm512_setzero_ps();
    uint32_t j = 0;
    for (; j + 2 <= width; j += 2) {
      a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[j]), load_f16(block + j * 16), a0);
      a1 = _mm512_fmadd_ps(_mm512_set1_ps(q[j + 1]), load_f16(block + (j + 1) * 16), a1);
    }
    if (j < width) a0 = _mm512_fmadd_ps(_mm512_set1_ps(q[j]), load_f16(block + j * 16), a0);
    _mm512_storeu_ps(ub + b * 16, _mm512_add_ps(a0, a1));
  }
}

uint32_t filter(const LouverFilterJob& job) noexcept {
  const uint32_t S = job.n_subspaces;
  const __m512i step = _mm512_set1_epi32(16);
  __m512i ids = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  uint32_t count = 0;
  for (uint32_t i = 0; i < job.n; i += 16) {
    const __mmask16 live = job.n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (job.n - i)) - 1);
    __mmask16 keep;
    if (job.gate == LouverGate::summed) {
      __m512 sum = _mm512_setzero_ps();
      for (uint32_t s = 0; s < S; ++s) {
        const __m512i a = _mm512_maskz_loadu_epi32(live, job.assign[s] + i);
        sum = _mm512_add_ps(sum,
                            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, a, job.ub[s], 4));
      }
      keep = _mm512_mask_cmp_ps_mask(live, sum, _mm512_set1_ps(job.t[0]), _CMP_GE_OQ);
    } else {
      const bool all = job.gate == LouverGate::all;
      keep = all ? live : 0;
      for (uint32_t s = 0; s < S; ++s) {
        const __m512i a = _mm512_maskz_loadu_epi32(live, job.assign[s] + i);
        const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, a, job.ub[s], 4);
        const __mmask16 pass =
            _mm512_mask_cmp_ps_mask(live, v, _mm512_set1_ps(job.t[s]), _CMP_GE_OQ);
        keep = all ? __mmask16(keep & pass) : __mmask16(keep | pass);
      }
    }
    _mm512_mask_compressstoreu_epi32(job.out + count, keep, ids);
    count += static_cast<uint32_t>(__builtin_popcount(keep));
    ids = _mm512_add_epi32(ids, step);
  }
  return count;
}

using Loops = LouverLoops<score>;

}  // namespace

const LouverKernels& louver_avx512_kernels() noexcept {
  static const LouverKernels table{Level::avx512, ball_bounds, filter,
                                   Loops::check,  Loops::scan, Loops::scores};
  return table;
}

}  // namespace kvsift::simd
