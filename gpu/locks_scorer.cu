// LOCKS page selection on CUDA (gpu/locks_scorer.hpp has the contract; the CPU original is
// PageSelector::select_pair in lib/select/page_selector.cpp, the score simd's locks_score).
//
// Two kernels per run. score_kernel: one thread per sealed page and block of up to 8 query heads
// (grid y = pair, z = head block), the record read straight from global memory in 16-byte loads;
// V^T q~ by dp4a on V's nibbles biased by +8 (n ^ 8 in 0..15, the bias taken out with
// 8 * sum(q codes), as the VNNI kernel does), mu . q~ by dp4a on the int8 codes, both exact in
// int32; then the B logits twice (their max, then the sum of exps), so no logit array lives in
// registers. select_kernel: one CTA per pair, every step a pass over the pair's pages: the open
// page's exact log-sum-exp, per head the best selectable score and the mass sum, the combined
// score, a radix select (8 bits a pass, stopping as soon as the bin holding the b-th key is taken
// whole) of the b-th largest key (combined score's ordered bits, then the complement of the page
// id, so that equal scores go to the lower page, as the CPU's BetterPage), an ordered compaction
// of the chosen pages (warp ballots), and the kept estimate. A pair's passes are O(pages) each,
// about 15 of them: at 65,536 pages a few tens of microseconds per CTA, the pairs in parallel.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "gpu/cuda_result.cuh"
#include "gpu/locks_scorer.hpp"
#include "simd/locks_record.hpp"

