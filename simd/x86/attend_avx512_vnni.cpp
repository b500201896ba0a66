// Decode attention over a q8 cache with AVX-512 VNNI (slot layout: simd/page_layout.hpp).
// Compiled with -march=x86-64-v4 -mavx512vnni, and called only through the avx512_vnni level's
// table (simd/kernels.cpp), which a CPU without VNNI never gets.
//
// The float kernel (simd/attend_body.hpp) converts every int8 code to float and spends an FMA
// per code and head: with G = 4 heads and d = 128 that is 96 vector ops a token on the two
// multiply pipes for 264 bytes, and it ran at 0.42 of the read bandwidth on 2 threads (Zen 5,
// docs/performance.md). Here both products are integer dot products (VNNI):
//   q.k: q rounded per head to 15 bits, q~ = (s_q / 128) * qcode, s_q = max|q| / 127 (the LOCKS
//     scorer's query scale, vnni_common.hpp), qcode = round(128 q / s_q) in [-16256, 16256];
//     sum_c qcode[c] * kcode[t, c] by vpdpwssd on K widened to int16, times s_q / 128 *
//     k_scale[t] once per token. An int8 query (qcode = round(q / s_q), vpdpbusd on K biased by
//     +128) cost half the K-side products but moved the output of tests/test_kernels.cpp's
//     Llama-shaped case by 2.1e-2 (relative L2), more than the int8 cache itself (1.6e-2); the 15-
//     bit query moves it by about 1/128 of that.
//   P.V: the softmax weights of a page times the V row scales, w[t] = p[t] * v_scale[t], are
//     rounded per page and head to u8 codes wcode[t] = round(255 w[t] / w_max); sum_t wcode[t] *
//     vcode[t, c] is exact in int32 (at most 64 * 255 * 127 < 2^21) and enters the float
//     accumulator times w_max / 255. The sum of the weights, l, is taken from the float p.
// Each rounding's effect on the output is bounded in tests/test_kernels.cpp (q8 attention on
// avx512_vnni). V is transposed by four tokens in registers (two unpack stages, channels
// permuted within 128-bit lanes), so lane j of a dot holds one channel: the accumulator is kept
// in that order during the job and put back in channel order at its end.
//
// Intrinsics only, no xsimd: see locks_avx512_vnni.cpp (tests/check_isa_symbols.cmake allows this
// object no weak symbol at all).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#if !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "attend_avx512_vnni.cpp must be compiled with AVX-512 and AVX-512 VNNI flags"
#endif

#include "simd/attend_pages.hpp"
#include "simd/kernels.hpp"
#include "simd/x86/vnni_common.hpp"
#include "simd/x86/x86_kernels.hpp"

namespace kvsift::simd {
namespace {

// Query heads whose codes are prepared for one walk over the pages; a larger group walks the
// pages again per this many heads.
constexpr uint32_t kQueryHeads = 32;
constexpr float kLog2e = 1.44269504088896341f;

struct QueryCodes {
  alignas(64) int16_t codes[kQueryHeads][kMaxHeadDim];
  float step[kQueryHeads];  // s_q / 128
};

// Head h's codes and step: q / s_q in float32 (as quantize_query), times 128 (exact), rounded to
// nearest even; all zero when q = 0.
void quantize_query15(const float* q, uint32_t d, QueryCodes& qc, uint32_t h) noexcept {
  const float s_q = query_scale(q, d);
  for (uint32_t c = 0; c < d; c += W) {
    const __m512 x = _mm512_div_ps(_mm512_loadu_ps(q + c), _mm512_set1_ps(s_q));
    const __m512i code = s_q > 0.0f ? _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(128.0f)))
                                    : _mm512_setzero_si512();
    _mm256_store_si256(reinterpret_cast<__m256i*>(qc.codes[h] + c), _mm512_cvtsepi32_epi16(code));
  }
  qc.step[h] = s_q / 128.0f;
}

// Tokens from n on are masked out of chunk t0 of a page.
__mmask16 live(uint32_t t0, uint32_t n) noexcept {
  return t0 + W <= n ? __mmask16(0xFFFF) : t0 >= n ? __mmask16(0) : __mmask16((1u << (n - t0)) - 1);
}

