// The device half of DevicePageCache on CUDA, the backend's PagePool (gpu/backend.hpp;
// gpu/page_transfer.hpp has the contract and the two paths).
//
// Both kernels move 16-byte vectors; a vector's page and offset are a quotient and a remainder by
// the slot's vector count (slots are not powers of two: a q8 slot of simd/page_layout.hpp holds
// its rows' scales after the codes). The division costs nothing next to PCIe (measured below).
// The mapped kernel reads host memory over PCIe: each CTA takes a contiguous range of the step's
// vectors, first fetches its few (host, device) slot pairs from the mapped move list into shared
// memory (one PCIe round trip), then streams its range with kUnroll
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
//
// Tried and measured on the H200 (same benchmark, medians of 5 in one process, 8 KiB pages,
// 512 / 4096 pages a step; a plain copy of as many bytes 49.5 / 54.7 GB/s), then left out:
// - A warp per page (the CTA's moves in shared memory, 16 loads in flight per lane, no division):
//   38.4 / 43.3 GB/s against this kernel's 40.4 / 44.2: the division is not what limits it.
// - The copy engines, one cudaMemcpyBatchAsync of a copy per page: 3.0 / 3.7 GB/s (0.07 of a
//   copy); on the decode-like trace 860 us a step against 91. Per-copy cost, not the link.
// - Host pools of 48 GiB, a KV cache's size (BM_gpu_transfer_pool): 40.3 GB/s against 44.8 from
//   1 GiB; the same region in transparent huge pages (madvise, then cudaHostRegister) read at
//   41.8, within the spread, so the pool stays cudaHostAlloc'd.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "gpu/cuda_backend.cuh"
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
                         const uint2* moves, uint32_t n_pages, uint32_t slot_vecs,
                         uint64_t vecs_per_cta) {
  __shared__ uint2 s_moves[kMaxCtaPages];
  const uint64_t total = uint64_t{n_pages} * slot_vecs;
  const uint64_t begin = uint64_t{blockIdx.x} * vecs_per_cta;
  const uint64_t end = min(total, begin + vecs_per_cta);
  const uint32_t first = static_cast<uint32_t>(begin / slot_vecs);
  const uint32_t last = static_cast<uint32_t>((end - 1) / slot_vecs);
  for (uint32_t p = first + threadIdx.x; p <= last; p += kThreads) s_moves[p - first] = moves[p];
  __syncthreads();
  for (uint64_t v0 = begin + threadIdx.x; v0 < end; v0 += kThreads * kUnroll) {
    uint4 r[kUnroll];
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * kThreads;
      if (v < end)
        r[u] = host[uint64_t{s_moves[v / slot_vecs - first].x} * slot_vecs + v % slot_vecs];
    }
#pragma unroll
    for (uint32_t u = 0; u < kUnroll; ++u) {
      const uint64_t v = v0 + u * kThreads;
      if (v < end)
        pool[uint64_t{s_moves[v / slot_vecs - first].y} * slot_vecs + v % slot_vecs] = r[u];
    }
  }
}

// One staging chunk on the device: n_pages pages, then their device slots (n_pages uint32).
__global__ void __launch_bounds__(kThreads)
    scatter_kernel(const uint4* __restrict__ staging, uint4* __restrict__ pool, uint32_t n_pages,
                   uint32_t slot_vecs) {
  const auto* slots = reinterpret_cast<const uint32_t*>(staging + uint64_t{n_pages} * slot_vecs);
  const uint32_t total = n_pages * slot_vecs;
  for (uint32_t v = blockIdx.x * kThreads + threadIdx.x; v < total; v += gridDim.x * kThreads)
    pool[uint64_t{__ldg(slots + v / slot_vecs)} * slot_vecs + v % slot_vecs] = __ldcs(staging + v);
}

}  // namespace

namespace cuda {

class PagePool final : public backend::PagePool {
 public:
  Result init(const PageCacheConfig& config) override;
  const void* device_pool() const noexcept override { return pool_.get(); }
  bool host_pool_mapped() const noexcept override { return host_pool_device_ != nullptr; }
  Result move_staged(const PageMove* moves, std::size_t n, void* stream) noexcept override;
  Result move_mapped(const PageMove* moves, std::size_t n, std::size_t list_offset,
                     void* stream) noexcept override;