namespace kvsift::gpu {
namespace {

constexpr uint32_t kRank = 8;
constexpr uint32_t kMaxHeadDim = 256;
constexpr uint32_t kMaxPageTokens = 64;
constexpr uint32_t kMaxGroup = 64;
constexpr uint32_t kScoreThreads = 128;
constexpr uint32_t kSelectThreads = 512;
constexpr uint32_t kFull = 0xffffffffu;

Result from_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Result{};
  return cuda_result(err, std::string("locks scorer: ") + what);
}

Result invalid(const std::string& message) {
  return Result{false, false, "locks scorer: " + message};
}

std::size_t align16(std::size_t n) {
  return (n + 15) / 16 * 16;
}

// One device pair of a run, as the kernels read it.
struct PairParams {
  uint64_t head_at;   // its per-head scores at head + head_at: [group][n_pages]
  uint32_t table_at;  // its sealed pages' slots at tables + table_at
  uint32_t comb_at;   // its combined scores at combined + comb_at: [n_pages]
  uint32_t out_at;    // its chosen pages at ids / scores + out_at
  uint32_t open_at;   // its open page's keys at keys + open_at (when open_tokens > 0)
  uint32_t n_pages, sealed, sink, sel_last, take, open_tokens;
  uint32_t index;  // the pair's index in the call (its estimate's place)
  uint32_t pad;
};

// Everything a kernel needs, by value.
struct RunView {
  const PairParams* params;
  const float* qf;      // [pairs][group][d] unscaled queries (the open page's exact score)
  const float* qs;      // [pairs][group] s_q * scale
  const int8_t* codes;  // [pairs][group][d] int8 query codes
  const uint32_t* tables;
  const uint16_t* keys;  // open pages' keys, [page_tokens * d] per open pair
  const unsigned char* records;
  float* head;
  float* combined;
  uint32_t* ids;
  float* scores;
  float* kept;
  uint32_t slots, record_bytes;
  uint32_t group, head_dim, page_tokens;
  uint32_t mu_codes, c_codes, v_scales, c_scales, mu_scale;  // record offsets
  uint32_t combine, bf16;
  float scale;
};

__device__ __forceinline__ float bf16_at(const unsigned char* p) {
  const uint32_t bits = uint32_t(p[0]) | uint32_t(p[1]) << 8;
  return __uint_as_float(bits << 16);
}

__device__ __forceinline__ float key_value(uint16_t x, uint32_t bf16) {
  return bf16 ? __uint_as_float(uint32_t(x) << 16) : __half2float(__ushort_as_half(x));
}

// Page scores of heads [blockIdx.z * GB, +GB) of pair blockIdx.y for its sealed pages.
template <int GB>
__global__ void __launch_bounds__(kScoreThreads) score_kernel(RunView v) {
  __shared__ uint32_t qe[GB][kMaxHeadDim / 8];  // codes of the even channels, V's low nibbles
  __shared__ uint32_t qo[GB][kMaxHeadDim / 8];  // odd channels, V's high nibbles
  __shared__ uint32_t qc[GB][kMaxHeadDim / 4];  // channel order, for mu
  __shared__ int32_t qsum[GB];
  __shared__ float qs[GB];
  const PairParams& p = v.params[blockIdx.y];
  const uint32_t sealed = p.sealed;
  if (blockIdx.x * kScoreThreads >= sealed) return;  // the whole block: no barrier is missed
  const uint32_t d = v.head_dim, G = v.group, B = v.page_tokens, g0 = blockIdx.z * GB;
  const int8_t* codes = v.codes + std::size_t{blockIdx.y} * G * d;
  for (uint32_t i = threadIdx.x; i < GB * (d / 8); i += kScoreThreads) {
    const uint32_t g = i / (d / 8), w = i % (d / 8);
    uint32_t e = 0, o = 0, c0 = 0, c1 = 0;
    if (g0 + g < G) {
      const int8_t* c = codes + std::size_t{g0 + g} * d + 8 * w;
      for (uint32_t k = 0; k < 4; ++k) {
        e |= uint32_t(uint8_t(c[2 * k])) << (8 * k);
        o |= uint32_t(uint8_t(c[2 * k + 1])) << (8 * k);
        c0 |= uint32_t(uint8_t(c[k])) << (8 * k);
        c1 |= uint32_t(uint8_t(c[4 + k])) << (8 * k);
      }
    }
    qe[g][w] = e;
    qo[g][w] = o;
    qc[g][2 * w] = c0;
    qc[g][2 * w + 1] = c1;
  }
  if (threadIdx.x < GB) {
    const uint32_t g = threadIdx.x;
    int32_t s = 0;
    float f = 0.0f;
    if (g0 + g < G) {
      for (uint32_t c = 0; c < d; ++c) s += codes[std::size_t{g0 + g} * d + c];
      f = v.qs[std::size_t{blockIdx.y} * G + g0 + g];
    }
    qsum[g] = s;
    qs[g] = f;
  }
  __syncthreads();
  const uint32_t page = blockIdx.x * kScoreThreads + threadIdx.x;
  if (page >= sealed) return;
  const uint32_t slot = v.tables[p.table_at + page];
  float lse[GB];
  if (slot >= v.slots) {  // validate() does not read the tables: a bad slot ranks last
#pragma unroll
    for (int g = 0; g < GB; ++g) lse[g] = __int_as_float(0x7fc00000);
  } else {
    const unsigned char* rec = v.records + std::size_t{slot} * v.record_bytes;
    // z_j = s_q scale v_scale_j sum_c V_code[c, j] q_code[c], exact up to the last product.
    float z[kRank][GB];
#pragma unroll
    for (int j = 0; j < int(kRank); ++j) {
      const uint4* column = reinterpret_cast<const uint4*>(rec + j * (d / 2));
      int acc[GB];
#pragma unroll
      for (int g = 0; g < GB; ++g) acc[g] = 0;
      for (uint32_t u = 0; u < d / 32; ++u) {
        const uint4 x = __ldg(column + u);
        const uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint32_t biased = words[k] ^ 0x88888888u;
          const int lo = int(biased & 0x0f0f0f0fu), hi = int((biased >> 4) & 0x0f0f0f0fu);
          const uint32_t w = 4 * u + k;
#pragma unroll
          for (int g = 0; g < GB; ++g) {
            acc[g] = __dp4a(lo, int(qe[g][w]), acc[g]);
            acc[g] = __dp4a(hi, int(qo[g][w]), acc[g]);
          }
        }
      }
      const float v_scale = bf16_at(rec + v.v_scales + 2 * j);
#pragma unroll
      for (int g = 0; g < GB; ++g) z[j][g] = float(acc[g] - 8 * qsum[g]) * (v_scale * qs[g]);
    }
    float mu_q[GB];
    {
      const uint4* mu = reinterpret_cast<const uint4*>(rec + v.mu_codes);
      int acc[GB];
#pragma unroll
      for (int g = 0; g < GB; ++g) acc[g] = 0;
      for (uint32_t u = 0; u < d / 16; ++u) {
        const uint4 x = __ldg(mu + u);
        const uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int k = 0; k < 4; ++k)
#pragma unroll
          for (int g = 0; g < GB; ++g)
            acc[g] = __dp4a(int(words[k]), int(qc[g][4 * u + k]), acc[g]);
      }
      const float mu_scale = bf16_at(rec + v.mu_scale);
#pragma unroll
      for (int g = 0; g < GB; ++g) mu_q[g] = float(acc[g]) * (mu_scale * qs[g]);
    }
    // lse = mu . q~ scale + max_t l_t + log sum_t e^(l_t - max), l_t = c_scale_t (c_t . z).
    float top[GB], sum[GB];
#pragma unroll
    for (int g = 0; g < GB; ++g) top[g] = -INFINITY, sum[g] = 0.0f;
    for (int pass = 0; pass < 2; ++pass) {
      for (uint32_t t4 = 0; t4 < B; t4 += 4) {
        uint32_t cw[kRank];
#pragma unroll
        for (int j = 0; j < int(kRank); ++j)
          cw[j] = __ldg(reinterpret_cast<const unsigned int*>(rec + v.c_codes + j * B + t4));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float c_scale = bf16_at(rec + v.c_scales + 2 * (t4 + k));
          float c[kRank];
#pragma unroll
          for (int j = 0; j < int(kRank); ++j) c[j] = float(int8_t(cw[j] >> (8 * k)));
#pragma unroll
          for (int g = 0; g < GB; ++g) {
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < int(kRank); ++j) dot += c[j] * z[j][g];
            const float logit = dot * c_scale;
            if (pass == 0)
              top[g] = fmaxf(top[g], logit);
            else
              sum[g] += expf(logit - top[g]);
          }
        }
      }
    }
