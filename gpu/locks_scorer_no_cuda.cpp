// LocksScorer in a build without the CUDA Toolkit: every entry point reports "unsupported", and
// nothing is ever allocated.
#include <string>
#include <utility>

#include "gpu/locks_scorer.hpp"

namespace kvsift::gpu {
namespace {

Result unsupported() {
  return without_cuda("GPU LOCKS scorer");
}

}  // namespace

struct LocksScorer::Device {};

LocksScorer::LocksScorer() = default;
LocksScorer::~LocksScorer() = default;
LocksScorer::LocksScorer(LocksScorer&& other) noexcept = default;
LocksScorer& LocksScorer::operator=(LocksScorer&& other) noexcept = default;

Result LocksScorer::init(int, const LocksScorerShape&) {
  return unsupported();
}

Result LocksScorer::upload(const std::byte*, const uint32_t*, std::size_t) noexcept {
  return unsupported();
}

Result LocksScorer::validate(const LocksPair*, uint32_t) const {
  return unsupported();
}

Result LocksScorer::run(const LocksPair*, uint32_t) noexcept {
  return unsupported();
}

const uint32_t* LocksScorer::offsets() const noexcept {
  return nullptr;
}

const uint32_t* LocksScorer::page_ids() const noexcept {
  return nullptr;
}

const float* LocksScorer::scores() const noexcept {
  return nullptr;
}

const float* LocksScorer::kept_estimate() const noexcept {
  return nullptr;
}

Result LocksScorer::head_scores(uint32_t, float*) const {
  return unsupported();
}

uint64_t LocksScorer::device_bytes() const noexcept {
  return 0;
}

float LocksScorer::last_run_ms() const noexcept {
  return 0.0f;
}

}  // namespace kvsift::gpu
