// The Llama forward pass's device side (gpu/device_llama.hpp): cuBLAS for the products, small
// kernels for the rest. The kernels are written for obvious correctness first: one block per row
// (RMSNorm, RoPE, embedding, KV store) and flat grid-stride loops (elementwise); the products
// carry nearly all the time. Prefill attention is the exception: quadratic in the context, it is
// tiled on tensor cores (prefill_attention_kernel).
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "gpu/cuda_backend.cuh"
#include "gpu/cuda_handles.cuh"
#include "gpu/cuda_result.cuh"
#include "gpu/device_llama.hpp"
#include "gpu/mma.cuh"

namespace kvsift::gpu {
namespace {

constexpr uint32_t kRowThreads = 256;   // RMSNorm, embedding, RoPE, KV store: one block per row
constexpr uint32_t kFlatThreads = 256;  // elementwise kernels
constexpr uint32_t kFlatMaxBlocks = 4096;
// Prefill attention: 16 query rows a warp (the mma's M), keys staged 64 at a time, 8 warps at most.
constexpr uint32_t kAttentionRows = 16;
constexpr uint32_t kAttentionKeys = 64;
constexpr uint32_t kAttentionMaxWarps = 8;
// cuBLAS's own recommendation for Hopper. Set by hand so that no product allocates while a graph
// is captured, and the same in every call, so that the graphed and the ungraphed products choose
// the same algorithm.
constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;

// Returns the first failing step's Result from the enclosing function.
#define KVSIFT_TRY(expr)                     \
  do {                                       \
    Result try_result_ = (expr);             \
    if (!try_result_.ok) return try_result_; \
  } while (0)

constexpr CudaErrors from_cuda{"device llama"};

// cuBLAS's statuses by gpu/cuda_result.cuh's rules: its allocation failure is out of memory, the
// rest a failure of the request.
Result from_cublas(cublasStatus_t status, const std::string& what) {
  if (status == CUBLAS_STATUS_SUCCESS) return Result{};
  std::string message = "device llama: " + what + ": " + cublasGetStatusString(status);
  return status == CUBLAS_STATUS_ALLOC_FAILED ? Result::out_of_memory(std::move(message))
                                              : Result::failed(std::move(message));
}

Result refuse(const std::string& message) {
  return from_cuda.invalid(message);
}

Result launched(const char* kernel) {
  return from_cuda.launched(std::string("kernel ") + kernel);
}

uint32_t flat_blocks(std::size_t n) {
  return static_cast<uint32_t>(
      std::clamp<std::size_t>((n + kFlatThreads - 1) / kFlatThreads, 1, kFlatMaxBlocks));
}

// Bit-exact with simd::f32_to_bf16 (round to nearest even, NaN kept quiet), so a GEMM input is
// the CPU runner's given the same fp32 value.
__device__ __forceinline__ uint16_t to_bf16(float value) {
  const uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float from_bf16(uint16_t h) {
  return __uint_as_float(static_cast<uint32_t>(h) << 16);
}

// The host cache's storage rounding (F16C's round to nearest even, or bf16's).
template <bool kBf16>
__device__ __forceinline__ uint16_t to_kv(float value) {
  if constexpr (kBf16)
    return to_bf16(value);
  else
    return __half_as_ushort(__float2half_rn(value));
}

template <bool kBf16>
__device__ __forceinline__ float from_kv(uint16_t h) {
  if constexpr (kBf16)
    return from_bf16(h);
  else
    return __half2float(__ushort_as_half(h));
}

// The rotation of lib/cache/rope.cpp, a * c - b * s and a * s + b * c, each product and sum
// rounded separately (the CPU's build has no FMA contraction there), so q is bit-identical.
__device__ __forceinline__ void rotate_pair(float& a, float& b, float c, float s) {
  const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  const float rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
  a = ra;
  b = rb;
}

__global__ void __launch_bounds__(kRowThreads)
    embed_kernel(const uint16_t* __restrict__ table, const int32_t* __restrict__ tokens,
                 uint32_t n_embd, float* __restrict__ x) {
  const uint16_t* row = table + static_cast<std::size_t>(tokens[blockIdx.x]) * n_embd;
  float* out = x + static_cast<std::size_t>(blockIdx.x) * n_embd;
  for (uint32_t i = threadIdx.x; i < n_embd; i += kRowThreads) out[i] = from_bf16(row[i]);
}

// y[r] = bf16(x[src] * inv * w) with src = row_index ? row_index[r] : r and inv =
// fp32(1 / sqrt(sum(x^2) / n + eps)), the sum in float64 as the CPU runner sums it.
__global__ void __launch_bounds__(kRowThreads)
    rms_norm_kernel(const float* __restrict__ x, const uint32_t* __restrict__ row_index,
                    const float* __restrict__ weight, uint32_t n, float eps,
                    uint16_t* __restrict__ y) {
  const uint32_t src = row_index != nullptr ? row_index[blockIdx.x] : blockIdx.x;
  const float* xr = x + static_cast<std::size_t>(src) * n;
  double sum = 0.0;
  for (uint32_t i = threadIdx.x; i < n; i += kRowThreads) sum += double{xr[i]} * xr[i];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  __shared__ double warp_sums[kRowThreads / 32];
  __shared__ float inv_shared;
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (uint32_t w = 0; w < kRowThreads / 32; ++w) total += warp_sums[w];
    inv_shared = static_cast<float>(1.0 / sqrt(total / n + double{eps}));
  }
  __syncthreads();
  const float inv = inv_shared;
  uint16_t* yr = y + static_cast<std::size_t>(blockIdx.x) * n;
  for (uint32_t i = threadIdx.x; i < n; i += kRowThreads)
    yr[i] = to_bf16(__fmul_rn(__fmul_rn(xr[i], inv), weight[i]));
}

// q (the first q_dim columns of the QKV rows) rotated in place at positions[r].
__global__ void __launch_bounds__(kRowThreads)
    rope_q_kernel(float* __restrict__ qkv, uint32_t qkv_stride,
                  const uint32_t* __restrict__ positions, const float* __restrict__ cos_table,
                  const float* __restrict__ sin_table, uint32_t head_dim, uint32_t n_heads) {
  const uint32_t half = head_dim / 2;
  float* q = qkv + static_cast<std::size_t>(blockIdx.x) * qkv_stride;
  const std::size_t table_row = static_cast<std::size_t>(positions[blockIdx.x]) * half;
  for (uint32_t p = threadIdx.x; p < n_heads * half; p += kRowThreads) {
    const uint32_t head = p / half, i = p % half;
    float* pair = q + head * head_dim + 2 * i;
    rotate_pair(pair[0], pair[1], cos_table[table_row + i], sin_table[table_row + i]);
  }
}

// Row r of the chunk: its key rotated to position pos0 + r, key and value rounded to the cache's
// dtype, stored at scratch row pos0 + r.
template <bool kBf16>
__global__ void __launch_bounds__(kRowThreads)
    store_kv_kernel(const float* __restrict__ qkv, uint32_t qkv_stride, uint32_t q_dim,
                    uint32_t kv_dim, uint32_t head_dim, uint64_t pos0,
                    const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                    uint16_t* __restrict__ k_scratch, uint16_t* __restrict__ v_scratch) {
  const uint32_t half = head_dim / 2;
  const uint64_t pos = pos0 + blockIdx.x;
  const float* k = qkv + static_cast<std::size_t>(blockIdx.x) * qkv_stride + q_dim;
  const float* v = k + kv_dim;
  uint16_t* k_out = k_scratch + pos * kv_dim;
  uint16_t* v_out = v_scratch + pos * kv_dim;
  const std::size_t table_row = pos * half;
  for (uint32_t p = threadIdx.x; p < kv_dim / 2; p += kRowThreads) {
    const uint32_t head = p / half, i = p % half, c = head * head_dim + 2 * i;
    float a = k[c], b = k[c + 1];
    rotate_pair(a, b, cos_table[table_row + i], sin_table[table_row + i]);
    k_out[c] = to_kv<kBf16>(a);
    k_out[c + 1] = to_kv<kBf16>(b);
  }
  for (uint32_t c = threadIdx.x; c < kv_dim; c += kRowThreads) v_out[c] = to_kv<kBf16>(v[c]);
}

// One head's row under the q8 rule of simd/page_rows.cpp (quantize_q8_row), held by a warp, each
// lane kValues of its values: every value becomes scale * code rounded once to fp32, the value
// load_rows reads back from the host cache (scale = max|x| / 127, code = x / scale to nearest
// even, clamped to +-127; the integer code makes a zero +0, as the cache's int8 does).
template <uint32_t kValues>
__device__ __forceinline__ void q8_round_row(float (&x)[kValues]) {
  float absmax = 0.0f;
  for (uint32_t e = 0; e < kValues; ++e) absmax = fmaxf(absmax, fabsf(x[e]));
  for (int offset = 16; offset > 0; offset /= 2)
    absmax = fmaxf(absmax, __shfl_xor_sync(0xffffffffu, absmax, offset));
  const float scale = __fdiv_rn(absmax, 127.0f);
  for (uint32_t e = 0; e < kValues; ++e) {
    const int code = scale > 0.0f ? min(max(__float2int_rn(__fdiv_rn(x[e], scale)), -127), 127) : 0;
    x[e] = __fmul_rn(scale, __int2float_rn(code));
  }
}

// store_kv_kernel for a q8 cache, one warp per (chunk row r, KV head): the key rotated to position
// pos0 + r, key and value rounded as the cache stores them (q8_round_row), then to the fp16
// scratch, which holds them to within 2^-11 (relative) of the values the CPU's prefill attention
// reads from the cache (lib/model/prefill_attention.cpp).
template <uint32_t kHeadDim>
__global__ void __launch_bounds__(32)
    store_kv_q8_kernel(const float* __restrict__ qkv, uint32_t qkv_stride, uint32_t q_dim,
                       uint32_t kv_dim, uint64_t pos0, const float* __restrict__ cos_table,
                       const float* __restrict__ sin_table, uint16_t* __restrict__ k_scratch,
                       uint16_t* __restrict__ v_scratch) {
  constexpr uint32_t kPairs = kHeadDim / 64;  // adjacent (2i, 2i + 1) pairs per lane
  const uint64_t pos = pos0 + blockIdx.x;
  const std::size_t head = std::size_t{blockIdx.y} * kHeadDim;
  const float* k = qkv + static_cast<std::size_t>(blockIdx.x) * qkv_stride + q_dim + head;
  const float* v = k + kv_dim;
  const std::size_t table_row = pos * (kHeadDim / 2);
  float kx[2 * kPairs], vx[2 * kPairs];
  for (uint32_t j = 0; j < kPairs; ++j) {
    const uint32_t i = threadIdx.x + 32 * j;
    float a = k[2 * i], b = k[2 * i + 1];
    rotate_pair(a, b, cos_table[table_row + i], sin_table[table_row + i]);
    kx[2 * j] = a, kx[2 * j + 1] = b;
    vx[2 * j] = v[2 * i], vx[2 * j + 1] = v[2 * i + 1];
  }
  q8_round_row(kx);
  q8_round_row(vx);
  uint16_t* k_out = k_scratch + pos * kv_dim + head;
  uint16_t* v_out = v_scratch + pos * kv_dim + head;
  for (uint32_t j = 0; j < kPairs; ++j)
    for (uint32_t e = 0; e < 2; ++e) {
      const uint32_t c = 2 * (threadIdx.x + 32 * j) + e;
      k_out[c] = to_kv<false>(kx[2 * j + e]);
      v_out[c] = to_kv<false>(vx[2 * j + e]);
    }
}

// n values fp32 -> the cache's dtype (a restored prefix: already rotated).
template <bool kBf16>
__global__ void __launch_bounds__(kFlatThreads)
    encode_kv_kernel(const float* __restrict__ in, std::size_t n, uint16_t* __restrict__ out) {
  for (std::size_t i = blockIdx.x * std::size_t{kFlatThreads} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * kFlatThreads)
    out[i] = to_kv<kBf16>(in[i]);
}

__global__ void __launch_bounds__(kFlatThreads)
    to_bf16_kernel(const float* __restrict__ in, std::size_t n, uint16_t* __restrict__ out) {
  for (std::size_t i = blockIdx.x * std::size_t{kFlatThreads} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * kFlatThreads)
    out[i] = to_bf16(in[i]);
}

// out[r, i] = bf16(silu(gate[r, i]) * up[r, i]), gate_up rows [gate | up]; the CPU's expression.
__global__ void __launch_bounds__(kFlatThreads)
    swiglu_kernel(const float* __restrict__ gate_up, uint32_t rows, uint32_t n_ff,
                  uint16_t* __restrict__ out) {
  const std::size_t n = std::size_t{rows} * n_ff;
  for (std::size_t i = blockIdx.x * std::size_t{kFlatThreads} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * kFlatThreads) {
    const std::size_t r = i / n_ff, c = i % n_ff;
    const float gate = gate_up[r * 2 * n_ff + c], up = gate_up[r * 2 * n_ff + n_ff + c];
    out[i] = to_bf16(__fmul_rn(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))), up));
  }
}

