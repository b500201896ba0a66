// CUDA errors as a Result (gpu/result.hpp): the one translation every .cu file uses. Two rules,
// stated here once:
// - absent: no CUDA driver, a driver too old for this build, or no device reads Fault::unsupported
//   (the dev box and CI have none; that is not a failure of the request); cudaErrorMemoryAllocation
//   reads Fault::out_of_memory, and every other error Fault::failed.
// - sticky errors: after a failed call, cudaGetLastError() clears the thread's last error, so that
//   the next launch check (which reads cudaGetLastError()) does not report this failure again. A
//   sticky context error (a kernel's illegal access) survives that and fails every later call, as
//   it must.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <string_view>

#include "gpu/result.hpp"

namespace kvsift::gpu {

inline Fault cuda_fault(cudaError_t err) noexcept {
  switch (err) {
    case cudaSuccess: return Fault::none;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice: return Fault::unsupported;
    case cudaErrorMemoryAllocation: return Fault::out_of_memory;
    default: return Fault::failed;
  }
}

// "scope: what: CUDA's message", or "what: ..." without a scope. The message is built only on
// failure: the run() paths of gpu/ check every call on the decode path.
inline Result cuda_result(cudaError_t err, std::string_view scope, std::string_view what) {
  if (err == cudaSuccess) return Result{};
  cudaGetLastError();
  std::string message;
  if (!scope.empty()) message.append(scope).append(": ");
  message.append(what).append(": ").append(cudaGetErrorString(err));
  switch (cuda_fault(err)) {
    case Fault::unsupported:
      return Result::absent(message + " (the CUDA driver or device is missing)");
    case Fault::out_of_memory: return Result::out_of_memory(std::move(message));
    default: return Result::failed(std::move(message));
  }
}

inline Result cuda_result(cudaError_t err, std::string_view what) {
  return cuda_result(err, {}, what);
}

// A component's CUDA checks, its scope named once per file:
//   constexpr CudaErrors from_cuda{"locks scorer"};
//   from_cuda(cudaMalloc(...), "records") -> "locks scorer: records: out of memory".
class CudaErrors {
 public:
  constexpr explicit CudaErrors(const char* scope) : scope_(scope) {}

  Result operator()(cudaError_t err, std::string_view what) const {
    return cuda_result(err, scope_, what);
  }
  // After a kernel launch (<<<>>> returns nothing): the launch's error, if any.
  Result launched(std::string_view what) const {
    return cuda_result(cudaGetLastError(), scope_, what);
  }
  // A request this component refuses: "scope: message".
  Result invalid(std::string_view message) const {
    return Result::invalid(std::string(scope_).append(": ").append(message));
  }

 private:
  const char* scope_;
};

}  // namespace kvsift::gpu
