// The device half of RowReconstructor (gpu/backend.hpp; gpu/row_reconstruct.hpp has the contract
// and the arithmetic).
//
// Cost of one reconstructed row of a unit (D' = heads * head_dim, rank r; K and V together):
// - flops: 2 r D' multiply-adds, 4 r D' flops;
// - device memory: 4 r bytes of coefficients and 4 of position in, 4 D' bytes of rows out; the
//   bases (8 r D' bytes a unit) are read once per tile of kTileRows rows, from L2 after the
//   first tile;
// - PCIe: 4 r + 4 bytes, where the reconstructed rows cost 4 D' (more: they go in whole chunks of
//   page_tokens rows).
// Floors on an H200 (~60 TFLOP/s fp32 FMA, ~4 TB/s HBM, ~50 GB/s PCIe), not measured here:
// - per-layer bases, Llama-3.1-8B (D' = 8 * 128 = 1024) at compression 2.5 (r ~ 400 at 32K,
//   lib/select/s4r_core.hpp's memory model): 1.6 MFLOP a row, 27 ns at the FMA peak; HBM 1.4 ns;
//   PCIe saved (4096 - 1604 bytes) 50 ns. The kernel at its floor costs half the link time it
//   saves, so the link alone is not where the win is: the host's reconstruction (the same 2 r D'
//   multiply-adds, 1.6 GFLOP per thousand rows: milliseconds even on 16 cores at ~50 GFLOP/s
//   each, where the device's floor is 27 us) leaves the decode step's critical path.
// - per-head bases (D' = 128, r ~ 50): 26 KFLOP a row-head, 0.4 ns; PCIe saved 512 - 204 bytes,
//   6.2 ns: the link dominates, and the kernel costs a fifteenth of what it saves.
// The kernel is plain fp32 FMA (compute-bound past a few hundred rows); TF32 tensor cores would
// lift the per-layer floor ~8x at a precision cost that breaks the 1-ulp agreement with the host.
//
// Grid: (unit, tile of kTileRows rows, KV head of the unit); head_dim / 2 threads, thread t owning
// the RoPE pair (2t, 2t + 1) of its head for every row of the tile, so the rotation needs no
// exchange between threads. The coefficients of a tile go through shared memory transposed
// ([k][row]), so a thread reads four rows' coefficients with one 16-byte load per k.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <string>
#include <vector>

#include "gpu/cuda_backend.cuh"
#include "gpu/cuda_handles.cuh"
#include "gpu/cuda_result.cuh"
#include "gpu/row_reconstruct.hpp"
#include "simd/page_layout.hpp"

