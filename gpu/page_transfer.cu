// DevicePageCache on CUDA (gpu/page_transfer.hpp has the contract and the two paths).
//
// Both kernels move 16-byte vectors; slot_bytes is a power of two, so a vector's page and offset
// are a shift and a mask. The mapped kernel reads host memory over PCIe: each CTA takes a
// contiguous range of the step's vectors, first fetches its few (host, device) slot pairs from the
// mapped move list into shared memory (one PCIe round trip), then streams its range with kUnroll
// loads in flight per thread before their stores, so that a wave of CTAs keeps megabytes of reads
// outstanding (PCIe at ~55 GB/s and ~1-2 us of latency needs only ~100 KB).
//
// Measured on the H200 (bench/bench_gpu_transfer.cpp; GB/s of page bytes, wall clock from ensure()
// to the stream's completion, against one pinned cudaMemcpyAsync of as many contiguous bytes):
//   8 KiB pages   8: mapped 4.3 (0.57 of copy), staged 2.5 | 512 (4 MiB): 35.2 (0.70), 18.6
//                 4096 (32 MiB): mapped 36.9 (0.67), staged 28.3 (0.52); copy 54.6
//   4 KiB pages 512 (2 MiB): 27.2 (0.59), 15.4 | 4096 (16 MiB): 29.6 (0.55), 22.2 (0.41)
// The mapped kernel sits near the ~35-40 GB/s that SM-driven reads of host memory reach
// (docs/platform-notes.md, Transfers: gathering pages); 4 KiB pages read slower than 8 KiB ones,
// and host memory madvised to 2 MiB pages and registered changed nothing (29.5 vs 30.1 GB/s at
// 16 MiB). Staging was DRAM-bound: 16 threads gather alone at 67 GB/s (49 with streaming stores,
// which keep the staging out of the cache), but gather and DMA together share the host's DRAM; one
// 32 MiB chunk instead of 4 MiB ones changed little (21.9 vs 22.4 GB/s before streaming stores).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "gpu/cuda_handles.cuh"
#include "gpu/cuda_result.cuh"
#include "gpu/page_transfer.hpp"

namespace kvsift::gpu {
namespace {

constexpr uint32_t kThreads = 256;
constexpr uint32_t kUnroll = 4;
// Slot pairs a mapped-gather CTA stages in shared memory; its range spans at most this many pages.
constexpr uint32_t kMaxCtaPages = 64;
// CTAs per multiprocessor the kernels aim for (8 x 256 threads fill an SM's 2048).
constexpr uint32_t kCtasPerSm = 8;

constexpr CudaErrors from_cuda{"page cache"};

__global__ void __launch_bounds__(kThreads)
    gather_mapped_kernel(const uint4* __restrict__ host, uint4* __restrict__ pool,
                         const uint2* moves, uint32_t n_pages, uint32_t vec_shift,
                         uint64_t vecs_per_cta) {
  __shared__ uint2 s_moves[kMaxCtaPages];
  const uint64_t total = uint64_t{n_pages} << vec_shift;
  const uint64_t begin = uint64_t{blockIdx.x} * vecs_per_cta;
  const uint64_t end = min(total, begin + vecs_per_cta);
  const uint32_t first = static_cast<uint32_t>(begin >> vec_shift);
  const uint32_t last = static_cast<uint32_t>((end - 1) >> vec_shift);
  for (uint32_t p = first + threadIdx.x; p <= last; p += kThreads) s_moves[p - first] = moves[p];
  __syncthreads();
  const uint64_t mask = (uint64_t{1} << vec_shift) - 1;
  for (uint64_t v0 = begin + threadIdx.x; v0 < end; v0 += kThreads * kUnroll) {
    uint4 r[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * kThreads;
      if (v < end)
        r[u] = host[(uint64_t{s_moves[(v >> vec_shift) - first].x} << vec_shift) | (v & mask)];
    }
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * kThreads;
      if (v < end)
        pool[(uint64_t{s_moves[(v >> vec_shift) - first].y} << vec_shift) | (v & mask)] = r[u];
    }
  }
}

// One staging chunk on the device: n_pages pages, then their device slots (n_pages uint32).
__global__ void __launch_bounds__(kThreads)
    scatter_kernel(const uint4* __restrict__ staging, uint4* __restrict__ pool, uint32_t n_pages,
                   uint32_t vec_shift) {
  const auto* slots = reinterpret_cast<const uint32_t*>(staging + (uint64_t{n_pages} << vec_shift));
  const uint32_t total = n_pages << vec_shift;
  const uint32_t mask = (1u << vec_shift) - 1;
  for (uint32_t v = blockIdx.x * kThreads + threadIdx.x; v < total; v += gridDim.x * kThreads)
    pool[(uint64_t{__ldg(slots + (v >> vec_shift))} << vec_shift) | (v & mask)] =
        __ldcs(staging + v);
}

}  // namespace