#pragma unroll
    for (int g = 0; g < GB; ++g) lse[g] = mu_q[g] + (top[g] + logf(sum[g]));
  }
#pragma unroll
  for (int g = 0; g < GB; ++g)
    if (g0 + g < G) v.head[p.head_at + std::size_t{g0 + g} * p.n_pages + page] = lse[g];
}

// Reduces x over the block (every thread must call; `red` is 32 elements of shared memory).
template <class T, class Op>
__device__ T block_reduce(T x, Op op, T identity, T* red) {
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (uint32_t off = 16; off > 0; off /= 2) x = op(x, __shfl_xor_sync(kFull, x, off));
  if (lane == 0) red[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < blockDim.x / 32 ? red[lane] : identity;
    for (uint32_t off = 16; off > 0; off /= 2) x = op(x, __shfl_xor_sync(kFull, x, off));
    if (lane == 0) red[0] = x;
  }
  __syncthreads();
  const T r = red[0];
  __syncthreads();
  return r;
}

struct MaxF {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumD {
  __device__ double operator()(double a, double b) const { return a + b; }
};

// Orders floats as unsigned integers (no NaN here: the combine maps NaN to -inf).
__device__ __forceinline__ uint64_t page_key(float score, uint32_t page) {
  const uint32_t u = __float_as_uint(score == 0.0f ? 0.0f : score);  // -0 ties +0, as on the CPU
  const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return uint64_t{ordered} << 32 | (0xffffffffu - page);
}

__global__ void __launch_bounds__(kSelectThreads) select_kernel(RunView v) {
  __shared__ float logits[kMaxGroup * kMaxPageTokens];
  __shared__ float top[kMaxGroup];
  __shared__ double mass[kMaxGroup];
  __shared__ float red_f[32];
  __shared__ double red_d[32];
  __shared__ uint32_t hist[256];
  __shared__ uint32_t warp_at[kSelectThreads / 32 + 1];
  __shared__ uint64_t s_prefix;
  __shared__ uint32_t s_bits, s_k, s_done, s_written;
  const PairParams& p = v.params[blockIdx.x];
  const uint32_t G = v.group, d = v.head_dim, B = v.page_tokens, n = p.n_pages;
  const uint32_t first = p.sink, last = p.sel_last, tid = threadIdx.x;
  float* head = v.head + p.head_at;
  float* comb = v.combined + p.comb_at;

  // The open page's exact log-sum-exp per head, as PageSelector::exact_page_lse (float32, one
  // rounded product and add per channel).
  if (p.open_tokens > 0) {
    const uint32_t nt = p.open_tokens;
    const float* q = v.qf + std::size_t{blockIdx.x} * G * d;
    const uint16_t* keys = v.keys + p.open_at;
    for (uint32_t i = tid; i < G * nt; i += blockDim.x) {
      const uint32_t h = i / nt, t = i % nt;
      float dot = 0.0f;
      for (uint32_t c = 0; c < d; ++c)
        dot = __fadd_rn(dot, __fmul_rn(q[h * d + c], key_value(keys[t * d + c], v.bf16)));
      logits[h * B + t] = __fmul_rn(dot, v.scale);
    }
    __syncthreads();
    for (uint32_t h = tid; h < G; h += blockDim.x) {
      float best = -INFINITY;
      for (uint32_t t = 0; t < nt; ++t) best = fmaxf(best, logits[h * B + t]);
      float sum = 0.0f;
      for (uint32_t t = 0; t < nt; ++t) sum += expf(logits[h * B + t] - best);
      head[std::size_t{h} * n + p.sealed] = best + logf(sum);
    }
    __syncthreads();
  }

  // masses(): per head the best selectable score and the sum of e^(score - best).
  for (uint32_t h = 0; h < G; ++h) {
    const float* sh = head + std::size_t{h} * n;
    float best = -INFINITY;
    for (uint32_t q = first + tid; q < last; q += blockDim.x) best = fmaxf(best, sh[q]);
    best = block_reduce(best, MaxF{}, -INFINITY, red_f);
    double sum = 0.0;
    for (uint32_t q = first + tid; q < last; q += blockDim.x) sum += double(expf(sh[q] - best));
    sum = block_reduce(sum, SumD{}, 0.0, red_d);
    if (tid == 0) top[h] = best, mass[h] = sum;
  }
  __syncthreads();

  // combine(), in the CPU's order of heads and roundings.
  for (uint32_t q = first + tid; q < last; q += blockDim.x) {
    float S;
    if (v.combine == uint32_t(LocksCombine::max)) {
      S = -INFINITY;
      for (uint32_t h = 0; h < G; ++h) S = fmaxf(S, head[std::size_t{h} * n + q]);
    } else {
      S = 0.0f;
      for (uint32_t h = 0; h < G; ++h) {
        const float m = expf(head[std::size_t{h} * n + q] - top[h]);
        const float w = v.combine == uint32_t(LocksCombine::share_avg)
                            ? __fdiv_rn(1.0f, __fmul_rn(float(mass[h]), float(G)))
                            : 1.0f;
        S = __fadd_rn(S, __fmul_rn(m, w));
      }
    }
    comb[q] = isnan(S) ? -INFINITY : S;
  }
  __syncthreads();

  // The take-th largest key among the selectable pages.
  const uint32_t n_sel = last - first, take = p.take;
  if (tid == 0) {
    s_prefix = 0;
    s_bits = 0;
    s_k = take;
    s_done = take == 0 || take == n_sel;
  }
  __syncthreads();
  while (!s_done) {
    const uint32_t bits = s_bits;
    const uint64_t prefix = s_prefix;
    const uint32_t shift = 56 - bits;
    for (uint32_t i = tid; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    // Warp-aggregated: the scores of a long tail share their high bits, and 32 lanes adding to
    // one shared counter would serialise.
    for (uint32_t base = first; base < last; base += blockDim.x) {
      const uint32_t q = base + tid;
      uint32_t bin = 256;  // no bin: past the pages, or outside the prefix
      if (q < last) {
        const uint64_t key = page_key(comb[q], q);
        if (bits == 0 || (key >> (64 - bits)) == prefix) bin = uint32_t(key >> shift) & 255;
      }
      const uint32_t same = __match_any_sync(kFull, bin);
      if (bin < 256 && tid % 32 == uint32_t(__ffs(same) - 1))
        atomicAdd(&hist[bin], uint32_t(__popc(same)));
    }
    __syncthreads();
    if (tid == 0) {
      const uint32_t k = s_k;
      uint32_t above = 0;
      int b = 255;
      for (; b > 0; --b) {
        if (above + hist[b] >= k) break;
        above += hist[b];
      }
      s_k = k - above;
      s_prefix = prefix << 8 | uint32_t(b);
      s_bits = bits + 8;
      s_done = hist[b] == s_k || s_bits == 64;
    }
    __syncthreads();
  }
  const uint32_t bits = s_bits;
  const uint64_t prefix = s_prefix;
  const auto chosen = [&](uint32_t q) {
    if (take == 0) return false;
    if (take == n_sel) return true;
    return (page_key(comb[q], q) >> (64 - bits)) >= prefix;
  };

  // Ordered compaction: the chosen pages, ascending, with their scores.
  const uint32_t lane = tid % 32, warp = tid / 32, warps = blockDim.x / 32;
  if (tid == 0) s_written = 0;
  __syncthreads();
  for (uint32_t base = 0; base < n; base += blockDim.x) {
    const uint32_t q = base + tid;
    bool keep = false;
    float score = INFINITY;
    if (q < n) {
      if (q < first || q >= last)
        keep = true;
      else if (chosen(q))
        keep = true, score = comb[q];
    }
    const uint32_t ballot = __ballot_sync(kFull, keep);
    if (lane == 0) warp_at[warp] = __popc(ballot);
    __syncthreads();
    if (tid == 0) {
      uint32_t at = s_written;
      for (uint32_t w = 0; w < warps; ++w) {
        const uint32_t c = warp_at[w];
        warp_at[w] = at;
        at += c;
      }
      s_written = at;
    }
    __syncthreads();
    if (keep) {
      const uint32_t at = p.out_at + warp_at[warp] + __popc(ballot & ((1u << lane) - 1u));
      v.ids[at] = q;
      v.scores[at] = score;
    }
    __syncthreads();
  }

  // The kept estimate, averaged over the heads: (kept + mandatory) / (selectable + mandatory).
  double kept_sum = 0.0;
  for (uint32_t h = 0; h < G; ++h) {
    const float* sh = head + std::size_t{h} * n;
    double kept = 0.0, mandatory = 0.0;
    for (uint32_t q = tid; q < n; q += blockDim.x) {
      if (q < first || q >= last)
        mandatory += exp(double(sh[q]) - double(top[h]));
      else if (chosen(q))
        kept += double(expf(sh[q] - top[h]));
    }
    kept = block_reduce(kept, SumD{}, 0.0, red_d);
    mandatory = block_reduce(mandatory, SumD{}, 0.0, red_d);
    kept_sum += (kept + mandatory) / (mass[h] + mandatory);
  }
  if (tid == 0) v.kept[p.index] = float(kept_sum / G);
}

// Copies n staged records to their slots: block i takes record i.
__global__ void scatter_kernel(const uint4* __restrict__ staged, const uint32_t* __restrict__ slots,
                               unsigned char* __restrict__ records, uint32_t record_bytes) {
  const uint32_t words = record_bytes / 16;
  uint4* to = reinterpret_cast<uint4*>(records + std::size_t{slots[blockIdx.x]} * record_bytes);
  const uint4* from = staged + std::size_t{blockIdx.x} * words;
  for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) to[i] = from[i];
}

}  // namespace

