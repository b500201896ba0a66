// The SIMD kernels, written once over xsimd and instantiated per ISA. Include this only from an
// ISA translation unit, after defining `IsaOps` there (register type, fp16/bf16 load and store).
//
// Everything here has internal linkage, and no standard-library template over a non-arch type is
// called: an out-of-line copy of such a template, compiled with AVX-512 flags, could otherwise be
// picked by the linker for baseline callers (pitfall 16 in research/env.md; a test checks the
// objects with nm).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include <xsimd/xsimd.hpp>

#include "simd/kernels.hpp"

namespace kvsift::simd {
namespace {

template <class Ops>
struct Body {
  using batch = typename Ops::batch;
  static constexpr uint32_t W = static_cast<uint32_t>(batch::size);
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  // xsimd 8.1's AVX-512 haddp returns the row sums in the order 0,1,4,5,2,3,6,7, 8,9,12,13,...
  // (checked: rows with sums 0,100,...,1500 come back as 0 100 400 500 200 300 600 700 ...). The
  // permutation is an involution: storing row i at haddp_slot(i) gives the sums in order.
  static constexpr uint32_t haddp_slot(uint32_t i) noexcept {
    if constexpr (W == 16) {
      const uint32_t j = i & 7u;
      return (i & 8u) | (j == 2 || j == 3 ? j + 2 : j == 4 || j == 5 ? j - 2 : j);
    } else {
      return i;
    }
  }

  template <Dtype D>
  static batch load(const uint16_t* p) noexcept {
    if constexpr (D == Dtype::f16)
      return Ops::load_f16(p);
    else
      return Ops::load_bf16(p);
  }

  static void encode(const float* src, uint16_t* dst, std::size_t n, Dtype dtype) noexcept {
    std::size_t i = 0;
    for (; i + W <= n; i += W) Ops::store(batch::load_unaligned(src + i), dst + i, dtype);
    if (i == n) return;
    alignas(64) float in[W] = {};
    alignas(64) uint16_t out[W];
    for (std::size_t j = 0; i + j < n; ++j) in[j] = src[i + j];
    Ops::store(batch::load_aligned(in), out, dtype);
    for (std::size_t j = 0; i + j < n; ++j) dst[i + j] = out[j];
  }

  static void decode(const uint16_t* src, float* dst, std::size_t n, Dtype dtype) noexcept {
    std::size_t i = 0;
    auto one = [dtype](const uint16_t* p) {
      return dtype == Dtype::f16 ? Ops::load_f16(p) : Ops::load_bf16(p);
    };
    for (; i + W <= n; i += W) one(src + i).store_unaligned(dst + i);
    if (i == n) return;
    alignas(64) uint16_t in[W] = {};
    alignas(64) float out[W];
    for (std::size_t j = 0; i + j < n; ++j) in[j] = src[i + j];
    one(in).store_aligned(out);
    for (std::size_t j = 0; i + j < n; ++j) dst[i + j] = out[j];
  }

  // Streams each bf16 weight row once for all M vectors; per vector two accumulators (even and
  // odd chunks) hide the FMA latency, the same order for every M.
  template <std::size_t M>
  static void matvec_rows(const uint16_t* w, std::size_t rows, std::size_t cols, const float* x,
                          float* y, std::size_t y_stride) noexcept {
    for (std::size_t r = 0; r < rows; ++r) {
      const uint16_t* wr = w + r * cols;
      batch a0[M], a1[M];
      for (std::size_t m = 0; m < M; ++m) a0[m] = a1[m] = batch(0.0f);
      std::size_t c = 0;
      for (; c + 2 * W <= cols; c += 2 * W) {
        const batch w0 = Ops::load_bf16(wr + c), w1 = Ops::load_bf16(wr + c + W);
        for (std::size_t m = 0; m < M; ++m) {
          a0[m] = xsimd::fma(w0, batch::load_unaligned(x + m * cols + c), a0[m]);
          a1[m] = xsimd::fma(w1, batch::load_unaligned(x + m * cols + c + W), a1[m]);
        }
      }
      for (; c < cols; c += W) {
        const batch w0 = Ops::load_bf16(wr + c);
        for (std::size_t m = 0; m < M; ++m)
          a0[m] = xsimd::fma(w0, batch::load_unaligned(x + m * cols + c), a0[m]);
      }
      for (std::size_t m = 0; m < M; ++m) y[m * y_stride + r] = xsimd::hadd(a0[m] + a1[m]);
    }
  }