// Two fp32 values as the sums hi + lo of the scratch's type, each pair packed as an mma operand
// register (x0 in the low half). The residual x - hi is exact in fp32, so what is lost is lo's own
// rounding: about 2^-22 of x for fp16, 2^-18 for bf16 (fp16's lo goes subnormal below |x| of
// about 2^-3, an absolute loss under 2^-25).
template <bool kBf16>
__device__ __forceinline__ void split_pair(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const uint16_t h0 = to_kv<kBf16>(x0), h1 = to_kv<kBf16>(x1);
  const uint16_t l0 = to_kv<kBf16>(x0 - from_kv<kBf16>(h0));
  const uint16_t l1 = to_kv<kBf16>(x1 - from_kv<kBf16>(h1));
  hi = static_cast<uint32_t>(h0) | static_cast<uint32_t>(h1) << 16;
  lo = static_cast<uint32_t>(l0) | static_cast<uint32_t>(l1) << 16;
}

// Causal prefill attention, flash-style. Every query row of a chunk reads every earlier key, so
// what decides the cost at long context is how often a key is read from global memory and how
// the products run. A block takes row_tiles tiles of 16 query rows for one KV head and up to
// kAttentionMaxWarps of the query heads that share it (its GQA group): one warp per (tile, head).
// It walks the keys from 0 to the causal limit of its last row in tiles of kAttentionKeys, each
// staged once in shared memory and read there by all its warps, so a key leaves global memory
// once per 16 * row_tiles rows and group, not once per row and head. A warp keeps its 16 rows'
// scores for the tile and their outputs in mma.sync's registers (fp32 accumulators) with an fp32
// online softmax (running max and sum per row, expf); the causal mask applies only on tiles that
// reach past the warp's first row. Memory beyond the scratch stays constant per block: there is
// no score matrix.
// Accuracy: the tensor cores take 16-bit operands. Keys and values already are (the scratch's
// type), but q and the probabilities p are fp32, and rounding them alone would move the output by
// about 2^-11 (fp16) or 2^-8 (bf16) relative, beyond the 1e-4 of tests/test_gpu_llama.cpp against
// float64 attention over the scratch. Each is split as hi + lo in the scratch's type (split_pair)
// and both parts are multiplied, at twice the tensor work.
// Work: per (query row, query head, visible key) head_dim multiply-adds for q.k and as many for
// p v, doubled by the split: 8 * head_dim flops, so about n^2 / 2 * n_heads * 8 * head_dim for an
// n-token prompt. For the Llama-3.1-8B shape at n = 128K that is 2.8e14 per layer, 16 times that
// at 512K. Measured on the H200 (kvsift-bench-decode --fill prompt, the whole 32-layer prefill of
// a prompt into the host cache, LOCKS summaries included): 32K tokens 11.8 s, 64K 36.7 s, 94K
// 70.6 s, which a n + b n^2 fits within 2%; its quadratic part is this kernel at about 86 TFLOP/s
// of mma work (a tenth of the device's bf16 peak), and it puts 512K at about half an hour.
// Limits: a tile's load is not overlapped with the previous tile's products (no cp.async
// pipeline); one expf per score runs on the special function units; 8 warps of about 250
// registers fill an SM's register file, one block per SM; there is no split over keys, so a
// chunk of few rows has few blocks (n_kv_heads per 16 * row_tiles rows) and leaves most of the
// device idle. The blocks of the chunk's last rows have the most tiles; they are launched first.
template <uint32_t kHeadDim, bool kBf16>
__global__ void __launch_bounds__(kAttentionMaxWarps * 32)
    prefill_attention_kernel(const float* __restrict__ qkv, uint32_t qkv_stride,
                             const uint16_t* __restrict__ k_scratch,
                             const uint16_t* __restrict__ v_scratch, uint32_t kv_dim,
                             uint32_t group_size, uint32_t heads_per_block, uint32_t row_tiles,
                             uint64_t pos0, uint32_t rows, float scale, float* __restrict__ out,
                             uint32_t q_dim) {
  constexpr uint32_t kRows = kAttentionRows, kKeys = kAttentionKeys;
  // Shared rows padded by 16 bytes: the fragment reads of a warp then fall in distinct banks.
  constexpr uint32_t kStride = kHeadDim + 8;
  constexpr uint32_t kChunks = kHeadDim / 8;  // 16-byte pieces of a key's head
  __shared__ alignas(16) uint16_t k_tile[kKeys * kStride];
  __shared__ alignas(16) uint16_t v_tile[kKeys * kStride];

  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const uint32_t g = lane / 4, t = lane % 4;
  const uint32_t kv_head = blockIdx.y;
  const uint32_t in_group = blockIdx.z * heads_per_block + warp % heads_per_block;
  const uint32_t block_row0 = (gridDim.x - 1 - blockIdx.x) * row_tiles * kRows;
  const uint32_t row0 = block_row0 + warp / heads_per_block * kRows;
  // A warp past the group or the chunk only helps load the tiles.
  const bool active = in_group < group_size && row0 < rows;
  const uint32_t head = kv_head * group_size + min(in_group, group_size - 1);
  const uint64_t block_last = pos0 + min(block_row0 + row_tiles * kRows - 1, rows - 1);
  const uint64_t warp_first = pos0 + row0;
  const uint64_t warp_last = pos0 + min(row0 + kRows - 1, rows - 1);
  // This lane's rows g and g + 8; one past the chunk repeats its last row (and is not written).
  const uint32_t my_rows[2] = {min(row0 + g, rows - 1), min(row0 + g + 8, rows - 1)};
  const uint64_t limit[2] = {pos0 + my_rows[0], pos0 + my_rows[1]};

  // q as the A operand of q k^T, split hi + lo, over the head's kHeadDim / 16 steps.
  uint32_t q_hi[kHeadDim / 16][4], q_lo[kHeadDim / 16][4];
#pragma unroll
  for (uint32_t step = 0; step < kHeadDim / 16; ++step)
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) {
      const float* q =
          qkv + std::size_t{my_rows[i % 2]} * qkv_stride + std::size_t{head} * kHeadDim;
      const uint32_t c = step * 16 + 2 * t + 8 * (i / 2);
      split_pair<kBf16>(q[c], q[c + 1], q_hi[step][i], q_lo[step][i]);
    }

  float o[kHeadDim / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  const uint64_t kv_end = pos0 + rows;  // keys past it are no row's and may be unwritten
  const std::size_t channel = std::size_t{kv_head} * kHeadDim;
  for (uint64_t j0 = 0; j0 <= block_last; j0 += kKeys) {
    __syncthreads();  // the previous tile's reads are done
#pragma unroll
    for (uint32_t i = threadIdx.x; i < kKeys * kChunks; i += blockDim.x) {
      const uint32_t key = i / kChunks, c = i % kChunks * 8;
      uint4 k = make_uint4(0, 0, 0, 0), v = k;
      if (j0 + key < kv_end) {
        const std::size_t at = (j0 + key) * kv_dim + channel + c;
        k = *reinterpret_cast<const uint4*>(k_scratch + at);
        v = *reinterpret_cast<const uint4*>(v_scratch + at);
      }
      *reinterpret_cast<uint4*>(k_tile + key * kStride + c) = k;
      *reinterpret_cast<uint4*>(v_tile + key * kStride + c) = v;
    }
    __syncthreads();
    if (!active || j0 > warp_last) continue;

    // s = q k^T for the tile's keys in 8-key column blocks.
    float s[kKeys / 8][4];
#pragma unroll
    for (uint32_t n = 0; n < kKeys / 8; ++n) {
      s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
      const uint16_t* k = k_tile + (n * 8 + g) * kStride + 2 * t;
#pragma unroll
      for (uint32_t step = 0; step < kHeadDim / 16; ++step) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(k + step * 16);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(k + step * 16 + 8);
        mma_m16n8k16<kBf16>(s[n], q_hi[step], b0, b1);
        mma_m16n8k16<kBf16>(s[n], q_lo[step], b0, b1);
      }
    }

    // The online softmax; a row's four lanes (one g) share its max through two shuffles.
    const bool masked = j0 + kKeys - 1 > warp_first;
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (uint32_t n = 0; n < kKeys / 8; ++n)
#pragma unroll
      for (uint32_t e = 0; e < 4; ++e) {
        float x = s[n][e] * scale;
        if (masked && j0 + n * 8 + 2 * t + e % 2 > limit[e / 2]) x = -INFINITY;
        s[n][e] = x;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
      }
    float correction[2];
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
#pragma unroll
      for (int offset = 1; offset < 4; offset *= 2)
        tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], offset));
      // Finite: every row sees key 0, in the first tile.
      const float m_new = fmaxf(m[h], tile_max[h]);
      correction[h] = expf(m[h] - m_new);  // 0 on the first tile (m = -inf)
      m[h] = m_new;
      l[h] *= correction[h];  // this lane's share of the row's sum; the four add up at the end
    }