namespace kvsift::gpu {
namespace {

constexpr CudaErrors from_cuda{"S4R row reconstruction"};

// Rows per CTA: 2 * kTileRows accumulators a thread; each basis element read from L2 once per tile.
constexpr uint32_t kTileRows = 32;
// Coefficients staged per pass: [kTileK][kTileRows + kPad] fp32, 4.5 KiB of shared memory. The pad
// spreads the transposing stores over 8 banks instead of one, and keeps each row 16-byte aligned.
constexpr uint32_t kTileK = 32;
constexpr uint32_t kPad = 4;

__device__ __forceinline__ float from_coeff(uint16_t h, bool bf16) {
  return bf16 ? __uint_as_float(static_cast<uint32_t>(h) << 16) : __half2float(__ushort_as_half(h));
}

// Round to nearest even, as simd/half.hpp's f32_to_f16 and f32_to_bf16 (the host's store_rows).
__device__ __forceinline__ uint16_t to_row(float value, bool bf16) {
  return bf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(value))
              : __half_as_ushort(__float2half_rn(value));
}

// lib/cache/rope.cpp's rotation: each product and the sum rounded apart, as the host (whose build
// has no FMA contraction there) computes them.
__device__ __forceinline__ void rotate_pair(float& a, float& b, float c, float s) {
  const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  const float rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
  a = ra;
  b = rb;
}

__global__ void reconstruct_kernel(const ReconstructUnit* __restrict__ units,
                                   const uint32_t* __restrict__ positions,
                                   const uint16_t* __restrict__ key_coeffs,
                                   const uint16_t* __restrict__ value_coeffs,
                                   const double* __restrict__ inv_freq, std::byte* chunks,
                                   simd::PageLayout layout) {
  __shared__ __align__(16) float tile[kTileK][kTileRows + kPad];
  const ReconstructUnit unit = units[blockIdx.x];
  const uint32_t row0 = blockIdx.y * kTileRows, head = blockIdx.z;
  if (row0 >= unit.n_rows || head >= unit.heads) return;  // the whole CTA leaves together
  const uint32_t rows = min(kTileRows, unit.n_rows - row0);
  const uint32_t d = layout.head_dim, t = threadIdx.x, dim = unit.heads * d;
  const bool bf16 = layout.dtype == simd::Dtype::bf16;
  const uint32_t n_chunks = (unit.n_rows + layout.page_tokens - 1) / layout.page_tokens;

  for (int part = 0; part < 2; ++part) {
    const bool keys = part == 0;
    const float* basis = (keys ? unit.key_basis : unit.value_basis) + head * d + 2 * t;
    const uint16_t* coeffs =
        (keys ? key_coeffs : value_coeffs) + unit.coeff_offset + std::size_t{row0} * unit.rank;
    float acc[kTileRows][2];
#pragma unroll
    for (uint32_t r = 0; r < kTileRows; ++r) acc[r][0] = acc[r][1] = 0.0f;
    for (uint32_t k0 = 0; k0 < unit.rank; k0 += kTileK) {
      const uint32_t ks = min(kTileK, unit.rank - k0);
      __syncthreads();  // the previous pass has read the tile
      for (uint32_t i = t; i < kTileK * kTileRows; i += blockDim.x) {
        const uint32_t r = i / kTileK, k = i % kTileK;
        tile[k][r] = r < rows && k < ks
                         ? from_coeff(coeffs[std::size_t{r} * unit.rank + k0 + k], bf16)
                         : 0.0f;
      }
      __syncthreads();
      for (uint32_t k = 0; k < ks; ++k) {
        const float2 b = *reinterpret_cast<const float2*>(basis + std::size_t{k0 + k} * dim);
#pragma unroll
        for (uint32_t r = 0; r < kTileRows; r += 4) {
          const float4 c = *reinterpret_cast<const float4*>(&tile[k][r]);
          acc[r][0] = fmaf(c.x, b.x, acc[r][0]);
          acc[r][1] = fmaf(c.x, b.y, acc[r][1]);
          acc[r + 1][0] = fmaf(c.y, b.x, acc[r + 1][0]);
          acc[r + 1][1] = fmaf(c.y, b.y, acc[r + 1][1]);
          acc[r + 2][0] = fmaf(c.z, b.x, acc[r + 2][0]);
          acc[r + 2][1] = fmaf(c.z, b.y, acc[r + 2][1]);
          acc[r + 3][0] = fmaf(c.w, b.x, acc[r + 3][0]);
          acc[r + 3][1] = fmaf(c.w, b.y, acc[r + 3][1]);
        }
      }
    }
    // Predicated rather than cut short, so that the unrolled loop indexes acc statically (a break
    // would leave it in local memory).
#pragma unroll
    for (uint32_t r = 0; r < kTileRows; ++r) {
      if (r >= rows) continue;
      const uint32_t row = row0 + r;
      float a = acc[r][0], b = acc[r][1];
      if (keys) {
        // lib/cache/rope.cpp's table entry: the float64 angle, its cosine and sine rounded once.
        const double angle = static_cast<double>(positions[unit.row_offset + row]) * inv_freq[t];
        double s = 0.0, c = 0.0;
        sincos(angle, &s, &c);
        rotate_pair(a, b, static_cast<float>(c), static_cast<float>(s));
      }
      std::byte* slot =
          layout.slot(chunks, unit.first_chunk + head * n_chunks + row / layout.page_tokens);
      uint16_t* dst = (keys ? layout.key(slot, row % layout.page_tokens)
                            : layout.value(slot, row % layout.page_tokens)) +
                      2 * t;
      *reinterpret_cast<uint32_t*>(dst) =
          uint32_t{to_row(a, bf16)} | (uint32_t{to_row(b, bf16)} << 16);
    }
  }
}

class CudaRowReconstructor final : public backend::RowReconstructor {
 public:
  Result init(const ReconstructShape& shape) override;
  Result run(const ReconstructCall& call) noexcept override;
  const ReconstructShape& shape() const noexcept override { return shape_; }

