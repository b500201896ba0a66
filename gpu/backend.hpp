// The interface between kvsift and its CUDA backend, the module libkvsift_cuda.so that the host
// loads at run time (gpu/backend_loader.cpp), as ggml loads its backends: the library itself never
// links the CUDA runtime, so it starts, and runs on the CPU, where CUDA is not installed.
//
// Two sides share this header. The module (gpu/*.cu, built only with KVSIFT_ENABLE_CUDA)
// implements every class below and exports one symbol, kvsift_cuda_backend_open. The host
// (gpu/*.cpp, always built, plain C++) reaches the device only through these classes, behind the
// facades that keep today's names (gpu::SparseDecodeAttention, gpu::DevicePageCache, ...).
//
// Why facades over the interfaces rather than making the interfaces the public names: the callers
// (lib/, tests, benches) keep value objects with init(), move them, and read a failed init's
// message; a facade keeps all of that as it was, and is the one place that answers
// Result::absent (no module, no CUDA runtime) for every entry point, so no caller tests for a null
// pointer and no stub of the device code is needed.
//
// Both sides are built from one tree by one compiler and share the C++ standard library, so the
// interface passes C++ objects (Result, std::string, std::vector, std::unique_ptr). Any change to
// a class below or to a structure it passes (gpu/*.hpp) changes kInterfaceVersion: a module built
// from another tree is then refused by the handshake instead of misreading a layout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "gpu/device_llama.hpp"
#include "gpu/locks_scorer.hpp"
#include "gpu/louver_filter.hpp"
#include "gpu/offload_runtime.hpp"
#include "gpu/page_transfer.hpp"
#include "gpu/result.hpp"
#include "gpu/row_reconstruct.hpp"
#include "gpu/sparse_attention.hpp"

