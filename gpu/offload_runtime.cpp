// The offload step's runtime on the host: the free functions and StepStream of
// gpu/offload_runtime.hpp, forwarded to the CUDA backend (gpu/backend.hpp; gpu/offload_runtime.cu
// does the work).
#include "gpu/offload_runtime.hpp"

#include <string>
#include <utility>

#include "gpu/backend_loader.hpp"

namespace kvsift::gpu {
namespace {

constexpr const char* kWhat = "offload stream";

Result absent(const char* what, const Result& why) {
  return Result::absent(std::string("offload: ") + what + ": " + why.message);
}

}  // namespace

Result set_device(int device) {
  Result why;
  backend::Backend* b = loaded_backend(&why);
  return b ? b->set_device(device) : absent("set device", why);
}

Result mapped_device_pointer(const void* host, const void** out) {
  *out = nullptr;
  Result why;
  backend::Backend* b = loaded_backend(&why);
  return b ? b->mapped_device_pointer(host, out) : absent("mapped host memory", why);
}

Result device_alloc(std::size_t bytes, void** out) {
  *out = nullptr;
  Result why;
  backend::Backend* b = loaded_backend(&why);
  return b ? b->device_alloc(bytes, out) : absent("device buffer", why);
}

// Memory device_alloc returned exists only where the backend is loaded.
void device_free(void* p) noexcept {
  if (p == nullptr) return;
  Result why;
  if (backend::Backend* b = loaded_backend(&why)) b->device_free(p);
}

StepStream::StepStream() = default;
StepStream::~StepStream() = default;
StepStream::StepStream(StepStream&& other) noexcept = default;
StepStream& StepStream::operator=(StepStream&& other) noexcept = default;

Result StepStream::init() {
  if (Result r = make_impl(&impl_, &backend::Backend::make_step_stream, kWhat); !r.ok) return r;
  return impl_->init();
}

void* StepStream::handle() const noexcept {
  return impl_ ? impl_->handle() : nullptr;
}

Result StepStream::copy_to_device(void* device_dst, const void* host_src,
                                  std::size_t bytes) noexcept {
  return impl_ ? impl_->copy_to_device(device_dst, host_src, bytes) : not_initialised(kWhat);
}

Result StepStream::copy_to_host(void* host_dst, const void* device_src,
                                std::size_t bytes) noexcept {
  return impl_ ? impl_->copy_to_host(host_dst, device_src, bytes) : not_initialised(kWhat);
}

Result StepStream::mark(uint32_t i) noexcept {
  return impl_ ? impl_->mark(i) : not_initialised(kWhat);
}

Result StepStream::wait(uint32_t i) noexcept {
  return impl_ ? impl_->wait(i) : not_initialised(kWhat);
}

float StepStream::elapsed_ms(uint32_t i, uint32_t j) const noexcept {
  return impl_ ? impl_->elapsed_ms(i, j) : 0.0f;
}

}  // namespace kvsift::gpu
