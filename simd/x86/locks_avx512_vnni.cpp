// LOCKS page scores of int8 queries with AVX-512 VNNI (docs/methods.md, LOCKS; record layout in
// simd/locks_record.hpp). Compiled with -march=x86-64-v4 -mavx512vnni, and called only through
// the avx512_vnni level's table (simd/kernels.cpp), which a CPU without VNNI never gets.
//
// q~ = s_q * qcode, so z_j = s_q * v_scale_j * sum_c vcode[c, j] * qcode[c] and mu . q~ =
// s_q * mu_scale * sum_c mucode[c] * qcode[c]. vpdpbusd multiplies unsigned by signed bytes, so
// V's int4 codes enter biased by +8 (nibble xor 8) and mu's int8 codes by +128 (xor 0x80); the
// reduced sums get -bias * sum_c qcode[c]. Every partial sum stays below 2^23 in magnitude: exact
// in int32, and the final sums exact in float32. The logits (C's int8 codes, bf16 row scales,
// times z) and the log-sum-exp are float32, as in the float kernel (attend_body.hpp), but taken
// about mu . q~ and in base 2: lse = mu . q~ + ln sum_i 2^(log2(e) c_i . z).
//
// Where the time goes (d = 128, B = 16, r = 8, G = 4, records in L2: 58 ns a page at 3.7 GHz,
// about 210 cycles): the multiply pipes (FP0/1 on Zen 4, one zmm vpdpbusd, FMA or multiply a
// cycle) carry 72 vpdpbusd, 52 FMAs and 10 multiplies, some 135 cycles; the rest is the other
// vector work beside them, each op measured at 0.4 to 1 cycle of throughput: moving V's quarters
// (16 shuffles, 3.5 ns), splitting nibbles (24 ops, 3.5 ns), the transpose-adds, the int8-to-
// float conversions of C, the clamps and exponent arithmetic of the exps, the 16-lane reductions
// of the sums (3.5 ns) and the prefetches (13 a page, 3 ns).
//
// No horizontal sum per V column: four columns are transposed in 16-byte quarters so that 128-bit
// lane k of every operand holds column k; lane k of a head's accumulator then sums column k alone,
// and one in-lane 4x4 transpose-add turns four heads' accumulators into [column][head]. The
// quarters are moved once per page and shared by every head; the query side is permuted to match
// once per job.
//
// Intrinsics only, no xsimd: an xsimd template instantiated here would share its name with the
// AVX-512 objects' copies, and a copy compiled with VNNI could be linked into their callers on a
// CPU without it (tests/check_isa_symbols.cmake allows this object no weak symbol at all).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#if !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512VNNI__)
#error "locks_avx512_vnni.cpp must be compiled with AVX-512 and AVX-512 VNNI flags"
#endif

#include "simd/kernels.hpp"
#include "simd/locks_record.hpp"
#include "simd/x86/vnni_common.hpp"
#include "simd/x86/x86_kernels.hpp"