struct DevicePageCache::Device {
  // The events come first so that they go last: freeing pinned or device memory waits for the
  // work using it.
  Event chunk_free[PageCacheConfig::kStagingChunks];  // its copy and scatter are done
  Event moves_free;                                   // the last mapped kernel has read the list
  DeviceBuffer<void> pool;
  const void* host_pool_device = nullptr;  // the host pool's device view when it is mapped
  PinnedBuffer<unsigned char> staging_host[PageCacheConfig::kStagingChunks];
  DeviceBuffer<unsigned char> staging_device[PageCacheConfig::kStagingChunks];
  uint32_t next_chunk = 0;
  std::size_t chunk_pages = 0;
  PinnedBuffer<PageMove> moves_host;  // pinned, mapped: the mapped kernel's list [capacity]
  const void* moves_device = nullptr;
  uint32_t multiprocessors = 0;
  uint32_t vec_shift = 0;
};

DevicePageCache::DevicePageCache() = default;
DevicePageCache::~DevicePageCache() = default;
DevicePageCache::DevicePageCache(DevicePageCache&& other) noexcept = default;
DevicePageCache& DevicePageCache::operator=(DevicePageCache&& other) noexcept = default;

const void* DevicePageCache::device_pool() const noexcept {
  return device_ ? device_->pool.get() : nullptr;
}

Result DevicePageCache::init(const PageCacheConfig& config) {
  device_.reset();
  if (Result r = validate(config); !r.ok) return r;
  int n_devices = 0;
  if (Result r = device_count(&n_devices); !r.ok) return r;
  auto d = std::make_unique<Device>();
  int device = 0, sms = 0;
  if (Result r = from_cuda(cudaGetDevice(&device), "cudaGetDevice"); !r.ok) return r;
  if (Result r = from_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                           "multiprocessor count");
      !r.ok)
    return r;
  d->multiprocessors = static_cast<uint32_t>(sms);
  d->vec_shift = static_cast<uint32_t>(__builtin_ctzll(config.slot_bytes / 16));

  // Pinned (cudaHostAlloc, cudaHostRegister) memory reports its device view; pageable memory
  // reports none and takes the staged path only.
  cudaPointerAttributes attributes{};
  if (const cudaError_t err = cudaPointerGetAttributes(&attributes, config.host_pool);
      err != cudaSuccess)
    cudaGetLastError();
  else if (attributes.type == cudaMemoryTypeHost)
    d->host_pool_device = attributes.devicePointer;
  if (config.path == TransferPath::mapped && d->host_pool_device == nullptr)
    return from_cuda.invalid("path mapped needs host_pool in mapped pinned memory (pinned_alloc)");

  const std::size_t pool_bytes =
      (std::size_t{config.capacity} + config.reserved_slots) * config.slot_bytes;
  if (Result r = from_cuda(d->pool.allocate(pool_bytes), "device pool (cudaMalloc)"); !r.ok)
    return r;
  d->chunk_pages = config.staging_chunk_bytes / (config.slot_bytes + sizeof(uint32_t));
  const std::size_t chunk_bytes = d->chunk_pages * (config.slot_bytes + sizeof(uint32_t));
  for (uint32_t c = 0; c < PageCacheConfig::kStagingChunks; ++c) {
    if (Result r = from_cuda(d->staging_host[c].allocate(chunk_bytes, cudaHostAllocDefault),
                             "pinned staging (cudaHostAlloc)");
        !r.ok)
      return r;
    if (Result r =
            from_cuda(d->staging_device[c].allocate(chunk_bytes), "device staging (cudaMalloc)");
        !r.ok)
      return r;
    if (Result r = from_cuda(d->chunk_free[c].create(cudaEventDisableTiming), "event"); !r.ok)
      return r;
  }
  if (Result r = from_cuda(d->moves_host.allocate(std::size_t{config.capacity} * sizeof(PageMove),
                                                  cudaHostAllocMapped),
                           "move list (cudaHostAlloc)");
      !r.ok)
    return r;
  void* moves_device = nullptr;
  if (Result r = from_cuda(cudaHostGetDevicePointer(&moves_device, d->moves_host.get(), 0),
                           "move list view");
      !r.ok)
    return r;
  d->moves_device = moves_device;
  if (Result r = from_cuda(d->moves_free.create(cudaEventDisableTiming), "event"); !r.ok) return r;

  if (Result r = residency_.init(config.capacity, config.host_slots, config.policy); !r.ok)
    return r;
  config_ = config;
  device_ = std::move(d);
  last_ = {};
  totals_ = {};
  return Result{};
}

