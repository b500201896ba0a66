// The GPU entry points of a build without the CUDA Toolkit: each reports "unsupported".
#include "gpu/host_memory.hpp"

namespace kvsift::gpu {
namespace {

Result unsupported(const char* what) {
  return Result{false, true, std::string(what) + ": kvsift was built without CUDA"};
}

}  // namespace

bool built_with_cuda() noexcept {
  return false;
}

Result device_count(int* n_devices) {
  *n_devices = 0;
  return unsupported("GPU device query");
}

Result pinned_alloc(std::size_t, void** out) {
  *out = nullptr;
  return unsupported("pinned host memory");
}

void pinned_free(void*) noexcept {}

}  // namespace kvsift::gpu