#pragma unroll
    for (uint32_t n = 0; n < kKeys / 8; ++n)
#pragma unroll
      for (uint32_t e = 0; e < 4; ++e) {
        s[n][e] = expf(s[n][e] - m[e / 2]);
        l[e / 2] += s[n][e];
      }
#pragma unroll
    for (uint32_t n = 0; n < kHeadDim / 8; ++n)
#pragma unroll
      for (uint32_t e = 0; e < 4; ++e) o[n][e] *= correction[e / 2];

// o += p v: p's accumulator layout is the A operand's for 16-key steps.
#pragma unroll
    for (uint32_t step = 0; step < kKeys / 16; ++step) {
      uint32_t p_hi[4], p_lo[4];
#pragma unroll
      for (uint32_t i = 0; i < 4; ++i) {
        const float* p = s[2 * step + i / 2] + 2 * (i % 2);
        split_pair<kBf16>(p[0], p[1], p_hi[i], p_lo[i]);
      }
      const uint16_t* v = v_tile + (step * 16 + 2 * t) * kStride + g;
#pragma unroll
      for (uint32_t n = 0; n < kHeadDim / 8; ++n) {
        const uint16_t* vn = v + n * 8;
        const uint32_t b0 = vn[0] | static_cast<uint32_t>(vn[kStride]) << 16;
        const uint32_t b1 = vn[8 * kStride] | static_cast<uint32_t>(vn[9 * kStride]) << 16;
        mma_m16n8k16<kBf16>(o[n], p_hi, b0, b1);
        mma_m16n8k16<kBf16>(o[n], p_lo, b0, b1);
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (uint32_t h = 0; h < 2; ++h) {
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2)
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], offset);
    const uint32_t row = row0 + g + 8 * h;
    if (row >= rows) continue;
    float* out_row = out + std::size_t{row} * q_dim + std::size_t{head} * kHeadDim + 2 * t;
#pragma unroll
    for (uint32_t n = 0; n < kHeadDim / 8; ++n) {
      out_row[n * 8] = o[n][2 * h] / l[h];
      out_row[n * 8 + 1] = o[n][2 * h + 1] / l[h];
    }
  }
}

// The grid: (row blocks, last rows first) x KV heads x slices of the group. Up to
// kAttentionMaxWarps warps a block, as many row tiles as the group leaves room for (at most 4,
// and no more than the chunk fills).
template <uint32_t kHeadDim, bool kBf16>
void launch_prefill_attention(cudaStream_t stream, const float* qkv, uint32_t qkv_stride,
                              const uint16_t* k, const uint16_t* v, uint32_t kv_dim,
                              uint32_t n_kv_heads, uint32_t group_size, uint64_t pos0,
                              uint32_t rows, float scale, float* out, uint32_t q_dim) {
  const uint32_t heads = std::min(group_size, kAttentionMaxWarps);
  const uint32_t row_tiles = std::min(
      {std::max(kAttentionMaxWarps / heads, 1u), 4u, (rows + kAttentionRows - 1) / kAttentionRows});
  const uint32_t block_rows = row_tiles * kAttentionRows;
  const dim3 grid((rows + block_rows - 1) / block_rows, n_kv_heads,
                  (group_size + heads - 1) / heads);
  prefill_attention_kernel<kHeadDim, kBf16><<<grid, 32 * heads * row_tiles, 0, stream>>>(
      qkv, qkv_stride, k, v, kv_dim, group_size, heads, row_tiles, pos0, rows, scale, out, q_dim);
}