namespace kvsift::gpu::backend {

inline constexpr uint32_t kInterfaceVersion = 3;

// gpu/sparse_attention.hpp states the contract of every call.
class SparseDecodeAttention {
 public:
  virtual ~SparseDecodeAttention() = default;
  virtual Result init(const AttentionShape& shape, uint32_t max_batch,
                      const AttendTuning& tuning) = 0;
  virtual Result validate(const PageAttendCall& call) const = 0;
  virtual Result validate(const TokenAttendCall& call) const = 0;
  virtual Result run(const PageAttendCall& call) noexcept = 0;
  virtual Result run(const TokenAttendCall& call) noexcept = 0;
  virtual const SplitPlan& last_plan() const noexcept = 0;
  virtual const AttentionShape& shape() const noexcept = 0;
};

// The device half of gpu::DevicePageCache (gpu/page_transfer.hpp): the device pool, the staging
// chunks, the move list and their events. Which pages are resident, and so which moves a step
// makes, is the facade's (gpu/page_residency.hpp); this half moves what it is told.
class PagePool {
 public:
  virtual ~PagePool() = default;
  // Allocates for a configuration gpu::validate() accepted (the facade checks it first).
  virtual Result init(const PageCacheConfig& config) = 0;
  virtual const void* device_pool() const noexcept = 0;
  // Whether the host pool is mapped pinned memory, which the mapped path needs.
  virtual bool host_pool_mapped() const noexcept = 0;
  // Copies host page moves[i].host_slot into device slot moves[i].device_slot for i < n, by one
  // path, enqueued on `stream` (a cudaStream_t). list_offset: where the moves go in the mapped
  // path's list (capacity entries); 0 starts a step's list, after the kernels that read the last
  // one; above 0 appends to the step's list behind the entries its earlier kernels read.
  virtual Result move_staged(const PageMove* moves, std::size_t n, void* stream) noexcept = 0;
  virtual Result move_mapped(const PageMove* moves, std::size_t n, std::size_t list_offset,
                             void* stream) noexcept = 0;
};

// gpu/offload_runtime.hpp states the contract of every call.
class StepStream {
 public:
  virtual ~StepStream() = default;
  virtual Result init() = 0;
  virtual void* handle() const noexcept = 0;
  virtual Result copy_to_device(void* device_dst, const void* host_src,
                                std::size_t bytes) noexcept = 0;
  virtual Result copy_to_host(void* host_dst, const void* device_src,
                              std::size_t bytes) noexcept = 0;
  virtual Result mark(uint32_t i) noexcept = 0;
  virtual Result wait(uint32_t i) noexcept = 0;
  virtual float elapsed_ms(uint32_t i, uint32_t j) const noexcept = 0;
};

// gpu/louver_filter.hpp states the contract of every call.
class LouverFilter {
 public:
  virtual ~LouverFilter() = default;
  virtual Result init(int device, const LouverFilterShape& shape) = 0;
  virtual Result sync(uint32_t slot, const LouverIndexView& view) = 0;
  virtual void release(uint32_t slot) noexcept = 0;
  virtual Result validate(const LouverFilterItem* items, uint32_t n_items) const = 0;
  virtual Result run(const LouverFilterItem* items, uint32_t n_items) noexcept = 0;
  virtual const uint32_t* mask(uint32_t item) const noexcept = 0;
  virtual uint32_t mask_keys(uint32_t item) const noexcept = 0;
  virtual const LouverFilterShape& shape() const noexcept = 0;
  virtual uint64_t device_bytes() const noexcept = 0;
  virtual float last_run_ms() const noexcept = 0;
};

// gpu/locks_scorer.hpp states the contract of every call.
class LocksScorer {
 public:
  virtual ~LocksScorer() = default;
  virtual Result init(int device, const LocksScorerShape& shape) = 0;
  virtual Result upload(const std::byte* records, const uint32_t* slots,
                        std::size_t n) noexcept = 0;
  virtual Result validate(const LocksPair* pairs, uint32_t n_pairs) const = 0;
  virtual Result run(const LocksPair* pairs, uint32_t n_pairs) noexcept = 0;
  virtual const uint32_t* offsets() const noexcept = 0;
  virtual const uint32_t* page_ids() const noexcept = 0;
  virtual const float* scores() const noexcept = 0;
  virtual const float* kept_estimate() const noexcept = 0;
  virtual Result head_scores(uint32_t pair, float* out) const = 0;
  virtual const LocksScorerShape& shape() const noexcept = 0;
  virtual uint64_t device_bytes() const noexcept = 0;
  virtual float last_run_ms() const noexcept = 0;
};

// gpu/row_reconstruct.hpp states the contract of every call.
class RowReconstructor {
 public:
  virtual ~RowReconstructor() = default;
  virtual Result init(const ReconstructShape& shape) = 0;
  virtual Result run(const ReconstructCall& call) noexcept = 0;
  virtual const ReconstructShape& shape() const noexcept = 0;
};

// gpu/device_llama.hpp states the contract of every call.
class DeviceLlama {
 public:
  virtual ~DeviceLlama() = default;
  virtual Result init(const LlamaShape& shape, const LlamaWeights& host_weights, int device) = 0;
  virtual Result embed(const int32_t* tokens, uint32_t rows) = 0;
  virtual Result load_embeddings(const float* x, uint32_t rows) = 0;
  virtual Result attention_inputs(uint32_t layer, const uint64_t* positions, uint32_t rows) = 0;
  virtual const float* q_host() const noexcept = 0;
  virtual const float* k_host() const noexcept = 0;
  virtual const float* v_host() const noexcept = 0;
  virtual float* attn_host() noexcept = 0;
  virtual Result prefill_attention(uint32_t layer, uint64_t pos0, uint32_t rows) = 0;
  virtual Result load_prefix(uint32_t layer, uint64_t first, const float* k_post_rope,
                             const float* v, uint64_t n) = 0;
  virtual void reset_prefill() noexcept = 0;
  virtual uint64_t prefill_held(uint32_t layer) const noexcept = 0;
  virtual Result finish_layer(uint32_t layer, bool attn_from_host) = 0;
  virtual Result logits(const uint32_t* rows_idx, uint32_t n, float* host_out) = 0;
  virtual Result read_hidden(float* host_out) = 0;
  virtual Result read_attention(float* host_out) = 0;
  virtual const LlamaShape& shape() const noexcept = 0;
  virtual uint32_t rows() const noexcept = 0;
  virtual void* stream() const noexcept = 0;
  virtual std::size_t device_bytes() const noexcept = 0;
  virtual const DecodeGraphStats& graph_stats() const noexcept = 0;
};

// The root: the runtime calls of gpu/host_memory.hpp and gpu/offload_runtime.hpp, and a factory
// per device object. One per process, owned by the module for the process's life (the host never
// unloads it), so it has no public destructor.
class Backend {
 public:
  virtual Result device_count(int* n_devices) = 0;
  virtual Result device_memory(int device, uint64_t* used_bytes, uint64_t* total_bytes) = 0;
  virtual Result pinned_alloc(std::size_t bytes, void** out) = 0;
  virtual void pinned_free(void* p) noexcept = 0;
  virtual Result set_device(int device) = 0;
  virtual Result mapped_device_pointer(const void* host, const void** out) = 0;
  virtual Result device_alloc(std::size_t bytes, void** out) = 0;
  virtual void device_free(void* p) noexcept = 0;

  virtual std::unique_ptr<SparseDecodeAttention> make_sparse_attention() = 0;
  virtual std::unique_ptr<PagePool> make_page_pool() = 0;
  virtual std::unique_ptr<StepStream> make_step_stream() = 0;
  virtual std::unique_ptr<LouverFilter> make_louver_filter() = 0;
  virtual std::unique_ptr<LocksScorer> make_locks_scorer() = 0;
  virtual std::unique_ptr<DeviceLlama> make_device_llama() = 0;
  virtual std::unique_ptr<RowReconstructor> make_row_reconstructor() = 0;

 protected:
  ~Backend() = default;
};

// The module's file name, and its one exported symbol.
inline constexpr const char* kModuleName = "libkvsift_cuda.so";
inline constexpr const char* kEntryPoint = "kvsift_cuda_backend_open";

// The entry point: returns the module's kInterfaceVersion and, only when host_version equals it,
// sets *out to the module's Backend (else leaves it null). Only integers and one pointer cross
// before the versions are known to agree, so a module of any version can answer it.
using EntryPoint = uint32_t (*)(uint32_t host_version, Backend** out);

}  // namespace kvsift::gpu::backend
