// LocksScorer on the host: the facade over the CUDA backend's implementation (gpu/backend.hpp;
// gpu/locks_scorer.cu does the work).
#include "gpu/locks_scorer.hpp"

#include <utility>

#include "gpu/backend_loader.hpp"

namespace kvsift::gpu {
namespace {

constexpr const char* kWhat = "GPU LOCKS scorer";

}  // namespace

LocksScorer::LocksScorer() = default;
LocksScorer::~LocksScorer() = default;
LocksScorer::LocksScorer(LocksScorer&& other) noexcept = default;
LocksScorer& LocksScorer::operator=(LocksScorer&& other) noexcept = default;

Result LocksScorer::init(int device, const LocksScorerShape& shape) {
  if (Result r = make_impl(&impl_, &backend::Backend::make_locks_scorer, kWhat); !r.ok) return r;
  return impl_->init(device, shape);
}

Result LocksScorer::upload(const std::byte* records, const uint32_t* slots,
                           std::size_t n) noexcept {
  return impl_ ? impl_->upload(records, slots, n) : not_initialised(kWhat);
}

Result LocksScorer::validate(const LocksPair* pairs, uint32_t n_pairs) const {
  return impl_ ? impl_->validate(pairs, n_pairs) : not_initialised(kWhat);
}

Result LocksScorer::run(const LocksPair* pairs, uint32_t n_pairs) noexcept {
  return impl_ ? impl_->run(pairs, n_pairs) : not_initialised(kWhat);
}

const uint32_t* LocksScorer::offsets() const noexcept {
  return impl_ ? impl_->offsets() : nullptr;
}

const uint32_t* LocksScorer::page_ids() const noexcept {
  return impl_ ? impl_->page_ids() : nullptr;
}

const float* LocksScorer::scores() const noexcept {
  return impl_ ? impl_->scores() : nullptr;
}

const float* LocksScorer::kept_estimate() const noexcept {
  return impl_ ? impl_->kept_estimate() : nullptr;
}

Result LocksScorer::head_scores(uint32_t pair, float* out) const {
  return impl_ ? impl_->head_scores(pair, out) : not_initialised(kWhat);
}

const LocksScorerShape& LocksScorer::shape() const noexcept {
  static const LocksScorerShape kNone{};
  return impl_ ? impl_->shape() : kNone;
}

uint64_t LocksScorer::device_bytes() const noexcept {
  return impl_ ? impl_->device_bytes() : 0;
}

float LocksScorer::last_run_ms() const noexcept {
  return impl_ ? impl_->last_run_ms() : 0.0f;
}

}  // namespace kvsift::gpu
