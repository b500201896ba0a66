// Owning handles of CUDA resources for the .cu files: device and pinned buffers, streams, events,
// graphs and graph instances. Each is move-only and frees its resource in the destructor with the
// device that made it current (then the caller's back), so an object may be destroyed from any
// thread and whatever device that thread has current. Creation returns the cudaError_t, for the
// file's CudaErrors (gpu/cuda_result.cuh): from_cuda(stream.create(cudaStreamNonBlocking),
// "stream"). A failed creation leaves the handle as it was.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace kvsift::gpu {

// Makes `device` current for the scope and restores the caller's device after it. Does nothing
// where the device is current already (the common case: one device per process).
class DeviceScope {
 public:
  explicit DeviceScope(int device) noexcept {
    // A failure clears the thread's last error (gpu/cuda_result.cuh's rule) and frees on the
    // current device, which is all that is left to try.
    if (cudaGetDevice(&previous_) != cudaSuccess)
      cudaGetLastError();
    else if (previous_ != device && !(switched_ = cudaSetDevice(device) == cudaSuccess))
      cudaGetLastError();
  }
  ~DeviceScope() {
    if (switched_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool switched_ = false;
};

namespace detail {

// A handle H released by Release::release(H) on the device current when it was adopted.
template <class H, class Release>
class Owned {
 public:
  Owned() = default;
  ~Owned() { reset(); }
  Owned(Owned&& other) noexcept
      : handle_(std::exchange(other.handle_, H{})), device_(other.device_) {}
  Owned& operator=(Owned&& other) noexcept {
    if (this != &other) {
      reset();
      handle_ = std::exchange(other.handle_, H{});
      device_ = other.device_;
    }
    return *this;
  }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;

  explicit operator bool() const noexcept { return handle_ != H{}; }

  void reset() noexcept {
    if (handle_ == H{}) return;
    const DeviceScope on(device_);
    Release::release(handle_);
    handle_ = H{};
  }

 protected:
  // Takes ownership of h, made on the current device; the previous handle goes first.
  void adopt(H h) noexcept {
    reset();
    if (cudaGetDevice(&device_) != cudaSuccess) cudaGetLastError();
    handle_ = h;
  }

  H handle_{};
  int device_ = 0;
};

struct FreeDevice {
  static void release(void* p) noexcept { cudaFree(p); }
};
struct FreeHost {
  static void release(void* p) noexcept { cudaFreeHost(p); }
};
struct DestroyStream {
  static void release(cudaStream_t s) noexcept { cudaStreamDestroy(s); }
};
struct DestroyEvent {
  static void release(cudaEvent_t e) noexcept { cudaEventDestroy(e); }
};
struct DestroyGraph {
  static void release(cudaGraph_t g) noexcept { cudaGraphDestroy(g); }
};
struct DestroyGraphExec {
  static void release(cudaGraphExec_t e) noexcept { cudaGraphExecDestroy(e); }
};

}  // namespace detail

// Device memory (cudaMalloc) viewed as T. Freeing waits for the device work that uses it.
template <class T>
class DeviceBuffer : public detail::Owned<void*, detail::FreeDevice> {
 public:
  cudaError_t allocate(std::size_t bytes) noexcept {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaSuccess) adopt(p);
    return err;
  }
  T* get() const noexcept { return static_cast<T*>(handle_); }
};

// Page-locked host memory (cudaHostAlloc with `flags`) viewed as T.
template <class T>
class PinnedBuffer : public detail::Owned<void*, detail::FreeHost> {
 public:
  cudaError_t allocate(std::size_t bytes, unsigned flags) noexcept {
    void* p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, bytes, flags);
    if (err == cudaSuccess) adopt(p);
    return err;
  }
  T* get() const noexcept { return static_cast<T*>(handle_); }
};

class Stream : public detail::Owned<cudaStream_t, detail::DestroyStream> {
 public:
  cudaError_t create(unsigned flags) noexcept {
    cudaStream_t s = nullptr;
    const cudaError_t err = cudaStreamCreateWithFlags(&s, flags);
    if (err == cudaSuccess) adopt(s);
    return err;
  }
  cudaStream_t get() const noexcept { return handle_; }
};

class Event : public detail::Owned<cudaEvent_t, detail::DestroyEvent> {
 public:
  cudaError_t create(unsigned flags = cudaEventDefault) noexcept {
    cudaEvent_t e = nullptr;
    const cudaError_t err = cudaEventCreateWithFlags(&e, flags);
    if (err == cudaSuccess) adopt(e);
    return err;
  }
  cudaEvent_t get() const noexcept { return handle_; }
};

// The graph a stream capture produced.
class Graph : public detail::Owned<cudaGraph_t, detail::DestroyGraph> {
 public:
  // Ends the capture on `stream` (even an invalidated one) and owns what it returned.
  cudaError_t end_capture(cudaStream_t stream) noexcept {
    cudaGraph_t g = nullptr;
    const cudaError_t err = cudaStreamEndCapture(stream, &g);
    if (g != nullptr) adopt(g);
    return err;
  }
  cudaGraph_t get() const noexcept { return handle_; }
};

class GraphExec : public detail::Owned<cudaGraphExec_t, detail::DestroyGraphExec> {
 public:
  cudaError_t instantiate(const Graph& graph) noexcept {
    cudaGraphExec_t e = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&e, graph.get(), 0);
    if (err == cudaSuccess) adopt(e);
    return err;
  }
  cudaGraphExec_t get() const noexcept { return handle_; }
};

}  // namespace kvsift::gpu
