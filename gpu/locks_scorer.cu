// LOCKS page selection on CUDA (gpu/locks_scorer.hpp has the contract; the CPU original is
// PageSelector::select_pair in lib/select/page_selector.cpp, the score simd's locks_score).
//
// Two kernels per run. score_kernel: a block copies the records of its 64 sealed pages (32 for
// large records) into shared memory with cp.async, a warp's lanes on consecutive 16 bytes of one
// record, and rounds its heads' queries to int8 (as the CPU does) while they travel; then four
// lanes per page and up to 4 heads a pass compute from shared memory: V^T q~ by dp4a on V's
// nibbles biased by +8 (n ^ 8 in 0..15, the bias taken out with 8 * sum(q codes), as the VNNI
// kernel does), mu . q~ by dp4a on the int8 codes, both exact in int32, and the B logits' max,
// then the sum of exps. It reads the pages' slots from the device copies of named tables and adds
// the new entries to them.
// select_kernel: a cluster of 8 CTAs per pair, each CTA an eighth of the pages in shared memory:
// the open page's exact log-sum-exp, per head the best selectable score and the mass sum, the
// combined score, a radix select (8 bits a pass, stopping as soon as the bin holding the b-th key
// is taken whole) of the b-th largest key (combined score's ordered bits, then the complement of
// the page id, so that equal scores go to the lower page, as the CPU's BetterPage), an ordered
// compaction of the chosen pages, and the kept estimate; maxima, sums, histograms and counts are
// combined across the cluster through distributed shared memory.
//
// Measured on the H200 at 128K (one Llama-3.1-8B layer, 8 pairs a sequence, 2% budget), with the
// previous score_kernel (records read from global memory by the quads): a batch 1 run, 8 pairs,
// takes 37 us of scoring (55 MB of records) and 24 us of selection. Profiled there with Nsight
// Compute (clocks held at ~1.45 GHz, so durations run long; one layer, batch 1,
// bench/bench_offload.cpp --locks-device 0): at 128K score_kernel 41.7 us, select_kernel 29.7 us;
// at 512K (32,768 pages a pair) 131.1 and 50.4 us. That scoring was L1-bound, not DRAM-bound:
// L1/TEX throughput 74% at 512K against DRAM 36% (1.72 TB/s), 80 registers with 65,664
// local-memory spill requests, occupancy 37.5% (three blocks, register-bound); a quad's four
// lanes read four V columns 64 bytes apart, so one load of a warp touched 32 sectors of 8
// records. The selection runs 64 CTAs (8 clusters of 8) at 25% occupancy, half a wave.
//
// The floor of the scoring, d = 128, B = 16, G = 4: a page's record is 832 bytes (V 512, C 128,
// mu 128, scales 50, the residual and padding 14), read once, whole sectors; 8 pairs of 32,768
// pages at 512K are 218 MB, 49.6 us at 4.4 TB/s (12.4 us for the 55 MB at 128K): the old
// kernel's 131 us is 2.6 times that (41.7 us, 3.4 times). The arithmetic a page: 1,152 dp4a (V's
// 128 words twice and mu's 32 once, for each of 4 heads), 512 FMA for the 16 logits of 4 heads,
// 64 exps. The PTX of score_kernel<4, 4> runs about 1,400 instructions a lane and page, 5,600 a
// page (four lanes; a count of the PTX, not of SASS, which drops most of its movs), a good part
// of them the logits' byte-to-float conversions. At ~1.45 GHz the 132 SMs issue ~24,500 lane
// instructions a ns; 218 MB at 4.4 TB/s leaves ~36 SM cycles a page, 4,600 lane instructions:
// at those clocks the kernel may be issue-bound short of the DRAM floor; not measured yet.
// Shared memory a page: 6.5 wavefronts to write the record, about 4 to read V (conflict-free by
// the swizzle), 4 for the query codes, 2-3 for mu and C.
// Registers 56-80 (80 for 4 heads), no spills, for sm_80, sm_89 and sm_90.
// Measured with this kernel (H200, bench/bench_offload.cpp --locks-device 0, the (c) step's
// selection a step, medians of 32 steps; docs/results/gpu-scale/raw/kernels/dec03/): 87.1 us at
// 128K batch 1 (86.3-90.0 with the previous kernel, three runs), 453.8 at batch 8 (495.5-498.7),
// 285.9 at 1M batch 1 (297.2-300.8, two runs): 0-10% less, where reaching the floor would have
// taken about 25 us off at 128K batch 1 (37 us of scoring then, 12.4 the floor). Whether this
// kernel reaches its floor is not profiled yet.
#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpu/cuda_backend.cuh"
#include "gpu/cuda_handles.cuh"
#include "gpu/cuda_result.cuh"
#include "gpu/locks_scorer.hpp"
#include "simd/locks_record.hpp"

