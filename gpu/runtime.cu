// The CUDA backend's root (gpu/backend.hpp): the runtime calls of gpu/host_memory.hpp, the Backend
// that hands out the device objects, and the module's one exported symbol.
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <cstdint>
#include <mutex>
#include <type_traits>
#include <unordered_map>

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

namespace {

// Regions of at least this size are mapped by the kernel in 2 MiB transparent huge pages and then
// registered with CUDA, rather than allocated by cudaHostAlloc (4 KiB pages): a KV pool of tens of
// GiB read a page here and a page there by the device crosses far more translations than the TLBs
// hold, one per 4 KiB page.
constexpr std::size_t kHugeRegionBytes = std::size_t{1} << 30;
constexpr std::size_t kHugePage = std::size_t{2} << 20;

// The registered regions, by the pointer handed out: the mapping to unmap on release.
struct Mapping {
  void* base;
  std::size_t bytes;
};
std::mutex registered_mutex;
std::unordered_map<void*, Mapping>& registered() {
  static std::unordered_map<void*, Mapping> regions;
  return regions;
}

Result huge_pinned_alloc(std::size_t bytes, void** out) {
  // Over-reserved by a huge page so that the region can start on a 2 MiB boundary.
  const std::size_t reserved = bytes + kHugePage;
  void* base = mmap(nullptr, reserved, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return Result::out_of_memory("pinned host memory (mmap)");
  const auto start = (reinterpret_cast<std::uintptr_t>(base) + kHugePage - 1) & ~(kHugePage - 1);
  void* p = reinterpret_cast<void*>(start);
  madvise(p, bytes, MADV_HUGEPAGE);  // advice: where the host has none, 4 KiB pages serve
  const Result r =
      cuda_result(cudaHostRegister(p, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
                  "pinned host memory (cudaHostRegister)");
  if (!r.ok) {
    munmap(base, reserved);
    return r;
  }
  try {
    const std::lock_guard<std::mutex> lock(registered_mutex);
    registered().emplace(p, Mapping{base, reserved});
  } catch (...) {
    cudaHostUnregister(p);
    munmap(base, reserved);
    return Result::out_of_memory("pinned host memory (the region's record)");
  }
  *out = p;
  return r;
}

}  // namespace

Result pinned_alloc(std::size_t bytes, void** out) {
  *out = nullptr;
  if (bytes >= kHugeRegionBytes) return huge_pinned_alloc(bytes, out);
  const Result r =
      cuda_result(cudaHostAlloc(out, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
                  "pinned host memory (cudaHostAlloc)");
  if (!r.ok) *out = nullptr;
  return r;
}

void pinned_free(void* p) noexcept {
  Mapping mapping{nullptr, 0};
  {
    const std::lock_guard<std::mutex> lock(registered_mutex);
    if (const auto it = registered().find(p); it != registered().end()) {
      mapping = it->second;
      registered().erase(it);
    }
  }
  if (mapping.base == nullptr) {
    cudaFreeHost(p);
    return;
  }
  cudaHostUnregister(p);
  munmap(mapping.base, mapping.bytes);
}

namespace {

class CudaBackend final : public backend::Backend {
 public:
  Result device_count(int* n_devices) override { return cuda::device_count(n_devices); }
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
