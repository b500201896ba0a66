// The offload step's runtime in a build without the CUDA Toolkit: every call reports
// "unsupported" and nothing is ever allocated.
#include <string>
#include <utility>

#include "gpu/offload_runtime.hpp"

namespace kvsift::gpu {
namespace {

Result unsupported(const char* what) {
  return without_cuda(what);
}

}  // namespace

Result set_device(int) {
  return unsupported("offload: set device");
}

Result mapped_device_pointer(const void*, const void** out) {
  *out = nullptr;
  return unsupported("offload: mapped host memory");
}

Result device_alloc(std::size_t, void** out) {
  *out = nullptr;
  return unsupported("offload: device buffer");
}

void device_free(void*) noexcept {}

struct StepStream::Device {};

StepStream::StepStream() = default;
StepStream::~StepStream() = default;
StepStream::StepStream(StepStream&& other) noexcept = default;
StepStream& StepStream::operator=(StepStream&& other) noexcept = default;

Result StepStream::init() {
  return unsupported("offload: stream");
}

void* StepStream::handle() const noexcept {
  return nullptr;
}

Result StepStream::copy_to_device(void*, const void*, std::size_t) noexcept {
  return unsupported("offload: copy to device");
}

Result StepStream::copy_to_host(void*, const void*, std::size_t) noexcept {
  return unsupported("offload: copy to host");
}

Result StepStream::refresh_pages(const void*, void*, std::size_t, const PageMove*,
                                 uint32_t) noexcept {
  return unsupported("offload: page refresh");
}

Result StepStream::mark(uint32_t) noexcept {
  return unsupported("offload: event");
}

Result StepStream::wait(uint32_t) noexcept {
  return unsupported("offload: event");
}

float StepStream::elapsed_ms(uint32_t, uint32_t) const noexcept {
  return 0.0f;
}

}  // namespace kvsift::gpu
