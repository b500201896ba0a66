// Loads the CUDA backend module (gpu/backend.hpp, gpu/backend_loader.hpp) and defines the runtime
// calls of gpu/host_memory.hpp over it.
#include "gpu/backend_loader.hpp"

#include <dlfcn.h>
#include <sys/stat.h>

#include <cstdlib>
#include <string>
#include <string_view>

#include "gpu/host_memory.hpp"

#ifndef KVSIFT_CUDA_MODULE_BUILT
#error "gpu/CMakeLists.txt defines KVSIFT_CUDA_MODULE_BUILT for kvsift_gpu_host"
#endif

namespace kvsift::gpu {
namespace {

constexpr const char* kPathVariable = "KVSIFT_CUDA_BACKEND";

struct Loaded {
  backend::Backend* backend = nullptr;
  std::string why;  // what is missing, when backend is null
};

bool file_exists(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0;
}

// The folder of the shared object (or executable) this loader is linked into, where an installed
// libkvsift.so finds the module installed beside it; empty when the loader cannot tell.
std::string loader_directory() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&loader_directory), &info) == 0 ||
      info.dli_fname == nullptr || info.dli_fname[0] == '\0')
    return {};
  // An executable's name is as it was run (argv[0], perhaps relative): made absolute for messages.
  char* absolute = realpath(info.dli_fname, nullptr);
  const std::string path = absolute ? absolute : info.dli_fname;
  std::free(absolute);
  const std::size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string(".") : path.substr(0, slash);
}

std::string not_found(const std::string& where) {
  std::string why =
      std::string("kvsift's CUDA backend ") + backend::kModuleName + " was not found " + where;
  if (!KVSIFT_CUDA_MODULE_BUILT)
    why += "; this kvsift was built without CUDA (KVSIFT_ENABLE_CUDA=OFF)";
  return why;
}

std::string unloadable(const std::string& module, const char* dl_error) {
  return "kvsift's CUDA backend " + module +
         " was found but could not be loaded: " + (dl_error ? dl_error : "unknown error") +
         " (the CUDA runtime is not installed or not on the library path)";
}

// Opens `module` (a path, or the bare name for dlopen's own search) and shakes hands.
Loaded open_module(const std::string& module) {
  Loaded loaded;
  void* handle = dlopen(module.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* error = dlerror();
    // dlopen says which file it could not open first: the module itself (its name leads the
    // message) is not found; anything else is a library the module needs.
    const std::string bare = backend::kModuleName;
    if (module == bare && error != nullptr && std::string_view(error).starts_with(bare + ":")) {
      const std::string dir = loader_directory();
      loaded.why = not_found("beside " + (dir.empty() ? std::string("kvsift") : dir) +
                             " or on the library path");
    } else {
      loaded.why = unloadable(module, error);
    }
    return loaded;
  }
  auto entry = reinterpret_cast<backend::EntryPoint>(dlsym(handle, backend::kEntryPoint));
  if (entry == nullptr) {
    loaded.why = module + " is not a kvsift CUDA backend: it has no " + backend::kEntryPoint;
    dlclose(handle);
    return loaded;
  }
  // Name the file dlopen's search picked, for the messages below.
  std::string path = module;
  if (Dl_info info{}; dladdr(reinterpret_cast<const void*>(entry), &info) != 0 && info.dli_fname)
    path = info.dli_fname;
  backend::Backend* b = nullptr;
  const uint32_t version = entry(backend::kInterfaceVersion, &b);
  if (version != backend::kInterfaceVersion || b == nullptr) {
    loaded.why = "kvsift's CUDA backend " + path + " has interface version " +
                 std::to_string(version) + ", this kvsift needs version " +
                 std::to_string(backend::kInterfaceVersion) +
                 " (use the libkvsift_cuda.so built with this kvsift)";
    dlclose(handle);
    return loaded;
  }
  // Kept open for the process's life: the device objects it made may outlive any caller.
  loaded.backend = b;
  return loaded;
}

Loaded load() {
  if (const char* path = std::getenv(kPathVariable); path != nullptr && path[0] != '\0') {
    // An explicit choice is the only one tried: falling back would hide its mistake.
    if (!file_exists(path))
      return Loaded{nullptr, std::string("kvsift's CUDA backend ") + path + " (named by " +
                                 kPathVariable + ") was not found"};
    return open_module(path);
  }
  if (const std::string dir = loader_directory(); !dir.empty()) {
    const std::string beside = dir + "/" + backend::kModuleName;
    if (file_exists(beside)) return open_module(beside);
  }
  return open_module(backend::kModuleName);
}

const Loaded& loaded() {
  static const Loaded once = load();  // thread-safe initialisation, on the first device call
  return once;
}

}  // namespace

backend::Backend* loaded_backend(Result* why) {
  const Loaded& l = loaded();
  if (l.backend == nullptr) *why = Result::absent(l.why);
  return l.backend;
}

Result not_initialised(const char* what) {
  Result why;
  if (loaded_backend(&why) == nullptr)
    return Result::absent(std::string(what) + ": " + why.message);
  return Result::invalid(std::string(what) + ": init() has not succeeded");
}

bool built_with_cuda() noexcept {
  return KVSIFT_CUDA_MODULE_BUILT;
}

Result backend_status() {
  Result why;
  return loaded_backend(&why) != nullptr ? Result{} : why;
}

Result device_count(int* n_devices) {
  *n_devices = 0;
  Result why;
  backend::Backend* b = loaded_backend(&why);
  return b ? b->device_count(n_devices) : why;
}

Result device_memory(int device, uint64_t* used_bytes, uint64_t* total_bytes) {
  *used_bytes = *total_bytes = 0;
  Result why;
  backend::Backend* b = loaded_backend(&why);
  return b ? b->device_memory(device, used_bytes, total_bytes) : why;
}

Result pinned_alloc(std::size_t bytes, void** out) {
  *out = nullptr;
  Result why;
  backend::Backend* b = loaded_backend(&why);
  return b ? b->pinned_alloc(bytes, out) : Result::absent("pinned host memory: " + why.message);
}

// Memory pinned_alloc returned exists only where the backend is loaded.
void pinned_free(void* p) noexcept {
  if (p == nullptr) return;
  Result why;
  if (backend::Backend* b = loaded_backend(&why)) b->pinned_free(p);
}

}  // namespace kvsift::gpu
