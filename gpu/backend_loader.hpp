// The host's way to the CUDA backend module (gpu/backend.hpp), for the facades of gpu/*.cpp: the
// loader (gpu/backend_loader.cpp) and the two answers every facade gives before its object
// exists. Host side only; the module never includes it.
#pragma once

#include <memory>
#include <string>

#include "gpu/backend.hpp"
#include "gpu/result.hpp"

namespace kvsift::gpu {

// Loads the module on the first call (thread-safe; never at program start) and returns its
// Backend, or nullptr with *why set to a Result::absent saying what is missing. The search:
// KVSIFT_CUDA_BACKEND (a full path; when set, the only place looked at), then beside the shared
// object (or executable) that holds this loader, then dlopen's search of libkvsift_cuda.so
// (LD_LIBRARY_PATH, the caller's RUNPATH, ld.so.cache).
backend::Backend* loaded_backend(Result* why);

// A facade's implementation, made by the loaded backend's factory `make` unless *impl exists;
// where the backend is absent, Result::absent("what: why").
template <class Impl>
Result make_impl(std::unique_ptr<Impl>* impl, std::unique_ptr<Impl> (backend::Backend::*make)(),
                 const char* what) {
  if (*impl) return Result{};
  Result why;
  backend::Backend* b = loaded_backend(&why);
  if (b == nullptr) return Result::absent(std::string(what) + ": " + why.message);
  *impl = (b->*make)();
  return Result{};
}

// What a facade's call answers before a successful init(): the loader's reason where the backend
// is absent (unsupported), else that init() comes first (invalid argument).
Result not_initialised(const char* what);

}  // namespace kvsift::gpu