namespace kvsift::gpu {
namespace {

constexpr uint32_t kRank = 8;
constexpr uint32_t kMaxHeadDim = 256;
constexpr uint32_t kMaxPageTokens = 64;
constexpr uint32_t kMaxGroup = 64;
// score_kernel: four lanes per page, 64 pages a block (32 where 64 records pass 64 KiB of shared
// memory), up to 8 query heads a block. One thread per page (the first version) left the H200 at
// 1.2 TB/s on the records at 128K (about 16 warps per SM, each a long chain of dependent loads and
// dp4a); four lanes per page run four times the warps on the same bytes. The second version read
// the records from global memory, a quad's lanes 64 bytes apart: L1-bound (header). This one
// copies a block's records to shared memory first (cp.async, a warp's lanes on consecutive 16
// bytes of one record) and computes from there.
constexpr uint32_t kScoreThreads = 256;
constexpr uint32_t kScoreMaxPages = kScoreThreads / 4;
constexpr uint32_t kScoreHeads = 8;
constexpr std::size_t kScoreTileCap = 64 * 1024;  // a block's records at most (64 pages of them)
// Registers capped at 80: three blocks of 256 threads (or six of 128), 24 warps an SM.
constexpr uint32_t kScoreBlocksPerSm = 3;
// select_kernel: a cluster of 8 CTAs of 512 threads per pair, each CTA's pages staged in shared
// memory. The first version, one CTA of 512 threads per pair over L2-resident scores, took 101 us
// at 8,192 pages on the H200 (every pass a few rounds of L2 latency and a serial step of thread
// 0); one CTA of 1024 threads over shared memory still took 40 us, issuing about 1.5
// instructions a cycle on its one SM: at batch 1 only 8 of the 132 SMs had work.
constexpr uint32_t kSelectCluster = 8;
constexpr uint32_t kSelectThreads = 512;
// select_kernel's passes over the scores take this many heads at a time.
constexpr int kHeadsPerPass = 4;
constexpr uint32_t kFull = 0xffffffffu;

constexpr CudaErrors from_cuda{"locks scorer"};

Result invalid(const std::string& message) {
  return from_cuda.invalid(message);
}

std::size_t align16(std::size_t n) {
  return (n + 15) / 16 * 16;
}

// One device pair of a run, as the kernels read it.
struct PairParams {
  uint64_t head_at;   // its per-head scores at head + head_at: [group][n_pages]
  uint64_t copy_at;   // its table's device copy at copies + copy_at; kNoCopy: none
  uint32_t copied;    // pages [0, copied) are read from the copy, the rest from tables
  uint32_t table_at;  // its slots of pages [copied, sealed) at tables + table_at
  uint32_t comb_at;   // its combined scores at combined + comb_at: [n_pages]
  uint32_t out_at;    // its chosen pages at ids / scores + out_at
  uint32_t open_at;   // its open page's keys at keys + open_at (when open_tokens > 0)
  uint32_t n_pages, sealed, sink, sel_last, take, open_tokens;
  uint32_t index;  // the pair's index in the call (its estimate's place)
};

constexpr uint64_t kNoCopy = ~uint64_t{0};

// Everything a kernel needs, by value.
struct RunView {
  const PairParams* params;
  const float* qf;  // [pairs][group][d] unscaled queries (the open page's exact score)
  const uint32_t* tables;
  uint32_t* copies;      // the device copies of named tables, [table_copies][max_pair_pages]
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
  uint32_t stage_floats;  // select_kernel's dynamic shared memory, in floats
  uint32_t score_pages;   // score_kernel's pages a block (its threads / 4)
};

__device__ __forceinline__ float key_value(uint16_t x, uint32_t bf16) {
  return bf16 ? __uint_as_float(uint32_t(x) << 16) : __half2float(__ushort_as_half(x));
}

// The bf16 in the low (hi = 0) or high half of a 32-bit word.
__device__ __forceinline__ float bf16_half(uint32_t w, uint32_t hi) {
  return __uint_as_float(hi ? w & 0xffff0000u : w << 16);
}

__device__ __forceinline__ uint32_t lds32(const unsigned char* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

__device__ __forceinline__ uint4 lds128(const unsigned char* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// 16 bytes global to shared, asynchronously (sm_80 on): no registers, no wait until
// cp_async_wait_all.
__device__ __forceinline__ void cp_async16(void* shared, const void* global) {
  const auto at = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(at), "l"(global) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\n\tcp.async.wait_group 0;" ::: "memory");
}

// score_kernel's place in shared memory of a record's 16-byte chunk c, with cpc = d / 32 chunks a
// V column. V's chunks are swizzled (c ^ (c / 8 mod cpc / 2)): the quad's four lanes then read
// chunk u of columns r (+ 4) from four different bank groups; the other fields stay in place.
__host__ __device__ constexpr uint32_t tile_chunk(uint32_t c, uint32_t cpc) {
  return c < 8 * cpc ? c ^ ((c >> 3) & (cpc / 2 - 1)) : c;
}

// Bytes between two records in score_kernel's tile: the record's bytes rounded up to an odd
// multiple of 8 cpc, so that the two pages a quarter warp reads (lanes 0-3 and 4-7) fall on the
// other half of the bank groups.
__host__ __device__ constexpr uint32_t tile_stride(uint32_t record_bytes, uint32_t cpc) {
  const uint32_t unit = 8 * cpc, units = (record_bytes + unit - 1) / unit;
  return (units | 1u) * unit;
}

// The logits l_t = c_scale_t (c_t . z) of tokens [t4, t4 + 4) of a page, for GB heads, from the
// record's copy in shared memory.
template <int GB>
__device__ __forceinline__ void chunk_logits(const RunView& v, const unsigned char* rec,
                                             uint32_t t4, const float (&z)[kRank][GB],
                                             float (&lg)[4][GB]) {
  const uint32_t B = v.page_tokens;
  uint32_t cw[kRank];
#pragma unroll
  for (int j = 0; j < int(kRank); ++j) cw[j] = lds32(rec + v.c_codes + j * B + t4);
  // c_scales is 4 bytes past a multiple of 16 and t4 a multiple of 4: two aligned words.
  const uint32_t s01 = lds32(rec + v.c_scales + 2 * t4), s23 = lds32(rec + v.c_scales + 2 * t4 + 4);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float c_scale = bf16_half(k < 2 ? s01 : s23, k % 2);
    float c[kRank];
#pragma unroll
    for (int j = 0; j < int(kRank); ++j) c[j] = float(int8_t(cw[j] >> (8 * k)));
#pragma unroll
    for (int g = 0; g < GB; ++g) {
      float dot = 0.0f;
#pragma unroll
      for (int j = 0; j < int(kRank); ++j) dot += c[j] * z[j][g];
      lg[k][g] = dot * c_scale;
    }
  }
}

// Page scores of pair blockIdx.y's heads [8 blockIdx.z, + 8) (GB at a time) for v.score_pages of
// its sealed pages (a quad of lanes per page, blockDim.x = 4 v.score_pages), CPC = d / 32.
//
// The block first copies its pages' records into shared memory with cp.async (each warp a record
// at a time, lane l its 16-byte chunks l, l + 32, ...: contiguous and whole sectors), rounds the
// queries to int8 while they travel, then computes from shared memory. Lane r of a page's quad
// takes V's columns r and r + 4 (all four lanes on one channel chunk u at a time, the query codes
// of u broadcast), mu's 16-byte words r, r + 4, ... and the tokens of C's words r, r + 4, ...; the
// quad exchanges z, the integer mu . q~ and the logits' max and sum by shuffles. z, mu . q~ and the
// logits come out bit for bit as from one lane; the sum of exps in another order.
template <int GB, int CPC>
__global__ void __launch_bounds__(kScoreThreads, kScoreBlocksPerSm) score_kernel(RunView v) {
  extern __shared__ uint4 tile_words[];  // [score_pages][tile_stride / 16], swizzled V
  // The int8 query codes: channel order (mu), and V's nibble pairs' even and odd channels.
  __shared__ uint4 qc[kScoreHeads][kMaxHeadDim / 16];
  __shared__ uint4 qe[kScoreHeads][kMaxHeadDim / 32];
  __shared__ uint4 qo[kScoreHeads][kMaxHeadDim / 32];
  __shared__ int32_t qsum[kScoreHeads];
  __shared__ float qs[kScoreHeads];
  __shared__ uint32_t tile_slot[kScoreMaxPages];
  const PairParams& p = v.params[blockIdx.y];
  const uint32_t sealed = p.sealed, P = v.score_pages;
  const uint32_t first = blockIdx.x * P;
  if (first >= sealed) return;  // the whole block: no barrier is missed
  constexpr uint32_t d = 32 * CPC;
  const uint32_t G = v.group, B = v.page_tokens, hb = blockIdx.z * kScoreHeads;
  const uint32_t nh = min(G - hb, kScoreHeads);  // this block's heads
  const uint32_t stride = tile_stride(v.record_bytes, CPC), chunks = v.record_bytes / 16;
  auto* tile = reinterpret_cast<unsigned char*>(tile_words);
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;

  // The pages' slots; the table's new entries join its device copy, for the next runs.
  for (uint32_t i = threadIdx.x; i < P; i += blockDim.x) {
    const uint32_t page = first + i;
    uint32_t slot = 0;
    if (page < sealed) {
      if (page < p.copied) {
        slot = v.copies[p.copy_at + page];
      } else {
        slot = v.tables[p.table_at + page - p.copied];
        if (p.copy_at != kNoCopy && blockIdx.z == 0) v.copies[p.copy_at + page] = slot;
      }
    }
    tile_slot[i] = slot;  // validate() does not read the tables: a bad slot ranks last
  }
  __syncthreads();
  // The records to shared memory: warp w takes records w, w + warps, ...; pages past the sealed
  // ones are not copied (their lanes read the first page and write nothing).
  for (uint32_t i = warp; i < P && first + i < sealed; i += warps) {
    const uint32_t slot = tile_slot[i] < v.slots ? tile_slot[i] : 0;
    const unsigned char* rec = v.records + std::size_t{slot} * v.record_bytes;
    unsigned char* to = tile + i * stride;
    for (uint32_t c = lane; c < chunks; c += 32)
      cp_async16(to + 16 * tile_chunk(c, CPC), rec + 16 * c);
  }

  // The query codes exactly as simd's locks_score rounds them (attend_scalar.cpp,
  // locks_avx512_vnni.cpp): s_q = max|q| / 127 in float, codes rint(q / s_q) (IEEE division and
  // round-to-nearest-even, as the host's nearbyint); a head with a non-finite q scores NaN. Each
  // block rounds its heads again: a few hundred divisions, against a launch and a copy. Heads
  // past the group get zero codes.
  for (uint32_t g = warp; g < kScoreHeads; g += warps) {
    const bool in = g < nh;
    const float* x = v.qf + (std::size_t{blockIdx.y} * G + hb + (in ? g : 0)) * d;
    float amax = 0.0f;
    bool finite = true;
    for (uint32_t c = lane; c < d; c += 32) {
      const float xc = in ? x[c] : 0.0f;
      amax = fmaxf(amax, fabsf(xc));
      finite = finite && isfinite(xc);
    }
    for (uint32_t off = 16; off > 0; off /= 2)
      amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, off));
    finite = __all_sync(kFull, finite);
    const float s_q = __fdiv_rn(amax, 127.0f);
    int32_t sum = 0;
    for (uint32_t c = lane; c < d; c += 32) {
      const int32_t code = in && finite && s_q > 0.0f ? int32_t(rintf(__fdiv_rn(x[c], s_q))) : 0;
      reinterpret_cast<int8_t*>(qc[g])[c] = int8_t(code);
      sum += code;
    }
    for (uint32_t off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(kFull, sum, off);
    if (lane == 0) {
      qsum[g] = sum;
      qs[g] = !in ? 0.0f : finite ? __fmul_rn(s_q, v.scale) : __int_as_float(0x7fc00000);
    }
  }
  __syncthreads();
  // V's nibbles pair channels 2i and 2i + 1: the even and the odd codes, four to a word.
  for (uint32_t i = threadIdx.x; i < kScoreHeads * (d / 8); i += blockDim.x) {
    const uint32_t g = i / (d / 8), w = i % (d / 8);
    const uint32_t* c = reinterpret_cast<const uint32_t*>(qc[g]);
    reinterpret_cast<uint32_t*>(qe[g])[w] = __byte_perm(c[2 * w], c[2 * w + 1], 0x6420);
    reinterpret_cast<uint32_t*>(qo[g])[w] = __byte_perm(c[2 * w], c[2 * w + 1], 0x7531);
  }
  cp_async_wait_all();
  __syncthreads();

  const uint32_t r = threadIdx.x % 4, quad0 = lane & ~3u, i = threadIdx.x / 4;
  const uint32_t page = first + i;
  const bool bad = page < sealed && tile_slot[i] >= v.slots;
  const unsigned char* rec = tile + (page < sealed ? i : 0) * stride;
  float* const out = v.head + p.head_at + std::size_t{hb} * p.n_pages + page;
  // Every lane stays to the end: the quads' shuffles take the whole warp.
#pragma unroll 1
  for (uint32_t h0 = 0; h0 < nh; h0 += GB) {
    // z_j = s_q scale v_scale_j sum_c V_code[c, j] q_code[c], exact up to the last product.
    int acc[2][GB];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int g = 0; g < GB; ++g) acc[m][g] = 0;
        // Not unrolled: the next chunk's query codes would take registers the logits need.
#pragma unroll 1
    for (uint32_t u = 0; u < CPC; ++u) {
      uint4 e4[GB], o4[GB];
#pragma unroll
      for (int g = 0; g < GB; ++g) e4[g] = qe[h0 + g][u], o4[g] = qo[h0 + g][u];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const uint32_t j = r + 4 * m;
        const uint4 x = lds128(rec + 16 * tile_chunk(j * CPC + u, CPC));
        const uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          // V's nibbles biased by +8 (n ^ 8 in 0..15), the bias taken out with 8 sum(q codes).
          const uint32_t biased = words[k] ^ 0x88888888u;
          const int lo = int(biased & 0x0f0f0f0fu), hi = int((biased >> 4) & 0x0f0f0f0fu);
#pragma unroll
          for (int g = 0; g < GB; ++g) {
            const uint32_t e = k == 0 ? e4[g].x : k == 1 ? e4[g].y : k == 2 ? e4[g].z : e4[g].w;
            const uint32_t o = k == 0 ? o4[g].x : k == 1 ? o4[g].y : k == 2 ? o4[g].z : o4[g].w;
            acc[m][g] = __dp4a(lo, int(e), acc[m][g]);
            acc[m][g] = __dp4a(hi, int(o), acc[m][g]);
          }
        }
      }
    }
    // v_scales is 4 bytes past a multiple of 16: columns r and r + 4 in words r / 2 and 2 + r / 2.
    float mine[2][GB];
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const float v_scale = bf16_half(lds32(rec + v.v_scales + 4 * (2 * m + r / 2)), r % 2);
#pragma unroll
      for (int g = 0; g < GB; ++g)
        mine[m][g] = float(acc[m][g] - 8 * qsum[h0 + g]) * (v_scale * qs[h0 + g]);
    }
    float z[kRank][GB];
