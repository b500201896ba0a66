// The GPU tests' one skip rule: a test that needs a device skips, saying why, where none is usable
// (a build without CUDA, or no driver: the development machine's cudaGetDeviceCount fails with
// "insufficient driver").
#pragma once

#include <gtest/gtest.h>

#include <string>

#include "gpu/host_memory.hpp"

namespace kvsift::test {

// Whether a CUDA device is usable; otherwise *why says what is missing.
inline bool device_usable(std::string* why) {
  int n_devices = 0;
  const gpu::Result r = gpu::device_count(&n_devices);
  if (!r.ok) *why = "no usable CUDA device: " + r.message;
  return r.ok;
}

}  // namespace kvsift::test

// In a test body or SetUp(): skip the test where no device is usable.
#define KVSIFT_SKIP_WITHOUT_DEVICE()                                             \
  do {                                                                           \
    std::string kvsift_why;                                                      \
    if (!::kvsift::test::device_usable(&kvsift_why)) GTEST_SKIP() << kvsift_why; \
  } while (0)