namespace kvsift::simd {
namespace {

constexpr uint32_t kMaxQuarters = kMaxHeadDim / 32;        // 16-byte quarters of a V column
constexpr uint32_t kMaxColumnGroups = kMaxPageTokens / 4;  // rank < page_tokens
constexpr uint32_t kMaxHeadQuads = kLocksHeadBlock / 4;
// Records are fetched this many pages ahead: the slots may be in any order, which the hardware
// prefetcher cannot follow.
constexpr uint32_t kPrefetchPages = 4;

// A block of up to kLocksHeadBlock heads' query codes in the operand orders below, built once
// per job.
struct QueryCodes {
  // Head g, quarter s: channels 32s + 2b (lo) and 32s + 2b + 1 (hi), b < 16, repeated in the
  // four 128-bit lanes (the low and high nibbles of quarter s of a V column).
  alignas(64) int8_t lo[kLocksHeadBlock][kMaxQuarters][64];
  alignas(64) int8_t hi[kLocksHeadBlock][kMaxQuarters][64];
  alignas(64) int8_t codes[kLocksHeadBlock][kMaxHeadDim];  // in channel order, for mu
  // Head quad p, lane 4k + h, for head 4p + h: -8 (V) and -128 (mu) times the sum of its codes,
  // added to the biased sums; s_q times the attention scale, times log2(e) for z (the exps are
  // powers of 2) and not for mu . q~ (the shift, in natural units).
  alignas(64) int32_t v_bias[kMaxHeadQuads][W];
  alignas(64) int32_t mu_bias[kMaxHeadQuads][W];
  alignas(64) float z_scale[kMaxHeadQuads][W];
  alignas(64) float mu_scale[kMaxHeadQuads][W];
};

void prepare(const LocksScoreJob& job, uint32_t g0, uint32_t ng, QueryCodes& qc) noexcept {
  const uint32_t d = job.head_dim;
  alignas(64) float s_q[kLocksHeadBlock] = {};
  alignas(64) int32_t sums[kLocksHeadBlock] = {};
  for (uint32_t g = 0; g < ng; ++g) {
    int8_t* codes = qc.codes[g];
    s_q[g] = quantize_query(job.q + std::size_t{g0 + g} * d, d, codes);
    for (uint32_t c = 0; c < d; ++c) sums[g] += codes[c];
    for (uint32_t s = 0; s < d / 32; ++s)
      for (uint32_t b = 0; b < 16; ++b)
        for (uint32_t k = 0; k < 4; ++k) {
          qc.lo[g][s][16 * k + b] = codes[32 * s + 2 * b];
          qc.hi[g][s][16 * k + b] = codes[32 * s + 2 * b + 1];
        }
  }
  for (uint32_t lane = 0; lane < kLocksHeadBlock * 4; ++lane) {
    const uint32_t g = 4 * (lane / W) + lane % 4;
    qc.v_bias[lane / W][lane % W] = -8 * sums[g];
    qc.mu_bias[lane / W][lane % W] = -128 * sums[g];
    qc.z_scale[lane / W][lane % W] = s_q[g] * job.scale * 1.44269504088896341f;
    qc.mu_scale[lane / W][lane % W] = s_q[g] * job.scale;
  }
}

__m512 sum4_ps(__m512 a, __m512 b, __m512 c, __m512 d) noexcept {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd));
  return _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
}

// Lane i of the result: the sum of x[i]'s lanes.
__m512 sum16_ps(const __m512* x) noexcept {
  __m512 s[4];
  for (uint32_t m = 0; m < 4; ++m)
    s[m] = sum4_ps(x[4 * m], x[4 * m + 1], x[4 * m + 2], x[4 * m + 3]);
  return add_quarters_ps(s);
}

// Four bf16 at p to floats, each repeated over the four lanes of one 128-bit lane; lanes from
// `live` on are zero.
__m512 bf16_quads(const std::byte* p, uint32_t live) noexcept {
  const __m512i index = _mm512_set_epi16(3, 0, 3, 0, 3, 0, 3, 0, 2, 0, 2, 0, 2, 0, 2, 0,  //
                                         1, 0, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128i four = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm512_castsi512_ps(
      _mm512_maskz_permutexvar_epi16(live >= 4 ? 0xAAAAAAAAu : 0xAAAAAAAAu & ((1u << 8 * live) - 1),
                                     index, _mm512_castsi128_si512(four)));
}

float bf16_at(const std::byte* p) noexcept {
  uint16_t h;
  __builtin_memcpy(&h, p, sizeof h);
  const uint32_t bits = uint32_t{h} << 16;
  float x;
  __builtin_memcpy(&x, &bits, sizeof x);
  return x;
}

__m512 load_i8(const std::byte* p) noexcept {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// ln x for finite x >= 1 (the sums of exps) to about 1 ulp: x = m 2^e with m in [0.75, 1.5), and
// ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.2, whose series to s^9 is within 1e-8.
__m512 log_ps(__m512 x) noexcept {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_src);
  __m512 e = _mm512_getexp_ps(x);  // floor(log2 x): a mantissa below 1 belongs to e + 1
  e = _mm512_mask_add_ps(e, _mm512_cmp_ps_mask(m, one, _CMP_LT_OQ), e, one);
  const __m512 s = _mm512_div_ps(_mm512_sub_ps(m, one), _mm512_add_ps(m, one));
  const __m512 s2 = _mm512_mul_ps(s, s);
  __m512 p = _mm512_set1_ps(1.0f / 9);
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.0f / 7));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.0f / 5));
  p = _mm512_fmadd_ps(p, s2, _mm512_set1_ps(1.0f / 3));
  p = _mm512_fmadd_ps(p, s2, one);
  const __m512 ln_m = _mm512_mul_ps(_mm512_add_ps(s, s), p);
  // ln 2 in two parts: e * 0.693359375 is exact.
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f),
                         _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), ln_m));
}

