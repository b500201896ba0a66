// The two halves of a module whose dependency is missing, for tests/test_backend_loader.cpp:
// KVSIFT_TEST_DEPENDENCY builds the dependency (a shared library tests/CMakeLists.txt puts where no
// search looks), otherwise the module that needs it.
#include <cstdint>

extern "C" __attribute__((visibility("default"))) uint32_t kvsift_test_dependency_version();

#if defined(KVSIFT_TEST_DEPENDENCY)
uint32_t kvsift_test_dependency_version() {
  return 1;
}
#else
namespace kvsift::gpu::backend {
class Backend;
}

extern "C" __attribute__((visibility("default"))) uint32_t kvsift_cuda_backend_open(
    uint32_t, kvsift::gpu::backend::Backend** out) {
  *out = nullptr;
  return kvsift_test_dependency_version();
}
#endif