 private:
  // The events come first so that they go last: freeing pinned or device memory waits for the
  // work using it.
  Event chunk_free_[PageCacheConfig::kStagingChunks];  // its copy and scatter are done
  Event moves_free_;                                   // the last mapped kernel has read the list
  DeviceBuffer<void> pool_;
  const void* host_pool_device_ = nullptr;  // the host pool's device view when it is mapped
  PinnedBuffer<unsigned char> staging_host_[PageCacheConfig::kStagingChunks];
  DeviceBuffer<unsigned char> staging_device_[PageCacheConfig::kStagingChunks];
  uint32_t next_chunk_ = 0;
  std::size_t chunk_pages_ = 0;
  PinnedBuffer<PageMove> moves_host_;  // pinned, mapped: the mapped kernel's list [capacity]
  const void* moves_device_ = nullptr;
  uint32_t multiprocessors_ = 0;
  uint32_t slot_vecs_ = 0;  // 16-byte vectors of a slot
  PageCacheConfig config_{};
};

std::unique_ptr<backend::PagePool> make_page_pool() {
  return std::make_unique<PagePool>();
}

// Called once, on a new object: the facade makes a PagePool per init() and keeps it only when
// this succeede
Result PagePool::init(const PageCacheConfig& config) {
  int n_devices = 0;
  if (Result r = device_count(&n_devices); !r.ok) return r;
  int device = 0, sms = 0;
  if (Result r = from_cuda(cudaGetDevice(&device), "cudaGetDevice"); !r.ok) return r;
  if (Result r = from_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
                           "multiprocessor count");
      !r.ok)
    return r;
  multiprocessors_ = static_cast<uint32_t>(sms);
  slot_vecs_ = static_cast<uint32_t>(config.slot_bytes / 16);

  // Pinned (cudaHostAlloc, cudaHostRegister) memory reports its device view; pageable memory
  // reports none and takes the staged path only.
  cudaPointerAttributes attributes{};
  if (const cudaError_t err = cudaPointerGetAttributes(&attributes, config.host_pool);
      err != cudaSuccess)
    cudaGetLastError();
  else if (attributes.type == cudaMemoryTypeHost)
    host_pool_device_ = attributes.devicePointer;
  if (config.path == TransferPath::mapped && host_pool_device_ == nullptr)
    return from_cuda.invalid("path mapped needs host_pool in mapped pinned memory (pinned_alloc)");

  const std::size_t pool_bytes =
      (std::size_t{config.capacity} + config.reserved_slots) * config.slot_bytes;
  if (Result r = from_cuda(pool_.allocate(pool_bytes), "device pool (cudaMalloc)"); !r.ok) return r;
  chunk_pages_ = config.staging_chunk_bytes / (config.slot_bytes + sizeof(uint32_t));
  const std::size_t chunk_bytes = chunk_pages_ * (config.slot_bytes + sizeof(uint32_t));
  for (uint32_t c = 0; c < PageCacheConfig::kStagingChunks; ++c) {
    if (Result r = from_cuda(staging_host_[c].allocate(chunk_bytes, cudaHostAllocDefault),
                             "pinned staging (cudaHostAlloc)");
        !r.ok)
      return r;
    if (Result r =
            from_cuda(staging_device_[c].allocate(chunk_bytes), "device staging (cudaMalloc)");
        !r.ok)
      return r;
    if (Result r = from_cuda(chunk_free_[c].create(cudaEventDisableTiming), "event"); !r.ok)
      return r;
  }
  if (Result r = from_cuda(moves_host_.allocate(std::size_t{config.capacity} * sizeof(PageMove),
                                                cudaHostAllocMapped),
                           "move list (cudaHostAlloc)");
      !r.ok)
    return r;
  void* moves_device = nullptr;
  if (Result r = from_cuda(cudaHostGetDevicePointer(&moves_device, moves_host_.get(), 0),
                           "move list view");
      !r.ok)
    return r;
  moves_device_ = moves_device;
  if (Result r = from_cuda(moves_free_.create(cudaEventDisableTiming), "event"); !r.ok) return r;
  config_ = config;
  return Result{};
}

