// The CUDA backend loader (gpu/backend_loader.cpp) on real modules that cannot serve: a path that
// does not exist, a module whose dependency is missing, a module of another interface version.
// The loader reads KVSIFT_CUDA_BACKEND once per process, so each case runs in its own process:
// tests/CMakeLists.txt registers one CTest per case with the variable set, and a case skips where
// the variable is not set (the binary run by hand).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "gpu/backend.hpp"
#include "gpu/host_memory.hpp"
#include "kvsift/kvsift.h"

namespace kvsift {
namespace {

// The module KVSIFT_CUDA_BACKEND names, or empty (the case then skips).
std::string named_module() {
  const char* path = std::getenv("KVSIFT_CUDA_BACKEND");
  return path ? path : "";
}

#define KVSIFT_NEEDS_NAMED_MODULE() \
  if (named_module().empty())       \
  GTEST_SKIP() << "run by CTest with KVSIFT_CUDA_BACKEND naming the module to load"

// A device query through the C API: UNSUPPORTED, with a message holding every needle.
void expect_unsupported(std::initializer_list<std::string> needles) {
  int n_devices = -1;
  ASSERT_EQ(kvsift_gpu_device_count(&n_devices), KVSIFT_STATUS_UNSUPPORTED);
  const std::string message = kvsift_last_error();
  for (const std::string& needle : needles)
    EXPECT_NE(message.find(needle), std::string::npos) << "no '" << needle << "' in: " << message;
  // The C++ layer answers the same, and the offload path's entry points too.
  const gpu::Result status = gpu::backend_status();
  EXPECT_TRUE(status.unsupported);
  EXPECT_NE(status.message.find(*needles.begin()), std::string::npos) << status.message;
  void* pinned = nullptr;
  EXPECT_TRUE(gpu::pinned_alloc(4096, &pinned).unsupported);
  EXPECT_EQ(pinned, nullptr);
}

TEST(BackendLoader, a_missing_module_is_unsupported_and_named) {
  KVSIFT_NEEDS_NAMED_MODULE();
  expect_unsupported({named_module(), "KVSIFT_CUDA_BACKEND", "was not found"});
}

TEST(BackendLoader, a_module_whose_dependency_is_missing_quotes_the_loader) {
  KVSIFT_NEEDS_NAMED_MODULE();
  // dlerror() names the library it could not find (tests/CMakeLists.txt builds it where no
  // search looks).
  expect_unsupported({named_module(), "could not be loaded", "libkvsift_test_missing_dependency.so",
                      "the CUDA runtime is not installed or not on the library path"});
}

TEST(BackendLoader, a_module_of_another_interface_version_is_refused) {
  KVSIFT_NEEDS_NAMED_MODULE();
  const uint32_t ours = gpu::backend::kInterfaceVersion;
  // tests/backend_wrong_version.cpp reports ours + 1.
  expect_unsupported({named_module(), "interface version " + std::to_string(ours + 1),
                      "needs version " + std::to_string(ours)});
}

// Without the variable: a CUDA build's executables find the build's module through their RUNPATH
// (gpu/CMakeLists.txt); a build without CUDA says so.
TEST(BackendLoader, finds_the_module_of_this_build) {
  if (!named_module().empty()) GTEST_SKIP() << "KVSIFT_CUDA_BACKEND is set";
  const gpu::Result status = gpu::backend_status();
  if (gpu::built_with_cuda()) {
    EXPECT_TRUE(status.ok) << status.message;
  } else {
    EXPECT_TRUE(status.unsupported);
    EXPECT_NE(status.message.find("built without CUDA"), std::string::npos) << status.message;
  }
}

}  // namespace
}  // namespace kvsift