struct LocksScorer::Device {
  int device = 0;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  simd::LocksRecordLayout layout{};
  unsigned char* records = nullptr;  // [slots][record_bytes]
  // Upload staging: kLocksUploadChunk records, then their slots.
  unsigned char* upload_host = nullptr;
  unsigned char* upload_device = nullptr;
  // Run staging (packed per run) and its capacity.
  unsigned char* staging_host = nullptr;
  unsigned char* staging_device = nullptr;
  std::size_t staging_bytes = 0;
  float* head = nullptr;      // [group * max_pages]
  float* combined = nullptr;  // [max_pages]
  // The result: estimates [max_pairs, padded to 4], then ids and scores [max_pages] each.
  unsigned char* out_device = nullptr;
  unsigned char* out_host = nullptr;
  std::size_t out_bytes = 0;
  // The last run.
  std::vector<LocksPairPlan> plans;
  std::vector<uint32_t> offsets;  // [n_pairs + 1]
  std::vector<uint64_t> head_at;  // per pair; ~0 for a pair filled on the host
  uint32_t n_pairs = 0, total_out = 0;

  ~Device() {
    cudaFree(records);
    cudaFreeHost(upload_host);
    cudaFree(upload_device);
    cudaFreeHost(staging_host);
    cudaFree(staging_device);
    cudaFree(head);
    cudaFree(combined);
    cudaFree(out_device);
    cudaFreeHost(out_host);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
  }
};

