// Portable reference Louver kernels: plain float32 loops, the baseline the AVX-512 table is tested
// against. Compiled without ISA flags.
#include "simd/half.hpp"
#include "simd/louver_kernels.hpp"
#include "simd/louver_loops.hpp"

namespace kvsift::simd {
namespace {

float score(const float* q, const uint16_t* k, uint32_t d) noexcept {
  float s = 0.0f;
  for (uint32_t j = 0; j < d; ++j) s += q[j] * f16_to_f32(k[j]);
  return s;
}

void ball_bounds(const float* q, const uint16_t* centers, uint32_t width, const float* radius,
                 float q_norm, uint32_t n, float* ub) noexcept {
  for (uint32_t c = 0; c < (n + 15) / 16 * 16; ++c) {
    const uint16_t* block = centers + std::size_t{c / 16} * width * 16 + c % 16;
    float s = 0.0f;
    for (uint32_t j = 0; j < width; ++j) s += q[j] * f16_to_f32(block[j * 16]);
    ub[c] = s + q_norm * radius[c];
  }
}

uint32_t filter(const LouverFilterJob& job) noexcept {
  const uint32_t S = job.n_subspaces;
  uint32_t count = 0;
  for (uint32_t i = 0; i < job.n; ++i) {
    bool keep;
    if (job.gate == LouverGate::summed) {
      float sum = 0.0f;
      for (uint32_t s = 0; s < S; ++s) sum += job.ub[s][job.assign[s][i]];
      keep = sum >= job.t[0];
    } else {
      uint32_t passed = 0;
      for (uint32_t s = 0; s < S; ++s) passed += job.ub[s][job.assign[s][i]] >= job.t[s];
      keep = job.gate == LouverGate::all ? passed == S : passed > 0;
    }
    job.out[count] = i;
    count += keep;
  }
  return count;
}

using Loops = LouverLoops<score>;

}  // namespace

const LouverKernels& louver_scalar_kernels() noexcept {
  static const LouverKernels table{Level::scalar, ball_bounds, filter,
                                   Loops::check,  Loops::scan, Loops::scores};
  return table;
}

}  // namespace kvsift::simd
