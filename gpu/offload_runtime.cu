// The offload step's stream, events and buffers on CUDA (gpu/offload_runtime.hpp), the backend's
// StepStream and runtime calls (gpu/backend.hpp).
#include <cuda_runtime.h>

#include <memory>
#include <utility>

#include "gpu/cuda_backend.cuh"
#include "gpu/cuda_handles.cuh"
#include "gpu/cuda_result.cuh"
#include "gpu/offload_runtime.hpp"

namespace kvsift::gpu {
namespace {

constexpr CudaErrors from_cuda{"offload"};

}  // namespace

namespace cuda {

// The backend's calls of gpu/offload_runtime.hpp's free functions (gpu/runtime.cu's Backend
// forwards to them).
Result set_device(int device) {
  return from_cuda(cudaSetDevice(device), "cudaSetDevice");
}

Result mapped_device_pointer(const void* host, const void** out) {
  *out = nullptr;
  cudaPointerAttributes attributes{};
  const cudaError_t err = cudaPointerGetAttributes(&attributes, host);
  if (err != cudaSuccess) cudaGetLastError();
  if (err != cudaSuccess || attributes.type != cudaMemoryTypeHost ||
      attributes.devicePointer == nullptr)
    return from_cuda.invalid("host memory is not mapped pinned memory");
  *out = attributes.devicePointer;
  return Result{};
}

Result device_alloc(std::size_t bytes, void** out) {
  *out = nullptr;
  const Result r = from_cuda(cudaMalloc(out, bytes), "device buffer (cudaMalloc)");
  if (!r.ok) *out = nullptr;
  return r;
}

void device_free(void* p) noexcept {
  cudaFree(p);
}

class StepStream final : public backend::StepStream {
 public:
  static constexpr uint32_t kEvents = gpu::StepStream::kEvents;

  Result init() override;
  void* handle() const noexcept override;
  Result copy_to_device(void* device_dst, const void* host_src,
                        std::size_t bytes) noexcept override;
  Result copy_to_host(void* host_dst, const void* device_src, std::size_t bytes) noexcept override;
  Result mark(uint32_t i) noexcept override;
  Result wait(uint32_t i) noexcept override;
  float elapsed_ms(uint32_t i, uint32_t j) const noexcept override;

 private:
  // Members go in reverse: the events, then the stream.
  struct Device {
    Stream stream;
    Event events[kEvents];
  };
  std::unique_ptr<Device> device_;
};

std::unique_ptr<backend::StepStream> make_step_stream() {
  return std::make_unique<StepStream>();
}

Result StepStream::init() {
  device_.reset();
  auto d = std::make_unique<Device>();
  // Non-blocking: the legacy default stream, which other code in the process may use, does not
  // serialise with the step.
  Result r = from_cuda(d->stream.create(cudaStreamNonBlocking), "stream");
  for (uint32_t i = 0; r.ok && i < kEvents; ++i) r = from_cuda(d->events[i].create(), "event");
  if (r.ok) device_ = std::move(d);
  return r;
}

void* StepStream::handle() const noexcept {
  return device_ ? device_->stream.get() : nullptr;
}

Result StepStream::copy_to_device(void* device_dst, const void* host_src,
                                  std::size_t bytes) noexcept {
  if (bytes == 0) return Result{};
  return from_cuda(
      cudaMemcpyAsync(device_dst, host_src, bytes, cudaMemcpyHostToDevice, device_->stream.get()),
      "copy to device");
}

Result StepStream::copy_to_host(void* host_dst, const void* device_src,
                                std::size_t bytes) noexcept {
  if (bytes == 0) return Result{};
  return from_cuda(
      cudaMemcpyAsync(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, device_->stream.get()),
      "copy to host");
}

Result StepStream::mark(uint32_t i) noexcept {
  return from_cuda(cudaEventRecord(device_->events[i].get(), device_->stream.get()),
                   "event record");
}

Result StepStream::wait(uint32_t i) noexcept {
  return from_cuda(cudaEventSynchronize(device_->events[i].get()), "event wait");
}

float StepStream::elapsed_ms(uint32_t i, uint32_t j) const noexcept {
  float ms = 0.0f;
  if (cudaEventElapsedTime(&ms, device_->events[i].get(), device_->events[j].get()) !=
      cudaSuccess) {
    cudaGetLastError();
    return 0.0f;
  }
  return ms;
}

}  // namespace cuda
}  // namespace kvsift::gpu
