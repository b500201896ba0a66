// A real CUDA backend module of another interface version, for tests/test_backend_loader.cpp: its
// entry point answers the handshake with kInterfaceVersion + 1 and offers no Backend.
#include <cstdint>

#include "gpu/backend.hpp"

extern "C" __attribute__((visibility("default"))) uint32_t kvsift_cuda_backend_open(
    uint32_t, kvsift::gpu::backend::Backend** out) {
  *out = nullptr;
  return kvsift::gpu::backend::kInterfaceVersion + 1;
}
