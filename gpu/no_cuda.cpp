// The GPU entry points of a build without the CUDA Toolkit: each reports "unsupported".
#include "gpu/host_memory.hpp"

namespace kvsift::gpu {

bool built_with_cuda() noexcept {
  return false;
}

Result device_count(int* n_devices) {
  *n_devices = 0;
  return without_cuda("GPU device query");
}

Result pinned_alloc(std::size_t, void** out) {
  *out = nullptr;
  return without_cuda("pinned host memory");
}

void pinned_free(void*) noexcept {}

}  // namespace kvsift::gpu