// One page for a block of NG heads (the first one's codes at qc.codes[h]):
// logits, online-softmax update, V accumulation into acc [NG, d] (channel order permuted, above).
// s: [NG, page_tokens] floats of scratch.
template <uint32_t d, uint32_t NG>
void page(const QueryCodes& qc, uint32_t h, const PageLayout& layout, const std::byte* slot,
          uint32_t n, float* m, float* l, float* acc, float* s) noexcept {
  const uint32_t B = layout.page_tokens;
  const int8_t* K = layout.key_codes(slot);
  const int8_t* V = layout.value_codes(slot);
  const float* k_scale = layout.key_scales(slot);
  const float* v_scale = layout.value_scales(slot);

  // Logits, 16 tokens at a time: four tokens' rows share each query load, and the 16 x NG dot
  // vectors are reduced by transpose-adds (sum4_epi32, then add_quarters_ps) into one vector of
  // 16 logits per head. The whole page is computed (slots are full-size); the tail is masked.
  for (uint32_t t0 = 0; t0 < B; t0 += W) {
    __m512 quad[NG][4];
    for (uint32_t tq = 0; tq < 4; ++tq) {
      __m512i a[4][NG];
      for (uint32_t u = 0; u < 4; ++u)
        for (uint32_t g = 0; g < NG; ++g) a[u][g] = _mm512_setzero_si512();
      for (uint32_t c = 0; c < d; c += 32) {
        __m512i k[4];
        for (uint32_t u = 0; u < 4; ++u)
          k[u] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(K + std::size_t{t0 + 4 * tq + u} * d + c)));
        for (uint32_t g = 0; g < NG; ++g) {
          const __m512i qg = _mm512_load_si512(qc.codes[h + g] + c);
          for (uint32_t u = 0; u < 4; ++u) a[u][g] = _mm512_dpwssd_epi32(a[u][g], k[u], qg);
        }
      }
      // Exact in int32 (|sum| <= 256 * 127 * 16256 < 2^29); the quarter sums are rounded to
      // float32 once.
      for (uint32_t g = 0; g < NG; ++g)
        quad[g][tq] = _mm512_cvtepi32_ps(sum4_epi32(a[0][g], a[1][g], a[2][g], a[3][g]));
    }
    const __m512 ks = _mm512_loadu_ps(k_scale + t0);
    for (uint32_t g = 0; g < NG; ++g) {
      const __m512 dot = add_quarters_ps(quad[g]);
      _mm512_storeu_ps(s + g * B + t0,
                       _mm512_mul_ps(dot, _mm512_mul_ps(ks, _mm512_set1_ps(qc.step[h + g]))));
    }
  }

  // Online softmax, as in attend_body.hpp: the running max rarely rises after the first pages.
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  __m512 mx[NG];
  bool rescale = false;
  for (uint32_t g = 0; g < NG; ++g) {
    mx[g] = neg_inf;
    for (uint32_t t0 = 0; t0 < B; t0 += W)
      mx[g] = _mm512_mask_max_ps(mx[g], live(t0, n), mx[g], _mm512_loadu_ps(s + g * B + t0));
    rescale |= _mm512_cmp_ps_mask(mx[g], _mm512_set1_ps(m[g]), _CMP_GT_OQ) != 0;
  }
  alignas(64) float alpha[W] = {};  // exp(m_old - m_new) per head, when rescaling
  if (rescale) {
    for (uint32_t g = 0; g < NG; ++g) {
      const float page_max = _mm512_reduce_max_ps(mx[g]);
      const float m_new = m[g] > page_max ? m[g] : page_max;
      alpha[g] = m[g] - m_new;  // -inf before the first page: 2^-125 times a zero state
      m[g] = m_new;
    }
    _mm512_store_ps(
        alpha, exp2_ps(clamp125(_mm512_mul_ps(_mm512_load_ps(alpha), _mm512_set1_ps(kLog2e)))));
  }
  alignas(64) uint8_t wcode[NG][kMaxPageTokens];
  float w_step[NG];
  for (uint32_t g = 0; g < NG; ++g) {
    float* sg = s + g * B;
    const __m512 shift = _mm512_set1_ps(m[g] * kLog2e);
    __m512 sum = _mm512_setzero_ps(), w_max = _mm512_setzero_ps();
    for (uint32_t t0 = 0; t0 < B; t0 += W) {
      const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(sg + t0), _mm512_set1_ps(kLog2e), shift);
      // Masked twice: a tail token's scales are whatever the slot held (finite or not).
      const __mmask16 in_page = live(t0, n);
      const __m512 p = _mm512_maskz_mov_ps(in_page, exp2_ps(clamp125(x)));
      sum = _mm512_add_ps(sum, p);
      const __m512 w = _mm512_maskz_mul_ps(in_page, p, _mm512_loadu_ps(v_scale + t0));
      w_max = _mm512_max_ps(w_max, w);
      _mm512_storeu_ps(sg + t0, w);
    }
    l[g] = (rescale ? l[g] * alpha[g] : l[g]) + _mm512_reduce_add_ps(sum);
    const float top = _mm512_reduce_max_ps(w_max);
    const __m512 to_code = _mm512_set1_ps(top > 0.0f ? 255.0f / top : 0.0f);
    w_step[g] = top / 255.0f;
    for (uint32_t t0 = 0; t0 < B; t0 += W)
      _mm_store_si128(reinterpret_cast<__m128i*>(wcode[g] + t0),
                      _mm512_cvtusepi32_epi8(
                          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(sg + t0), to_code))));
  }

  // Values: 64 channels at a time, four tokens a step. The codes of tokens from n on are zero,
  // so a step may cover them (their V codes are finite bytes of the full-size slot).
  const uint32_t n4 = (n + 3) & ~3u;
  for (uint32_t c0 = 0; c0 < d; c0 += 64) {
    __m512i a[NG][4];
    for (uint32_t g = 0; g < NG; ++g)
      for (uint32_t j = 0; j < 4; ++j) a[g][j] = _mm512_setzero_si512();
    for (uint32_t t = 0; t < n4; t += 4) {
      const int8_t* row = V + std::size_t{t} * d + c0;
      const __m512i r0 = _mm512_loadu_si512(row), r1 = _mm512_loadu_si512(row + d);
      const __m512i r2 = _mm512_loadu_si512(row + 2 * d), r3 = _mm512_loadu_si512(row + 3 * d);
      const __m512i lo01 = _mm512_unpacklo_epi8(r0, r1), hi01 = _mm512_unpackhi_epi8(r0, r1);
      const __m512i lo23 = _mm512_unpacklo_epi8(r2, r3), hi23 = _mm512_unpackhi_epi8(r2, r3);
      // x[j] lane 4L + i: channel c0 + 16L + 4j + i of the four tokens, token-major bytes.
      const __m512i x[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                            _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
      for (uint32_t g = 0; g < NG; ++g) {
        int32_t four;
        std::memcpy(&four, wcode[g] + t, sizeof four);
        const __m512i wg = _mm512_set1_epi32(four);
        for (uint32_t j = 0; j < 4; ++j) a[g][j] = _mm512_dpbusd_epi32(a[g][j], wg, x[j]);
      }
    }
    for (uint32_t g = 0; g < NG; ++g) {
      const __m512 step = _mm512_set1_ps(w_step[g]);
      for (uint32_t j = 0; j < 4; ++j) {
        float* out = acc + std::size_t{g} * d + c0 + 16 * j;
        __m512 prev = _mm512_loadu_ps(out);
        if (rescale) prev = _mm512_mul_ps(prev, _mm512_set1_ps(alpha[g]));
        _mm512_storeu_ps(out, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[g][j]), step, prev));
      }
    }
  }
}

