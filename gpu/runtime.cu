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
  const Result r = cuda_result(cudaGetDeviceCount(n_devices), "cudaGetDeviceCount");
  if (!r.ok) {
    *n_devices = 0;
    return r;
  }
  if (*n_devices == 0) return Result::absent("no CUDA device present");
  return r;
}

Result pinned_alloc(std::size_t bytes, void** out) {
  *out = nullptr;
  const Result r =
      cuda_result(cudaHostAlloc(out, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                  "pinned host memory (cudaHostAlloc)");
  if (!r.ok) *out = nullptr;
  return r;
}

void pinned_free(void* p) noexcept {
  cudaFreeHost(p);
}

}  // namespace kvsift::gpu