#pragma unroll
    for (int j = 0; j < int(kRank); ++j)
#pragma unroll
      for (int g = 0; g < GB; ++g) z[j][g] = __shfl_sync(kFull, mine[j / 4][g], quad0 + j % 4);

    // lse = mu . q~ scale + max_t l_t + log sum_t e^(l_t - max): the logits' max, then the sum
    // of exps; a lane with one chunk of tokens (page_tokens 16) keeps its logits in between.
    float top[GB], sum[GB], lg[4][GB];
#pragma unroll
    for (int g = 0; g < GB; ++g) top[g] = -INFINITY, sum[g] = 0.0f;
    for (uint32_t t4 = 4 * r; t4 < B; t4 += 16) {
      chunk_logits<GB>(v, rec, t4, z, lg);
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int g = 0; g < GB; ++g) top[g] = fmaxf(top[g], lg[k][g]);
    }
#pragma unroll
    for (int g = 0; g < GB; ++g) {
      top[g] = fmaxf(top[g], __shfl_xor_sync(kFull, top[g], 1));
      top[g] = fmaxf(top[g], __shfl_xor_sync(kFull, top[g], 2));
    }
    for (uint32_t t4 = 4 * r; t4 < B; t4 += 16) {
      if (B > 16) chunk_logits<GB>(v, rec, t4, z, lg);
#pragma unroll
      for (int k = 0; k < 4; ++k)
#pragma unroll
        for (int g = 0; g < GB; ++g) sum[g] += expf(lg[k][g] - top[g]);
    }
#pragma unroll
    for (int g = 0; g < GB; ++g) {
      sum[g] += __shfl_xor_sync(kFull, sum[g], 1);
      sum[g] += __shfl_xor_sync(kFull, sum[g], 2);
    }
    // mu . q~ last: its registers are not live while the logits are.
    float mu_q[GB];
    {
      int macc[GB];
#pragma unroll
      for (int g = 0; g < GB; ++g) macc[g] = 0;
#pragma unroll
      for (uint32_t u0 = 0; u0 < d / 16; u0 += 4) {
        const uint32_t u = u0 + r;
        const uint4 x = lds128(rec + v.mu_codes + 16 * u);
        const uint32_t words[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int g = 0; g < GB; ++g) {
          const uint4 c4 = qc[h0 + g][u];
          const uint32_t c[4] = {c4.x, c4.y, c4.z, c4.w};
#pragma unroll
          for (int k = 0; k < 4; ++k) macc[g] = __dp4a(int(words[k]), int(c[k]), macc[g]);
        }
      }
      // mu_scale is 4 bytes past a multiple of 16: the low half of its word.
      const float mu_scale = bf16_half(lds32(rec + v.mu_scale), 0);
#pragma unroll
      for (int g = 0; g < GB; ++g) {
        macc[g] += __shfl_xor_sync(kFull, macc[g], 1);
        macc[g] += __shfl_xor_sync(kFull, macc[g], 2);
        mu_q[g] = float(macc[g]) * (mu_scale * qs[h0 + g]);
      }
    }
    if (page < sealed) {
#pragma unroll
      for (int g = 0; g < GB; ++g)
        if (g % 4 == int(r) && h0 + g < nh)
          out[std::size_t{h0 + g} * p.n_pages] =
              bad ? __int_as_float(0x7fc00000) : mu_q[g] + (top[g] + logf(sum[g]));
    }
  }
}

