// The CUDA runtime calls lib/ needs, behind plain C++ (lib/ never includes CUDA headers).
// Built from runtime.cu with CUDA, or from no_cuda.cpp without it; both define every function.
#pragma once

#include <cstddef>

#include "gpu/result.hpp"

namespace kvsift::gpu {

// Whether this build has the CUDA offload path compiled in.
bool built_with_cuda() noexcept;

// Number of usable CUDA devices.
Result device_count(int* n_devices);

// Page-locked, mapped host memory (cudaHostAlloc) and its release.
Result pinned_alloc(std::size_t bytes, void** out);
void pinned_free(void* p) noexcept;

}  // namespace kvsift::gpu