// Each (page, head)'s W-lane sum of 2^x waits in `sum`, at row head * pages + page for the
// `pages` pages since the last reduction; one sum16 reduces W rows to their totals, which wait
// with their shifts in `total` and `shift` until kRingBatches reductions are in. Only then are
// the logs taken and the results stored, in a pass whose iterations are independent: a log and
// its stores right after each sum16 made a dependency chain of some 80 cycles, longer than the
// out-of-order window covers, and cost a sixth of the kernel's time.
constexpr uint32_t kRingBatches = 16;

struct Ring {
  __m512 sum[W];
  alignas(64) float total[kRingBatches][W];
  alignas(64) float shift[kRingBatches][W];
  uint32_t first[kRingBatches];  // the batch's first page
  uint32_t used[kRingBatches];   // and its number of pages

  Ring() noexcept {
    for (uint32_t k = 0; k < W; ++k) sum[k] = _mm512_set1_ps(1.0f);
    for (uint32_t b = 0; b < kRingBatches; ++b) _mm512_store_ps(shift[b], _mm512_setzero_ps());
  }
  void reduce(uint32_t batch, uint32_t first_page, uint32_t pages) noexcept {
    _mm512_store_ps(total[batch], sum16_ps(sum));
    first[batch] = first_page;
    used[batch] = pages;
  }
  // Writes batch b's log-sum-exps of rows h * pages + j (h < heads, j < used[b]) to
  // lse[h * stride + first[b] + j], and returns those of them whose sum lies outside [2^-60,
  // 2^80] (or is not a number), which the caller scores again: there the shift was too far from
  // the page's largest logit for the exps (whose argument is clamped) to be exact.
  uint32_t write(uint32_t b, uint32_t heads, uint32_t pages, float* lse,
                 std::size_t stride) const noexcept {
    const __m512 t = _mm512_load_ps(total[b]);
    const __m512 out = _mm512_add_ps(log_ps(t), _mm512_load_ps(shift[b]));
    const __mmask16 row_used = static_cast<__mmask16>((1u << used[b]) - 1);
    __mmask16 rows = 0;
    for (uint32_t h = 0; h < heads; ++h) {
      rows |= static_cast<__mmask16>(row_used << (h * pages));
      _mm512_mask_storeu_ps(lse + h * stride + first[b], row_used,
                            _mm512_maskz_compress_ps(row_used << (h * pages), out));
    }
    return (_mm512_cmp_ps_mask(t, _mm512_set1_ps(0x1p80f), _CMP_NLE_UQ) |
            _mm512_cmp_ps_mask(t, _mm512_set1_ps(0x1p-60f), _CMP_NGE_UQ)) &
           rows;
  }
};

template <uint32_t d, uint32_t NG>
struct Block {
  static constexpr uint32_t nq = d / 32;  // quarters per V column
  static constexpr uint32_t HQ = (NG + 3) / 4;
  static constexpr uint32_t P = W / NG;  // pages per reduction of the ring

