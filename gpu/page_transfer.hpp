// The transfer engine: a device page cache for one layer, and the per-step ensure() that makes the
// pages a selection names resident on the device, moving only the missing ones in coalesced
// transfers. Plain C++ (no CUDA types): the class keeps the residency bookkeeping and the
// statistics on the host and leaves the device pool and the moves to the CUDA backend
// (gpu/backend.hpp's PagePool, gpu/page_transfer.cu); where the backend is absent init() returns
// Result{unsupported} saying why. One DevicePageCache per layer: the model's step asks each layer's
// cache for that layer's pages, then hands device_pool() and the returned slots to
// SparseDecodeAttention. ensure() is plan() (the bookkeeping) then move() (the transfer), and a
// caller that has pages of its own to send again (the offload step's refreshes) sends them in
// move() with the misses, one transfer for both.
//
// Data layout: host and device slots are alike, slot_bytes each (K [page_tokens, head_dim] then V,
// lib/cache/geometry.hpp), so a page moves as one unit. The host pool is one contiguous region of
// host_slots slots (lib/cache/page_pool.hpp); the device pool is one allocation of capacity slots.
//
// Two ways to move a step's misses (both are one or a few operations per step, never one per page):
// - staged: OpenMP threads gather the missing pages into pinned staging, chunk by chunk; each
//   chunk (pages, then their device slots) goes host-to-device in one cudaMemcpyAsync on the copy
//   engine, and a scatter kernel puts its pages into their slots. The CPU gathers chunk c + 1 while
//   chunk c crosses PCIe. The host pool may be pageable.
// - mapped: one kernel reads the pages straight from the host pool over PCIe (16-byte loads of
//   mapped pinned memory) into their slots. No CPU work but writing the list of moves; needs the
//   pool allocated by pinned_alloc (cudaHostAllocMapped) or registered as mapped.
// TransferPath::automatic takes the mapped kernel for steps whose misses come to fewer than
// mapped_below_bytes, staging from there up. Measured on the H200 host
// (bench/bench_gpu_transfer.cpp, 8 to 4096 pages of 4 and 8 KiB, wall clock to completion), the
// mapped kernel was faster at every size: 0.55-0.71 of a plain pinned copy of the same bytes
// against staging's 0.32-0.52, because staging moves each byte through host DRAM three times
// (gather read, gather write, DMA read) and this 16-vCPU host runs out of DRAM bandwidth first. So
// the default threshold is unbounded: the staged path serves pageable pools, and hosts with more
// DRAM bandwidth where a measurement says staging wins past some size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/host_memory.hpp"
#include "gpu/page_residency.hpp"

