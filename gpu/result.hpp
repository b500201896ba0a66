// What a gpu/ call reports, and the one translation of it into kvsift's Error (lib/core/error.hpp).
// Plain C++: lib/ includes it without CUDA headers. Every gpu/ function that can fail returns a
// Result built by one of the factories below, so that `fault` and the two flags agree.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "lib/core/error.hpp"

namespace kvsift::gpu {

enum class Fault : uint8_t {
  none,
  unsupported,    // no CUDA backend module or runtime, or no usable CUDA driver or device
  invalid,        // the request itself is wrong: an argument or a shape the call does not serve
  out_of_memory,  // device or pinned host memory ran out
  failed,         // CUDA failed a request that was valid (a launch, a copy, a lost context)
};

struct Result {
  bool ok = true;
  bool unsupported = false;  // fault == Fault::unsupported; kept as a field for the callers' tests
  std::string message;
  Fault fault = Fault::none;

  static Result absent(std::string message) {
    return Result{false, true, std::move(message), Fault::unsupported};
  }
  static Result invalid(std::string message) {
    return Result{false, false, std::move(message), Fault::invalid};
  }
  static Result out_of_memory(std::string message) {
    return Result{false, false, std::move(message), Fault::out_of_memory};
  }
  static Result failed(std::string message) {
    return Result{false, false, std::move(message), Fault::failed};
  }
};

// The status a failed Result stands for: no driver or device reads "unsupported" (the dev box and
// CI have none, and that is not a failure of the request), a wrong request "invalid_argument",
// exhausted memory "out_of_memory", and anything else CUDA refused "internal".
constexpr Status status_of(const Result& r) noexcept {
  switch (r.fault) {
    case Fault::none: return Status::ok;
    case Fault::unsupported: return Status::unsupported;
    case Fault::invalid: return Status::invalid_argument;
    case Fault::out_of_memory: return Status::out_of_memory;
    case Fault::failed: break;
  }
  return Status::internal;
}

// Throws Error(status_of(r), context then r.message) when r failed: lib/'s cold paths call
// check(r, "OffloadAttention: stream: ").
template <class... Context>
void check(const Result& r, const Context&... context) {
  if (!r.ok) fail(status_of(r), context..., r.message);
}

}  // namespace kvsift::gpu
