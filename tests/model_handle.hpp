// The real model for tests that need it: its path (KVSIFT_MODEL, which make test sets; the tests
// skip without it) and an owning handle.
#pragma once

#include <cstdlib>
#include <memory>

#include "kvsift/kvsift.h"

namespace kvsift::test {

inline const char* model_path() {
  return std::getenv("KVSIFT_MODEL");
}

struct ModelFree {
  void operator()(kvsift_model* m) const { kvsift_model_free(m); }
};
using Model = std::unique_ptr<kvsift_model, ModelFree>;

}  // namespace kvsift::test
