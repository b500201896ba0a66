// The GPU tests' one skip rule: a test that needs a device skips, saying why, where none is usable:
// no CUDA backend module (a build without CUDA, or libkvsift_cuda.so or the CUDA runtime not
// found), no NVIDIA driver (the development machine: "no NVIDIA driver (libcuda.so.1) was found"),
// or no device. The reason is the loader's or the backend's message (gpu/backend_loader.cpp,
// gpu/cuda_result.cuh).
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
