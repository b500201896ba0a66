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

// What is missing, for the errors cuda_fault() reads as Fault::unsupported. CUDA's own strings
// mislead here: with no driver installed at all (a machine without a GPU) cudaGetDeviceCount
// fails with "CUDA driver version is insufficient for CUDA runtime version".
inline std::string absent_reason(cudaError_t err) {
  const auto version = [](int v) {
    return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
  };
  switch (err) {
    case cudaErrorNoDevice: return "no CUDA device";
    case cudaErrorInsufficientDriver: {
      int driver = 0;
      if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
        cudaGetLastError();
        return "no NVIDIA driver (libcuda.so.1) was found";
      }
      return "the NVIDIA driver supports CUDA " + version(driver) + ", older than the CUDA " +
             version(CUDART_VERSION) + " runtime kvsift's CUDA backend was built with";
    }
    case cudaErrorStubLibrary:
      return "the libcuda.so.1 found is the CUDA toolkit's stub, not an NVIDIA driver";
    case cudaErrorSystemDriverMismatch:
      return "the NVIDIA driver's library and kernel module differ in version";
    case cudaErrorCompatNotSupportedOnDevice:
      return "the CUDA forward-compatibility driver does not support this device";
    default: return "the NVIDIA driver failed to initialise";
  }
}

// "scope: what: CUDA's message", or "what: ..." without a scope; where the driver or the device
// is missing, "scope: what: what is missing (CUDA's error name)", without CUDA's message, which
// misleads there (absent_reason). The message is built only on failure: the run() paths of gpu/
// check every call on the decode path.
inline Result cuda_result(cudaError_t err, std::string_view scope, std::string_view what) {
  if (err == cudaSuccess) return Result{};
  cudaGetLastError();
  std::string message;
  if (!scope.empty()) message.append(scope).append(": ");
  message.append(what).append(": ");
  switch (cuda_fault(err)) {
    case Fault::unsupported:
      return Result::absent(message + absent_reason(err) + " (" + cudaGetErrorName(err) + ")");
    case Fault::out_of_memory:
      return Result::out_of_memory(message.append(cudaGetErrorString(err)));
    default: return Result::failed(message.append(cudaGetErrorString(err)));
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
