// LouverFilter on the host: the facade over the CUDA backend's implementation (gpu/backend.hpp;
// gpu/louver_filter.cu does the work).
#include "gpu/louver_filter.hpp"

#include <utility>

#include "gpu/backend_loader.hpp"

namespace kvsift::gpu {
namespace {

constexpr const char* kWhat = "GPU Louver filter";

}  // namespace

LouverFilter::LouverFilter() = default;
LouverFilter::~LouverFilter() = default;
LouverFilter::LouverFilter(LouverFilter&& other) noexcept = default;
LouverFilter& LouverFilter::operator=(LouverFilter&& other) noexcept = default;

Result LouverFilter::init(int device, const LouverFilterShape& shape) {
  if (Result r = make_impl(&impl_, &backend::Backend::make_louver_filter, kWhat); !r.ok) return r;
  return impl_->init(device, shape);
}

Result LouverFilter::sync(uint32_t slot, const LouverIndexView& view) {
  return impl_ ? impl_->sync(slot, view) : not_initialised(kWhat);
}

void LouverFilter::release(uint32_t slot) noexcept {
  if (impl_) impl_->release(slot);
}

Result LouverFilter::validate(const LouverFilterItem* items, uint32_t n_items) const {
  return impl_ ? impl_->validate(items, n_items) : not_initialised(kWhat);
}

Result LouverFilter::run(const LouverFilterItem* items, uint32_t n_items) noexcept {
  return impl_ ? impl_->run(items, n_items) : not_initialised(kWhat);
}

const uint32_t* LouverFilter::mask(uint32_t item) const noexcept {
  return impl_ ? impl_->mask(item) : nullptr;
}

uint32_t LouverFilter::mask_keys(uint32_t item) const noexcept {
  return impl_ ? impl_->mask_keys(item) : 0;
}

const LouverFilterShape& LouverFilter::shape() const noexcept {
  static const LouverFilterShape kNone{};
  return impl_ ? impl_->shape() : kNone;
}

uint64_t LouverFilter::device_bytes() const noexcept {
  return impl_ ? impl_->device_bytes() : 0;
}

float LouverFilter::last_run_ms() const noexcept {
  return impl_ ? impl_->last_run_ms() : 0.0f;
}

}  // namespace kvsift::gpu
