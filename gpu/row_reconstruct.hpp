// S4R's token rows reconstructed on the GPU (docs/methods.md, S4R: decode): for each chosen
// compressed token, K = c_K B_K^T, rotated by RoPE at the token's position, and V = c_V B_V^T,
// written into device pool slots in the cache's row layout (simd/page_layout.hpp), where the
// sparse kernel's token form (gpu/sparse_attention.hpp) then attends them. The bases live on the
// device (uploaded once per compression by the caller, lib/offload/offload_attention.cpp); per
// step only the coefficients and the positions cross PCIe. Plain C++: lib/ includes this without
// CUDA headers. The class is the host's facade over the CUDA backend's implementation
// (gpu/backend.hpp, gpu/row_reconstruct.cu); where the backend is absent every call returns
// Result{unsupported}.
//
// Arithmetic, against the host's reconstruction (lib/select/s4r_selector.cpp: s4r::reconstruct,
// Rope::rotate, simd::store_rows): coefficients decoded exactly to fp32, the products summed in
// fp32 (in another order than the host's gemm_f32), RoPE's cos and sin from the same float64 angle
// rounded once to fp32 (lib/cache/rope.cpp's table) and its two products and sum rounded apart
// (no FMA contraction, as on the host), then rounded to nearest even in the rows' dtype. A row
// therefore equals the host's to within the summation order's fp32 difference before that last
// rounding: 1 ulp of the dtype (tests/test_offload.cpp checks it).
//
// 16-bit caches only (f16, bf16): a q8 cache's rows are per-row quantized codes with a scale, and
// its offload mode keeps the host's reconstruction (lib/engine/decode_engine.cpp).
//
// Data layout (every pointer named "device" is device memory):
// - Bases: per unit (one basis over `heads` KV heads of one sequence, docs/methods.md's D' =
//   heads * head_dim), B_K^T and B_V^T as [rank, heads * head_dim] fp32 (s4r::Basis::columns).
// - Coefficients: per unit, [n_rows, rank] in the dtype, row i of the unit at
//   coeff_offset + i * rank of the call's key and value arrays; positions [n_rows] uint32 at
//   positions + row_offset.
// - Output: KV head h (< heads) of the unit's row i goes to row i % page_tokens of chunk
//   first_chunk + h * ceil(n_rows / page_tokens) + i / page_tokens, chunk c at
//   chunks + c * slot_bytes: the pairs of a unit are consecutive and each holds the unit's rows,
//   as lib/attend/decode_attention.hpp's RowChunks packs them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "gpu/host_memory.hpp"
#include "simd/kernels.hpp"

namespace kvsift::gpu {

namespace backend {
class RowReconstructor;
}

struct ReconstructShape {
  uint32_t head_dim = 128;               // 64, 128 or 256
  uint32_t page_tokens = 16;             // 16, 32 or 64
  simd::Dtype dtype = simd::Dtype::f16;  // f16 or bf16: the coefficients' and the rows' dtype
  float rope_theta = 10000.0f;           // the cache's Rope::theta()
  uint32_t max_heads = 1;                // most KV heads one basis spans, 1..1024
};

// One unit's rows, in a device array the caller fills (it is read by the kernel, not the host).
struct ReconstructUnit {
  const float* key_basis = nullptr;  // device [rank, heads * head_dim]
  const float* value_basis = nullptr;
  uint64_t coeff_offset = 0;  // elements into the call's key and value coefficient arrays
  uint32_t row_offset = 0;    // into the call's positions
  uint32_t n_rows = 0;
  uint32_t rank = 0;   // 1..heads * head_dim
  uint32_t heads = 0;  // 1..max_heads
  uint32_t first_chunk = 0;
  uint32_t pad = 0;
};

struct ReconstructCall {
  const ReconstructUnit* units = nullptr;  // device [n_units]
  uint32_t n_units = 0;
  uint32_t max_rows = 0;                   // the most rows of one unit (sizes the grid)
  uint32_t max_heads = 0;                  // the most heads of one unit, <= shape.max_heads
  const uint32_t* positions = nullptr;     // device
  const uint16_t* key_coeffs = nullptr;    // device
  const uint16_t* value_coeffs = nullptr;  // device
  std::byte* chunks = nullptr;             // device: the first chunk, 16-byte aligned
  void* stream = nullptr;                  // cudaStream_t the kernel is enqueued on
};

// Owns the RoPE frequencies on one device. Use from one host thread at a time. Movable, not
// copyable.
class RowReconstructor {
 public:
  RowReconstructor();  // out of line, where the backend's class is complete
  ~RowReconstructor();
  RowReconstructor(RowReconstructor&& other) noexcept;
  RowReconstructor& operator=(RowReconstructor&& other) noexcept;
  RowReconstructor(const RowReconstructor&) = delete;
  RowReconstructor& operator=(const RowReconstructor&) = delete;

  // Checks the shape (invalid argument), then uploads the RoPE frequencies (head_dim / 2 float64)
  // to the current device. Without the CUDA backend: Result{unsupported} before any check.
  Result init(const ReconstructShape& shape);
  // Enqueues the reconstruction of a call's rows on call.stream; waits for nothing. The host
  // checks only what it can read (non-null pointers, max_heads within the shape); the units must
  // satisfy their comments. Reports the launch's error.
  Result run(const ReconstructCall& call) noexcept;
  const ReconstructShape& shape() const noexcept;

 private:
  std::unique_ptr<backend::RowReconstructor> impl_;  // made by the first init()
};

}  // namespace kvsift::gpu
