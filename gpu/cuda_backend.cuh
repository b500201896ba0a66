// Inside the CUDA backend module only (gpu/*.cu): the calls one .cu file makes into another, and
// each device object's factory, which gpu/runtime.cu's Backend hands out (gpu/backend.hpp). They
// live in kvsift::gpu::cuda, apart from the host's functions of gpu/host_memory.hpp, which the
// module must never call: it needs no symbol of the host library (gpu/CMakeLists.txt checks).
#pragma once

#include <cstddef>
#include <memory>

#include "gpu/backend.hpp"

namespace kvsift::gpu::cuda {

// The runtime calls the Backend forwards (gpu/host_memory.hpp and gpu/offload_runtime.hpp state
// them): gpu/runtime.cu and gpu/offload_runtime.cu.
Result device_count(int* n_devices);
Result device_memory(int device, uint64_t* used_bytes, uint64_t* total_bytes);
Result pinned_alloc(std::size_t bytes, void** out);
void pinned_free(void* p) noexcept;
Result set_device(int device);
Result mapped_device_pointer(const void* host, const void** out);
Result device_alloc(std::size_t bytes, void** out);
void device_free(void* p) noexcept;

std::unique_ptr<backend::SparseDecodeAttention> make_sparse_attention();
std::unique_ptr<backend::PagePool> make_page_pool();
std::unique_ptr<backend::StepStream> make_step_stream();
std::unique_ptr<backend::LouverFilter> make_louver_filter();
std::unique_ptr<backend::LocksScorer> make_locks_scorer();
std::unique_ptr<backend::DeviceLlama> make_device_llama();
std::unique_ptr<backend::RowReconstructor> make_row_reconstructor();

}  // namespace kvsift::gpu::cuda
