// Portable reference kernels: plain loops in float32, the baseline every SIMD path is tested
// against. Compiled without ISA flags.
#include <algorithm>
#include <cmath>
#include <limits>

#include <cstring>

#include "simd/gemm_body.hpp"
#include "simd/half.hpp"
#include "simd/kernels.hpp"
#include "simd/locks_record.hpp"
#include "simd/quant.hpp"

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
  const uint32_t G = job.group, d = job.layout.head_dim, B = job.layout.page_tokens;
  std::fill(job.m, job.m + G, -std::numeric_limits<float>::infinity());
  std::fill(job.l, job.l + G, 0.0f);
  std::fill(job.acc, job.acc + std::size_t{G} * d, 0.0f);
  for (uint32_t i = 0; i < job.count; ++i) {
    const uint32_t page = job.logical ? job.logical[job.first + i] : job.first + i;
    const std::byte* slot = job.layout.slot(job.pool, job.table ? job.table[page] : page);
    const PageLayout& layout = job.layout;
    // Stored value c of token t's K or V row, as float32 (q8: its row's scale times the code).
    auto key = [&](uint32_t t, uint32_t c) {
      return layout.quantized() ? layout.key_scales(slot)[t] * float(layout.key_codes(slot, t)[c])
                                : to_f32(layout.key(slot, t)[c], layout.dtype);
    };
    auto value = [&](uint32_t t, uint32_t c) {
      return layout.quantized()
                 ? layout.value_scales(slot)[t] * float(layout.value_codes(slot, t)[c])
                 : to_f32(layout.value(slot, t)[c], layout.dtype);
    };
    const uint64_t page_start = uint64_t{page} * B;
    const uint32_t n = static_cast<uint32_t>(std::min<uint64_t>(B, job.seq_tokens - page_start));
    for (uint32_t g = 0; g < G; ++g) {
      const float* q = job.q + std::size_t{g} * d;
      float* s = job.scratch + std::size_t{g} * B;
      float page_max = -std::numeric_limits<float>::infinity();
      for (uint32_t t = 0; t < n; ++t) {
        float dot = 0.0f;
        for (uint32_t c = 0; c < d; ++c) dot += q[c] * key(t, c);
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
        for (uint32_t c = 0; c < d; ++c) acc[c] += p * value(t, c);
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

float bf16_at(const std::byte* p) noexcept {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return bf16_to_f32(h);
}

void locks_score(const LocksScoreJob& job) noexcept {
  const uint32_t d = job.head_dim, B = job.page_tokens, r = job.rank;
  const LocksRecordLayout layout = locks_record_layout(d, B, r);
  float q[256], z[64], logits[64];
  for (uint32_t g = 0; g < job.group; ++g) {
    const float* raw = job.q + std::size_t{g} * d;
    float s_q = 0.0f;
    for (uint32_t c = 0; c < d; ++c) s_q = std::max(s_q, std::fabs(raw[c]));
    s_q /= 127.0f;
    for (uint32_t c = 0; c < d; ++c)
      q[c] = !job.int8_query ? raw[c] : s_q > 0.0f ? std::nearbyint(raw[c] / s_q) * s_q : 0.0f;
    for (uint32_t i = 0; i < job.count; ++i) {
      const std::byte* rec = job.records + std::size_t{job.slots[i]} * job.record_bytes;
      for (uint32_t j = 0; j < r; ++j) {
        const auto* column = reinterpret_cast<const int8_t*>(rec + layout.v_codes) + j * d / 2;
        float dot = 0.0f;
        for (uint32_t b = 0; b < d / 2; ++b) {
          const int lo = static_cast<int8_t>(column[b] * 16) / 16, hi = column[b] >> 4;
          dot += float(lo) * q[2 * b] + float(hi) * q[2 * b + 1];
        }
        z[j] = dot * bf16_at(rec + layout.v_scales + 2 * j);
      }
      const auto* mu = reinterpret_cast<const int8_t*>(rec + layout.mu_codes);
      float mu_q = 0.0f;
      for (uint32_t c = 0; c < d; ++c) mu_q += float(mu[c]) * q[c];
      mu_q *= bf16_at(rec + layout.mu_scale);
      const auto* coeffs = reinterpret_cast<const int8_t*>(rec + layout.c_codes);
      float max_logit = -std::numeric_limits<float>::infinity();
      for (uint32_t t = 0; t < B; ++t) {
        float dot = 0.0f;
        for (uint32_t j = 0; j < r; ++j) dot += float(coeffs[j * B + t]) * z[j];
        logits[t] = job.scale * (dot * bf16_at(rec + layout.c_scales + 2 * t) + mu_q);
        max_logit = std::max(max_logit, logits[t]);
      }
      float sum = 0.0f;
      for (uint32_t t = 0; t < B; ++t) sum += std::exp(logits[t] - max_logit);
      job.lse[std::size_t{g} * job.count + i] = max_logit + std::log(sum);
    }
  }
}

double exp_sum(const float* x, float shift, float* out, std::size_t n) noexcept {
  double total = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    out[i] = std::exp(x[i] - shift);
    total += out[i];
  }
  return total;
}

}  // namespace

const Kernels& scalar_kernels() noexcept {
  // 4 rows x 2 columns: 8 accumulators, within x86-64's 16 xmm registers with room for B and A.
  static const Kernels table{Level::scalar,      encode,      decode,
                             attend,             matvec_bf16, matvec_quant_scalar,
                             locks_score,        exp_sum,     GemmBody<OneLane, 4, 2>::gemm_f32};
  return table;
}

}  // namespace kvsift::simd