LocksScorer::~LocksScorer() {
  if (device_) cudaSetDevice(device_->device);
  delete device_;
}

LocksScorer::LocksScorer(LocksScorer&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)), shape_(other.shape_) {}

LocksScorer& LocksScorer::operator=(LocksScorer&& other) noexcept {
  if (this != &other) {
    delete device_;
    device_ = std::exchange(other.device_, nullptr);
    shape_ = other.shape_;
  }
  return *this;
}

namespace {

// Bytes of each run staging section at its capacity.
std::size_t staging_capacity(const LocksScorerShape& s) {
  const std::size_t P = s.max_pairs, G = s.group, d = s.head_dim;
  return align16(P * sizeof(PairParams)) + align16(P * G * d * 4) + align16(P * G * 4) +
         align16(P * G * d) + align16(s.max_pages * 4) + align16(P * s.page_tokens * d * 2);
}

}  // namespace

Result LocksScorer::init(int device, const LocksScorerShape& shape) {
  const auto num = [](uint64_t x) { return std::to_string(x); };
  if (shape.head_dim != 64 && shape.head_dim != 128 && shape.head_dim != 256)
    return invalid("head_dim=" + num(shape.head_dim) + " is not 64, 128 or 256");
  if (shape.page_tokens != 16 && shape.page_tokens != 32 && shape.page_tokens != 64)
    return invalid("page_tokens=" + num(shape.page_tokens) + " is not 16, 32 or 64");
  if (shape.rank != kRank) return invalid("rank=" + num(shape.rank) + " is not 8");
  if (shape.group == 0 || shape.group > kMaxGroup)
    return invalid("group=" + num(shape.group) + " is not in 1..64");
  if (shape.combine > LocksCombine::max) return invalid("combine is not a LocksCombine");
  if (!(shape.scale > 0.0f) || !std::isfinite(shape.scale)) return invalid("scale is not > 0");
  if (shape.slots == 0) return invalid("slots=0");
  if (shape.max_pairs == 0 || shape.max_pairs > 65535)
    return invalid("max_pairs=" + num(shape.max_pairs) + " is not in 1..65535");
  if (shape.max_pages == 0 || shape.max_pages >= (uint64_t{1} << 31))
    return invalid("max_pages=" + num(shape.max_pages) + " is not in 1..2^31 - 1");
  // The ordinal is checked against the count first: cudaSetDevice with a bad one is an API
  // error a sanitizer reports, and the message here is clearer.
  if (device < 0) return invalid("device=" + std::to_string(device) + " is negative");
  int n_devices = 0;
  if (Result r = device_count(&n_devices); !r.ok) return r;
  if (device >= n_devices)
    return invalid("device=" + std::to_string(device) + " is not in 0.." +
                   std::to_string(n_devices - 1));
  delete std::exchange(device_, nullptr);
  Result r = from_cuda(cudaSetDevice(device), "cudaSetDevice");
  if (!r.ok) return r;
  auto* d = new Device;
  d->device = device;
  d->layout = simd::locks_record_layout(shape.head_dim, shape.page_tokens, shape.rank);
  const std::size_t rb = d->layout.bytes;
  d->staging_bytes = staging_capacity(shape);
  d->out_bytes = (std::size_t{shape.max_pairs} + 4) / 4 * 16 + 8 * shape.max_pages;
  const std::size_t upload = kLocksUploadChunk * (rb + 4);
  r = from_cuda(cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking), "stream");
  if (r.ok) r = from_cuda(cudaEventCreate(&d->start), "event");
  if (r.ok) r = from_cuda(cudaEventCreate(&d->stop), "event");
  if (r.ok) r = from_cuda(cudaMalloc(&d->records, std::size_t{shape.slots} * rb), "records");
  if (r.ok)
    r = from_cuda(
        cudaHostAlloc(reinterpret_cast<void**>(&d->upload_host), upload, cudaHostAllocPortable),
        "pinned upload staging");
  if (r.ok) r = from_cuda(cudaMalloc(&d->upload_device, upload), "device upload staging");
  if (r.ok)
    r = from_cuda(cudaHostAlloc(reinterpret_cast<void**>(&d->staging_host), d->staging_bytes,
                                cudaHostAllocPortable),
                  "pinned staging");
  if (r.ok) r = from_cuda(cudaMalloc(&d->staging_device, d->staging_bytes), "device staging");
  if (r.ok)
    r = from_cuda(cudaMalloc(&d->head, std::size_t{shape.group} * shape.max_pages * 4),
                  "score workspace");
  if (r.ok) r = from_cuda(cudaMalloc(&d->combined, shape.max_pages * 4), "combined workspace");
  if (r.ok) r = from_cuda(cudaMalloc(&d->out_device, d->out_bytes), "result");
  if (r.ok)
    r = from_cuda(
        cudaHostAlloc(reinterpret_cast<void**>(&d->out_host), d->out_bytes, cudaHostAllocPortable),
        "pinned result");
  if (!r.ok) {
    delete d;
    return r;
  }
  d->plans.resize(shape.max_pairs);
  d->offsets.resize(std::size_t{shape.max_pairs} + 1);
  d->head_at.resize(shape.max_pairs);
  device_ = d;
  shape_ = shape;
  return r;
}

