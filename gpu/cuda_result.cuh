// CUDA errors as a Result, one translation for every .cu file: no driver or no device (the dev box
// and CI) reads "unsupported", not a failure of the request.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "gpu/host_memory.hpp"

namespace kvsift::gpu {

inline Result cuda_result(cudaError_t err, const std::string& what) {
  if (err == cudaSuccess) return Result{};
  cudaGetLastError();  // clear a sticky launch error so that later calls start clean
  const bool absent = err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ||
                      err == cudaErrorInitializationError ||
                      err == cudaErrorCompatNotSupportedOnDevice;
  return Result{false, absent, what + ": " + cudaGetErrorString(err)};
}

}  // namespace kvsift::gpu