  static void matvec_bf16(const uint16_t* w, std::size_t rows, std::size_t cols, const float* x,
                          std::size_t n_vectors, float* y, std::size_t y_stride) noexcept {
    static_assert(kMaxVectors == 8, "the switch covers 1..8 vectors");
    switch (n_vectors) {
      case 1: matvec_rows<1>(w, rows, cols, x, y, y_stride); break;
      case 2: matvec_rows<2>(w, rows, cols, x, y, y_stride); break;
      case 3: matvec_rows<3>(w, rows, cols, x, y, y_stride); break;
      case 4: matvec_rows<4>(w, rows, cols, x, y, y_stride); break;
      case 5: matvec_rows<5>(w, rows, cols, x, y, y_stride); break;
      case 6: matvec_rows<6>(w, rows, cols, x, y, y_stride); break;
      case 7: matvec_rows<7>(w, rows, cols, x, y, y_stride); break;
      default: matvec_rows<8>(w, rows, cols, x, y, y_stride); break;
    }
  }

  // One page for a block of NG query heads: logits, online-softmax rescale, V accumulation.
  // s: [NG, page_tokens] scratch. q, m, l, acc point at the block's first head.
  template <Dtype D, uint32_t NG, uint32_t d>
  static void page(const float* q, uint32_t B, const uint16_t* k, const uint16_t* v, uint32_t n,
                   float* m, float* l, float* acc, float* s) noexcept {
    // Logits: TT tokens share each q load, and W tokens' dot products are reduced together by
    // haddp (one transpose-add tree, not W hadds). The whole page is computed: slots are full-size,
    // and the tail's logits are overwritten with -inf below.
    constexpr uint32_t TT = W >= 16 ? 4 : 2;
    for (uint32_t t0 = 0; t0 < B; t0 += W) {
      batch rows[NG][W];
      for (uint32_t t = t0; t < t0 + W; t += TT) {
        batch a[TT][NG];
        for (uint32_t u = 0; u < TT; ++u)
          for (uint32_t g = 0; g < NG; ++g) a[u][g] = batch(0.0f);
        for (uint32_t c = 0; c < d; c += W) {
          batch kc[TT];
          for (uint32_t u = 0; u < TT; ++u) kc[u] = load<D>(k + std::size_t{t + u} * d + c);
          for (uint32_t g = 0; g < NG; ++g) {
            const batch qg = batch::load_unaligned(q + std::size_t{g} * d + c);
            for (uint32_t u = 0; u < TT; ++u) a[u][g] = xsimd::fma(kc[u], qg, a[u][g]);
          }
        }
        for (uint32_t u = 0; u < TT; ++u)
          for (uint32_t g = 0; g < NG; ++g) rows[g][haddp_slot(t - t0 + u)] = a[u][g];
      }
      for (uint32_t g = 0; g < NG; ++g) xsimd::haddp(rows[g]).store_unaligned(s + g * B + t0);
    }
    // Online-softmax update with the heads interleaved, so that their latency chains overlap.
    float alpha[NG], m_new[NG];
    batch mx[NG];
    for (uint32_t g = 0; g < NG; ++g) {
      float* sg = s + g * B;
      for (uint32_t t = n; t < B; ++t) sg[t] = kNegInf;  // exp(-inf) = 0: the tail adds nothing
      mx[g] = batch::load_unaligned(sg);
      for (uint32_t t = W; t < B; t += W) mx[g] = xsimd::max(mx[g], batch::load_unaligned(sg + t));
    }
    alignas(64) float shift_old[W] = {};
    for (uint32_t g = 0; g < NG; ++g) {
      const float page_max = Ops::hmax(mx[g]);
      m_new[g] = m[g] > page_max ? m[g] : page_max;
      shift_old[g] = m[g] - m_new[g];  // m[g] = -inf before the first page: alpha = 0
    }
    xsimd::exp(batch::load_aligned(shift_old)).store_aligned(shift_old);
    batch sum[NG];
    for (uint32_t g = 0; g < NG; ++g) {
      float* sg = s + g * B;
      const batch shift(m_new[g]);
      sum[g] = batch(0.0f);
      for (uint32_t t = 0; t < B; t += W) {
        const batch p = xsimd::exp(batch::load_unaligned(sg + t) - shift);
        p.store_unaligned(sg + t);
        sum[g] += p;
      }
    }
    for (uint32_t g = 0; g < NG; ++g) {
      alpha[g] = shift_old[g];
      l[g] = l[g] * alpha[g] + xsimd::hadd(sum[g]);
      m[g] = m_new[g];
    }
    // Values: tokens outer over a block of CB channel chunks, so NG * CB independent accumulators
    // hide the FMA latency and each probability is broadcast once per block, not once per chunk.
    constexpr uint32_t CB = W >= 16 ? 4 : 2;
    constexpr uint32_t chunks = d / W;
    static_assert(chunks % CB == 0, "head_dim is a multiple of the channel block");
    for (uint32_t c0 = 0; c0 < d; c0 += CB * W) {
      batch a[NG][CB];
      for (uint32_t g = 0; g < NG; ++g)
        for (uint32_t j = 0; j < CB; ++j)
          a[g][j] = batch::load_unaligned(acc + std::size_t{g} * d + c0 + j * W) * batch(alpha[g]);
      for (uint32_t t = 0; t < n; ++t) {
        batch p[NG];
        for (uint32_t g = 0; g < NG; ++g) p[g] = batch(s[g * B + t]);
        for (uint32_t j = 0; j < CB; ++j) {
          const batch vc = load<D>(v + std::size_t{t} * d + c0 + j * W);
          for (uint32_t g = 0; g < NG; ++g) a[g][j] = xsimd::fma(vc, p[g], a[g][j]);
        }
      }
      for (uint32_t g = 0; g < NG; ++g)
        for (uint32_t j = 0; j < CB; ++j)
          a[g][j].store_unaligned(acc + std::size_t{g} * d + c0 + j * W);
    }
  }

