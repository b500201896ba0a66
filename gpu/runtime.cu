// The CUDA backend's root (gpu/backend.hpp): the runtime calls of gpu/host_memory.hpp, the Backend
// that hands out the device objects, and the module's one exported symbol.
#include <cuda_runtime.h>

#include <string>
#include <type_traits>

#include "gpu/cuda_backend.cuh"
#include "gpu/cuda_result.cuh"

namespace kvsift::gpu::cuda {

Result device_count(int* n_devices) {
  *n_devices = 0;
  const Result r = cuda_result(cudaGetDeviceCount(n_devices), "cudaGetDeviceCount");
  if (!r.ok) {
    *n_devices = 0;
    return r;
  }
  if (*n_devices == 0) return Result::absent("no CUDA device is present");
  return r;
}

Result device_memory(int device, uint64_t* used_bytes, uint64_t* total_bytes) {
  *used_bytes = *total_bytes = 0;
  int n_devices = 0;
  if (Result r = device_count(&n_devices); !r.ok) return r;
  if (device < 0 || device >= n_devices)
    return Result::invalid("device " + std::to_string(device) + " is not in 0.." +
                           std::to_string(n_devices - 1));
  int current = 0;
  if (Result r = cuda_result(cudaGetDevice(&current), "cudaGetDevice"); !r.ok) return r;
  if (Result r = cuda_result(cudaSetDevice(device), "cudaSetDevice"); !r.ok) return r;
  std::size_t free = 0, total = 0;
  Result r = cuda_result(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  if (Result back = cuda_result(cudaSetDevice(current), "cudaSetDevice"); r.ok && !back.ok)
    r = back;
  if (r.ok) {
    *used_bytes = total - free;
    *total_bytes = total;
  }
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

namespace {

class CudaBackend final : public backend::Backend {
 public:
  Result device_count(int* n_devices) override { return cuda::device_count(n_devices); }
  Result device_memory(int device, uint64_t* used_bytes, uint64_t* total_bytes) override {
    return cuda::device_memory(device, used_bytes, total_bytes);
  }
  Result pinned_alloc(std::size_t bytes, void** out) override {
    return cuda::pinned_alloc(bytes, out);
  }
  void pinned_free(void* p) noexcept override { cuda::pinned_free(p); }
  Result set_device(int device) override { return cuda::set_device(device); }
  Result mapped_device_pointer(const void* host, const void** out) override {
    return cuda::mapped_device_pointer(host, out);
  }
  Result device_alloc(std::size_t bytes, void** out) override {
    return cuda::device_alloc(bytes, out);
  }
  void device_free(void* p) noexcept override { cuda::device_free(p); }

  std::unique_ptr<backend::SparseDecodeAttention> make_sparse_attention() override {
    return cuda::make_sparse_attention();
  }
  std::unique_ptr<backend::PagePool> make_page_pool() override { return cuda::make_page_pool(); }
  std::unique_ptr<backend::StepStream> make_step_stream() override {
    return cuda::make_step_stream();
  }
  std::unique_ptr<backend::LouverFilter> make_louver_filter() override {
    return cuda::make_louver_filter();
  }
  std::unique_ptr<backend::LocksScorer> make_locks_scorer() override {
    return cuda::make_locks_scorer();
  }
  std::unique_ptr<backend::DeviceLlama> make_device_llama() override {
    return cuda::make_device_llama();
  }
  std::unique_ptr<backend::RowReconstructor> make_row_reconstructor() override {
    return cuda::make_row_reconstructor();
  }
};

}  // namespace
}  // namespace kvsift::gpu::cuda

// The module's only exported symbol (everything else is hidden: gpu/CMakeLists.txt). The Backend
// holds no state of its own; it lives as long as the process, since the host never unloads the
// module.
extern "C" __attribute__((visibility("default"))) uint32_t kvsift_cuda_backend_open(
    uint32_t host_version, kvsift::gpu::backend::Backend** out) {
  static kvsift::gpu::cuda::CudaBackend backend;
  if (out != nullptr)
    *out = host_version == kvsift::gpu::backend::kInterfaceVersion ? &backend : nullptr;
  return kvsift::gpu::backend::kInterfaceVersion;
}

static_assert(std::is_same_v<decltype(&kvsift_cuda_backend_open), kvsift::gpu::backend::EntryPoint>,
              "the entry point has gpu/backend.hpp's signature");
