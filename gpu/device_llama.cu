// The Llama forward pass's device side (gpu/device_llama.hpp): cuBLAS for the products, small
// kernels for the rest. The kernels are written for obvious correctness first: one block per row
// (RMSNorm, RoPE, embedding, KV store), flat grid-stride loops (elementwise), and one block per
// (query row, query head) for prefill attention; the products carry nearly all the time.
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

namespace kvsift::gpu {
namespace {

constexpr uint32_t kRowThreads = 256;   // RMSNorm, embedding, RoPE, KV store: one block per row
constexpr uint32_t kFlatThreads = 256;  // elementwise kernels
constexpr uint32_t kFlatMaxBlocks = 4096;
constexpr uint32_t kAttentionWarps = 4;
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

// Causal prefill attention, one block per (query row r, query head): the block's warps take the
// visible positions 0 .. pos0 + r round-robin, each lane holding head_dim / 32 channels of q and of
// its own accumulator, with an fp32 online softmax per warp; the warps merge at the end. Prompts
// are at most a few thousand tokens and a chunk's blocks fill the device, so no split over keys.
template <uint32_t kHeadDim, bool kBf16>
__global__ void __launch_bounds__(kAttentionWarps * 32)
    prefill_attention_kernel(const float* __restrict__ qkv, uint32_t qkv_stride,
                             const uint16_t* __restrict__ k_scratch,
                             const uint16_t* __restrict__ v_scratch, uint32_t kv_dim,
                             uint32_t group_size, uint64_t pos0, float scale,
                             float* __restrict__ out, uint32_t q_dim) {
  constexpr uint32_t kPerLane = kHeadDim / 32;
  const uint32_t row = blockIdx.x, head = blockIdx.y, kv_head = head / group_size;
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const float* q = qkv + static_cast<std::size_t>(row) * qkv_stride + head * kHeadDim;
  float qv[kPerLane], acc[kPerLane];
  for (uint32_t e = 0; e < kPerLane; ++e) {
    qv[e] = q[lane * kPerLane + e];
    acc[e] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  const uint64_t visible = pos0 + row + 1;
  const std::size_t channel = std::size_t{kv_head} * kHeadDim + lane * kPerLane;
  for (uint64_t j = warp; j < visible; j += kAttentionWarps) {
    const uint16_t* k = k_scratch + j * kv_dim + channel;
    float dot = 0.0f;
    for (uint32_t e = 0; e < kPerLane; ++e) dot += qv[e] * from_kv<kBf16>(k[e]);
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    const float s = dot * scale;
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);  // 0 for the first key (m = -inf)
    const float p = expf(s - m_new);
    l = l * correction + p;
    const uint16_t* v = v_scratch + j * kv_dim + channel;
    for (uint32_t e = 0; e < kPerLane; ++e) acc[e] = acc[e] * correction + p * from_kv<kBf16>(v[e]);
    m = m_new;
  }
  __shared__ float warp_m[kAttentionWarps], warp_l[kAttentionWarps];
  __shared__ float warp_acc[kAttentionWarps][kHeadDim];
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
  for (uint32_t e = 0; e < kPerLane; ++e) warp_acc[warp][lane * kPerLane + e] = acc[e];
  __syncthreads();
  float m_all = -INFINITY;
  for (uint32_t w = 0; w < kAttentionWarps; ++w) m_all = fmaxf(m_all, warp_m[w]);
  float* o = out + static_cast<std::size_t>(row) * q_dim + head * kHeadDim;
  for (uint32_t i = threadIdx.x; i < kHeadDim; i += kAttentionWarps * 32) {
    float sum = 0.0f, value = 0.0f;
    for (uint32_t w = 0; w < kAttentionWarps; ++w) {
      if (warp_l[w] == 0.0f) continue;  // a warp that saw no position (visible < warps)
      const float c = expf(warp_m[w] - m_all);
      sum += warp_l[w] * c;
      value += warp_acc[w][i] * c;
    }
    o[i] = value / sum;
  }
}

template <uint32_t kHeadDim, bool kBf16>
void launch_prefill_attention(dim3 grid, cudaStream_t stream, const float* qkv, uint32_t qkv_stride,
                              const uint16_t* k, const uint16_t* v, uint32_t kv_dim,
                              uint32_t group_size, uint64_t pos0, float scale, float* out,
                              uint32_t q_dim) {
  prefill_attention_kernel<kHeadDim, kBf16><<<grid, kAttentionWarps * 32, 0, stream>>>(
      qkv, qkv_stride, k, v, kv_dim, group_size, pos0, scale, out, q_dim);
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
    const dim3 grid(rows, shape_.n_heads);
    auto launch =
        shape_.head_dim == 64
            ? (bf16 ? launch_prefill_attention<64, true> : launch_prefill_attention<64, false>)
            : (bf16 ? launch_prefill_attention<128, true> : launch_prefill_attention<128, false>);
    launch(grid, d.stream.get(), d.qkv, stride, L.k_scratch, L.v_scratch, kvdim, group, pos0, scale,
           d.attn, qdim);
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
