// CUDA runtime calls behind gpu/host_memory.hpp.
#include <cuda_runtime.h>

#include "gpu/cuda_result.cuh"
#include "gpu/host_memory.hpp"

namespace kvsift::gpu {

bool built_with_cuda() noexcept {
  return true;
}

Result device_count(int* n_devices) {
  *n_devices = 0;
  const cudaError_t err = cudaGetDeviceCount(n_devices);
  if (err != cudaSuccess) {
    *n_devices = 0;
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return cuda_result(err, "cudaGetDeviceCount");
  }
  if (*n_devices == 0) return Result{false, true, "no CUDA device present"};
  return Result{};
}

Result pinned_alloc(std::size_t bytes, void** out) {
  *out = nullptr;
  const cudaError_t err = cudaHostAlloc(out, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
  if (err != cudaSuccess) {
    *out = nullptr;
    cudaGetLastError();
    return cuda_result(err, "pinned host memory (cudaHostAlloc)");
  }
  return Result{};
}

void pinned_free(void* p) noexcept {
  cudaFreeHost(p);
}

}  // namespace kvsift::gpu
