// RowReconstructor on the host: the facade over the CUDA backend's implementation
// (gpu/backend.hpp; gpu/row_reconstruct.cu does the work).
#include "gpu/row_reconstruct.hpp"

#include <utility>

#include "gpu/backend_loader.hpp"

namespace kvsift::gpu {
namespace {

constexpr const char* kWhat = "GPU S4R row reconstruction";

}  // namespace

RowReconstructor::RowReconstructor() = default;
RowReconstructor::~RowReconstructor() = default;
RowReconstructor::RowReconstructor(RowReconstructor&& other) noexcept = default;
RowReconstructor& RowReconstructor::operator=(RowReconstructor&& other) noexcept = default;

Result RowReconstructor::init(const ReconstructShape& shape) {
  if (Result r = make_impl(&impl_, &backend::Backend::make_row_reconstructor, kWhat); !r.ok)
    return r;
  return impl_->init(shape);
}

Result RowReconstructor::run(const ReconstructCall& call) noexcept {
  return impl_ ? impl_->run(call) : not_initialised(kWhat);
}

const ReconstructShape& RowReconstructor::shape() const noexcept {
  static const ReconstructShape kNone{};
  return impl_ ? impl_->shape() : kNone;
}

}  // namespace kvsift::gpu
