// SparseDecodeAttention in a build without the CUDA Toolkit: every entry point reports
// "unsupported", and nothing is ever allocated.
#include <utility>

#include "gpu/sparse_attention.hpp"

namespace kvsift::gpu {
namespace {

Result unsupported(const char* what) {
  return without_cuda(what);
}

}  // namespace

struct SparseDecodeAttention::Workspace {};

SparseDecodeAttention::SparseDecodeAttention() = default;
SparseDecodeAttention::~SparseDecodeAttention() = default;

SparseDecodeAttention::SparseDecodeAttention(SparseDecodeAttention&& other) noexcept {
  *this = std::move(other);
}

SparseDecodeAttention& SparseDecodeAttention::operator=(SparseDecodeAttention&&) noexcept {
  return *this;
}

void SparseDecodeAttention::release() noexcept {}

Result SparseDecodeAttention::init(const AttentionShape&, uint32_t) {
  return unsupported("GPU sparse attention");
}

Result SparseDecodeAttention::validate(const PageAttendCall&) const {
  return unsupported("GPU sparse attention");
}

Result SparseDecodeAttention::validate(const TokenAttendCall&) const {
  return unsupported("GPU sparse attention");
}

Result SparseDecodeAttention::run(const PageAttendCall&) noexcept {
  return unsupported("GPU sparse attention");
}

Result SparseDecodeAttention::run(const TokenAttendCall&) noexcept {
  return unsupported("GPU sparse attention");
}

}  // namespace kvsift::gpu
