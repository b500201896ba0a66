// The CUDA work of one offload step that is neither the transfer engine (gpu/page_transfer.hpp,
// which also sends the refreshes of cached pages whose host copy changed) nor the attention kernel
// (gpu/sparse_attention.hpp): a stream with its timing events, device buffers, and the small
// copies of q, the lists and the output. Plain C++, so lib/offload uses it without CUDA headers:
// the host's facade (gpu/offload_runtime.cpp) over the CUDA backend (gpu/backend.hpp,
// gpu/offload_runtime.cu); where the backend is absent every call reports Result{unsupported}
// saying why.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "gpu/host_memory.hpp"

namespace kvsift::gpu {

namespace backend {
class StepStream;
}

// Makes `device` the calling thread's current device (the CUDA runtime's notion, per thread).
Result set_device(int device);

// The device's view of mapped pinned host memory (pinned_alloc, or cudaHostRegister'd with the
// mapped flag): *out = the address kernels read it through. Pageable or unmapped memory: an error
// saying so, *out = nullptr.
Result mapped_device_pointer(const void* host, const void** out);

// Device memory (cudaMalloc) and its release; device_free(nullptr) does nothing.
Result device_alloc(std::size_t bytes, void** out);
void device_free(void* p) noexcept;

// One non-blocking stream on the current device of init() and kEvents timing events. Every call
// enqueues on the stream and returns; wait() is the only blocking call. Use from one host thread at
// a time. Movable, not copyable.
class StepStream {
 public:
  static constexpr uint32_t kEvents = 16;

  StepStream();
  ~StepStream();
  StepStream(StepStream&& other) noexcept;
  StepStream& operator=(StepStream&& other) noexcept;
  StepStream(const StepStream&) = delete;
  StepStream& operator=(const StepStream&) = delete;

  Result init();
  // The cudaStream_t, for the transfer engine and the attention kernel.
  void* handle() const noexcept;

  // Asynchronous copies; the host side must be pinned for the copy to overlap anything (pageable
  // host memory makes the runtime stage it and return late).
  Result copy_to_device(void* device_dst, const void* host_src, std::size_t bytes) noexcept;
  Result copy_to_host(void* host_dst, const void* device_src, std::size_t bytes) noexcept;

  // Records event i (< kEvents) on the stream.
  Result mark(uint32_t i) noexcept;
  // Blocks until event i completes.
  Result wait(uint32_t i) noexcept;
  // Milliseconds between events i and j, both complete.
  float elapsed_ms(uint32_t i, uint32_t j) const noexcept;

 private:
  std::unique_ptr<backend::StepStream> impl_;  // made by the first init()
};

}  // namespace kvsift::gpu