// Which small host->device upload a pinned staging region serves.
enum Staging : uint32_t { kTokens, kPositions, kRowIndex, kEmbeddings, kPrefix, kStagings };

}  // namespace

namespace cuda {

// The backend's DeviceLlama (gpu/backend.hpp): the CUDA resources and the order of the calls.
class DeviceLlama final : public backend::DeviceLlama {
 public:
  Result init(const LlamaShape& shape, const LlamaWeights& host_weights, int device) override;
  Result embed(const int32_t* tokens, uint32_t rows) override;
  Result load_embeddings(const float* x, uint32_t rows) override;
  Result attention_inputs(uint32_t layer, const uint64_t* positions, uint32_t rows) override;
  const float* q_host() const noexcept override;
  const float* k_host() const noexcept override;
  const float* v_host() const noexcept override;
  float* attn_host() noexcept override;
  Result prefill_attention(uint32_t layer, uint64_t pos0, uint32_t rows) override;
  Result load_prefix(uint32_t layer, uint64_t first, const float* k_post_rope, const float* v,
                     uint64_t n) override;
  void reset_prefill() noexcept override;
  uint64_t prefill_held(uint32_t layer) const noexcept override;
  Result finish_layer(uint32_t layer, bool attn_from_host) override;
  Result logits(const uint32_t* rows_idx, uint32_t n, float* host_out) override;
  Result read_hidden(float* host_out) override;
  Result read_attention(float* host_out) override;
  const LlamaShape& shape() const noexcept override { return shape_; }
  uint32_t rows() const noexcept override { return rows_; }
  void* stream() const noexcept override;
  std::size_t device_bytes() const noexcept override;
  const DecodeGraphStats& graph_stats() const noexcept override { return graph_stats_; }

 private:
  enum class Stage : uint8_t { idle, need_inputs, have_inputs, have_attention };
  struct Device;  // the CUDA resources

  Result check_layer_call(const char* what, uint32_t layer, Stage expected) const;
  void abandon() noexcept;

  LlamaShape shape_{};
  std::unique_ptr<Device> device_;
  uint32_t rows_ = 0;
  uint32_t next_layer_ = 0;
  Stage stage_ = Stage::idle;
  std::vector<uint64_t> held_;       // per layer: scratch positions held
  std::vector<uint32_t> positions_;  // the layer in flight's positions (host copy)
  // A decode graph has enqueued layer next_layer_'s attention inputs at positions_.
  bool inputs_ahead_ = false;
  DecodeGraphStats graph_stats_;
};

std::unique_ptr<backend::DeviceLlama> make_device_llama() {
  return std::make_unique<DeviceLlama>();
}

struct DeviceLlama::Device {
  int ordinal = 0;
  LlamaShape shape{};
  // Every device and pinned allocation; the pointers below are views into them.
  std::vector<DeviceBuffer<void>> device_blocks;
  std::vector<PinnedBuffer<void>> pinned_blocks;
  Stream stream;  // declared after the blocks, so that it goes before them
  cublasHandle_t cublas = nullptr;
  std::size_t device_bytes = 0;

  struct Layer {
    const uint16_t *wqkv, *wo, *w_gate_up, *w_down;
    const float *attn_norm, *ffn_norm;
    uint16_t *k_scratch, *v_scratch;  // [max_prefill_tokens, kv_dim]
  };
  std::vector<Layer> layers;
  const uint16_t* token_embd = nullptr;
  const uint16_t* output = nullptr;
  const float* output_norm = nullptr;
  const float* cos_table = nullptr;  // [max_positions, head_dim / 2]
  const float* sin_table = nullptr;

  float* x = nullptr;          // [max_rows, n_embd] the residual stream
  uint16_t* x_bf16 = nullptr;  // [max_rows, max(n_embd, q_dim, n_ff)] the products' input
  float* qkv = nullptr;        // [max_rows, q_dim + 2 * kv_dim]
  float* attn = nullptr;       // [max_rows, q_dim]
  float* gate_up = nullptr;    // [max_rows, 2 * n_ff]
  float* logits = nullptr;     // [max_rows, n_vocab]
  float* prefix = nullptr;     // [max_rows, 2 * kv_dim] a restored prefix's chunk, k then v
  int32_t* tokens = nullptr;   // [max_rows]
  uint32_t* positions = nullptr;
  uint32_t* row_index = nullptr;

  float *q_host = nullptr, *k_host = nullptr, *v_host = nullptr, *attn_host = nullptr;
  void* staging[kStagings] = {};
  Event staged[kStagings];  // the last upload from each staging region

  // Decode graphs of one rows value: execs[l] is finish_layer(l, true) then, below the last
  // layer, layer l + 1's attention inputs; null until captured, on its second use (used[l]).
  struct Graphs {
    uint32_t rows;
    std::vector<GraphExec> execs;
    std::vector<uint8_t> used;
  };
  std::vector<Graphs> graphs;  // at most kMaxGraphRows

  // The work drains, then the graphs and events go before the cuBLAS handle; the stream and the
  // blocks follow as members.
  ~Device() {
    const DeviceScope on(ordinal);
    if (stream) cudaStreamSynchronize(stream.get());
    graphs.clear();
    for (Event& e : staged) e.reset();
    if (cublas) cublasDestroy(cublas);
  }

  Result build(const LlamaShape& s, const LlamaWeights& w) {
    shape = s;
    const uint32_t E = shape.n_embd, F = shape.n_ff, V = shape.n_vocab, R = shape.max_rows;
    const uint32_t qdim = shape.q_dim(), kvdim = shape.kv_dim(), half = shape.head_dim / 2;
    const std::size_t widest = std::max({E, qdim, F});
    KVSIFT_TRY(from_cuda(cudaSetDevice(ordinal), "cudaSetDevice"));
    KVSIFT_TRY(from_cuda(stream.create(cudaStreamNonBlocking), "stream"));
    KVSIFT_TRY(from_cublas(cublasCreate(&cublas), "cublasCreate"));
    KVSIFT_TRY(from_cublas(cublasSetStream(cublas, stream.get()), "cublasSetStream"));
    // After cublasSetStream, which resets the workspace to cuBLAS's own pool.
    char* workspace = nullptr;
    KVSIFT_TRY(alloc(&workspace, kCublasWorkspaceBytes, "cuBLAS workspace"));
    KVSIFT_TRY(from_cublas(cublasSetWorkspace(cublas, workspace, kCublasWorkspaceBytes),
                           "cublasSetWorkspace"));
    graphs.reserve(kMaxGraphRows);
    for (Event& e : staged) KVSIFT_TRY(from_cuda(e.create(cudaEventDisableTiming), "event"));

    layers.resize(shape.n_layers);
    for (uint32_t l = 0; l < shape.n_layers; ++l) {
      const LlamaLayerWeights& h = w.layers[l];
      Layer& L = layers[l];
      KVSIFT_TRY(upload(&L.wqkv, h.wqkv, std::size_t{qdim + 2 * kvdim} * E, "wqkv"));
      KVSIFT_TRY(upload(&L.wo, h.wo, std::size_t{E} * qdim, "wo"));
      KVSIFT_TRY(upload(&L.w_gate_up, h.w_gate_up, std::size_t{2} * F * E, "w_gate_up"));
      KVSIFT_TRY(upload(&L.w_down, h.w_down, std::size_t{E} * F, "w_down"));
      KVSIFT_TRY(upload(&L.attn_norm, h.attn_norm, E, "attn_norm"));
      KVSIFT_TRY(upload(&L.ffn_norm, h.ffn_norm, E, "ffn_norm"));
    }
    KVSIFT_TRY(upload(&token_embd, w.token_embd, std::size_t{V} * E, "token_embd"));
    if (w.output == w.token_embd)
      output = token_embd;
    else
      KVSIFT_TRY(upload(&output, w.output, std::size_t{V} * E, "output"));
    KVSIFT_TRY(upload(&output_norm, w.output_norm, E, "output_norm"));

    // lib/cache/rope.cpp's table: angles in float64 from the same expression, rounded once.
    std::vector<float> cos_host(std::size_t{shape.max_positions} * half), sin_host(cos_host.size());
    std::vector<double> inv_freq(half);
    for (uint32_t i = 0; i < half; ++i)
      inv_freq[i] = std::pow(double{shape.rope_theta}, -2.0 * i / shape.head_dim);
    for (std::size_t pos = 0; pos < shape.max_positions; ++pos)
      for (uint32_t i = 0; i < half; ++i) {
        const double angle = static_cast<double>(pos) * inv_freq[i];
        cos_host[pos * half + i] = static_cast<float>(std::cos(angle));
        sin_host[pos * half + i] = static_cast<float>(std::sin(angle));
      }
    KVSIFT_TRY(upload(&cos_table, cos_host.data(), cos_host.size(), "rope cos"));
    KVSIFT_TRY(upload(&sin_table, sin_host.data(), sin_host.size(), "rope sin"));

    KVSIFT_TRY(alloc(&x, std::size_t{R} * E, "x"));
    KVSIFT_TRY(alloc(&x_bf16, R * widest, "x_bf16"));
    KVSIFT_TRY(alloc(&qkv, std::size_t{R} * (qdim + 2 * kvdim), "qkv"));
    KVSIFT_TRY(alloc(&attn, std::size_t{R} * qdim, "attn"));
    KVSIFT_TRY(alloc(&gate_up, std::size_t{R} * 2 * F, "gate_up"));
    KVSIFT_TRY(alloc(&logits, std::size_t{R} * V, "logits"));
    KVSIFT_TRY(alloc(&prefix, std::size_t{R} * 2 * kvdim, "prefix"));
    KVSIFT_TRY(alloc(&tokens, R, "tokens"));
    KVSIFT_TRY(alloc(&positions, R, "positions"));
    KVSIFT_TRY(alloc(&row_index, R, "row index"));

    KVSIFT_TRY(alloc_pinned(&q_host, std::size_t{R} * qdim, "q"));
    KVSIFT_TRY(alloc_pinned(&k_host, std::size_t{R} * kvdim, "k"));
    KVSIFT_TRY(alloc_pinned(&v_host, std::size_t{R} * kvdim, "v"));
    KVSIFT_TRY(alloc_pinned(&attn_host, std::size_t{R} * qdim, "attn"));
    const std::size_t staging_bytes[kStagings] = {
        R * sizeof(int32_t), R * sizeof(uint32_t), R * sizeof(uint32_t),
        std::size_t{R} * E * sizeof(float), std::size_t{R} * 2 * kvdim * sizeof(float)};
    for (uint32_t s = 0; s < kStagings; ++s) {
      char* p = nullptr;
      KVSIFT_TRY(alloc_pinned(&p, staging_bytes[s], "staging"));
      staging[s] = p;
    }
    return Result{};
  }