Result LocksScorer::upload(const std::byte* records, const uint32_t* slots,
                           std::size_t n) noexcept {
  if (!device_) return invalid("upload before init");
  for (std::size_t i = 0; i < n; ++i)
    if (slots[i] >= shape_.slots)
      return invalid("slot " + std::to_string(slots[i]) +
                     " is not below slots=" + std::to_string(shape_.slots));
  Device& dev = *device_;
  const std::size_t rb = dev.layout.bytes;
  Result r = from_cuda(cudaSetDevice(dev.device), "cudaSetDevice");
  for (std::size_t done = 0; r.ok && done < n;) {
    const std::size_t m = std::min<std::size_t>(kLocksUploadChunk, n - done);
    // The staging is reused chunk after chunk: the previous chunk's copy must have read it.
    r = from_cuda(cudaStreamSynchronize(dev.stream), "upload");
    if (!r.ok) break;
    for (std::size_t i = 0; i < m; ++i)
      std::memcpy(dev.upload_host + i * rb, records + std::size_t{slots[done + i]} * rb, rb);
    std::memcpy(dev.upload_host + m * rb, slots + done, m * 4);
    r = from_cuda(cudaMemcpyAsync(dev.upload_device, dev.upload_host, m * (rb + 4),
                                  cudaMemcpyHostToDevice, dev.stream),
                  "records upload");
    if (!r.ok) break;
    scatter_kernel<<<static_cast<unsigned>(m), 64, 0, dev.stream>>>(
        reinterpret_cast<const uint4*>(dev.upload_device),
        reinterpret_cast<const uint32_t*>(dev.upload_device + m * rb), dev.records,
        static_cast<uint32_t>(rb));
    r = from_cuda(cudaGetLastError(), "scatter launch");
    done += m;
  }
  if (r.ok) r = from_cuda(cudaStreamSynchronize(dev.stream), "upload");
  return r;
}

Result LocksScorer::validate(const LocksPair* pairs, uint32_t n_pairs) const {
  if (!device_) return invalid("run before init");
  if (n_pairs == 0 || n_pairs > shape_.max_pairs)
    return invalid(std::to_string(n_pairs) +
                   " pairs is not in 1..max_pairs=" + std::to_string(shape_.max_pairs));
  uint64_t pages = 0;
  for (uint32_t i = 0; i < n_pairs; ++i) {
    const LocksPair& pair = pairs[i];
    // The message is built only on failure: select() validates every step.
    const auto which = [i] { return "pair " + std::to_string(i) + ": "; };
    if (!pair.q || !pair.table) return invalid(which() + "a null pointer");
    if (pair.tokens % shape_.page_tokens != 0 && !pair.open_keys)
      return invalid(which() + "no keys for its open page");
    pages += (pair.tokens + shape_.page_tokens - 1) / shape_.page_tokens;
  }
  if (pages > shape_.max_pages)
    return invalid(std::to_string(pages) +
                   " pages is over max_pages=" + std::to_string(shape_.max_pages));
  return Result{};
}