  // Pages outer, head blocks inner: a group larger than one block re-reads each page from L1,
  // never the run from DRAM.
  template <Dtype D, uint32_t d>
  static void attend_dtype(const AttendJob& job) noexcept {
    const uint32_t B = job.page_tokens;
    const std::size_t page_elems = std::size_t{B} * d;
    auto page_of = [&job](uint32_t i) {
      return job.logical ? job.logical[job.first + i] : job.first + i;
    };
    for (uint32_t i = 0; i < job.count; ++i) {
      const uint32_t p = page_of(i);
      const auto* k = reinterpret_cast<const uint16_t*>(job.pool + job.table[p] * job.slot_bytes);
      const uint16_t* v = k + page_elems;
      const uint64_t left = job.seq_tokens - uint64_t{p} * B;
      const uint32_t n = left < B ? static_cast<uint32_t>(left) : B;
      for (uint32_t g0 = 0; g0 < job.group; g0 += kHeadBlock) {
        const float* q = job.q + std::size_t{g0} * d;
        float* acc = job.acc + std::size_t{g0} * d;
        float* m = job.m + g0;
        float* l = job.l + g0;
        switch (job.group - g0) {
          case 1: page<D, 1, d>(q, B, k, v, n, m, l, acc, job.scratch); break;
          case 2: page<D, 2, d>(q, B, k, v, n, m, l, acc, job.scratch); break;
          case 3: page<D, 3, d>(q, B, k, v, n, m, l, acc, job.scratch); break;
          default: page<D, 4, d>(q, B, k, v, n, m, l, acc, job.scratch); break;
        }
      }
    }
  }

  static void attend(const AttendJob& job) noexcept {
    static_assert(kHeadBlock == 4, "attend_dtype's switch covers blocks of up to 4 heads");
    const std::size_t G = job.group, d = job.head_dim;
    for (std::size_t g = 0; g < G; ++g) {
      job.m[g] = kNegInf;
      job.l[g] = 0.0f;
    }
    for (std::size_t i = 0; i < G * d; ++i) job.acc[i] = 0.0f;
    // head_dim as a template parameter: the channel loops unroll fully, with no counters.
    const bool f16 = job.dtype == Dtype::f16;
    switch (job.head_dim) {
      case 64: f16 ? attend_dtype<Dtype::f16, 64>(job) : attend_dtype<Dtype::bf16, 64>(job); break;
      case 128:
        f16 ? attend_dtype<Dtype::f16, 128>(job) : attend_dtype<Dtype::bf16, 128>(job);
        break;
      default:
        f16 ? attend_dtype<Dtype::f16, 256>(job) : attend_dtype<Dtype::bf16, 256>(job);
        break;
    }
  }
};

}  // namespace
}  // namespace kvsift::simd