  // The int32 products of four V columns (clamped to the last one past the rank) with the NG
  // heads' codes, less the bias: acc[g] lane k holds column k's partial sums. (Two groups per
  // pass over the query codes, each code load feeding two vpdpbusd, measured 4% slower.)
  static void column_group(const std::byte* v, uint32_t first, uint32_t r, const QueryCodes& codes,
                           __m512i* acc) noexcept {
    // Left alone, GCC hoists the query operands out of the page loop, spills them and copies them
    // back every page; hidden behind an empty asm they stay vpdpbusd's memory operands.
    const QueryCodes* q = &codes;
    asm("" : "+r"(q));
    const QueryCodes& qc = *q;
    const __m512i eight = _mm512_set1_epi8(0x08), low = _mm512_set1_epi8(0x0f);
    const std::byte* col[4];
    for (uint32_t k = 0; k < 4; ++k)
      col[k] = v + std::size_t{first + k < r ? first + k : r - 1} * (d / 2);
    for (uint32_t g = 0; g < NG; ++g) acc[g] = _mm512_setzero_si512();
    auto step = [&](__m512i o, uint32_t s) {
      // (x xor 8) and 15: ternary-logic table 0x28 = (a xor b) and c.
      const __m512i lo = _mm512_ternarylogic_epi32(o, eight, low, 0x28);
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(o, 4), eight, low, 0x28);
      for (uint32_t g = 0; g < NG; ++g) {
        acc[g] = _mm512_dpbusd_epi32(acc[g], lo, _mm512_load_si512(qc.lo[g][s]));
        acc[g] = _mm512_dpbusd_epi32(acc[g], hi, _mm512_load_si512(qc.hi[g][s]));
      }
    };
    if constexpr (d == 64) {
      // A column is two quarters: pairs of columns fill a register.
      auto pair = [](const std::byte* a, const std::byte* b) {
        const __m512i x =
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
        return _mm512_inserti64x4(x, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
      };
      const __m512i p0 = pair(col[0], col[1]), p2 = pair(col[2], col[3]);
      step(_mm512_shuffle_i64x2(p0, p2, 0x88), 0);
      step(_mm512_shuffle_i64x2(p0, p2, 0xDD), 1);
    } else {
      for (uint32_t s0 = 0; s0 < nq; s0 += 4) {
        __m512i x[4];
        for (uint32_t k = 0; k < 4; ++k) x[k] = _mm512_loadu_si512(col[k] + 16 * s0);
        const __m512i p0 = _mm512_shuffle_i64x2(x[0], x[1], 0x44);
        const __m512i p1 = _mm512_shuffle_i64x2(x[0], x[1], 0xEE);
        const __m512i p2 = _mm512_shuffle_i64x2(x[2], x[3], 0x44);
        const __m512i p3 = _mm512_shuffle_i64x2(x[2], x[3], 0xEE);
        step(_mm512_shuffle_i64x2(p0, p2, 0x88), s0);
        step(_mm512_shuffle_i64x2(p0, p2, 0xDD), s0 + 1);
        step(_mm512_shuffle_i64x2(p1, p3, 0x88), s0 + 2);
        step(_mm512_shuffle_i64x2(p1, p3, 0xDD), s0 + 3);
      }
    }
  }

  // Heads 4p .. 4p + 3 of acc (zero past NG) summed per 128-bit lane: lane 4k + h.
  static __m512i quad_sum(const __m512i* acc, uint32_t p) noexcept {
    __m512i a[4];
    for (uint32_t h = 0; h < 4; ++h)
      a[h] = 4 * p + h < NG ? acc[4 * p + h] : _mm512_setzero_si512();
    return sum4_epi32(a[0], a[1], a[2], a[3]);
  }