  // A layer's prefill scratch, allocated by its first prefill or load_prefix: a model that only
  // decodes (its context appended to the host cache) never holds it, and at 512K tokens of an
  // 8B-shaped model it would be 64 GiB.
  Result scratch_for(uint32_t layer) {
    Layer& L = layers[layer];
    if (L.k_scratch != nullptr) return Result{};
    const std::size_t scratch = std::size_t{shape.max_prefill_tokens} * shape.kv_dim();
    KVSIFT_TRY(alloc(&L.k_scratch, scratch, "prefill keys"));
    return alloc(&L.v_scratch, scratch, "prefill values");
  }

  template <class T>
  Result alloc(T** out, std::size_t count, const char* what) {
    DeviceBuffer<void> block;
    const std::size_t bytes = std::max<std::size_t>(count, 1) * sizeof(T);
    const Result r = from_cuda(block.allocate(bytes), std::string("cudaMalloc (") + what + ")");
    if (!r.ok) return r;
    *out = static_cast<T*>(block.get());
    device_blocks.push_back(std::move(block));
    device_bytes += bytes;
    return r;
  }

  template <class T>
  Result upload(const T** out, const T* host, std::size_t count, const char* what) {
    T* p = nullptr;
    Result r = alloc(&p, count, what);
    if (r.ok)
      r = from_cuda(cudaMemcpy(p, host, count * sizeof(T), cudaMemcpyHostToDevice),
                    std::string("cudaMemcpy (") + what + ")");
    *out = p;
    return r;
  }

  template <class T>
  Result alloc_pinned(T** out, std::size_t count, const char* what) {
    PinnedBuffer<void> block;
    const Result r = from_cuda(
        block.allocate(std::max<std::size_t>(count, 1) * sizeof(T), cudaHostAllocPortable),
        std::string("cudaHostAlloc (") + what + ")");
    if (!r.ok) return r;
    *out = static_cast<T*>(block.get());
    pinned_blocks.push_back(std::move(block));
    return r;
  }

  // Enqueues a copy of host[0, bytes) to device memory through staging region `which`, first
  // waiting for that region's previous upload: the caller's memory is free when this returns and
  // the region is never rewritten under a copy still queued.
  Result stage(Staging which, void* device_dst, const void* host, std::size_t bytes) {
    Result r =
        from_cuda(cudaEventSynchronize(staged[which].get()), "cudaEventSynchronize (staging)");
    if (!r.ok) return r;
    std::memcpy(staging[which], host, bytes);
    r = from_cuda(
        cudaMemcpyAsync(device_dst, staging[which], bytes, cudaMemcpyHostToDevice, stream.get()),
        "cudaMemcpyAsync (upload)");
    if (!r.ok) return r;
    return from_cuda(cudaEventRecord(staged[which].get(), stream.get()),
                     "cudaEventRecord (staging)");
  }

  // y [rows, out] (+)= x [rows, in] * w[out, in]^T: bf16 inputs, fp32 accumulation and output.
  // In cuBLAS's column-major terms y^T = w * x^T with w read transposed. accumulate: beta = 1
  // adds the product to y in the same fp32 epilogue (the residual add).
  Result gemm(const uint16_t* w, uint32_t out, uint32_t in, const uint16_t* x_in, uint32_t rows,
              float* y, bool accumulate, const char* what) {
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    return from_cublas(
        cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out),
                     static_cast<int>(rows), static_cast<int>(in), &alpha, w, CUDA_R_16BF,
                     static_cast<int>(in), x_in, CUDA_R_16BF, static_cast<int>(in), &beta, y,
                     CUDA_R_32F, static_cast<int>(out), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        std::string("cublasGemmEx (") + what + ")");
  }

  // Blocking copy of count floats of device memory to the host, after the work queued before.
  Result download(float* host, const float* device, std::size_t count, const char* what) {
    KVSIFT_TRY(from_cuda(cudaSetDevice(ordinal), "cudaSetDevice"));
    KVSIFT_TRY(from_cuda(
        cudaMemcpyAsync(host, device, count * sizeof(float), cudaMemcpyDeviceToHost, stream.get()),
        std::string("cudaMemcpyAsync (") + what + ")"));
    return from_cuda(cudaStreamSynchronize(stream.get()),
                     std::string("cudaStreamSynchronize (") + what + ")");
  }

  Result rms_norm(const float* in, const uint32_t* row_index, const float* weight, uint32_t rows,
                  uint32_t n, float eps) {
    rms_norm_kernel<<<rows, kRowThreads, 0, stream.get()>>>(in, row_index, weight, n, eps, x_bf16);
    return launched("rms_norm");
  }

  // attention_inputs' device work, at the positions already in `positions`. Enqueues only (no
  // staging, no wait), so that a graph can capture it.
  Result inputs(uint32_t layer, uint32_t rows) {
    const Layer& L = layers[layer];
    const uint32_t E = shape.n_embd, qdim = shape.q_dim(), kvdim = shape.kv_dim();
    const uint32_t stride = qdim + 2 * kvdim;
    KVSIFT_TRY(rms_norm(x, nullptr, L.attn_norm, rows, E, shape.rms_eps));
    KVSIFT_TRY(gemm(L.wqkv, stride, E, x_bf16, rows, qkv, false, "wqkv"));
    rope_q_kernel<<<rows, kRowThreads, 0, stream.get()>>>(qkv, stride, positions, cos_table,
                                                          sin_table, shape.head_dim, shape.n_heads);
    KVSIFT_TRY(launched("rope_q"));
    const std::size_t pitch = std::size_t{stride} * sizeof(float);
    const struct {
      float* host;
      uint32_t offset, width;
    } parts[] = {{q_host, 0, qdim}, {k_host, qdim, kvdim}, {v_host, qdim + kvdim, kvdim}};
    for (const auto& part : parts)
      KVSIFT_TRY(from_cuda(
          cudaMemcpy2DAsync(part.host, part.width * sizeof(float), qkv + part.offset, pitch,
                            part.width * sizeof(float), rows, cudaMemcpyDeviceToHost, stream.get()),
          "cudaMemcpy2DAsync (q, k, v to the host)"));
    return Result{};
  }

