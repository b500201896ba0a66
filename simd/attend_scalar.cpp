// Portable reference kernels: plain loops in float32, the baseline every SIMD path is tested
// against. Compiled without ISA flags.
#include <algorithm>
#include <cmath>
#include <limits>

#include "simd/half.hpp"
#include "simd/kernels.hpp"

namespace kvsift::simd {
namespace {

float to_f32(uint16_t x, Dtype dtype) noexcept {
  return dtype == Dtype::f16 ? f16_to_f32(x) : bf16_to_f32(x);
}

void encode(const float* src, uint16_t* dst, std::size_t n, Dtype dtype) noexcept {
  for (std::size_t i = 0; i < n; ++i)
    dst[i] = dtype == Dtype::f16 ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
}

void decode(const uint16_t* src, float* dst, std::size_t n, Dtype dtype) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = to_f32(src[i], dtype);
}

void attend(const AttendJob& job) noexcept {
  const uint32_t G = job.group, d = job.head_dim, B = job.page_tokens;
  std::fill(job.m, job.m + G, -std::numeric_limits<float>::infinity());
  std::fill(job.l, job.l + G, 0.0f);
  std::fill(job.acc, job.acc + std::size_t{G} * d, 0.0f);
  const std::size_t page_elems = std::size_t{B} * d;
  for (uint32_t i = 0; i < job.count; ++i) {
    const uint32_t page = job.logical ? job.logical[job.first + i] : job.first + i;
    const auto* k = reinterpret_cast<const uint16_t*>(job.pool + job.table[page] * job.slot_bytes);
    const uint16_t* v = k + page_elems;
    const uint64_t page_start = uint64_t{page} * B;
    const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(B, job.seq_tokens - page_start));
    for (uint32_t g = 0; g < G; ++g) {
      const float* q = job.q + std::size_t{g} * d;
      float* s = job.scratch + std::size_t{g} * B;
      float page_max = -std::numeric_limits<float>::infinity();
      for (uint32_t t = 0; t < n; ++t) {
        float dot = 0.0f;
        for (uint32_t c = 0; c < d; ++c) dot += q[c] * to_f32(k[std::size_t{t} * d + c], job.dtype);
        s[t] = dot;
        page_max = std::max(page_max, dot);
      }
      const float m_new = std::max(job.m[g], page_max);
      const float alpha = std::exp(job.m[g] - m_new);  // exp(-inf) = 0 on the first page
      float* acc = job.acc + std::size_t{g} * d;
      for (uint32_t c = 0; c < d; ++c) acc[c] *= alpha;
      float sum = 0.0f;
      for (uint32_t t = 0; t < n; ++t) {
        const float p = std::exp(s[t] - m_new);
        sum += p;
        for (uint32_t c = 0; c < d; ++c) acc[c] += p * to_f32(v[std::size_t{t} * d + c], job.dtype);
      }
      job.l[g] = job.l[g] * alpha + sum;
      job.m[g] = m_new;
    }
  }
}

void matvec_bf16(const uint16_t* w, std::size_t rows, std::size_t cols, const float* x,
                 std::size_t n_vectors, float* y, std::size_t y_stride) noexcept {
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t m = 0; m < n_vectors; ++m) {
      float sum = 0.0f;
      for (std::size_t c = 0; c < cols; ++c) sum += bf16_to_f32(w[r * cols + c]) * x[m * cols + c];
      y[m * y_stride + r] = sum;
    }
}

}  // namespace

const Kernels& scalar_kernels() noexcept {
  static const Kernels table{Isa::scalar, encode, decode, attend, matvec_bf16};
  return table;
}

}  // namespace kvsift::simd
