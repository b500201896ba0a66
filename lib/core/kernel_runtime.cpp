#include "lib/core/kernel_runtime.hpp"

#include <string_view>

#include "lib/core/error.hpp"

namespace kvsift {

namespace {

simd::Level checked_level(simd::Level request) {
  if (const std::string_view env = simd::env_max_level_error(); !env.empty())
    fail(Status::invalid_argument, env);
  return simd::resolve_level(request);
}

}  // namespace

KernelRuntime::KernelRuntime(simd::Level request)
    : kernels_(&simd::kernels_for(checked_level(request))) {}

}  // namespace kvsift