// Reduces each of x[0..N) over the block (every thread must call; `red` is 32 * N elements of
// shared memory): one set of barriers for N values.
template <int N, class T, class Op>
__device__ void block_reduce_n(T (&x)[N], Op op, T identity, T* red) {
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < N; ++i)
    for (uint32_t off = 16; off > 0; off /= 2) x[i] = op(x[i], __shfl_xor_sync(kFull, x[i], off));
  if (lane == 0)
#pragma unroll
    for (int i = 0; i < N; ++i) red[warp * N + i] = x[i];
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      x[i] = lane < blockDim.x / 32 ? red[lane * N + i] : identity;
      for (uint32_t off = 16; off > 0; off /= 2) x[i] = op(x[i], __shfl_xor_sync(kFull, x[i], off));
    }
    if (lane == 0)
#pragma unroll
      for (int i = 0; i < N; ++i) red[i] = x[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = red[i];
  __syncthreads();
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

// The block's exclusive prefix sum of x (every thread must call; `warp_at` holds 33 words).
__device__ uint32_t block_exclusive_sum(uint32_t x, uint32_t* warp_at) {
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  uint32_t inclusive = x;
  for (uint32_t off = 1; off < 32; off *= 2) {
    const uint32_t y = __shfl_up_sync(kFull, inclusive, off);
    if (lane >= off) inclusive += y;
  }
  if (lane == 31) warp_at[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const uint32_t total = lane < blockDim.x / 32 ? warp_at[lane] : 0;
    uint32_t before = total;
    for (uint32_t off = 1; off < 32; off *= 2) {
      const uint32_t y = __shfl_up_sync(kFull, before, off);
      if (lane >= off) before += y;
    }
    warp_at[lane] = before - total;
  }
  __syncthreads();
  const uint32_t at = warp_at[warp] + inclusive - x;
  __syncthreads();
  return at;
}

// select_kernel's CTAs of one pair. From sm_90 on, a thread block cluster of kSelectCluster CTAs
// that read each other's shared memory. Before sm_90 there are no clusters: one CTA takes all of
// the pair's pages and the same code runs with one rank (its pages' scores then stay in global
// memory where they outgrow the CTA's shared memory; the sums are taken in another order, so
// results may differ from the sm_90 code's in the last bits). The host launches as many CTAs a
// pair as the kernel the device runs was compiled for (its PTX version: LocksScorer::init).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KVSIFT_SELECT_CLUSTER_DIMS
struct SelectCluster {
  static constexpr uint32_t kRanks = 1;
  __device__ uint32_t block_rank() const { return 0; }
  __device__ void sync() const { __syncthreads(); }
  template <class T>
  __device__ T* map(T* p, uint32_t) const {
    return p;
  }
};
#else
#define KVSIFT_SELECT_CLUSTER_DIMS __cluster_dims__(kSelectCluster, 1, 1)
struct SelectCluster {
  static constexpr uint32_t kRanks = kSelectCluster;
  __device__ uint32_t block_rank() const { return cooperative_groups::this_cluster().block_rank(); }
  __device__ void sync() const { cooperative_groups::this_cluster().sync(); }
  template <class T>
  __device__ T* map(T* p, uint32_t rank) const {
    return cooperative_groups::this_cluster().map_shared_rank(p, rank);
  }
};
#endif

// One cluster of SelectCluster::kRanks CTAs per pair (blockIdx.y); CTA `rank` takes the pair's
// pages [rank * chunk, (rank + 1) * chunk) and the cluster combines the CTAs' maxima, sums,
// histograms and counts through distributed shared memory, each CTA summing the ranks in order
// (the results are the same in every CTA and on every run).
__global__ void KVSIFT_SELECT_CLUSTER_DIMS __launch_bounds__(kSelectThreads)
    select_kernel(RunView v) {
  // v.stage_floats: first the open page's query and keys, then the CTA's head scores [G][m] and
  // combined scores [m].
  extern __shared__ float stage[];
  __shared__ float logits[kMaxGroup * kMaxPageTokens];
  __shared__ float top[kMaxGroup];
  __shared__ double mass[kMaxGroup];
  __shared__ float top_all[kMaxGroup];  // per head: its best page before the window, sinks in
  __shared__ float weight[kMaxGroup];   // share_avg's 1 / (mass G), nrm's e^(top - top_all), else 1
  __shared__ float red_f[32 * kHeadsPerPass];
  __shared__ double red_d[32 * kHeadsPerPass];
  __shared__ uint32_t total_hist[256];
  __shared__ uint32_t warp_at[32];
  __shared__ uint64_t s_prefix;
  __shared__ uint32_t s_bits, s_k, s_done, s_offset;
  // Read by the other CTAs of the cluster.
  __shared__ float part_best[kMaxGroup];
  __shared__ float part_best_all[kMaxGroup];
  __shared__ double part_sum[kMaxGroup];
  __shared__ uint32_t hist[2][256];
  __shared__ uint32_t part_count;
  __shared__ double part_kept[2][kMaxGroup];  // per head: chosen and mandatory mass
  const SelectCluster cluster;
  const uint32_t rank = cluster.block_rank();
  const PairParams& p = v.params[blockIdx.y];
  const uint32_t G = v.group, d = v.head_dim, B = v.page_tokens, n = p.n_pages;
  const uint32_t first = p.sink, last = p.sel_last, tid = threadIdx.x;
  const uint32_t lane = tid % 32, warp = tid / 32;
  const uint32_t chunk = (n + SelectCluster::kRanks - 1) / SelectCluster::kRanks;
  const uint32_t lo = min(n, rank * chunk), hi = min(n, lo + chunk), m = hi - lo;
  const uint32_t sel_lo = max(lo, first), sel_hi = max(sel_lo, min(hi, last));
  float* head = v.head + p.head_at;
  // Shared memory holds the CTA's scores and combined ones when both fit, else only the
  // combined ones (the radix passes read them most), else neither.
  const bool stage_head = uint64_t{G + 1} * m <= v.stage_floats;
  const bool stage_comb = m <= v.stage_floats;
  // Score of head h, page q (q in [lo, hi)).
  float* const hs = stage_head ? stage - lo : head;
  const uint32_t hs_stride = stage_head ? m : n;
  float* const comb = stage_head   ? stage + std::size_t{G} * m - lo
                      : stage_comb ? stage - lo
                                   : v.combined + p.comb_at;

  // The open page's exact log-sum-exp per head, as PageSelector::exact_page_lse (float32, one
  // rounded product and add per channel), by the CTA that holds it. The dot products are serial
  // chains of d rounded adds: their operands come from shared memory (over global loads they
  // took tens of microseconds).
  if (p.open_tokens > 0 && p.sealed >= lo && p.sealed < hi) {
    const uint32_t nt = p.open_tokens;
    float* q = stage;
    float* keys = stage + G * d;
    for (uint32_t i = tid; i < G * d; i += blockDim.x)
      q[i] = v.qf[std::size_t{blockIdx.y} * G * d + i];
    for (uint32_t i = tid; i < nt * d; i += blockDim.x)
      keys[i] = key_value(v.keys[p.open_at + i], v.bf16);
    __syncthreads();
    for (uint32_t i = tid; i < G * nt; i += blockDim.x) {
      const uint32_t h = i / nt, t = i % nt;
      float dot = 0.0f;
#pragma unroll 8
      for (uint32_t c = 0; c < d; ++c)
        dot = __fadd_rn(dot, __fmul_rn(q[h * d + c], keys[t * d + c]));
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

  // masses(): per head the best selectable score and the sum of e^(score - best), a few heads a
  // pass; the scores move to shared memory on the way.
  for (uint32_t h0 = 0; h0 < G; h0 += kHeadsPerPass) {
    const uint32_t nh = min(G - h0, uint32_t(kHeadsPerPass));
    float best[kHeadsPerPass], best_all[kHeadsPerPass];
#pragma unroll
    for (int j = 0; j < kHeadsPerPass; ++j) best[j] = best_all[j] = -INFINITY;
    for (uint32_t q = lo + tid; q < hi; q += blockDim.x) {
      const bool selectable = q >= first && q < last;
#pragma unroll
      for (int j = 0; j < kHeadsPerPass; ++j)
        if (j < int(nh)) {
          const float x = head[std::size_t{h0 + j} * n + q];
          if (stage_head) hs[std::size_t{h0 + j} * hs_stride + q] = x;
          if (selectable) best[j] = fmaxf(best[j], x);
          if (q < last) best_all[j] = fmaxf(best_all[j], x);
        }
    }
    block_reduce_n(best, MaxF{}, -INFINITY, red_f);
    if (tid < nh) part_best[h0 + tid] = best[tid];
    __syncthreads();  // red_f is read by the first reduction's broadcast
    block_reduce_n(best_all, MaxF{}, -INFINITY, red_f);
    if (tid < nh) part_best_all[h0 + tid] = best_all[tid];
    cluster.sync();
    if (tid < nh) {
      float b = -INFINITY, a = -INFINITY;
      for (uint32_t r = 0; r < SelectCluster::kRanks; ++r) {
        b = fmaxf(b, cluster.map(part_best, r)[h0 + tid]);
        a = fmaxf(a, cluster.map(part_best_all, r)[h0 + tid]);
      }
      top[h0 + tid] = b;
      top_all[h0 + tid] = a;
    }
    __syncthreads();
    double sum[kHeadsPerPass] = {};
    for (uint32_t q = sel_lo + tid; q < sel_hi; q += blockDim.x)
#pragma unroll
      for (int j = 0; j < kHeadsPerPass; ++j)
        if (j < int(nh))
          sum[j] += double(expf(hs[std::size_t{h0 + j} * hs_stride + q] - top[h0 + j]));
    block_reduce_n(sum, SumD{}, 0.0, red_d);
    if (tid < nh) part_sum[h0 + tid] = sum[tid];
    cluster.sync();
    if (tid < nh) {
      double s = 0.0;
      for (uint32_t r = 0; r < SelectCluster::kRanks; ++r) s += cluster.map(part_sum, r)[h0 + tid];
      mass[h0 + tid] = s;
      // nrm takes each head's masses relative to its best page sinks included, as the CPU's
      // combine() and the authors' kernel do (docs/methods.md).
      weight[h0 + tid] = v.combine == uint32_t(LocksCombine::share_avg)
                             ? __fdiv_rn(1.0f, __fmul_rn(float(s), float(G)))
                         : v.combine == uint32_t(LocksCombine::nrm)
                             ? expf(top[h0 + tid] - top_all[h0 + tid])
                             : 1.0f;
    }
    __syncthreads();
  }

  // combine(), in the CPU's order of heads and roundings.
  for (uint32_t q = sel_lo + tid; q < sel_hi; q += blockDim.x) {
    float S;
    if (v.combine == uint32_t(LocksCombine::max)) {
      S = -INFINITY;
      for (uint32_t h = 0; h < G; ++h) S = fmaxf(S, hs[std::size_t{h} * hs_stride + q]);
    } else {
      S = 0.0f;
      for (uint32_t h = 0; h < G; ++h)
        S = __fadd_rn(S, __fmul_rn(expf(hs[std::size_t{h} * hs_stride + q] - top[h]), weight[h]));
    }
    comb[q] = isnan(S) ? -INFINITY : S;
  }

  // The take-th largest key among the selectable pages: a radix select, 8 bits a pass, stopping
  // as soon as the bin holding it is taken whole. Each CTA counts its pages, and every CTA sums
  // the cluster's counts and takes the same bin. The counts alternate between two buffers: a
  // buffer is cleared two passes after it was read, past a cluster barrier.
  const uint32_t n_sel = last - first, take = p.take;
  if (tid == 0) {
    s_prefix = 0;
    s_bits = 0;
    s_k = take;
    s_done = take == 0 || take == n_sel;
  }
  __syncthreads();
  for (uint32_t pass = 0; !s_done; ++pass) {
    const uint32_t bits = s_bits, k = s_k;
    const uint64_t prefix = s_prefix;
    const uint32_t shift = 56 - bits;
    uint32_t* counts = hist[pass % 2];
    for (uint32_t i = tid; i < 256; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    // A warp whose lanes share a bin adds once: the scores of a long tail share their high bits,
    // and 32 lanes adding to one shared counter would serialise.
    for (uint32_t base = sel_lo; base < sel_hi; base += blockDim.x) {
      const uint32_t q = base + tid;
      uint32_t bin = 256;  // no bin: past the pages, or outside the prefix
      if (q < sel_hi) {
        const uint64_t key = page_key(comb[q], q);
        if (bits == 0 || (key >> (64 - bits)) == prefix) bin = uint32_t(key >> shift) & 255;
      }
      const uint32_t bin0 = __shfl_sync(kFull, bin, 0);
      if (__all_sync(kFull, bin == bin0)) {
        if (lane == 0 && bin0 < 256) atomicAdd(&counts[bin0], 32u);
      } else if (bin < 256) {
        atomicAdd(&counts[bin], 1u);
      }
    }
    cluster.sync();
    for (uint32_t i = tid; i < 256; i += blockDim.x) {
      uint32_t t = 0;
      for (uint32_t r = 0; r < SelectCluster::kRanks; ++r) t += cluster.map(counts, r)[i];
      total_hist[i] = t;
    }
    __syncthreads();
    if (warp == 0) {
      // Lane l holds bins 255 - 8l down to 248 - 8l; the lane whose bins hold the k-th key from
      // the top finds its bin.
      uint32_t c[8], mine = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) mine += c[i] = total_hist[255 - 8 * lane - i];
      uint32_t inclusive = mine;
      for (uint32_t off = 1; off < 32; off *= 2) {
        const uint32_t y = __shfl_up_sync(kFull, inclusive, off);
        if (lane >= off) inclusive += y;
      }
      uint32_t above = inclusive - mine;
      if (above < k && k <= inclusive) {
        int i = 0;
        for (; i < 7 && above + c[i] < k; ++i) above += c[i];
        const uint32_t b = 255 - 8 * lane - i;
        s_k = k - above;
        s_prefix = prefix << 8 | b;
        s_bits = bits + 8;
        s_done = c[i] == k - above || bits + 8 == 64;
      }
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
  const auto kept = [&](uint32_t q) { return q < first || q >= last || chosen(q); };

  // Ordered compaction: each thread a run of the CTA's pages, the runs' counts summed in order,
  // after the counts of the CTAs of lower rank.
  const uint32_t run = (m + blockDim.x - 1) / blockDim.x;
  const uint32_t t_lo = min(hi, lo + tid * run), t_hi = min(hi, t_lo + run);
  uint32_t count = 0;
  for (uint32_t q = t_lo; q < t_hi; ++q) count += kept(q);
  const uint32_t before = block_exclusive_sum(count, warp_at);
  if (tid == blockDim.x - 1) part_count = before + count;
  cluster.sync();
  if (tid == 0) {
    uint32_t offset = 0;
    for (uint32_t r = 0; r < rank; ++r) offset += *cluster.map(&part_count, r);
    s_offset = offset;
  }
  __syncthreads();
  const uint32_t list_at = p.out_at + s_offset;
  uint32_t at = list_at + before;
  for (uint32_t q = t_lo; q < t_hi; ++q)
    if (kept(q)) {
      v.ids[at] = q;
      v.scores[at++] = q < first || q >= last ? INFINITY : comb[q];
    }
  __syncthreads();  // the CTA's list is read back below

  // The kept estimate over the lists just written (a warp per head), averaged over the heads:
  // (kept + mandatory) / (selectable + mandatory).
  const uint32_t listed = part_count;
  for (uint32_t h = warp; h < G; h += blockDim.x / 32) {
    double chosen_mass = 0.0, mandatory = 0.0;
    for (uint32_t e = lane; e < listed; e += 32) {
      const uint32_t q = v.ids[list_at + e];
      const float x = hs[std::size_t{h} * hs_stride + q];
      if (q < first || q >= last)
        mandatory += exp(double(x) - double(top[h]));
      else
        chosen_mass += double(expf(x - top[h]));
    }
    for (uint32_t off = 16; off > 0; off /= 2) {
      chosen_mass += __shfl_xor_sync(kFull, chosen_mass, off);
      mandatory += __shfl_xor_sync(kFull, mandatory, off);
    }
    if (lane == 0) part_kept[0][h] = chosen_mass, part_kept[1][h] = mandatory;
  }
  cluster.sync();
  if (rank == 0 && tid == 0) {
    double kept_sum = 0.0;
    for (uint32_t h = 0; h < G; ++h) {
      double chosen_mass = 0.0, mandatory = 0.0;
      for (uint32_t r = 0; r < SelectCluster::kRanks; ++r) {
        const double(*part)[kMaxGroup] = cluster.map(part_kept, r);
        chosen_mass += part[0][h];
        mandatory += part[1][h];
      }
      kept_sum += (chosen_mass + mandatory) / (mass[h] + mandatory);
    }
    v.kept[p.index] = float(kept_sum / G);
  }
  cluster.sync();  // no CTA leaves while rank 0 reads its shared memory
}

// Copies n staged records to their slots: block i takes record i.
__global__ void scatter_kernel(const uint4* __restrict__ staged, const uint32_t* __restrict__ slots,
                               unsigned char* __restrict__ records, uint32_t record_bytes) {
  const uint32_t words = record_bytes / 16;
  uint4* to = reinterpret_cast<uint4*>(records + std::size_t{slots[blockIdx.x]} * record_bytes);
  const uint4* from = staged + std::size_t{blockIdx.x} * words;
  for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) to[i] = from[i];
}

using ScoreKernel = void (*)(RunView);

// score_kernel's instance for G heads and head_dim d: 1, 2 or 4 heads at a time.
ScoreKernel score_kernel_for(uint32_t G, uint32_t d) {
  const uint32_t gb = G <= 1 ? 1 : G <= 2 ? 2 : 4;
  switch (d) {
    case 64:
      return gb == 1 ? score_kernel<1, 2> : gb == 2 ? score_kernel<2, 2> : score_kernel<4, 2>;
    case 128:
      return gb == 1 ? score_kernel<1, 4> : gb == 2 ? score_kernel<2, 4> : score_kernel<4, 4>;
    default:
      return gb == 1 ? score_kernel<1, 8> : gb == 2 ? score_kernel<2, 8> : score_kernel<4, 8>;
  }
}

}  // namespace

namespace cuda {

// The backend's LocksScorer (gpu/backend.hpp).
class LocksScorer final : public backend::LocksScorer {
 public:
  Result init(int device, const LocksScorerShape& shape) override;
  Result upload(const std::byte* records, const uint32_t* slots, std::size_t n) noexcept override;
  Result validate(const LocksPair* pairs, uint32_t n_pairs) const override;
  Result run(const LocksPair* pairs, uint32_t n_pairs) noexcept override;
  const uint32_t* offsets() const noexcept override;
  const uint32_t* page_ids() const noexcept override;
  const float* scores() const noexcept override;
  const float* kept_estimate() const noexcept override;
  Result head_scores(uint32_t pair, float* out) const override;
  const LocksScorerShape& shape() const noexcept override { return shape_; }
  uint64_t device_bytes() const noexcept override;
  float last_run_ms() const noexcept override;

 private:
  struct Device;
  std::unique_ptr<Device> device_;
  LocksScorerShape shape_{};
};

std::unique_ptr<backend::LocksScorer> make_locks_scorer() {
  return std::make_unique<LocksScorer>();
}

struct LocksScorer::Device {
  int device = 0;
  // Declared first so that they go last, after the memory.
  Stream stream;
  Event start, stop;
  simd::LocksRecordLayout layout{};
  DeviceBuffer<unsigned char> records;  // [slots][record_bytes]
  // Upload staging: kLocksUploadChunk records, then their slots.
  PinnedBuffer<unsigned char> upload_host;
  DeviceBuffer<unsigned char> upload_device;
  // Run staging (packed per run) and its capacity.
  PinnedBuffer<unsigned char> staging_host;
  DeviceBuffer<unsigned char> staging_device;
  std::size_t staging_bytes = 0;
  uint32_t stage_cap_floats = 0;  // select_kernel's dynamic shared memory at most, in floats
  uint32_t select_ctas = 1;       // select_kernel's CTAs a pair: its cluster width (1 before sm_90)
  uint32_t score_pages = kScoreMaxPages;  // score_kernel's pages a block
  std::size_t score_tile_bytes = 0;       // and their records' bytes in its shared memory
  DeviceBuffer<float> head;               // [group * max_pages]
  DeviceBuffer<float> combined;           // [max_pages]
  // The device copies of named tables (LocksPair::table_id), [table_copies][max_pair_pages], and
  // which table each holds: its name, its entries, the run that last used it.
  struct TableCopy {
    uint64_t id = 0;
    uint32_t count = 0;
    uint64_t used = 0;
  };
  DeviceBuffer<uint32_t> copies;
  std::vector<TableCopy> copy;
  std::unordered_map<uint64_t, uint32_t> copy_index;  // name to copy
  uint32_t hand = 0;                                  // the next copy to reuse, round robin
  uint64_t runs = 0;
  uint64_t max_pair_pages = 0;
  // The result: estimates [max_pairs, padded to 4], then ids and scores [max_pages] each.
  DeviceBuffer<unsigned char> out_device;
  PinnedBuffer<unsigned char> out_host;
  std::size_t out_bytes = 0;
  // The last run.
  std::vector<LocksPairPlan> plans;
  std::vector<uint32_t> offsets;  // [n_pairs + 1]
  std::vector<uint64_t> head_at;  // per pair; ~0 for a pair filled on the host
  std::vector<uint64_t> copy_of;  // per pair: its table's copy (PairParams::copy_at)
  std::vector<uint32_t> copied;   // per pair: the entries its copy held before the run
  uint32_t n_pairs = 0, total_out = 0;

  // The copy for table `id` of `sealed` entries in run `stamp` (PairParams::copy_at), with the
  // entries it already holds in *held; kNoCopy for an unnamed table, one too long, or one named
  // a second time in the run (sent whole then).
  uint64_t copy_for(uint64_t id, uint32_t sealed, uint64_t stamp, uint32_t* held) noexcept {
    *held = 0;
    if (id == 0 || copy.empty() || sealed > max_pair_pages) return kNoCopy;
    uint32_t c = 0;
    if (const auto it = copy_index.find(id); it != copy_index.end()) {
      c = it->second;
      if (copy[c].used == stamp) return kNoCopy;
      // A table only grows while its name lasts; a shorter one is sent whole again.
      *held = copy[c].count <= sealed ? copy[c].count : 0;
    } else {
      uint32_t tries = 0;
      for (; tries < copy.size() && copy[hand].used == stamp; ++tries)
        hand = (hand + 1) % static_cast<uint32_t>(copy.size());
      if (tries == copy.size()) return kNoCopy;  // every copy serves this run already
      c = hand;
      hand = (hand + 1) % static_cast<uint32_t>(copy.size());
      if (copy[c].id != 0) copy_index.erase(copy[c].id);
      copy[c] = TableCopy{};
      try {
        copy_index.emplace(id, c);
      } catch (...) {  // no memory for the entry: sent whole
        return kNoCopy;
      }
      copy[c].id = id;
    }
    copy[c].used = stamp;
    copy[c].count = sealed;
    return uint64_t{c} * max_pair_pages;
  }
  void forget_copies() noexcept {
    copy_index.clear();
    for (TableCopy& t : copy) t = TableCopy{};
  }
};

namespace {

// Bytes of each run staging section at its capacity.
std::size_t staging_capacity(const LocksScorerShape& s) {
  const std::size_t P = s.max_pairs, G = s.group, d = s.head_dim;
  return align16(P * sizeof(PairParams)) + align16(P * G * d * 4) + align16(s.max_pages * 4) +
         align16(P * s.page_tokens * d * 2);
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
  if (shape.table_copies > 0 &&
      (shape.max_pair_pages == 0 || shape.max_pair_pages >= (uint64_t{1} << 31) ||
       shape.table_copies > (uint64_t{1} << 40) / shape.max_pair_pages))
    return invalid("table_copies=" + num(shape.table_copies) + " of max_pair_pages=" +
                   num(shape.max_pair_pages) + " pages: not a size to keep on the device");
  // The ordinal is checked against the count first: cudaSetDevice with a bad one is an API
  // error a sanitizer reports, and the message here is clearer.
  if (device < 0) return invalid("device=" + std::to_string(device) + " is negative");
  int n_devices = 0;
  if (Result r = device_count(&n_devices); !r.ok) return r;
  if (device >= n_devices)
    return invalid("device=" + std::to_string(device) + " is not in 0.." +
                   std::to_string(n_devices - 1));
  device_.reset();
  Result r = from_cuda(cudaSetDevice(device), "cudaSetDevice");
  if (!r.ok) return r;
  auto d = std::make_unique<Device>();
  d->device = device;
  d->layout = simd::locks_record_layout(shape.head_dim, shape.page_tokens, shape.rank);
  const std::size_t rb = d->layout.bytes;
  d->staging_bytes = staging_capacity(shape);
  d->out_bytes = (std::size_t{shape.max_pairs} + 4) / 4 * 16 + 8 * shape.max_pages;
  const std::size_t upload = kLocksUploadChunk * (rb + 4);
  r = from_cuda(d->stream.create(cudaStreamNonBlocking), "stream");
  if (r.ok) r = from_cuda(d->start.create(), "event");
  if (r.ok) r = from_cuda(d->stop.create(), "event");
  if (r.ok) r = from_cuda(d->records.allocate(std::size_t{shape.slots} * rb), "records");
  if (r.ok)
    r = from_cuda(d->upload_host.allocate(upload, cudaHostAllocPortable), "pinned upload staging");
  if (r.ok) r = from_cuda(d->upload_device.allocate(upload), "device upload staging");
  if (r.ok)
    r = from_cuda(d->staging_host.allocate(d->staging_bytes, cudaHostAllocPortable),
                  "pinned staging");
  if (r.ok) r = from_cuda(d->staging_device.allocate(d->staging_bytes), "device staging");
  if (r.ok)
    r = from_cuda(d->head.allocate(std::size_t{shape.group} * shape.max_pages * 4),
                  "score workspace");
  if (r.ok) r = from_cuda(d->combined.allocate(shape.max_pages * 4), "combined workspace");
  if (r.ok && shape.table_copies > 0)
    r = from_cuda(d->copies.allocate(shape.table_copies * shape.max_pair_pages * 4),
                  "table copies");
  if (r.ok) r = from_cuda(d->out_device.allocate(d->out_bytes), "result");
  if (r.ok)
    r = from_cuda(d->out_host.allocate(d->out_bytes, cudaHostAllocPortable), "pinned result");
  // select_kernel stages a pair's scores in whatever shared memory its static arrays leave.
  int optin = 0;
  cudaFuncAttributes attributes{};
  if (r.ok)
    r = from_cuda(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                  "shared memory per block");
  if (r.ok) r = from_cuda(cudaFuncGetAttributes(&attributes, select_kernel), "select kernel");
  if (r.ok) {
    const std::size_t stage_bytes =
        std::size_t(optin) > attributes.sharedSizeBytes ? optin - attributes.sharedSizeBytes : 0;
    d->stage_cap_floats = static_cast<uint32_t>(stage_bytes / 4);
    // The kernel the device runs has clusters where it was compiled for compute_90 or later
    // (SelectCluster tests __CUDA_ARCH__, the PTX version of the code the device runs).
    d->select_ctas = attributes.ptxVersion >= 90 ? kSelectCluster : 1;
    if (d->stage_cap_floats < (shape.group + shape.page_tokens) * shape.head_dim)
      r = invalid("the device's shared memory per block (" + std::to_string(optin) +
                  " bytes) is too small for an open page's query and keys");
    if (r.ok)
      r = from_cuda(cudaFuncSetAttribute(select_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(stage_bytes)),
                    "select kernel shared memory");
  }
  // score_kernel's records in shared memory: 64 pages a block, or 32 where they pass the cap.
  if (r.ok) {
    const std::size_t stride = tile_stride(static_cast<uint32_t>(rb), shape.head_dim / 32);
    d->score_pages = stride * kScoreMaxPages <= kScoreTileCap ? kScoreMaxPages : kScoreMaxPages / 2;
    d->score_tile_bytes = stride * d->score_pages;
    const ScoreKernel kernel = score_kernel_for(shape.group, shape.head_dim);
    r = from_cuda(cudaFuncGetAttributes(&attributes, kernel), "score kernel");
    if (r.ok && d->score_tile_bytes + attributes.sharedSizeBytes > std::size_t(optin))
      r = invalid("the device's shared memory per block (" + std::to_string(optin) +
                  " bytes) is too small for the score kernel's " +
                  std::to_string(d->score_tile_bytes) + " bytes of records");
    if (r.ok)
      r = from_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(d->score_tile_bytes)),
                    "score kernel shared memory");
    // The most shared memory an SM can give, so that three blocks (or six) fit.
    if (r.ok)
      r = from_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         cudaSharedmemCarveoutMaxShared),
                    "score kernel carveout");
  }
  if (!r.ok) return r;
  d->plans.resize(shape.max_pairs);
  d->offsets.resize(std::size_t{shape.max_pairs} + 1);
  d->head_at.resize(shape.max_pairs);
  d->copy_of.resize(shape.max_pairs);
  d->copied.resize(shape.max_pairs);
  d->copy.resize(shape.table_copies);
  d->copy_index.reserve(shape.table_copies);
  d->max_pair_pages = shape.max_pair_pages;
  device_ = std::move(d);
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
    r = from_cuda(cudaStreamSynchronize(dev.stream.get()), "upload");
    if (!r.ok) break;
    for (std::size_t i = 0; i < m; ++i)
      std::memcpy(dev.upload_host.get() + i * rb, records + std::size_t{slots[done + i]} * rb, rb);
    std::memcpy(dev.upload_host.get() + m * rb, slots + done, m * 4);
    r = from_cuda(cudaMemcpyAsync(dev.upload_device.get(), dev.upload_host.get(), m * (rb + 4),
                                  cudaMemcpyHostToDevice, dev.stream.get()),
                  "records upload");
    if (!r.ok) break;
    scatter_kernel<<<static_cast<unsigned>(m), 64, 0, dev.stream.get()>>>(
        reinterpret_cast<const uint4*>(dev.upload_device.get()),
        reinterpret_cast<const uint32_t*>(dev.upload_device.get() + m * rb), dev.records.get(),
        static_cast<uint32_t>(rb));
    r = from_cuda.launched("scatter launch");
    done += m;
  }
  if (r.ok) r = from_cuda(cudaStreamSynchronize(dev.stream.get()), "upload");
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
  uint32_t n_dev = 0, n_open = 0, max_sealed = 0, max_n = 0;
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
    max_n = std::max(max_n, plan.n_pages);
  }
  dev.n_pairs = n_pairs;
  dev.total_out = dev.offsets[n_pairs];
  const std::size_t kept_bytes = (std::size_t{n_pairs} + 3) / 4 * 16;
  auto* kept_host = reinterpret_cast<float*>(dev.out_host.get());
  auto* ids_host = reinterpret_cast<uint32_t*>(dev.out_host.get() + kept_bytes);
  float* scores_host = reinterpret_cast<float*>(ids_host + dev.total_out);

  Result r = from_cuda(cudaSetDevice(dev.device), "cudaSetDevice");
  if (r.ok && n_dev > 0) {
    // Sections, packed: params, q floats, tables (the entries the device copies lack), open
    // keys. The sealed pages' slots are most of a run's bytes (32 KiB a pair at 128K): a named
    // table's device copy takes only its new entries, which the score kernel adds to it.
    const uint64_t stamp = ++dev.runs;
    uint64_t sent_total = 0;
    for (uint32_t i = 0; i < n_pairs; ++i) {
      const LocksPairPlan& plan = dev.plans[i];
      if (plan.whole) continue;
      dev.copy_of[i] = dev.copy_for(pairs[i].table_id, plan.sealed, stamp, &dev.copied[i]);
      sent_total += plan.sealed - dev.copied[i];
    }
    const std::size_t at_params = 0;
    const std::size_t at_qf = at_params + align16(std::size_t{n_dev} * sizeof(PairParams));
    const std::size_t at_tables = at_qf + align16(std::size_t{n_dev} * G * d * 4);
    const std::size_t at_keys = at_tables + align16(sent_total * 4);
    const std::size_t bytes = at_keys + std::size_t{n_open} * B * d * 2;
    unsigned char* h = dev.staging_host.get();
    auto* params = reinterpret_cast<PairParams*>(h + at_params);
    auto* qf = reinterpret_cast<float*>(h + at_qf);
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
      pp.copy_at = dev.copy_of[i];
      pp.copied = dev.copied[i];
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
      std::memcpy(tables + table_at, pair.table + pp.copied,
                  std::size_t{plan.sealed - pp.copied} * 4);
      if (pp.open_tokens > 0) {
        std::memcpy(keys + open_at, pair.open_keys, std::size_t{pp.open_tokens} * d * 2);
        open_at += B * d;
      }
      table_at += plan.sealed - pp.copied;
      comb_at += plan.n_pages;
      ++k;
    }
    unsigned char* base = dev.staging_device.get();
    RunView view{};
    view.params = reinterpret_cast<const PairParams*>(base + at_params);
    view.qf = reinterpret_cast<const float*>(base + at_qf);
    view.tables = reinterpret_cast<const uint32_t*>(base + at_tables);
    view.copies = dev.copies.get();
    view.keys = reinterpret_cast<const uint16_t*>(base + at_keys);
    view.records = dev.records.get();
    view.head = dev.head.get();
    view.combined = dev.combined.get();
    view.kept = reinterpret_cast<float*>(dev.out_device.get());
    view.ids = reinterpret_cast<uint32_t*>(dev.out_device.get() + kept_bytes);
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
    const uint64_t max_chunk = (max_n + dev.select_ctas - 1) / dev.select_ctas;
    view.stage_floats = static_cast<uint32_t>(std::min<uint64_t>(
        dev.stage_cap_floats, std::max<uint64_t>(uint64_t{G + 1} * max_chunk, (G + B) * d)));
    if (r.ok) r = from_cuda(cudaEventRecord(dev.start.get(), dev.stream.get()), "event");
    if (r.ok)
      r = from_cuda(cudaMemcpyAsync(dev.staging_device.get(), dev.staging_host.get(), bytes,
                                    cudaMemcpyHostToDevice, dev.stream.get()),
                    "batch upload");
    if (r.ok && max_sealed > 0) {
      const dim3 grid((max_sealed + dev.score_pages - 1) / dev.score_pages, n_dev,
                      (G + kScoreHeads - 1) / kScoreHeads);
      view.score_pages = dev.score_pages;
      score_kernel_for(
          G, d)<<<grid, 4 * dev.score_pages, dev.score_tile_bytes, dev.stream.get()>>>(view);
      r = from_cuda.launched("score launch");
    }
    if (r.ok) {
      const dim3 grid(dev.select_ctas, n_dev);  // one cluster a pair (select_kernel's dims)
      select_kernel<<<grid, kSelectThreads, std::size_t{view.stage_floats} * 4, dev.stream.get()>>>(
          view);
      r = from_cuda.launched("select launch");
    }
    if (r.ok)
      r = from_cuda(cudaMemcpyAsync(dev.out_host.get(), dev.out_device.get(),
                                    kept_bytes + std::size_t{dev.total_out} * 8,
                                    cudaMemcpyDeviceToHost, dev.stream.get()),
                    "result download");
    if (r.ok) r = from_cuda(cudaEventRecord(dev.stop.get(), dev.stream.get()), "event");
    if (r.ok) r = from_cuda(cudaStreamSynchronize(dev.stream.get()), "run");
  }
  if (!r.ok) {
    dev.forget_copies();  // the kernel may have stopped short of the new entries
    return r;
  }
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
  return reinterpret_cast<const uint32_t*>(device_->out_host.get() +
                                           (std::size_t{device_->n_pairs} + 3) / 4 * 16);
}

