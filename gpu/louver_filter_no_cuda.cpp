// LouverFilter in a build without the CUDA Toolkit: every entry point reports "unsupported", and
// nothing is ever allocated.
#include <string>
#include <utility>

#include "gpu/louver_filter.hpp"

namespace kvsift::gpu {
namespace {

Result unsupported(const char* what) {
  return without_cuda(what);
}

}  // namespace

struct LouverFilter::Device {};

LouverFilter::LouverFilter() = default;
LouverFilter::~LouverFilter() = default;
LouverFilter::LouverFilter(LouverFilter&& other) noexcept = default;
LouverFilter& LouverFilter::operator=(LouverFilter&& other) noexcept = default;

Result LouverFilter::init(int, const LouverFilterShape&) {
  return unsupported("GPU Louver filter");
}

Result LouverFilter::sync(uint32_t, const LouverIndexView&) {
  return unsupported("GPU Louver filter");
}

void LouverFilter::release(uint32_t) noexcept {}

Result LouverFilter::validate(const LouverFilterItem*, uint32_t) const {
  return unsupported("GPU Louver filter");
}

Result LouverFilter::run(const LouverFilterItem*, uint32_t) noexcept {
  return unsupported("GPU Louver filter");
}

const uint32_t* LouverFilter::mask(uint32_t) const noexcept {
  return nullptr;
}

uint32_t LouverFilter::mask_keys(uint32_t) const noexcept {
  return 0;
}

uint64_t LouverFilter::device_bytes() const noexcept {
  return 0;
}

float LouverFilter::last_run_ms() const noexcept {
  return 0.0f;
}

}  // namespace kvsift::gpu
