// SparseDecodeAttention on the host: the facade over the CUDA backend's implementation
// (gpu/backend.hpp; gpu/sparse_attention.cu does the work).
#include "gpu/sparse_attention.hpp"

#include <utility>

#include "gpu/backend_loader.hpp"

namespace kvsift::gpu {
namespace {

constexpr const char* kWhat = "GPU sparse attention";

}  // namespace

SparseDecodeAttention::SparseDecodeAttention() = default;
SparseDecodeAttention::~SparseDecodeAttention() = default;
SparseDecodeAttention::SparseDecodeAttention(SparseDecodeAttention&& other) noexcept = default;
SparseDecodeAttention& SparseDecodeAttention::operator=(SparseDecodeAttention&& other) noexcept =
    default;

Result SparseDecodeAttention::init(const AttentionShape& shape, uint32_t max_batch,
                                   const AttendTuning& tuning) {
  if (Result r = make_impl(&impl_, &backend::Backend::make_sparse_attention, kWhat); !r.ok)
    return r;
  return impl_->init(shape, max_batch, tuning);
}

Result SparseDecodeAttention::validate(const PageAttendCall& call) const {
  return impl_ ? impl_->validate(call) : not_initialised(kWhat);
}

Result SparseDecodeAttention::validate(const TokenAttendCall& call) const {
  return impl_ ? impl_->validate(call) : not_initialised(kWhat);
}

Result SparseDecodeAttention::run(const PageAttendCall& call) noexcept {
  return impl_ ? impl_->run(call) : not_initialised(kWhat);
}

Result SparseDecodeAttention::run(const TokenAttendCall& call) noexcept {
  return impl_ ? impl_->run(call) : not_initialised(kWhat);
}

const SplitPlan& SparseDecodeAttention::last_plan() const noexcept {
  static const SplitPlan kNone{};
  return impl_ ? impl_->last_plan() : kNone;
}

const AttentionShape& SparseDecodeAttention::shape() const noexcept {
  static const AttentionShape kNone{};
  return impl_ ? impl_->shape() : kNone;
}

}  // namespace kvsift::gpu