  // A page's z as [column group][quad][column k][head h], in log2 units, and mu . q~ as
  // [quad][head h] (lanes 0..3 of each quad's 16), in natural units: both times s_q, the record's
  // scales and the attention scale.
  static void dots(const std::byte* rec, const LocksRecordLayout& layout, uint32_t r,
                   const QueryCodes& qc, float* z, float* mu_q) noexcept {
    const uint32_t groups = (r + 3) / 4;
    for (uint32_t grp = 0; grp < groups; ++grp) {
      __m512i acc[NG];
      column_group(rec + layout.v_codes, 4 * grp, r, qc, acc);
      // Columns past the rank get z = 0, so that the logits can take whole groups.
      const __m512 v_scale = bf16_quads(rec + layout.v_scales + 8 * grp, r - 4 * grp);
      for (uint32_t p = 0; p < HQ; ++p) {
        const __m512i sum = _mm512_add_epi32(quad_sum(acc, p), _mm512_load_si512(qc.v_bias[p]));
        _mm512_store_ps(z + (grp * HQ + p) * W,
                        _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), v_scale),
                                      _mm512_load_ps(qc.z_scale[p])));
      }
    }
    const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i acc[NG];
    for (uint32_t g = 0; g < NG; ++g) acc[g] = _mm512_setzero_si512();
    for (uint32_t c = 0; c < d; c += 64) {
      const __m512i mu = _mm512_xor_si512(_mm512_loadu_si512(rec + layout.mu_codes + c), bias);
      for (uint32_t g = 0; g < NG; ++g)
        acc[g] = _mm512_dpbusd_epi32(acc[g], mu, _mm512_load_si512(qc.codes[g] + c));
    }
    const __m512 mu_scale = _mm512_set1_ps(bf16_at(rec + layout.mu_scale));
    for (uint32_t p = 0; p < HQ; ++p) {
      __m512i t = quad_sum(acc, p);
      t = _mm512_add_epi32(t, _mm512_shuffle_i64x2(t, t, 0x4E));
      t = _mm512_add_epi32(t, _mm512_shuffle_i64x2(t, t, 0xB1));
      t = _mm512_add_epi32(t, _mm512_load_si512(qc.mu_bias[p]));
      _mm512_store_ps(mu_q + p * W, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(t), mu_scale),
                                                  _mm512_load_ps(qc.mu_scale[p])));
    }
  }

  // Tokens t0 .. t0 + W - 1's logits less mu . q~, in log2 units, for every head. One conversion
  // of a C component serves every head; small groups split the sum over j in two chains.
  static void deviations(const std::byte* rec, const LocksRecordLayout& layout, uint32_t B,
                         uint32_t r, const float* z, uint32_t t0, __m512* out) noexcept {
    constexpr uint32_t LA = NG <= 4 ? 2 : 1;
    const std::byte* c_codes = rec + layout.c_codes + t0;
    __m512 acc[LA][NG];
    for (uint32_t a = 0; a < LA; ++a)
      for (uint32_t g = 0; g < NG; ++g) acc[a][g] = _mm512_setzero_ps();
    // Whole groups of four components: the rows past the rank read the fields after C (at most
    // 3 * page_tokens bytes, inside the record) and meet z = 0.
    for (uint32_t grp = 0; grp < (r + 3) / 4; ++grp, c_codes += 4 * std::size_t{B}, z += HQ * W)
      for (uint32_t k = 0; k < 4; ++k) {
        const __m512 ck = load_i8(c_codes + k * std::size_t{B});
        for (uint32_t g = 0; g < NG; ++g)
          acc[k % LA][g] =
              _mm512_fmadd_ps(ck, _mm512_set1_ps(z[(g / 4) * W + 4 * k + g % 4]), acc[k % LA][g]);
      }
    const __m512 c_scale = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + layout.c_scales + 2 * t0))),
        16));
    for (uint32_t g = 0; g < NG; ++g) {
      __m512 sum = acc[0][g];
      for (uint32_t a = 1; a < LA; ++a) sum = _mm512_add_ps(sum, acc[a][g]);
      out[g] = _mm512_mul_ps(sum, c_scale);
    }
  }

  // A page's logits and every head's sum of exps into row head * P + j of the ring. The shift is
  // mu . q~, the centroid's logit (no horizontal max per head and page, which costs more than the
  // exps, and no subtraction): the logits of a page's centered keys average about it, so some lie
  // above it, and none far. Ring::write reports the rare (page, head) where that fails.
  static void sums(const std::byte* rec, const LocksRecordLayout& layout, uint32_t B, uint32_t r,
                   const float* z, const float* mu_q, Ring& ring, uint32_t batch,
                   uint32_t j) noexcept {
    __m512 sum[NG], x[NG];
    deviations(rec, layout, B, r, z, 0, x);
    for (uint32_t g = 0; g < NG; ++g) sum[g] = exp2_ps(clamp125(x[g]));
    for (uint32_t t0 = W; t0 < B; t0 += W) {
      deviations(rec, layout, B, r, z, t0, x);
      for (uint32_t g = 0; g < NG; ++g) sum[g] = _mm512_add_ps(sum[g], exp2_ps(clamp125(x[g])));
    }
    for (uint32_t g = 0; g < NG; ++g) {
      ring.sum[g * P + j] = sum[g];
      ring.shift[batch][g * P + j] = mu_q[(g / 4) * W + g % 4];
    }
  }

  // Head g's score of one page shifted by the largest logit: the slow path, for pages where the
  // centroid's logit is no shift.
  [[gnu::noinline]] static float exact(const std::byte* rec, const LocksRecordLayout& layout,
                                       uint32_t B, uint32_t r, const QueryCodes& qc,
                                       uint32_t g) noexcept {
    alignas(64) float z[kMaxColumnGroups * kMaxHeadQuads * W];
    alignas(64) float mu_q[kMaxHeadQuads * W];
    dots(rec, layout, r, qc, z, mu_q);
    __m512 x[kMaxPageTokens / W][NG];
    for (uint32_t t0 = 0; t0 < B; t0 += W) deviations(rec, layout, B, r, z, t0, x[t0 / W]);
    __m512 mx = x[0][g];
    for (uint32_t t = 1; t < B / W; ++t) mx = _mm512_max_ps(mx, x[t][g]);
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (uint32_t t = 0; t < B / W; ++t)
      sum = _mm512_add_ps(sum, exp2_ps(clamp125(_mm512_sub_ps(x[t][g], m))));
    // ln(sum) + m ln 2 + mu . q~; the sum is >= 1.
    const __m512 ln_sum = log_ps(_mm512_set1_ps(_mm512_reduce_add_ps(sum)));
    return _mm512_cvtss_f32(_mm512_fmadd_ps(m, _mm512_set1_ps(0.693147180559945309f), ln_sum)) +
           mu_q[(g / 4) * W + g % 4];
  }

  // The ring's first `batches` batches out, the failed rows scored again.
  static void write(const Ring& ring, uint32_t batches, const LocksScoreJob& job,
                    const LocksRecordLayout& layout, const QueryCodes& qc, float* lse) noexcept {
    for (uint32_t b = 0; b < batches; ++b) {
      uint32_t bad = ring.write(b, NG, P, lse, job.count);
      for (; bad != 0; bad &= bad - 1) {
        const uint32_t k = static_cast<uint32_t>(__builtin_ctz(bad)), g = k / P;
        const uint32_t i = ring.first[b] + k % P;
        const std::byte* rec = job.records + std::size_t{job.slots[i]} * job.record_bytes;
        lse[g * std::size_t{job.count} + i] = exact(rec, layout, job.page_tokens, job.rank, qc, g);
      }
    }
  }

  // Flattened: past GCC's inlining budget the helpers above become calls that pass vectors
  // through memory.
  [[gnu::flatten]] static void score(const LocksScoreJob& job, const LocksRecordLayout& layout,
                                     const QueryCodes& qc, float* lse) noexcept {
    const uint32_t B = job.page_tokens, r = job.rank;
    const uint32_t lines = static_cast<uint32_t>(job.record_bytes / 64);
    alignas(64) float z[kMaxColumnGroups * kMaxHeadQuads * W];
    alignas(64) float mu_q[kMaxHeadQuads * W];
    Ring ring;
    uint32_t first = 0, batch = 0;  // the ring's rows hold pages first .. i - 1
    for (uint32_t i = 0; i < job.count; ++i) {
      if (i + kPrefetchPages < job.count) {
        const char* ahead = reinterpret_cast<const char*>(
            job.records + std::size_t{job.slots[i + kPrefetchPages]} * job.record_bytes);
        for (uint32_t l = 0; l < lines; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
      }
      // Both per page: issuing page i + 1's integer products before page i's logits measured no
      // faster, nor did batching the pages (all their products, then all their logits).
      const std::byte* rec = job.records + std::size_t{job.slots[i]} * job.record_bytes;
      dots(rec, layout, r, qc, z, mu_q);
      sums(rec, layout, B, r, z, mu_q, ring, batch, i - first);
      if (i + 1 - first == P || i + 1 == job.count) {
        ring.reduce(batch, first, i + 1 - first);
        first = i + 1;
        if (++batch == kRingBatches || i + 1 == job.count) {
          write(ring, batch, job, layout, qc, lse);
          batch = 0;
        }
      }
    }
  }
};