  // finish_layer's device work. Enqueues only.
  Result finish(uint32_t layer, uint32_t rows, bool attn_from_host) {
    const Layer& L = layers[layer];
    const uint32_t E = shape.n_embd, F = shape.n_ff, qdim = shape.q_dim();
    // The host writes attn_host only between attention_inputs (which waited for the stream) and
    // finish_layer, so the plain pinned buffer needs no staging, and a graph may read it.
    if (attn_from_host)
      KVSIFT_TRY(
          from_cuda(cudaMemcpyAsync(attn, attn_host, std::size_t{rows} * qdim * sizeof(float),
                                    cudaMemcpyHostToDevice, stream.get()),
                    "cudaMemcpyAsync (attention output)"));
    const std::size_t n_attn = std::size_t{rows} * qdim, n_ffn = std::size_t{rows} * F;
    to_bf16_kernel<<<flat_blocks(n_attn), kFlatThreads, 0, stream.get()>>>(attn, n_attn, x_bf16);
    KVSIFT_TRY(launched("to_bf16"));
    KVSIFT_TRY(gemm(L.wo, E, qdim, x_bf16, rows, x, true, "wo"));
    KVSIFT_TRY(rms_norm(x, nullptr, L.ffn_norm, rows, E, shape.rms_eps));
    KVSIFT_TRY(gemm(L.w_gate_up, 2 * F, E, x_bf16, rows, gate_up, false, "w_gate_up"));
    swiglu_kernel<<<flat_blocks(n_ffn), kFlatThreads, 0, stream.get()>>>(gate_up, rows, F, x_bf16);
    KVSIFT_TRY(launched("swiglu"));
    return gemm(L.w_down, E, F, x_bf16, rows, x, true, "w_down");
  }

  // The decode graphs of rows, or null where rows would exceed kMaxGraphRows values.
  Graphs* graphs_of(uint32_t rows) {
    for (Graphs& g : graphs)
      if (g.rows == rows) return &g;
    if (graphs.size() == kMaxGraphRows) return nullptr;
    graphs.push_back(Graphs{rows, std::vector<GraphExec>(shape.n_layers),
                            std::vector<uint8_t>(shape.n_layers, 0)});
    return &graphs.back();
  }

  // Captures what enqueue() enqueues on the stream into *exec. Returns why it failed, or "". The
  // capture is thread-local: other threads' CUDA calls (the offload attention's) stay legal.
  template <class Enqueue>
  std::string capture(GraphExec* exec, Enqueue&& enqueue) {
    cudaError_t err = cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal);
    if (err != cudaSuccess) return from_cuda(err, "cudaStreamBeginCapture").message;
    const Result enqueued = enqueue();
    Graph graph;
    err = graph.end_capture(stream.get());  // ends the capture, even an invalidated one
    std::string why;
    if (!enqueued.ok)
      why = enqueued.message + " (while capturing a decode graph)";
    else if (err != cudaSuccess)
      why = from_cuda(err, "cudaStreamEndCapture").message;
    else if (!graph)
      why = "device llama: cudaStreamEndCapture returned no graph";
    else if ((err = exec->instantiate(graph)) != cudaSuccess)
      why = from_cuda(err, "cudaGraphInstantiate").message;
    graph.reset();
    if (!why.empty()) {
      cudaGetLastError();  // a failed launch inside the capture: not the next call's error
      exec->reset();
    }
    return why;
  }

  // Launches the decode graph of (layer, rows), capturing it from enqueue() on its second use;
  // sets *launched. The first use is left to the caller, ungraphed: a warm-up, so that lazy
  // module loading and cuBLAS's first-call setup happen outside any capture. Where graphs are
  // off, rows has no slot, or the capture or launch fails (the graphs are then turned off, the
  // reason kept in stats.off), launches nothing: nothing was enqueued, and the caller runs the
  // work ungraphed.
  template <class Enqueue>
  void launch_graph(uint32_t layer, uint32_t rows, DecodeGraphStats& stats, bool* launched,
                    Enqueue&& enqueue) {
    *launched = false;
    Graphs* g = stats.off.empty() ? graphs_of(rows) : nullptr;
    GraphExec* exec = nullptr;
    if (g != nullptr && g->used[layer])
      exec = &g->execs[layer];
    else if (g != nullptr)
      g->used[layer] = 1;
    if (exec != nullptr && !*exec) {
      std::string why = capture(exec, enqueue);
      if (why.empty())
        ++stats.captured;
      else
        stats.off = std::move(why);
    }
    if (exec != nullptr && *exec) {
      // A launch that fails has enqueued nothing: the runtime validates before it submits.
      const cudaError_t err = cudaGraphLaunch(exec->get(), stream.get());
      if (err == cudaSuccess) {
        ++stats.replays;
        *launched = true;
        return;
      }
      stats.off = from_cuda(err, "cudaGraphLaunch").message;
    }
    ++stats.ungraphed;
  }
};

namespace {

Result check_shape(const LlamaShape& s) {
  auto in = [](uint64_t v, uint64_t lo, uint64_t hi) { return v >= lo && v <= hi; };
  if (!in(s.n_layers, 1, 4096))
    return refuse("n_layers=" + std::to_string(s.n_layers) + " is not in 1..4096");
  if (!in(s.n_embd, 1, 65536))
    return refuse("n_embd=" + std::to_string(s.n_embd) + " is not in 1..65536");
  if (!in(s.n_ff, 1, 262144))
    return refuse("n_ff=" + std::to_string(s.n_ff) + " is not in 1..262144");
  if (!in(s.n_heads, 1, 1024) || !in(s.n_kv_heads, 1, s.n_heads) || s.n_heads % s.n_kv_heads != 0)
    return refuse("n_heads=" + std::to_string(s.n_heads) +
                  ", n_kv_heads=" + std::to_string(s.n_kv_heads) +
                  ": need 1 <= n_kv_heads <= n_heads <= 1024, n_kv_heads dividing n_heads");
  if (s.head_dim != 64 && s.head_dim != 128)
    return refuse("head_dim=" + std::to_string(s.head_dim) + " is not 64 or 128");
  if (!in(s.n_vocab, 1, uint64_t{1} << 24))
    return refuse("n_vocab=" + std::to_string(s.n_vocab) + " is not in 1..2^24");
  if (!std::isfinite(s.rope_theta) || !(s.rope_theta > 0.0f))
    return refuse("rope_theta=" + std::to_string(s.rope_theta) + " is not a positive number");
  if (!std::isfinite(s.rms_eps) || !(s.rms_eps > 0.0f))
    return refuse("rms_eps=" + std::to_string(s.rms_eps) + " is not a positive number");
  if (!in(s.max_rows, 1, 4096))
    return refuse("max_rows=" + std::to_string(s.max_rows) + " is not in 1..4096");
  if (!in(s.max_positions, 1, uint64_t{1} << 20))
    return refuse("max_positions=" + std::to_string(s.max_positions) + " is not in 1..2^20");
  if (s.max_prefill_tokens > s.max_positions)
    return refuse("max_prefill_tokens=" + std::to_string(s.max_prefill_tokens) +
                  " exceeds max_positions=" + std::to_string(s.max_positions));
  if (s.kv_dtype != simd::Dtype::f16 && s.kv_dtype != simd::Dtype::bf16 &&
      s.kv_dtype != simd::Dtype::q8)
    return refuse("kv_dtype is not f16, bf16 or q8");
  return Result{};
}

Result check_weights(const LlamaShape& s, const LlamaWeights& w) {
  if (w.layers.size() != s.n_layers)
    return refuse("weights hold " + std::to_string(w.layers.size()) + " layers, the shape " +
                  std::to_string(s.n_layers));
  for (std::size_t l = 0; l < w.layers.size(); ++l) {
    const LlamaLayerWeights& L = w.layers[l];
    if (!L.wqkv || !L.wo || !L.w_gate_up || !L.w_down || !L.attn_norm || !L.ffn_norm)
      return refuse("layer " + std::to_string(l) + " has a null weight pointer");
  }
  if (!w.token_embd || !w.output || !w.output_norm)
    return refuse("token_embd, output or output_norm is null");
  return Result{};
}

}  // namespace

Result DeviceLlama::init(const LlamaShape& shape, const LlamaWeights& w, int device) {
  Result r = check_shape(shape);
  if (r.ok) r = check_weights(shape, w);
  if (!r.ok) return r;
  device_.reset();
  abandon();
  auto d = std::make_unique<Device>();
  d->ordinal = device;
  r = d->build(shape, w);
  if (!r.ok) return r;
  device_ = std::move(d);
  shape_ = shape;
  held_.assign(shape.n_layers, 0);
  positions_.assign(shape.max_rows, 0);
  graph_stats_ = DecodeGraphStats{};
  return r;
}