const float* LocksScorer::scores() const noexcept {
  return reinterpret_cast<const float*>(page_ids() + device_->total_out);
}

const float* LocksScorer::kept_estimate() const noexcept {
  return reinterpret_cast<const float*>(device_->out_host.get());
}

Result LocksScorer::head_scores(uint32_t pair, float* out) const {
  if (!device_) return invalid("head_scores before init");
  const Device& dev = *device_;
  if (pair >= dev.n_pairs || dev.head_at[pair] == ~uint64_t{0})
    return invalid("pair " + std::to_string(pair) + " has no device scores in the last run");
  Result r = from_cuda(cudaSetDevice(dev.device), "cudaSetDevice");
  if (r.ok)
    r = from_cuda(
        cudaMemcpy(out, dev.head.get() + dev.head_at[pair],
                   std::size_t{shape_.group} * dev.plans[pair].n_pages * 4, cudaMemcpyDeviceToHost),
        "head scores");
  return r;
}

uint64_t LocksScorer::device_bytes() const noexcept {
  return device_ ? uint64_t{shape_.slots} * device_->layout.bytes : 0;
}

float LocksScorer::last_run_ms() const noexcept {
  float ms = 0.0f;
  if (!device_ ||
      cudaEventElapsedTime(&ms, device_->start.get(), device_->stop.get()) != cudaSuccess) {
    cudaGetLastError();
    return 0.0f;
  }
  return ms;
}

}  // namespace cuda
}  // namespace kvsift::gpu
