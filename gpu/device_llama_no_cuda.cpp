// DeviceLlama in a build without the CUDA Toolkit: every entry point reports "unsupported", and
// nothing is ever allocated.
#include <string>
#include <utility>

#include "gpu/device_llama.hpp"

namespace kvsift::gpu {
namespace {

Result unsupported(const char* what) {
  return without_cuda(std::string("device llama: ") + what);
}

}  // namespace

struct DeviceLlama::Device {};

DeviceLlama::DeviceLlama() = default;
DeviceLlama::~DeviceLlama() = default;
DeviceLlama::DeviceLlama(DeviceLlama&&) noexcept {}
DeviceLlama& DeviceLlama::operator=(DeviceLlama&&) noexcept {
  return *this;
}

Result DeviceLlama::init(const LlamaShape&, const LlamaWeights&, int) {
  return unsupported("init");
}

Result DeviceLlama::embed(const int32_t*, uint32_t) {
  return unsupported("embed");
}

Result DeviceLlama::load_embeddings(const float*, uint32_t) {
  return unsupported("load_embeddings");
}

Result DeviceLlama::attention_inputs(uint32_t, const uint64_t*, uint32_t) {
  return unsupported("attention_inputs");
}

const float* DeviceLlama::q_host() const noexcept {
  return nullptr;
}

const float* DeviceLlama::k_host() const noexcept {
  return nullptr;
}

const float* DeviceLlama::v_host() const noexcept {
  return nullptr;
}

float* DeviceLlama::attn_host() noexcept {
  return nullptr;
}

Result DeviceLlama::prefill_attention(uint32_t, uint64_t, uint32_t) {
  return unsupported("prefill_attention");
}

Result DeviceLlama::load_prefix(uint32_t, uint64_t, const float*, const float*, uint64_t) {
  return unsupported("load_prefix");
}

void DeviceLlama::reset_prefill() noexcept {}

uint64_t DeviceLlama::prefill_held(uint32_t) const noexcept {
  return 0;
}

Result DeviceLlama::finish_layer(uint32_t, bool) {
  return unsupported("finish_layer");
}

Result DeviceLlama::logits(const uint32_t*, uint32_t, float*) {
  return unsupported("logits");
}

Result DeviceLlama::read_hidden(float*) {
  return unsupported("read_hidden");
}

Result DeviceLlama::read_attention(float*) {
  return unsupported("read_attention");
}

void* DeviceLlama::stream() const noexcept {
  return nullptr;
}

std::size_t DeviceLlama::device_bytes() const noexcept {
  return 0;
}

}  // namespace kvsift::gpu