Result LocksScorer::run(const LocksPair* pairs, uint32_t n_pairs) noexcept {
  Device& dev = *device_;
  const uint32_t G = shape_.group, d = shape_.head_dim, B = shape_.page_tokens;
  // Plans, output offsets and the sizes of this run's staging sections.
  uint32_t n_dev = 0, n_open = 0, max_sealed = 0;
  uint64_t sealed_total = 0, head_total = 0;
  dev.offsets[0] = 0;
  for (uint32_t i = 0; i < n_pairs; ++i) {
    const LocksPairPlan plan = locks_pair_plan(shape_, pairs[i].tokens, pairs[i].budget_tokens);
    dev.plans[i] = plan;
    dev.offsets[i + 1] = dev.offsets[i] + plan.count;
    dev.head_at[i] = ~uint64_t{0};
    if (plan.whole) continue;
    dev.head_at[i] = head_total;
    head_total += uint64_t{G} * plan.n_pages;
    ++n_dev;
    n_open += plan.sealed < plan.n_pages;
    sealed_total += plan.sealed;
    max_sealed = std::max(max_sealed, plan.sealed);
  }
  dev.n_pairs = n_pairs;
  dev.total_out = dev.offsets[n_pairs];
  const std::size_t kept_bytes = (std::size_t{n_pairs} + 3) / 4 * 16;
  auto* kept_host = reinterpret_cast<float*>(dev.out_host);
  auto* ids_host = reinterpret_cast<uint32_t*>(dev.out_host + kept_bytes);
  float* scores_host = reinterpret_cast<float*>(ids_host + dev.total_out);

  Result r = from_cuda(cudaSetDevice(dev.device), "cudaSetDevice");
  if (r.ok && n_dev > 0) {
    // Sections, packed: params, q floats, q scales, q codes, tables, open keys.
    const std::size_t at_params = 0;
    const std::size_t at_qf = at_params + align16(std::size_t{n_dev} * sizeof(PairParams));
    const std::size_t at_qs = at_qf + align16(std::size_t{n_dev} * G * d * 4);
    const std::size_t at_codes = at_qs + align16(std::size_t{n_dev} * G * 4);
    const std::size_t at_tables = at_codes + align16(std::size_t{n_dev} * G * d);
    const std::size_t at_keys = at_tables + align16(sealed_total * 4);
    const std::size_t bytes = at_keys + std::size_t{n_open} * B * d * 2;
    unsigned char* h = dev.staging_host;
    auto* params = reinterpret_cast<PairParams*>(h + at_params);
    auto* qf = reinterpret_cast<float*>(h + at_qf);
    auto* qs = reinterpret_cast<float*>(h + at_qs);
    auto* codes = reinterpret_cast<int8_t*>(h + at_codes);
    auto* tables = reinterpret_cast<uint32_t*>(h + at_tables);
    auto* keys = reinterpret_cast<uint16_t*>(h + at_keys);
    uint32_t k = 0, table_at = 0, open_at = 0, comb_at = 0;
    for (uint32_t i = 0; i < n_pairs; ++i) {
      const LocksPairPlan& plan = dev.plans[i];
      if (plan.whole) continue;
      const LocksPair& pair = pairs[i];
      PairParams& pp = params[k];
      pp = PairParams{};
      pp.head_at = dev.head_at[i];
      pp.table_at = table_at;
      pp.comb_at = comb_at;
      pp.out_at = dev.offsets[i];
      pp.open_at = open_at;
      pp.n_pages = plan.n_pages;
      pp.sealed = plan.sealed;
      pp.sink = plan.sink;
      pp.sel_last = plan.sel_last;
      pp.take = plan.take;
      pp.open_tokens = static_cast<uint32_t>(pair.tokens - uint64_t{plan.sealed} * B);
      pp.index = i;
      std::memcpy(qf + std::size_t{k} * G * d, pair.q, std::size_t{G} * d * 4);
      // The query codes exactly as simd's locks_score rounds them (attend_scalar.cpp,
      // locks_avx512_vnni.cpp): s_q = max|q| / 127 in float, nearbyint(q / s_q).
      for (uint32_t g = 0; g < G; ++g) {
        const float* x = pair.q + std::size_t{g} * d;
        float amax = 0.0f;
        bool finite = true;  // else the head's scores are NaN, and its pages rank last
        for (uint32_t c = 0; c < d; ++c) {
          amax = std::max(amax, std::fabs(x[c]));
          finite = finite && std::isfinite(x[c]);
        }
        const float s_q = amax / 127.0f;
        int8_t* out = codes + (std::size_t{k} * G + g) * d;
        for (uint32_t c = 0; c < d; ++c)
          out[c] =
              finite && s_q > 0.0f ? static_cast<int8_t>(std::nearbyint(x[c] / s_q)) : int8_t{0};
        qs[std::size_t{k} * G + g] =
            finite ? s_q * shape_.scale : std::numeric_limits<float>::quiet_NaN();
      }
      std::memcpy(tables + table_at, pair.table, std::size_t{plan.sealed} * 4);
      if (pp.open_tokens > 0) {
        std::memcpy(keys + open_at, pair.open_keys, std::size_t{pp.open_tokens} * d * 2);
        open_at += B * d;
      }
      table_at += plan.sealed;
      comb_at += plan.n_pages;
      ++k;
    }
    unsigned char* base = dev.staging_device;
    RunView view{};
    view.params = reinterpret_cast<const PairParams*>(base + at_params);
    view.qf = reinterpret_cast<const float*>(base + at_qf);
    view.qs = reinterpret_cast<const float*>(base + at_qs);
    view.codes = reinterpret_cast<const int8_t*>(base + at_codes);
    view.tables = reinterpret_cast<const uint32_t*>(base + at_tables);
    view.keys = reinterpret_cast<const uint16_t*>(base + at_keys);
    view.records = dev.records;
    view.head = dev.head;
    view.combined = dev.combined;
    view.kept = reinterpret_cast<float*>(dev.out_device);
    view.ids = reinterpret_cast<uint32_t*>(dev.out_device + kept_bytes);
    view.scores = reinterpret_cast<float*>(view.ids + dev.total_out);
    view.slots = shape_.slots;
    view.record_bytes = dev.layout.bytes;
    view.group = G;
    view.head_dim = d;
    view.page_tokens = B;
    view.mu_codes = dev.layout.mu_codes;
    view.c_codes = dev.layout.c_codes;
    view.v_scales = dev.layout.v_scales;
    view.c_scales = dev.layout.c_scales;
    view.mu_scale = dev.layout.mu_scale;
    view.combine = static_cast<uint32_t>(shape_.combine);
    view.bf16 = shape_.dtype == simd::Dtype::bf16;
    view.scale = shape_.scale;
    if (r.ok) r = from_cuda(cudaEventRecord(dev.start, dev.stream), "event");
    if (r.ok)
      r = from_cuda(cudaMemcpyAsync(dev.staging_device, dev.staging_host, bytes,
                                    cudaMemcpyHostToDevice, dev.stream),
                    "batch upload");
    if (r.ok && max_sealed > 0) {
      const uint32_t gb = G <= 1 ? 1 : G <= 2 ? 2 : G <= 4 ? 4 : 8;
      const dim3 grid((max_sealed + kScoreThreads - 1) / kScoreThreads, n_dev, (G + gb - 1) / gb);
      switch (gb) {
        case 1: score_kernel<1><<<grid, kScoreThreads, 0, dev.stream>>>(view); break;
        case 2: score_kernel<2><<<grid, kScoreThreads, 0, dev.stream>>>(view); break;
        case 4: score_kernel<4><<<grid, kScoreThreads, 0, dev.stream>>>(view); break;
        default: score_kernel<8><<<grid, kScoreThreads, 0, dev.stream>>>(view); break;
      }
      r = from_cuda(cudaGetLastError(), "score launch");
    }
    if (r.ok) {
      select_kernel<<<n_dev, kSelectThreads, 0, dev.stream>>>(view);
      r = from_cuda(cudaGetLastError(), "select launch");
    }
    if (r.ok)
      r = from_cuda(
          cudaMemcpyAsync(dev.out_host, dev.out_device, kept_bytes + std::size_t{dev.total_out} * 8,
                          cudaMemcpyDeviceToHost, dev.stream),
          "result download");
    if (r.ok) r = from_cuda(cudaEventRecord(dev.stop, dev.stream), "event");
    if (r.ok) r = from_cuda(cudaStreamSynchronize(dev.stream), "run");
  }
  if (!r.ok) return r;
  // The pairs attended whole, as the CPU fills them.
  for (uint32_t i = 0; i < n_pairs; ++i) {
    const LocksPairPlan& plan = dev.plans[i];
    if (!plan.whole) continue;
    for (uint32_t q = 0; q < plan.n_pages; ++q) {
      ids_host[dev.offsets[i] + q] = q;
      scores_host[dev.offsets[i] + q] = std::numeric_limits<float>::infinity();
    }
    kept_host[i] = 1.0f;
  }
  return r;
}