Result PagePool::move_staged(const PageMove* moves, std::size_t n, void* stream_ptr) noexcept {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const std::size_t slot_bytes = config_.slot_bytes;
  for (std::size_t done = 0; done < n;) {
    const std::size_t k = std::min(chunk_pages_, n - done);
    const uint32_t c = next_chunk_;
    next_chunk_ = (c + 1) % PageCacheConfig::kStagingChunks;
    // The chunk's previous copy (host staging) and scatter (device staging) must be done.
    if (Result r = from_cuda(cudaEventSynchronize(chunk_free_[c].get()), "staging wait"); !r.ok)
      return r;
    gather_pages(config_.host_pool, slot_bytes, moves + done, k, staging_host_[c].get(),
                 config_.gather_threads);
    if (Result r = from_cuda(
            cudaMemcpyAsync(staging_device_[c].get(), staging_host_[c].get(),
                            k * (slot_bytes + sizeof(uint32_t)), cudaMemcpyHostToDevice, stream),
            "staged copy (cudaMemcpyAsync)");
        !r.ok)
      return r;
    const uint32_t vecs = static_cast<uint32_t>(k) * slot_vecs_;
    const uint32_t grid = std::min((vecs + kThreads - 1) / kThreads, multiprocessors_ * kCtasPerSm);
    scatter_kernel<<<grid, kThreads, 0, stream>>>(
        reinterpret_cast<const uint4*>(staging_device_[c].get()), static_cast<uint4*>(pool_.get()),
        static_cast<uint32_t>(k), slot_vecs_);
    if (Result r = from_cuda.launched("scatter launch"); !r.ok) return r;
    if (Result r = from_cuda(cudaEventRecord(chunk_free_[c].get(), stream), "event"); !r.ok)
      return r;
    done += k;
  }
  return Result{};
}

Result PagePool::move_mapped(const PageMove* moves, std::size_t n, std::size_t list_offset,
                             void* stream_ptr) noexcept {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  // The list is read by the kernel over PCIe: the previous step's kernels must be done with it
  // before its start is rewritten. A later piece of the same step writes behind the entries the
  // step's running kernels read, so it waits for nothing (the host plans it while they gather).
  if (list_offset == 0)
    if (Result r = from_cuda(cudaEventSynchronize(moves_free_.get()), "move list wait"); !r.ok)
      return r;
  PageMove* list = moves_host_.get() + list_offset;
  std::memcpy(list, moves, n * sizeof(PageMove));
  const auto n_pages = static_cast<uint32_t>(n);
  const uint64_t total = uint64_t{n_pages} * slot_vecs_;
  const uint64_t slot_vecs = slot_vecs_;
  // One wave of CTAs when there is enough work, at least a block's worth of vectors each, and
  // few enough pages per CTA that its pairs fit in shared memory (a range of r vectors touches at
  // most r / slot_vecs + 2 pages).
  const uint64_t target = uint64_t{multiprocessors_} * kCtasPerSm;
  uint64_t per_cta = std::max<uint64_t>((total + target - 1) / target, kThreads);
  per_cta = std::min(per_cta, (kMaxCtaPages - 2) * slot_vecs);
  const uint64_t grid = (total + per_cta - 1) / per_cta;
  gather_mapped_kernel<<<static_cast<uint32_t>(grid), kThreads, 0, stream>>>(
      static_cast<const uint4*>(host_pool_device_), static_cast<uint4*>(pool_.get()),
      static_cast<const uint2*>(moves_device_) + list_offset, n_pages, slot_vecs_, per_cta);
  if (Result r = from_cuda.launched("mapped gather launch"); !r.ok) return r;
  return from_cuda(cudaEventRecord(moves_free_.get(), stream), "event");
}

}  // namespace cuda
}  // namespace kvsift::gpu