void DeviceLlama::abandon() noexcept {
  rows_ = 0;
  next_layer_ = 0;
  stage_ = Stage::idle;
  inputs_ahead_ = false;
}

Result DeviceLlama::check_layer_call(const char* what, uint32_t layer, Stage expected) const {
  const std::string name(what);
  if (device_ == nullptr) return refuse(name + ": not initialised");
  if (rows_ == 0) return refuse(name + ": no forward pass in flight (embed first)");
  if (layer != next_layer_ || layer >= shape_.n_layers)
    return refuse(name + ": layer " + std::to_string(layer) +
                  " out of order; the pass is at layer " + std::to_string(next_layer_) + " of " +
                  std::to_string(shape_.n_layers));
  if (stage_ != expected) {
    static const char* const kStage[] = {"idle", "before attention_inputs",
                                         "after attention_inputs", "after prefill_attention"};
    return refuse(name + ": called " + kStage[static_cast<int>(stage_)] + " of layer " +
                  std::to_string(layer));
  }
  return Result{};
}

Result DeviceLlama::embed(const int32_t* tokens, uint32_t rows) {
  if (device_ == nullptr) return refuse("embed: not initialised");
  if (rows < 1 || rows > shape_.max_rows)
    return refuse("embed: rows=" + std::to_string(rows) +
                  " is not in 1..max_rows=" + std::to_string(shape_.max_rows));
  if (tokens == nullptr) return refuse("embed: tokens is null");
  for (uint32_t r = 0; r < rows; ++r)
    if (tokens[r] < 0 || static_cast<uint32_t>(tokens[r]) >= shape_.n_vocab)
      return refuse("embed: tokens[" + std::to_string(r) + "]=" + std::to_string(tokens[r]) +
                    " is not in the vocabulary (" + std::to_string(shape_.n_vocab) + " tokens)");
  abandon();
  Device& d = *device_;
  const Result r = [&]() -> Result {
    KVSIFT_TRY(from_cuda(cudaSetDevice(d.ordinal), "cudaSetDevice"));
    KVSIFT_TRY(d.stage(kTokens, d.tokens, tokens, rows * sizeof(int32_t)));
    embed_kernel<<<rows, kRowThreads, 0, d.stream.get()>>>(d.token_embd, d.tokens, shape_.n_embd,
                                                           d.x);
    return launched("embed");
  }();
  if (r.ok) {
    rows_ = rows;
    stage_ = Stage::need_inputs;
  }
  return r;
}

Result DeviceLlama::load_embeddings(const float* x, uint32_t rows) {
  if (device_ == nullptr) return refuse("load_embeddings: not initialised");
  if (rows < 1 || rows > shape_.max_rows)
    return refuse("load_embeddings: rows=" + std::to_string(rows) +
                  " is not in 1..max_rows=" + std::to_string(shape_.max_rows));
  if (x == nullptr) return refuse("load_embeddings: x is null");
  abandon();
  Device& d = *device_;
  const Result r = [&]() -> Result {
    KVSIFT_TRY(from_cuda(cudaSetDevice(d.ordinal), "cudaSetDevice"));
    return d.stage(kEmbeddings, d.x, x, std::size_t{rows} * shape_.n_embd * sizeof(float));
  }();
  if (r.ok) {
    rows_ = rows;
    stage_ = Stage::need_inputs;
  }
  return r;
}

Result DeviceLlama::attention_inputs(uint32_t layer, const uint64_t* positions, uint32_t rows) {
  KVSIFT_TRY(check_layer_call("attention_inputs", layer, Stage::need_inputs));
  if (rows != rows_)
    return refuse("attention_inputs: rows=" + std::to_string(rows) + " but the pass has " +
                  std::to_string(rows_));
  if (positions == nullptr) return refuse("attention_inputs: positions is null");
  for (uint32_t i = 0; i < rows; ++i)
    if (positions[i] >= shape_.max_positions)
      return refuse("attention_inputs: positions[" + std::to_string(i) +
                    "]=" + std::to_string(positions[i]) +
                    " is not below max_positions=" + std::to_string(shape_.max_positions));
  // A decode graph computed this layer's inputs at the previous layer's positions: where they are
  // these, the work is done (and the device's positions are these already).
  bool ahead = inputs_ahead_;
  for (uint32_t i = 0; i < rows && ahead; ++i) ahead = positions_[i] == positions[i];
  inputs_ahead_ = false;
  for (uint32_t i = 0; i < rows; ++i) positions_[i] = static_cast<uint32_t>(positions[i]);
  Device& d = *device_;
  const Result r = [&]() -> Result {
    KVSIFT_TRY(from_cuda(cudaSetDevice(d.ordinal), "cudaSetDevice"));
    if (!ahead) {
      KVSIFT_TRY(d.stage(kPositions, d.positions, positions_.data(), rows * sizeof(uint32_t)));
      KVSIFT_TRY(d.inputs(layer, rows));
    }
    return from_cuda(cudaStreamSynchronize(d.stream.get()),
                     "cudaStreamSynchronize (attention inputs)");
  }();
  if (!r.ok) {
    abandon();
    return r;
  }
  if (ahead) ++graph_stats_.inputs_reused;
  stage_ = Stage::have_inputs;
  return r;
}

const float* DeviceLlama::q_host() const noexcept {
  return device_ ? device_->q_host : nullptr;
}

const float* DeviceLlama::k_host() const noexcept {
  return device_ ? device_->k_host : nullptr;
}

const float* DeviceLlama::v_host() const noexcept {
  return device_ ? device_->v_host : nullptr;
}

float* DeviceLlama::attn_host() noexcept {
  return device_ ? device_->attn_host : nullptr;
}

Result DeviceLlama::prefill_attention(uint32_t layer, uint64_t pos0, uint32_t rows) {
  KVSIFT_TRY(check_layer_call("prefill_attention", layer, Stage::have_inputs));
  if (rows != rows_)
    return refuse("prefill_attention: rows=" + std::to_string(rows) + " but the pass has " +
                  std::to_string(rows_));
  if (pos0 > held_[layer])
    return refuse("prefill_attention: pos0=" + std::to_string(pos0) + " but the scratch of layer " +
                  std::to_string(layer) + " holds " + std::to_string(held_[layer]) +
                  " positions (load_prefix first)");
  if (pos0 + rows > shape_.max_prefill_tokens)
    return refuse("prefill_attention: positions up to " + std::to_string(pos0 + rows) +
                  " exceed max_prefill_tokens=" + std::to_string(shape_.max_prefill_tokens));
  for (uint32_t i = 0; i < rows; ++i)
    if (positions_[i] != pos0 + i)
      return refuse("prefill_attention: attention_inputs had positions[" + std::to_string(i) +
                    "]=" + std::to_string(positions_[i]) + ", not pos0 + " + std::to_string(i));
  Device& d = *device_;
  const Device::Layer& L = d.layers[layer];
  const uint32_t qdim = shape_.q_dim(), kvdim = shape_.kv_dim(), stride = qdim + 2 * kvdim;
  const uint32_t group = shape_.n_heads / shape_.n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim));
  const bool bf16 = shape_.kv_dtype == simd::Dtype::bf16;  // else fp16, a q8 cache's too
  const Result r = [&]() -> Result {
    KVSIFT_TRY(from_cuda(cudaSetDevice(d.ordinal), "cudaSetDevice"));
    KVSIFT_TRY(d.scratch_for(layer));
    if (shape_.kv_dtype == simd::Dtype::q8) {
      const auto store = shape_.head_dim == 64 ? store_kv_q8_kernel<64> : store_kv_q8_kernel<128>;
      store<<<dim3(rows, shape_.n_kv_heads), 32, 0, d.stream.get()>>>(
          d.qkv, stride, qdim, kvdim, pos0, d.cos_table, d.sin_table, L.k_scratch, L.v_scratch);
    } else if (bf16) {
      store_kv_kernel<true><<<rows, kRowThreads, 0, d.stream.get()>>>(
          d.qkv, stride, qdim, kvdim, shape_.head_dim, pos0, d.cos_table, d.sin_table, L.k_scratch,
          L.v_scratch);
    } else {
      store_kv_kernel<false><<<rows, kRowThreads, 0, d.stream.get()>>>(
          d.qkv, stride, qdim, kvdim, shape_.head_dim, pos0, d.cos_table, d.sin_table, L.k_scratch,
          L.v_scratch);
    }
    KVSIFT_TRY(launched("store_kv"));
    auto launch =
        shape_.head_dim == 64
            ? (bf16 ? launch_prefill_attention<64, true> : launch_prefill_attention<64, false>)
            : (bf16 ? launch_prefill_attention<128, true> : launch_prefill_attention<128, false>);
    launch(d.stream.get(), d.qkv, stride, L.k_scratch, L.v_scratch, kvdim, shape_.n_kv_heads, group,
           pos0, rows, scale, d.attn, qdim);
    return launched("prefill_attention");
  }();
  if (!r.ok) {
    held_[layer] = std::min<uint64_t>(held_[layer], pos0);  // what the failed store may have hit
    abandon();
    return r;
  }
  held_[layer] = pos0 + rows;
  stage_ = Stage::have_attention;
  return r;
}

