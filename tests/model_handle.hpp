// The real model for tests that need it: its path (KVSIFT_MODEL, which make test sets; the tests
// skip without it) and an owning handle.
#pragma once

#include <cstdlib>

#include "kvsift/kvsift.hpp"

namespace kvsift::test {

inline const char* model_path() {
  return std::getenv("KVSIFT_MODEL");
}

// Tests of the C API load through kvsift_model_load and hand the handle to this owner
// (Model(raw)); they reach it again with get().
using Model = kvsift::model_runner;

}  // namespace kvsift::test