Result DevicePageCache::ensure(const uint32_t* host_slots, std::size_t n, uint32_t* device_slots,
                               void* stream, TransferPath path) noexcept {
  if (!device_) return from_cuda.invalid("ensure() before a successful init()");
  if (path == TransferPath::automatic) path = config_.path;
  if (path == TransferPath::mapped && device_->host_pool_device == nullptr)
    return from_cuda.invalid("path mapped needs host_pool in mapped pinned memory (pinned_alloc)");
  if (Result r = residency_.plan(host_slots, n, device_slots); !r.ok) return r;
  const StepCounts& counts = residency_.last_counts();
  const uint64_t bytes = counts.misses * config_.slot_bytes;
  if (path == TransferPath::automatic)
    path = bytes < config_.mapped_below_bytes && device_->host_pool_device != nullptr
               ? TransferPath::mapped
               : TransferPath::staged;
  if (counts.misses > 0) {
    Result r = path == TransferPath::mapped ? move_mapped(stream) : move_staged(stream);
    if (!r.ok) {
      residency_.forget_moves();
      return r;
    }
  }
  last_ = TransferStats{};
  last_.steps = 1;
  last_.requested = counts.requested;
  last_.hits = counts.hits;
  last_.misses = counts.misses;
  last_.evictions = counts.evictions;
  last_.bytes_moved = bytes;
  last_.staged_steps = counts.misses > 0 && path == TransferPath::staged;
  last_.mapped_steps = counts.misses > 0 && path == TransferPath::mapped;
  totals_.steps += 1;
  totals_.requested += last_.requested;
  totals_.hits += last_.hits;
  totals_.misses += last_.misses;
  totals_.evictions += last_.evictions;
  totals_.bytes_moved += last_.bytes_moved;
  totals_.staged_steps += last_.staged_steps;
  totals_.mapped_steps += last_.mapped_steps;
  return Result{};
}

Result DevicePageCache::move_staged(void* stream_ptr) noexcept {
  Device& d = *device_;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const std::vector<PageMove>& moves = residency_.moves();
  const std::size_t slot_bytes = config_.slot_bytes;
  for (std::size_t done = 0; done < moves.size();) {
    const std::size_t k = std::min(d.chunk_pages, moves.size() - done);
    const uint32_t c = d.next_chunk;
    d.next_chunk = (c + 1) % PageCacheConfig::kStagingChunks;
    // The chunk's previous copy (host staging) and scatter (device staging) must be done.
    if (Result r = from_cuda(cudaEventSynchronize(d.chunk_free[c].get()), "staging wait"); !r.ok)
      return r;
    gather_pages(config_.host_pool, slot_bytes, moves.data() + done, k, d.staging_host[c].get(),
                 config_.gather_threads);
    if (Result r = from_cuda(
            cudaMemcpyAsync(d.staging_device[c].get(), d.staging_host[c].get(),
                            k * (slot_bytes + sizeof(uint32_t)), cudaMemcpyHostToDevice, stream),
            "staged copy (cudaMemcpyAsync)");
        !r.ok)
      return r;
    const uint32_t vecs = static_cast<uint32_t>(k) << d.vec_shift;
    const uint32_t grid =
        std::min((vecs + kThreads - 1) / kThreads, d.multiprocessors * kCtasPerSm);
    scatter_kernel<<<grid, kThreads, 0, stream>>>(
        reinterpret_cast<const uint4*>(d.staging_device[c].get()),
        static_cast<uint4*>(d.pool.get()), static_cast<uint32_t>(k), d.vec_shift);
    if (Result r = from_cuda.launched("scatter launch"); !r.ok) return r;
    if (Result r = from_cuda(cudaEventRecord(d.chunk_free[c].get(), stream), "event"); !r.ok)
      return r;
    done += k;
  }
  return Result{};
}

Result DevicePageCache::move_mapped(void* stream_ptr) noexcept {
  Device& d = *device_;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const std::vector<PageMove>& moves = residency_.moves();
  // The list is read by the kernel over PCIe: the previous step's kernel must be done with it.
  if (Result r = from_cuda(cudaEventSynchronize(d.moves_free.get()), "move list wait"); !r.ok)
    return r;
  std::memcpy(d.moves_host.get(), moves.data(), moves.size() * sizeof(PageMove));
  const auto n_pages = static_cast<uint32_t>(moves.size());
  const uint64_t total = uint64_t{n_pages} << d.vec_shift;
  const uint64_t slot_vecs = uint64_t{1} << d.vec_shift;
  // One wave of CTAs when there is enough work, at least a block's worth of vectors each, and
  // few enough pages per CTA that its pairs fit in shared memory (a range of r vectors touches at
  // most r / slot_vecs + 2 pages).
  const uint64_t target = uint64_t{d.multiprocessors} * kCtasPerSm;
  uint64_t per_cta = std::max<uint64_t>((total + target - 1) / target, kThreads);
  per_cta = std::min(per_cta, (kMaxCtaPages - 2) * slot_vecs);
  const uint64_t grid = (total + per_cta - 1) / per_cta;
  gather_mapped_kernel<<<static_cast<uint32_t>(grid), kThreads, 0, stream>>>(
      static_cast<const uint4*>(d.host_pool_device), static_cast<uint4*>(d.pool.get()),
      static_cast<const uint2*>(d.moves_device), n_pages, d.vec_shift, per_cta);
  if (Result r = from_cuda.launched("mapped gather launch"); !r.ok) return r;
  return from_cuda(cudaEventRecord(d.moves_free.get(), stream), "event");
}

}  // namespace kvsift::gpu