namespace kvsift::gpu {

namespace backend {
class PagePool;
}

enum class TransferPath : uint8_t { automatic, staged, mapped };

const char* transfer_path_name(TransferPath path) noexcept;

struct PageCacheConfig {
  std::size_t slot_bytes = 0;  // bytes of one page: a multiple of 16
  uint32_t capacity = 0;       // device slots, 1..2^31 - 1
  // The device pool mirrors the host pool slot for slot (capacity == host_slots): device slot i
  // holds host slot i, so there is no residency to plan and nothing is evicted. plan() and
  // ensure() are refused; move() sends the caller's moves alone, each to its own slot
  // (device_slot == host_slot), no plan() first. For a device that holds the whole KV cache.
  bool mirror = false;
  // Device slots after the cache's capacity that it allocates in the same pool but never manages:
  // the caller's per-step staging (token rows the offload step attends besides pages), so that
  // one pool holds everything a kernel reads. capacity + reserved_slots <= 2^31.
  uint32_t reserved_slots = 0;
  const void* host_pool = nullptr;  // host_slots * slot_bytes bytes, 16-byte aligned
  uint64_t host_slots = 0;          // slots in the host pool; ids at or above are refused
  // CLOCK: on a LOCKS-like trace (2% of 128K tokens per KV head, drifting queries, sink and
  // window pages; bench/bench_gpu_transfer.cpp) LRU and CLOCK hit within 0.002 of each other at
  // every capacity from 1x to 4x a step's pages (0.960 vs 0.959 at 1.5x with slow drift, 0.813 vs
  // 0.811 with fast; Belady's optimum 0.974 and 0.880), and plan() cost alike (13-48 us per
  // 1,312-page step on the H200 host, neither always lower). CLOCK keeps one byte per slot and a
  // hit is one store, where LRU keeps two links and relinks on every hit.
  EvictionPolicy policy = EvictionPolicy::clock;
  TransferPath path = TransferPath::automatic;
  // automatic: steps whose misses come to fewer bytes take the mapped kernel (when the pool is
  // mapped), the rest staging. Unbounded by default: mapped won at every size measured (above).
  std::size_t mapped_below_bytes = SIZE_MAX;
  // staged: bytes per staging chunk (pages plus 4 bytes of slot id each), kStagingChunks of them
  // in pinned host memory and as many on the device. A few MiB reach the copy engine's plateau
  // (2 MiB 50 GB/s, 16 MiB 54 GB/s: docs/platform-notes.md, Transfers: host to device).
  std::size_t staging_chunk_bytes = std::size_t{4} << 20;
  static constexpr uint32_t kStagingChunks = 3;
  // staged: OpenMP threads of the gather; 0 takes OpenMP's default (OMP_NUM_THREADS, else every
  // core), which also selection wants: the caller decides how the cores are shared.
  uint32_t gather_threads = 0;
};

// One ensure(), or the sum of many (totals()). Pages are distinct pages of a step.
struct TransferStats {
  uint64_t steps = 0;
  uint64_t requested = 0;    // ids passed, duplicates counted
  uint64_t hits = 0;         // pages already resident: not sent again
  uint64_t misses = 0;       // pages moved host to device
  uint64_t evictions = 0;    // misses that replaced a resident page
  uint64_t bytes_moved = 0;  // misses * slot_bytes: page bytes over PCIe (staged also sends 4 bytes
                             // of slot id per page)
  uint64_t staged_steps = 0;  // steps whose moves took each path (steps with none take neither)
  uint64_t mapped_steps = 0;

  double hit_rate() const noexcept {
    return hits + misses == 0 ? 1.0
                              : static_cast<double>(hits) / static_cast<double>(hits + misses);
  }
};

// Owns the device pool, the staging buffers and the events on one device (the current device when
// init() ran). Use from one host thread at a time. ensure() enqueues on the caller's stream and
// returns once the CPU's part is done; work that reads the slots must follow on that stream (or
// wait for it). Evicted slots are overwritten by later ensure() calls on their stream, so readers
// on other streams must be ordered before the next ensure() by the caller. Movable, not copyable.
class DevicePageCache {
 public:
  DevicePageCache();
  ~DevicePageCache();
  DevicePageCache(DevicePageCache&& other) noexcept;
  DevicePageCache& operator=(DevicePageCache&& other) noexcept;
  DevicePageCache(const DevicePageCache&) = delete;
  DevicePageCache& operator=(const DevicePageCache&) = delete;

  // Checks the configuration (sizes, alignment, the pool pointer; mapped path: the pool is mapped
  // pinned memory) before allocating the device pool (capacity * slot_bytes), the staging chunks,
  // the move list and the events. Errors name the argument; no device: Result{unsupported}.
  Result init(const PageCacheConfig& config);

  // Makes the pages host_slots[0..n) resident and writes their device slots to device_slots[0..n)
  // (host memory, caller-owned). Only misses move; every page of the step is pinned, so none of
  // them is evicted by its own step. Refused with nothing changed: an id >= host_slots, more
  // distinct pages than the capacity, or the mapped path on an unmapped pool. path overrides the
  // configured path for this call (automatic: the configuration's). The staged path blocks until
  // its last chunk is gathered (and, for chunk reuse, until earlier chunks' copies are done); the
  // mapped path only enqueues. stream: a cudaStream_t, nullptr for the legacy default stream.
  Result ensure(const uint32_t* host_slots, std::size_t n, uint32_t* device_slots, void* stream,
                TransferPath path = TransferPath::automatic) noexcept;