template <uint32_t d>
void score_heads(const LocksScoreJob& job, const LocksRecordLayout& layout, const QueryCodes& qc,
                 uint32_t ng, float* lse) noexcept {
  static_assert(kLocksHeadBlock == 8, "the switch covers blocks of up to 8 heads");
  switch (ng) {
    case 1: Block<d, 1>::score(job, layout, qc, lse); break;
    case 2: Block<d, 2>::score(job, layout, qc, lse); break;
    case 3: Block<d, 3>::score(job, layout, qc, lse); break;
    case 4: Block<d, 4>::score(job, layout, qc, lse); break;
    case 5: Block<d, 5>::score(job, layout, qc, lse); break;
    case 6: Block<d, 6>::score(job, layout, qc, lse); break;
    case 7: Block<d, 7>::score(job, layout, qc, lse); break;
    default: Block<d, 8>::score(job, layout, qc, lse); break;
  }
}

}  // namespace

void locks_score_avx512_vnni(const LocksScoreJob& job) noexcept {
  const LocksRecordLayout layout = locks_record_layout(job.head_dim, job.page_tokens, job.rank);
  QueryCodes qc;
  for (uint32_t g0 = 0; g0 < job.group; g0 += kLocksHeadBlock) {
    const uint32_t left = job.group - g0;
    const uint32_t ng = left < kLocksHeadBlock ? left : kLocksHeadBlock;
    prepare(job, g0, ng, qc);
    float* lse = job.lse + std::size_t{g0} * job.count;
    switch (job.head_dim) {
      case 64: score_heads<64>(job, layout, qc, ng, lse); break;
      case 128: score_heads<128>(job, layout, qc, ng, lse); break;
      default: score_heads<256>(job, layout, qc, ng, lse); break;
    }
  }
}

}  // namespace kvsift::simd