 private:
  ReconstructShape shape_{};
  DeviceBuffer<double> inv_freq_;  // [head_dim / 2]
};

Result CudaRowReconstructor::init(const ReconstructShape& shape) {
  const auto num = [](uint64_t x) { return std::to_string(x); };
  if (shape.head_dim != 64 && shape.head_dim != 128 && shape.head_dim != 256)
    return from_cuda.invalid("head_dim=" + num(shape.head_dim) + " is not 64, 128 or 256");
  if (shape.page_tokens != 16 && shape.page_tokens != 32 && shape.page_tokens != 64)
    return from_cuda.invalid("page_tokens=" + num(shape.page_tokens) + " is not 16, 32 or 64");
  if (shape.dtype != simd::Dtype::f16 && shape.dtype != simd::Dtype::bf16)
    return from_cuda.invalid(
        "dtype is not f16 or bf16 (a q8 cache's rows are reconstructed on "
        "the host)");
  if (!(shape.rope_theta > 0.0f) || !std::isfinite(shape.rope_theta))
    return from_cuda.invalid("rope_theta is not a positive number");
  if (shape.max_heads == 0 || shape.max_heads > 1024)
    return from_cuda.invalid("max_heads=" + num(shape.max_heads) + " is not in 1..1024");
  // lib/cache/rope.cpp's expression, so that the angles are the host's to the last bit.
  const uint32_t half = shape.head_dim / 2;
  std::vector<double> inv_freq(half);
  for (uint32_t i = 0; i < half; ++i)
    inv_freq[i] = std::pow(double{shape.rope_theta}, -2.0 * i / shape.head_dim);
  DeviceBuffer<double> buffer;
  if (Result r = from_cuda(buffer.allocate(half * sizeof(double)), "RoPE frequencies (cudaMalloc)");
      !r.ok)
    return r;
  if (Result r = from_cuda(
          cudaMemcpy(buffer.get(), inv_freq.data(), half * sizeof(double), cudaMemcpyHostToDevice),
          "RoPE frequencies");
      !r.ok)
    return r;
  inv_freq_ = std::move(buffer);
  shape_ = shape;
  return Result{};
}

Result CudaRowReconstructor::run(const ReconstructCall& call) noexcept {
  if (!inv_freq_) return from_cuda.invalid("run before init");
  if (call.n_units == 0 || call.max_rows == 0) return Result{};
  if (call.units == nullptr || call.positions == nullptr || call.key_coeffs == nullptr ||
      call.value_coeffs == nullptr || call.chunks == nullptr)
    return from_cuda.invalid("a pointer of the call is NULL");
  if (call.max_heads == 0 || call.max_heads > shape_.max_heads || call.n_units > 0x7fffffffu)
    return from_cuda.invalid("max_heads or n_units out of range");
  const dim3 grid(call.n_units, (call.max_rows + kTileRows - 1) / kTileRows, call.max_heads);
  if (grid.y > 65535) return from_cuda.invalid("more than 65535 tiles of rows in one unit");
  const simd::PageLayout layout{shape_.page_tokens, shape_.head_dim, shape_.dtype};
  reconstruct_kernel<<<grid, shape_.head_dim / 2, 0, static_cast<cudaStream_t>(call.stream)>>>(
      call.units, call.positions, call.key_coeffs, call.value_coeffs, inv_freq_.get(), call.chunks,
      layout);
  return from_cuda.launched("reconstruct launch");
}

}  // namespace

namespace cuda {

std::unique_ptr<backend::RowReconstructor> make_row_reconstructor() {
  return std::make_unique<CudaRowReconstructor>();
}

}  // namespace cuda
}  // namespace kvsift::gpu
