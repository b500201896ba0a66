// The CUDA runtime calls lib/ needs, behind plain C++ (lib/ never includes CUDA headers). Defined
// on the host (gpu/backend_loader.cpp), which forwards them to the CUDA backend module
// (gpu/backend.hpp) and loads it on the first of them; without the module each answers
// Result::absent saying why.
#pragma once

#include <cstddef>

#include "gpu/result.hpp"

namespace kvsift::gpu {

// Whether this build made the CUDA backend module (KVSIFT_ENABLE_CUDA). Whether it loads is
// backend_status()'s to say.
bool built_with_cuda() noexcept;

// Loads the CUDA backend module once (the first caller of any device call does): ok when it is
// loaded, else Result::absent saying what is missing (the module, or the CUDA runtime it needs).
// A loaded module does not mean a usable device: device_count() says that.
Result backend_status();

// Number of usable CUDA devices.
Result device_count(int* n_devices);

// Device memory of `device`: *used_bytes in use by every process and context on it (the driver's
// total minus free, so this process's CUDA context counts too) and *total_bytes. The calling
// thread's current device is left as it was. Invalid argument for a device outside the count.
Result device_memory(int device, uint64_t* used_bytes, uint64_t* total_bytes);

// Page-locked, mapped host memory (cudaHostAlloc) and its release.
Result pinned_alloc(std::size_t bytes, void** out);
void pinned_free(void* p) noexcept;

}  // namespace kvsift::gpu
