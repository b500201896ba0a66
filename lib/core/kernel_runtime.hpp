// The CPU kernels of one handle. A handle (the C API's cache, a model) creates one when it is
// created: the level is chosen then, once, from the handle's request, this CPU's features and the
// process cap (simd/isa.hpp), and the handle passes the level's tables to everything of its own
// that runs kernels: the KV cache's conversions, attention, the selectors, the model's products.
// Nothing finds kernels through another object, so a handle's parts cannot run different levels,
// and a test can hand any part the table of any level it wants to check.
#pragma once

#include "simd/isa.hpp"
#include "simd/kernels.hpp"

namespace kvsift {

class KernelRuntime {
 public:
  // simd::resolve_level(request): best, or a named level, which falls back to the best level
  // below it when the CPU or the cap refuses it (callers that must refuse a level the CPU lacks
  // check simd::cpu_has first, as the C API does). Throws Error(invalid_argument) naming the
  // variable, its value and the level names when KVSIFT_MAX_ISA holds something else.
  explicit KernelRuntime(simd::Level request = simd::Level::best);

  simd::Level level() const noexcept { return kernels_->level; }
  // A static table: it outlives the runtime. (Louver's indexes take the level, params.isa, and
  // map it to their own table: simd::louver_kernels_for.)
  const simd::Kernels& kernels() const noexcept { return *kernels_; }

 private:
  const simd::Kernels* kernels_;
};

}  // namespace kvsift
