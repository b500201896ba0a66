// Inside the CUDA backend module only (gpu/*.cu): the inline-PTX wrappers more than one kernel
// uses (asynchronous copies into shared memory, the one-instruction exponential), in one place.
// Valid from sm_80 on: the module is built for 80, 89 and 90.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace kvsift::gpu::cuda {

// 2^x with one MUFU.EX2 (exp2f adds range handling the attention kernels do not need: their
// arguments are <= 0 or -inf, and ex2.approx's relative error, 2^-22, is far inside their
// budgets).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 16 bytes global -> shared, asynchronously, through L2 only (the rows are read once per CTA);
// with fill false it writes zeros and reads nothing.
__device__ __forceinline__ void copy16(void* shared, const void* global, bool fill) {
  const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(global),
               "r"(fill ? 16 : 0));
}
// 4 or 8 bytes global -> shared, asynchronously, through L1 (cp.async.cg copies only 16).
template <int kBytes>
__device__ __forceinline__ void copy_small(void* shared, const void* global, bool fill) {
  const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(to), "l"(global),
               "n"(kBytes), "r"(fill ? kBytes : 0));
}
__device__ __forceinline__ void commit_copies() {
  asm volatile("cp.async.commit_group;\n" ::);
}
// Waits until at most kPending of this thread's committed copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

}  // namespace kvsift::gpu::cuda