// acc [d] from the V loop's order (position 16j + 4L + i holds channel 16L + 4j + i of each
// 64-channel block) to channel order. The permutation is its own inverse.
void to_channel_order(float* acc, uint32_t d) noexcept {
  float block[64];
  for (uint32_t c0 = 0; c0 < d; c0 += 64) {
    std::memcpy(block, acc + c0, sizeof block);
    for (uint32_t j = 0; j < 4; ++j)
      for (uint32_t L = 0; L < 4; ++L)
        for (uint32_t i = 0; i < 4; ++i) acc[c0 + 16 * L + 4 * j + i] = block[16 * j + 4 * L + i];
  }
}

template <uint32_t d>
void attend_q8(const AttendJob& job) noexcept {
  static_assert(kHeadBlock == 4, "the switch covers blocks of up to 4 heads");
  QueryCodes qc;
  for (uint32_t h0 = 0; h0 < job.group; h0 += kQueryHeads) {
    const uint32_t heads = job.group - h0 < kQueryHeads ? job.group - h0 : kQueryHeads;
    for (uint32_t h = 0; h < heads; ++h)
      quantize_query15(job.q + std::size_t{h0 + h} * d, d, qc, h);
    // Pages outer, head blocks inner: a block after the first reads the page from L1.
    walk_pages(job, [&](const std::byte* bytes, uint32_t n) {
      for (uint32_t h = 0; h < heads; h += kHeadBlock) {
        const uint32_t g = h0 + h;
        float* acc = job.acc + std::size_t{g} * d;
        float* m = job.m + g;
        float* l = job.l + g;
        switch (heads - h) {
          case 1: page<d, 1>(qc, h, job.layout, bytes, n, m, l, acc, job.scratch); break;
          case 2: page<d, 2>(qc, h, job.layout, bytes, n, m, l, acc, job.scratch); break;
          case 3: page<d, 3>(qc, h, job.layout, bytes, n, m, l, acc, job.scratch); break;
          default: page<d, 4>(qc, h, job.layout, bytes, n, m, l, acc, job.scratch); break;
        }
      }
    });
  }
  for (uint32_t g = 0; g < job.group; ++g) to_channel_order(job.acc + std::size_t{g} * d, d);
}

}  // namespace

void attend_q8_avx512_vnni(const AttendJob& job) noexcept {
  start_attend(job);
  switch (job.layout.head_dim) {
    case 64: attend_q8<64>(job); break;
    case 128: attend_q8<128>(job); break;
    default: attend_q8<256>(job); break;
  }
}

}  // namespace kvsift::simd
