// DeviceLlama on the host: the facade over the CUDA backend's implementation (gpu/backend.hpp;
// gpu/device_llama.cu does the work and keeps the order of the calls).
#include "gpu/device_llama.hpp"

#include <utility>

#include "gpu/backend_loader.hpp"

namespace kvsift::gpu {
namespace {

constexpr const char* kWhat = "device llama";

}  // namespace

DeviceLlama::DeviceLlama() = default;
DeviceLlama::~DeviceLlama() = default;
DeviceLlama::DeviceLlama(DeviceLlama&& other) noexcept = default;
DeviceLlama& DeviceLlama::operator=(DeviceLlama&& other) noexcept = default;

Result DeviceLlama::init(const LlamaShape& shape, const LlamaWeights& host_weights, int device) {
  if (Result r = make_impl(&impl_, &backend::Backend::make_device_llama, kWhat); !r.ok) return r;
  return impl_->init(shape, host_weights, device);
}

Result DeviceLlama::embed(const int32_t* tokens, uint32_t rows) {
  return impl_ ? impl_->embed(tokens, rows) : not_initialised(kWhat);
}

Result DeviceLlama::load_embeddings(const float* x, uint32_t rows) {
  return impl_ ? impl_->load_embeddings(x, rows) : not_initialised(kWhat);
}

Result DeviceLlama::attention_inputs(uint32_t layer, const uint64_t* positions, uint32_t rows) {
  return impl_ ? impl_->attention_inputs(layer, positions, rows) : not_initialised(kWhat);
}

const float* DeviceLlama::q_host() const noexcept {
  return impl_ ? impl_->q_host() : nullptr;
}

const float* DeviceLlama::k_host() const noexcept {
  return impl_ ? impl_->k_host() : nullptr;
}

const float* DeviceLlama::v_host() const noexcept {
  return impl_ ? impl_->v_host() : nullptr;
}

float* DeviceLlama::attn_host() noexcept {
  return impl_ ? impl_->attn_host() : nullptr;
}

Result DeviceLlama::prefill_attention(uint32_t layer, uint64_t pos0, uint32_t rows) {
  return impl_ ? impl_->prefill_attention(layer, pos0, rows) : not_initialised(kWhat);
}

Result DeviceLlama::load_prefix(uint32_t layer, uint64_t first, const float* k_post_rope,
                                const float* v, uint64_t n) {
  return impl_ ? impl_->load_prefix(layer, first, k_post_rope, v, n) : not_initialised(kWhat);
}

void DeviceLlama::reset_prefill() noexcept {
  if (impl_) impl_->reset_prefill();
}

uint64_t DeviceLlama::prefill_held(uint32_t layer) const noexcept {
  return impl_ ? impl_->prefill_held(layer) : 0;
}

Result DeviceLlama::finish_layer(uint32_t layer, bool attn_from_host) {
  return impl_ ? impl_->finish_layer(layer, attn_from_host) : not_initialised(kWhat);
}

Result DeviceLlama::logits(const uint32_t* rows_idx, uint32_t n, float* host_out) {
  return impl_ ? impl_->logits(rows_idx, n, host_out) : not_initialised(kWhat);
}

Result DeviceLlama::read_hidden(float* host_out) {
  return impl_ ? impl_->read_hidden(host_out) : not_initialised(kWhat);
}

Result DeviceLlama::read_attention(float* host_out) {
  return impl_ ? impl_->read_attention(host_out) : not_initialised(kWhat);
}

const LlamaShape& DeviceLlama::shape() const noexcept {
  static const LlamaShape kNone{};
  return impl_ ? impl_->shape() : kNone;
}

uint32_t DeviceLlama::rows() const noexcept {
  return impl_ ? impl_->rows() : 0;
}

void* DeviceLlama::stream() const noexcept {
  return impl_ ? impl_->stream() : nullptr;
}

std::size_t DeviceLlama::device_bytes() const noexcept {
  return impl_ ? impl_->device_bytes() : 0;
}

const DecodeGraphStats& DeviceLlama::graph_stats() const noexcept {
  static const DecodeGraphStats kNone{};
  return impl_ ? impl_->graph_stats() : kNone;
}

}  // namespace kvsift::gpu