Result DeviceLlama::load_prefix(uint32_t layer, uint64_t first, const float* k_post_rope,
                                const float* v, uint64_t n) {
  if (device_ == nullptr) return refuse("load_prefix: not initialised");
  if (layer >= shape_.n_layers)
    return refuse("load_prefix: layer " + std::to_string(layer) +
                  " is not below n_layers=" + std::to_string(shape_.n_layers));
  if (first > held_[layer])
    return refuse("load_prefix: first=" + std::to_string(first) + " but the scratch of layer " +
                  std::to_string(layer) + " holds " + std::to_string(held_[layer]) + " positions");
  // first <= held <= max_prefill_tokens, so the difference cannot wrap where first + n could.
  if (n > shape_.max_prefill_tokens - first)
    return refuse("load_prefix: n=" + std::to_string(n) + " positions from first=" +
                  std::to_string(first) + " exceed max_prefill_tokens=" +
                  std::to_string(shape_.max_prefill_tokens));
  if (n > 0 && (k_post_rope == nullptr || v == nullptr))
    return refuse("load_prefix: k_post_rope or v is null");
  Device& d = *device_;
  const Device::Layer& L = d.layers[layer];
  const uint32_t kvdim = shape_.kv_dim();
  const bool bf16 = shape_.kv_dtype == simd::Dtype::bf16;  // else fp16, a q8 cache's too
  // Through the prefix staging, max_rows positions at a time: a cold path (a prefill that
  // continues an older sequence), so simplicity over overlap.
  const Result r = [&]() -> Result {
    KVSIFT_TRY(from_cuda(cudaSetDevice(d.ordinal), "cudaSetDevice"));
    KVSIFT_TRY(d.scratch_for(layer));
    for (uint64_t done = 0; done < n;) {
      const uint64_t count = std::min<uint64_t>(shape_.max_rows, n - done);
      const std::size_t values = count * kvdim, bytes = values * sizeof(float);
      KVSIFT_TRY(from_cuda(cudaEventSynchronize(d.staged[kPrefix].get()),
                           "cudaEventSynchronize (staging)"));
      char* staging = static_cast<char*>(d.staging[kPrefix]);
      std::memcpy(staging, k_post_rope + done * kvdim, bytes);
      std::memcpy(staging + bytes, v + done * kvdim, bytes);
      KVSIFT_TRY(from_cuda(
          cudaMemcpyAsync(d.prefix, staging, 2 * bytes, cudaMemcpyHostToDevice, d.stream.get()),
          "cudaMemcpyAsync (prefix)"));
      KVSIFT_TRY(
          from_cuda(cudaEventRecord(d.staged[kPrefix].get(), d.stream.get()), "cudaEventRecord"));
      const std::size_t offset = (first + done) * kvdim;
      for (uint32_t part = 0; part < 2; ++part) {
        const float* in = d.prefix + part * values;
        uint16_t* out = (part == 0 ? L.k_scratch : L.v_scratch) + offset;
        if (bf16)
          encode_kv_kernel<true>
              <<<flat_blocks(values), kFlatThreads, 0, d.stream.get()>>>(in, values, out);
        else
          encode_kv_kernel<false>
              <<<flat_blocks(values), kFlatThreads, 0, d.stream.get()>>>(in, values, out);
        KVSIFT_TRY(launched("encode_kv"));
      }
      done += count;
    }
    return Result{};
  }();
  if (!r.ok) {
    held_[layer] = std::min<uint64_t>(held_[layer], first);  // what the failed copy may have hit
    return r;
  }
  held_[layer] = first + n;
  return r;
}

void DeviceLlama::reset_prefill() noexcept {
  std::fill(held_.begin(), held_.end(), 0);
}

uint64_t DeviceLlama::prefill_held(uint32_t layer) const noexcept {
  return layer < held_.size() ? held_[layer] : 0;
}

Result DeviceLlama::finish_layer(uint32_t layer, bool attn_from_host) {
  KVSIFT_TRY(check_layer_call("finish_layer", layer,
                              attn_from_host ? Stage::have_inputs : Stage::have_attention));
  Device& d = *device_;
  const uint32_t rows = rows_;
  const bool has_next = layer + 1 < shape_.n_layers;
  bool graphed = false;
  const Result r = [&]() -> Result {
    KVSIFT_TRY(from_cuda(cudaSetDevice(d.ordinal), "cudaSetDevice"));
    if (attn_from_host && shape_.decode_graphs) {
      d.launch_graph(layer, rows, graph_stats_, &graphed, [&]() -> Result {
        KVSIFT_TRY(d.finish(layer, rows, true));
        return has_next ? d.inputs(layer + 1, rows) : Result{};
      });
      if (graphed) return Result{};
    }
    return d.finish(layer, rows, attn_from_host);
  }();
  if (!r.ok) {
    abandon();
    return r;
  }
  ++next_layer_;
  stage_ = Stage::need_inputs;
  inputs_ahead_ = graphed && has_next;
  return r;
}

Result DeviceLlama::logits(const uint32_t* rows_idx, uint32_t n, float* host_out) {
  if (device_ == nullptr) return refuse("logits: not initialised");
  if (rows_ == 0 || next_layer_ != shape_.n_layers || stage_ != Stage::need_inputs)
    return refuse("logits: the forward pass has not run its " + std::to_string(shape_.n_layers) +
                  " layers (it is at layer " + std::to_string(next_layer_) + ")");
  if (n < 1 || n > shape_.max_rows)
    return refuse("logits: n=" + std::to_string(n) +
                  " is not in 1..max_rows=" + std::to_string(shape_.max_rows));
  if (rows_idx == nullptr || host_out == nullptr) return refuse("logits: a null pointer");
  for (uint32_t i = 0; i < n; ++i)
    if (rows_idx[i] >= rows_)
      return refuse("logits: rows_idx[" + std::to_string(i) + "]=" + std::to_string(rows_idx[i]) +
                    " is not below the pass's rows=" + std::to_string(rows_));
  Device& d = *device_;
  const uint32_t E = shape_.n_embd, V = shape_.n_vocab;
  const Result r = [&]() -> Result {
    KVSIFT_TRY(from_cuda(cudaSetDevice(d.ordinal), "cudaSetDevice"));
    KVSIFT_TRY(d.stage(kRowIndex, d.row_index, rows_idx, n * sizeof(uint32_t)));
    KVSIFT_TRY(d.rms_norm(d.x, d.row_index, d.output_norm, n, E, shape_.rms_eps));
    KVSIFT_TRY(d.gemm(d.output, V, E, d.x_bf16, n, d.logits, false, "output"));
    KVSIFT_TRY(from_cuda(cudaMemcpyAsync(host_out, d.logits, std::size_t{n} * V * sizeof(float),
                                         cudaMemcpyDeviceToHost, d.stream.get()),
                         "cudaMemcpyAsync (logits)"));
    return from_cuda(cudaStreamSynchronize(d.stream.get()), "cudaStreamSynchronize (logits)");
  }();
  if (!r.ok) abandon();
  return r;
}

Result DeviceLlama::read_hidden(float* host_out) {
  if (device_ == nullptr || rows_ == 0) return refuse("read_hidden: no forward pass in flight");
  if (host_out == nullptr) return refuse("read_hidden: host_out is null");
  return device_->download(host_out, device_->x, std::size_t{rows_} * shape_.n_embd, "hidden");
}

Result DeviceLlama::read_attention(float* host_out) {
  if (device_ == nullptr || rows_ == 0) return refuse("read_attention: no forward pass in flight");
  if (host_out == nullptr) return refuse("read_attention: host_out is null");
  return device_->download(host_out, device_->attn, std::size_t{rows_} * shape_.q_dim(),
                           "attention");
}

void* DeviceLlama::stream() const noexcept {
  return device_ ? device_->stream.get() : nullptr;
}

std::size_t DeviceLlama::device_bytes() const noexcept {
  return device_ ? device_->device_bytes : 0;
}

}  // namespace cuda
}  // namespace kvsift::gpu
