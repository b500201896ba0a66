// The SIMD kernels, written once over xsimd and instantiated per ISA. Include this only from an
// ISA translation unit, after defining `IsaOps` there (register type, fp16/bf16 load and store).
//
// Everything here has internal linkage, and no standard-library template over a non-arch type is
// called: an out-of-line copy of such a template, compiled with AVX-512 flags, could otherwise be
// picked by the linker for baseline callers (tests/check_isa_symbols.cmake checks the objects
// with nm).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include <xsimd/xsimd.hpp>

#include "simd/attend_pages.hpp"
#include "simd/kernels.hpp"
#include "simd/locks_record.hpp"

namespace kvsift::simd {
namespace {

template <class Ops>
struct Body {
  using batch = typename Ops::batch;
  using batch_bool = typename batch::batch_bool_type;
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

  static double exp_sum(const float* x, float shift, float* out, std::size_t n) noexcept {
    const batch sh(shift);
    double total = 0.0;
    for (std::size_t i0 = 0; i0 < n; i0 += kExpSumBlock) {
      const std::size_t end = i0 + kExpSumBlock < n ? i0 + kExpSumBlock : n;
      batch sum(0.0f);
      std::size_t i = i0;
      for (; i + W <= end; i += W) {
        const batch e = xsimd::exp(batch::load_unaligned(x + i) - sh);
        e.store_unaligned(out + i);
        sum += e;
      }
      if (i < end) {  // the tail through a padded copy: -inf adds exp(-inf) = 0
        alignas(64) float in[W], e[W];
        for (std::size_t j = 0; j < W; ++j) in[j] = i + j < end ? x[i + j] : kNegInf;
        const batch v = xsimd::exp(batch::load_aligned(in) - sh);
        v.store_aligned(e);
        sum += v;
        for (std::size_t j = 0; i + j < end; ++j) out[i + j] = e[j];
      }
      total += xsimd::hadd(sum);
    }
    return total;
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

  // W stored values of a K or V row from value c on, as float32: q8 codes without their scale
  // (page() applies it per token).
  template <Dtype D>
  static batch row_chunk(const std::byte* slot, const PageLayout& layout, bool key, uint32_t t,
                         uint32_t c) noexcept {
    if constexpr (D == Dtype::q8) {
      return Ops::load_i8(reinterpret_cast<const std::byte*>(
          (key ? layout.key_codes(slot, t) : layout.value_codes(slot, t)) + c));
    } else {
      return load<D>((key ? layout.key(slot, t) : layout.value(slot, t)) + c);
    }
  }

  // One page for a block of NG query heads: logits, online-softmax rescale, V accumulation.
  // s: [NG, page_tokens] scratch. q, m, l, acc point at the block's first head. A q8 page's dot
  // products are taken with the codes and multiplied by the token's K scale once; its
  // probabilities are multiplied by the token's V scale before the V accumulation (l sums them
  // unscaled), so the inner loops are the 16-bit ones with a wider conversion.
  template <Dtype D, uint32_t NG, uint32_t d>
  static void page(const float* q, const PageLayout& layout, const std::byte* slot, uint32_t n,
                   float* m, float* l, float* acc, float* s) noexcept {
    const uint32_t B = layout.page_tokens;
    // Logits: TT tokens share each q load, and W tokens' dot products are reduced together by
    // haddp (one transpose-add tree, not W hadds). The whole page is computed: slots are full-size,
    // and the tail's logits are overwritten with -inf below.
    constexpr uint32_t TT = W >= 16 ? 4 : 2;
    for (uint32_t t0 = 0; t0 < B; t0 += W) {
      batch rows[NG][W];
#pragma GCC unroll 16
      for (uint32_t t = t0; t < t0 + W; t += TT) {
        batch a[TT][NG];
        for (uint32_t u = 0; u < TT; ++u)
          for (uint32_t g = 0; g < NG; ++g) a[u][g] = batch(0.0f);
        for (uint32_t c = 0; c < d; c += W) {
          batch kc[TT];
          for (uint32_t u = 0; u < TT; ++u) kc[u] = row_chunk<D>(slot, layout, true, t + u, c);
          for (uint32_t g = 0; g < NG; ++g) {
            const batch qg = batch::load_unaligned(q + std::size_t{g} * d + c);
            for (uint32_t u = 0; u < TT; ++u) a[u][g] = xsimd::fma(kc[u], qg, a[u][g]);
          }
        }
        for (uint32_t u = 0; u < TT; ++u)
          for (uint32_t g = 0; g < NG; ++g) rows[g][haddp_slot(t - t0 + u)] = a[u][g];
      }
      if constexpr (D == Dtype::q8) {
        const batch k_scale = batch::load_unaligned(layout.key_scales(slot) + t0);
        for (uint32_t g = 0; g < NG; ++g)
          (xsimd::haddp(rows[g]) * k_scale).store_unaligned(s + g * B + t0);
      } else {
        for (uint32_t g = 0; g < NG; ++g) xsimd::haddp(rows[g]).store_unaligned(s + g * B + t0);
      }
    }
    // Online-softmax update with the heads interleaved, so that their latency chains overlap.
    // The running max rarely rises after the first pages: a lane-wise compare finds that out, and
    // only then are the page maxima reduced and acc and l rescaled.
    batch mx[NG];
    auto rises = batch_bool(false);
    for (uint32_t g = 0; g < NG; ++g) {
      float* sg = s + g * B;
      for (uint32_t t = n; t < B; ++t) sg[t] = kNegInf;  // exp(-inf) = 0: the tail adds nothing
      mx[g] = batch::load_unaligned(sg);
      for (uint32_t t = W; t < B; t += W) mx[g] = xsimd::max(mx[g], batch::load_unaligned(sg + t));
      rises = rises | (mx[g] > batch(m[g]));
    }
    const bool rescale = xsimd::any(rises);
    alignas(64) float alpha[W] = {};  // exp(m_old - m_new) per head, when rescaling
    if (rescale) {
      for (uint32_t g = 0; g < NG; ++g) {
        const float page_max = Ops::hmax(mx[g]);
        const float m_new = m[g] > page_max ? m[g] : page_max;
        alpha[g] = m[g] - m_new;  // m[g] = -inf before the first page: alpha = 0
        m[g] = m_new;
      }
      xsimd::exp(batch::load_aligned(alpha)).store_aligned(alpha);
    }
    batch sum[NG];
    for (uint32_t g = 0; g < NG; ++g) {
      float* sg = s + g * B;
      const batch shift(m[g]);
      sum[g] = batch(0.0f);
      for (uint32_t t = 0; t < B; t += W) {
        const batch p = xsimd::exp(batch::load_unaligned(sg + t) - shift);
        if constexpr (D == Dtype::q8)
          (p * batch::load_unaligned(layout.value_scales(slot) + t)).store_unaligned(sg + t);
        else
          p.store_unaligned(sg + t);
        sum[g] += p;
      }
    }
    for (uint32_t g = 0; g < NG; ++g)
      l[g] = (rescale ? l[g] * alpha[g] : l[g]) + xsimd::hadd(sum[g]);
    // Values: tokens outer over a block of CB channel chunks, so NG * CB independent accumulators
    // hide the FMA latency and each probability is broadcast once per block, not once per chunk.
    constexpr uint32_t CB = W >= 16 ? 4 : 2;
    constexpr uint32_t chunks = d / W;
    static_assert(chunks % CB == 0, "head_dim is a multiple of the channel block");
    for (uint32_t c0 = 0; c0 < d; c0 += CB * W) {
      batch a[NG][CB];
      for (uint32_t g = 0; g < NG; ++g)
        for (uint32_t j = 0; j < CB; ++j)
          a[g][j] = rescale ? batch::load_unaligned(acc + std::size_t{g} * d + c0 + j * W) *
                                  batch(alpha[g])
                            : batch::load_unaligned(acc + std::size_t{g} * d + c0 + j * W);
      for (uint32_t t = 0; t < n; ++t) {
        batch p[NG];
        for (uint32_t g = 0; g < NG; ++g) p[g] = batch(s[g * B + t]);
        for (uint32_t j = 0; j < CB; ++j) {
          const batch vc = row_chunk<D>(slot, layout, false, t, c0 + j * W);
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
    const PageLayout layout = job.layout;
    walk_pages(job, [&](const std::byte* bytes, uint32_t n) {
      for (uint32_t g0 = 0; g0 < job.group; g0 += kHeadBlock) {
        const float* q = job.q + std::size_t{g0} * d;
        float* acc = job.acc + std::size_t{g0} * d;
        float* m = job.m + g0;
        float* l = job.l + g0;
        switch (job.group - g0) {
          case 1: page<D, 1, d>(q, layout, bytes, n, m, l, acc, job.scratch); break;
          case 2: page<D, 2, d>(q, layout, bytes, n, m, l, acc, job.scratch); break;
          case 3: page<D, 3, d>(q, layout, bytes, n, m, l, acc, job.scratch); break;
          default: page<D, 4, d>(q, layout, bytes, n, m, l, acc, job.scratch); break;
        }
      }
    });
  }

  static void attend(const AttendJob& job) noexcept {
    static_assert(kHeadBlock == 4, "attend_dtype's switch covers blocks of up to 4 heads");
    start_attend(job);
    // head_dim and the dtype as template parameters: the channel loops unroll fully, with no
    // counters and no per-element branch on the dtype.
    switch (job.layout.dtype) {
      case Dtype::f16: attend_dim<Dtype::f16>(job); break;
      case Dtype::bf16: attend_dim<Dtype::bf16>(job); break;
      default: attend_dim<Dtype::q8>(job); break;
    }
  }

  template <Dtype D>
  static void attend_dim(const AttendJob& job) noexcept {
    switch (job.layout.head_dim) {
      case 64: attend_dtype<D, 64>(job); break;
      case 128: attend_dtype<D, 128>(job); break;
      default: attend_dtype<D, 256>(job); break;
    }
  }

  // ---- LOCKS page scores (docs/methods.md, LOCKS; layout in simd/locks_record.hpp) ----

  static float bf16_at(const std::byte* p) noexcept {
    uint16_t h;
    std::memcpy(&h, p, sizeof h);
    const uint32_t bits = uint32_t{h} << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  }

  // Where a row must go among haddp's inputs for its sum to land at lane k of the output.
  static constexpr uint32_t haddp_input(uint32_t k) noexcept {
    return (k & ~(W - 1)) | haddp_slot(k & (W - 1));
  }

  // Computes the products of CB consecutive V columns (int4, from `columns`) with NG heads' split
  // queries as W-lane partial sums, pair (u, g) into part[haddp_input(first + u * NG + g)]; two
  // chains (low and high nibbles) each. Small groups take several columns per pass so that
  // enough accumulators are in flight.
  template <uint32_t NG, uint32_t CB>
  static void v_columns(const std::byte* columns, uint32_t d, const float* qe, batch* part,
                        uint32_t first) noexcept {
    const uint32_t half = d / 2;
    batch lo_acc[CB][NG], hi_acc[CB][NG];
    for (uint32_t u = 0; u < CB; ++u)
      for (uint32_t g = 0; g < NG; ++g) lo_acc[u][g] = hi_acc[u][g] = batch(0.0f);
    for (uint32_t b = 0; b < half; b += W)
      for (uint32_t u = 0; u < CB; ++u) {
        batch lo, hi;
        Ops::load_nibbles(columns + std::size_t{u} * half + b, lo, hi);
        for (uint32_t g = 0; g < NG; ++g) {
          const float* qg = qe + std::size_t{g} * d;
          lo_acc[u][g] = xsimd::fma(lo, batch::load_aligned(qg + b), lo_acc[u][g]);
          hi_acc[u][g] = xsimd::fma(hi, batch::load_aligned(qg + half + b), hi_acc[u][g]);
        }
      }
    for (uint32_t u = 0; u < CB; ++u)
      for (uint32_t g = 0; g < NG; ++g)
        part[haddp_input(first + u * NG + g)] = lo_acc[u][g] + hi_acc[u][g];
  }

  // Scores every page for a block of NG heads. qn: [NG, d] the heads' q~, already multiplied by
  // the attention scale; qe: the same with each head's channels split into even then odd ones,
  // matching the nibble order of V's columns (no unpacking shuffles). lse: the block's first
  // head's row of the output.
  template <uint32_t NG>
  static void locks_block(const LocksScoreJob& job, const LocksRecordLayout& layout,
                          const float* qn, const float* qe, float* lse) noexcept {
    constexpr uint32_t CB = NG == 1 ? 4 : NG == 2 ? 2 : 1;
    const uint32_t d = job.head_dim, B = job.page_tokens, r = job.rank;
    // The (column, head) dot products, column r being mu: `pairs` W-lane partial sums, reduced
    // W at a time by haddp into dots[column * NG + head].
    const uint32_t pairs = (r + 1) * NG, padded = (pairs + W - 1) / W * W;
    batch part[kMaxPageTokens * NG + W];
    for (uint32_t k = pairs; k < padded; ++k) part[haddp_input(k)] = batch(0.0f);
    alignas(64) float dots[kMaxPageTokens * NG + W];
    alignas(64) float z[kMaxPageTokens * NG];
    alignas(64) float logits[NG][kMaxPageTokens];
    // Each (page, head)'s W-lane sum of exp(logit - shift) waits in a ring of W rows, reduced by
    // one haddp and one log for W of them (not a hadd and a log each); the shift and the
    // destination are kept at the lane where haddp leaves the row's sum.
    batch ring[W];
    alignas(64) float ring_max[W];
    float* ring_dest[W];
    uint32_t ring_fill = 0;
    auto flush = [&]() {
      for (uint32_t k = ring_fill; k < W; ++k) {
        ring[k] = batch(1.0f);
        ring_max[haddp_slot(k)] = 0.0f;
        ring_dest[haddp_slot(k)] = nullptr;
      }
      alignas(64) float out[W];
      (xsimd::log(xsimd::haddp(ring)) + batch::load_aligned(ring_max)).store_aligned(out);
      for (uint32_t lane = 0; lane < W; ++lane)
        if (ring_dest[lane] != nullptr) *ring_dest[lane] = out[lane];
      ring_fill = 0;
    };

    for (uint32_t i = 0; i < job.count; ++i) {
      const std::byte* rec = job.records + std::size_t{job.slots[i]} * job.record_bytes;
      const std::byte* v = rec + layout.v_codes;
      uint32_t j = 0;
      for (; j + CB <= r; j += CB)
        v_columns<NG, CB>(v + std::size_t{j} * d / 2, d, qe, part, j * NG);
      for (; j < r; ++j) v_columns<NG, 1>(v + std::size_t{j} * d / 2, d, qe, part, j * NG);
      {
        const std::byte* mu = rec + layout.mu_codes;
        batch a0[NG], a1[NG];
        for (uint32_t g = 0; g < NG; ++g) a0[g] = a1[g] = batch(0.0f);
        for (uint32_t c = 0; c < d; c += 2 * W) {
          const batch m0 = Ops::load_i8(mu + c), m1 = Ops::load_i8(mu + c + W);
          for (uint32_t g = 0; g < NG; ++g) {
            const float* qg = qn + std::size_t{g} * d;
            a0[g] = xsimd::fma(m0, batch::load_aligned(qg + c), a0[g]);
            a1[g] = xsimd::fma(m1, batch::load_aligned(qg + c + W), a1[g]);
          }
        }
        for (uint32_t g = 0; g < NG; ++g) part[haddp_input(r * NG + g)] = a0[g] + a1[g];
      }
      for (uint32_t k = 0; k < pairs; k += W) xsimd::haddp(part + k).store_aligned(dots + k);
      for (uint32_t jj = 0; jj < r; ++jj) {
        const float v_scale = bf16_at(rec + layout.v_scales + 2 * jj);
        for (uint32_t g = 0; g < NG; ++g) z[jj * NG + g] = dots[jj * NG + g] * v_scale;
      }
      const float mu_scale = bf16_at(rec + layout.mu_scale);
      batch mu_q[NG];
      for (uint32_t g = 0; g < NG; ++g) mu_q[g] = batch(dots[r * NG + g] * mu_scale);

      // Logits, W tokens at a time: one load of a C component serves every head; small groups
      // split the sum over j in two chains.
      constexpr uint32_t LA = NG <= 2 ? 2 : 1;
      for (uint32_t t0 = 0; t0 < B; t0 += W) {
        batch acc[LA][NG];
        for (uint32_t a = 0; a < LA; ++a)
          for (uint32_t g = 0; g < NG; ++g) acc[a][g] = batch(0.0f);
        for (uint32_t jj = 0; jj < r; ++jj) {
          const batch cj = Ops::load_i8(rec + layout.c_codes + std::size_t{jj} * B + t0);
          for (uint32_t g = 0; g < NG; ++g)
            acc[jj % LA][g] = xsimd::fma(cj, batch(z[jj * NG + g]), acc[jj % LA][g]);
        }
        const batch c_scale =
            Ops::load_bf16(reinterpret_cast<const uint16_t*>(rec + layout.c_scales) + t0);
        for (uint32_t g = 0; g < NG; ++g) {
          batch sum = acc[0][g];
          for (uint32_t a = 1; a < LA; ++a) sum += acc[a][g];
          xsimd::fma(sum, c_scale, mu_q[g]).store_aligned(logits[g] + t0);
        }
      }
      // The shift is the first token's logit, not the page's max (a horizontal max per head
      // and page cost more than the exps): exp stays finite unless some logit exceeds it by 80,
      // which is checked, and then the max is taken after all. The sum is >= 1 either way.
      for (uint32_t g = 0; g < NG; ++g) {
        const float* lg = logits[g];
        float m = lg[0];
        batch sum(0.0f), shifted[kMaxPageTokens / W];
        auto far = batch_bool(false);
        for (uint32_t t = 0; t < B; t += W) {
          shifted[t / W] = batch::load_aligned(lg + t) - batch(m);
          far = far | (shifted[t / W] > batch(80.0f));
        }
        if (xsimd::any(far)) {
          batch mx = batch::load_aligned(lg);
          for (uint32_t t = W; t < B; t += W) mx = xsimd::max(mx, batch::load_aligned(lg + t));
          m = Ops::hmax(mx);
          for (uint32_t t = 0; t < B; t += W)
            shifted[t / W] = batch::load_aligned(lg + t) - batch(m);
        }
        for (uint32_t t = 0; t < B; t += W) sum += xsimd::exp(shifted[t / W]);
        const uint32_t lane = haddp_slot(ring_fill);
        ring[ring_fill] = sum;
        ring_max[lane] = m;
        ring_dest[lane] = lse + std::size_t{g} * job.count + i;
        if (++ring_fill == W) flush();
      }
    }
    if (ring_fill != 0) flush();
  }

  static void locks_score(const LocksScoreJob& job) noexcept {
    static_assert(kLocksHeadBlock == 8, "the switch covers blocks of up to 8 heads");
    const uint32_t d = job.head_dim, half = d / 2;
    const LocksRecordLayout layout = locks_record_layout(d, job.page_tokens, job.rank);
    alignas(64) float qn[kLocksHeadBlock * kMaxHeadDim];
    alignas(64) float qe[kLocksHeadBlock * kMaxHeadDim];
    for (uint32_t g0 = 0; g0 < job.group; g0 += kLocksHeadBlock) {
      const uint32_t left = job.group - g0;
      const uint32_t ng = left < kLocksHeadBlock ? left : kLocksHeadBlock;
      for (uint32_t g = 0; g < ng; ++g) {
        const float* q = job.q + std::size_t{g0 + g} * d;
        float* out = qn + std::size_t{g} * d;
        if (job.int8_query) {
          // Rounded exactly as the reference: s_q = max|q| / 127 in float, round(q / s_q) to
          // nearest even; the product with s_q * scale is the only step that differs.
          batch amax(0.0f);
          for (uint32_t c = 0; c < d; c += W)
            amax = xsimd::max(amax, xsimd::abs(batch::load_unaligned(q + c)));
          const float s_q = Ops::hmax(amax) / 127.0f;
          const batch step(s_q), mult(s_q * job.scale);
          for (uint32_t c = 0; c < d; c += W) {
            const batch x = s_q > 0.0f
                                ? xsimd::nearbyint(batch::load_unaligned(q + c) / step) * mult
                                : batch(0.0f);
            x.store_aligned(out + c);
          }
        } else {
          for (uint32_t c = 0; c < d; c += W)
            (batch::load_unaligned(q + c) * batch(job.scale)).store_aligned(out + c);
        }
        float* split = qe + std::size_t{g} * d;
        for (uint32_t b = 0; b < half; ++b) {
          split[b] = out[2 * b];
          split[half + b] = out[2 * b + 1];
        }
      }
      float* lse = job.lse + std::size_t{g0} * job.count;
      switch (ng) {
        case 1: locks_block<1>(job, layout, qn, qe, lse); break;
        case 2: locks_block<2>(job, layout, qn, qe, lse); break;
        case 3: locks_block<3>(job, layout, qn, qe, lse); break;
        case 4: locks_block<4>(job, layout, qn, qe, lse); break;
        case 5: locks_block<5>(job, layout, qn, qe, lse); break;
        case 6: locks_block<6>(job, layout, qn, qe, lse); break;
        case 7: locks_block<7>(job, layout, qn, qe, lse); break;
        default: locks_block<8>(job, layout, qn, qe, lse); break;
      }
    }
  }
};

}  // namespace
}  // namespace kvsift::simd