const uint32_t* LocksScorer::offsets() const noexcept {
  return device_->offsets.data();
}

const uint32_t* LocksScorer::page_ids() const noexcept {
  return reinterpret_cast<const uint32_t*>(device_->out_host +
                                           (std::size_t{device_->n_pairs} + 3) / 4 * 16);
}

const float* LocksScorer::scores() const noexcept {
  return reinterpret_cast<const float*>(page_ids() + device_->total_out);
}

const float* LocksScorer::kept_estimate() const noexcept {
  return reinterpret_cast<const float*>(device_->out_host);
}

Result LocksScorer::head_scores(uint32_t pair, float* out) const {
  if (!device_) return invalid("head_scores before init");
  const Device& dev = *device_;
  if (pair >= dev.n_pairs || dev.head_at[pair] == ~uint64_t{0})
    return invalid("pair " + std::to_string(pair) + " has no device scores in the last run");
  Result r = from_cuda(cudaSetDevice(dev.device), "cudaSetDevice");
  if (r.ok)
    r = from_cuda(
        cudaMemcpy(out, dev.head + dev.head_at[pair],
                   std::size_t{shape_.group} * dev.plans[pair].n_pages * 4, cudaMemcpyDeviceToHost),
        "head scores");
  return r;
}

uint64_t LocksScorer::device_bytes() const noexcept {
  return device_ ? uint64_t{shape_.slots} * device_->layout.bytes : 0;
}

float LocksScorer::last_run_ms() const noexcept {
  float ms = 0.0f;
  if (!device_ || cudaEventElapsedTime(&ms, device_->start, device_->stop) != cudaSuccess) {
    cudaGetLastError();
    return 0.0f;
  }
  return ms;
}

}  // namespace kvsift::gpu