  // ensure() in its two halves, so that a caller can send moves of its own with the step's misses
  // in the same operation (the offload step's refreshes: resident pages whose host copy changed;
  // one gather instead of two launches and two PCIe round trips).
  // plan(): the bookkeeping alone, refused as ensure() is; no device work. StepMode::same plans
  // another piece of the step the last plan() started (PageResidency::plan): a caller plans a step
  // in pieces and move()s each piece before it plans the next, so that the device gathers one
  // piece while the host plans the next; the pieces' moves share the step's move list.
  Result plan(const uint32_t* host_slots, std::size_t n, uint32_t* device_slots,
              StepMode mode = StepMode::next) noexcept;
  // move(): enqueues the last successful plan()'s misses, then extra[0..n_extra) (host memory,
  // read before the call returns), by one path, and records the step's statistics (bytes_moved
  // counts the misses only). Refused with nothing enqueued: a move() without a plan() of its own
  // (a second one for one plan()), an extra move outside the pools, more moves than the capacity,
  // the mapped path on an unmapped pool. A refused or failed move() ends its plan and forgets the
  // plan's misses (misses again at the next plan()). The statistics are the piece's when a step
  // comes in pieces.
  Result move(void* stream, const PageMove* extra = nullptr, std::size_t n_extra = 0,
              TransferPath path = TransferPath::automatic) noexcept;

  // Device memory: capacity + reserved_slots slots of slot_bytes; ensure()'s slots index it,
  // the reserved ones start at capacity().
  const void* device_pool() const noexcept;
  uint32_t capacity() const noexcept { return config_.capacity; }
  const PageCacheConfig& config() const noexcept { return config_; }
  const PageResidency& residency() const noexcept { return residency_; }
  const TransferStats& last_step() const noexcept { return last_; }
  const TransferStats& totals() const noexcept { return totals_; }
  // Forgets every resident page (PageResidency::clear), so that the next ensure() moves every page
  // it names: a benchmark's cold step. The device pool's bytes stay; later moves overwrite slots in
  // stream order, as after evictions. Allocates nothing.
  void clear() noexcept {
    residency_.clear();
    planned_ = false;
  }

 private:
  PageCacheConfig config_{};
  PageResidency residency_;                    // empty in a mirror
  std::unique_ptr<backend::PagePool> device_;  // set by a successful init()
  std::vector<PageMove> moves_;  // [capacity] a move()'s misses and extra moves, sent as one list
  bool planned_ = false;         // a plan() waits for its move()
  // Moves the step's earlier pieces sent: the next piece's list follows them in the mapped path's
  // list, which kernels of the step may still be reading.
  std::size_t step_moves_ = 0;
  TransferStats last_{}, totals_{};
};

// The checks init() makes before touching the device: slot_bytes, capacity, host_slots, the pool
// pointer and its alignment, the staging chunk (at least one page and its slot id), the path.
// Errors name the field.
Result validate(const PageCacheConfig& config);

// The CPU half of the staged path: copies slot_bytes from host_pool + moves[i].host_slot *
// slot_bytes to staging + i * slot_bytes for i < n, with `threads` OpenMP threads (0: OpenMP's
// default) when the bytes make it pay, and writes the moves' device slots after the pages
// (staging + n * slot_bytes, n uint32). Compiled into the host library and into the CUDA module,
// whose staged path calls it (gpu/page_gather.cpp).
void gather_pages(const void* host_pool, std::size_t slot_bytes, const PageMove* moves,
                  std::size_t n, void* staging, uint32_t threads = 0) noexcept;

}  // namespace kvsift::gpu
