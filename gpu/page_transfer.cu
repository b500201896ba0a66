// The device half of DevicePageCache on CUDA, the backend's PagePool (gpu/backend.hpp;
// gpu/page_transfer.hpp has the contract and the two paths).
//
// Both kernels move 16-byte vectors; a vector's page and offset are a quotient and a remainder by
// the slot's vector count (slots are not powers of two: a q8 slot of simd/page_layout.hpp holds
// its rows' scales after the codes). The division costs nothing next to PCIe. The mapped kernel
// reads host memory over PCIe: each CTA takes a contiguous range of the step's vectors, first
// fetches its few (host, device) slot pairs from the mapped move list into shared memory (one PCIe
// round trip), then streams its range with kUnroll loads in flight per thread before their stores,
// so that a wave of CTAs keeps megabytes of reads outstanding (PCIe at ~55 GB/s and ~1-2 us of
// latency needs only ~100 KB).
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
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "gpu/cuda_backend.cuh"
#include "gpu/cuda_handles.cuh"
#include "gpu/cuda_result.cuh"
#include "gpu/page_transfer.hpp"

namespace kvsift::gpu {
namespace {

constexpr uint32_t kThreads = 256;
constexpr uint32_t kWarps = kThreads / 32;
// 16-byte vectors a lane of the mapped gather has in flight: a warp reads 8 KiB per round trip,
// one whole f16 page (16 tokens x 128 channels, K and V) of Llama-3.1-8B's shape.
constexpr uint32_t kLaneVecs = 16;
// Moves a mapped-gather CTA stages in shared memory.
constexpr uint32_t kMaxCtaPages = 64;
// CTAs per multiprocessor the kernels aim for (8 x 256 threads fill an SM's 2048).
constexpr uint32_t kCtasPerSm = 8;

constexpr CudaErrors from_cuda{"page cache"};

// One warp per page: the CTA fetches its pages' moves from the mapped list into shared memory (one
// PCIe round trip), then each warp streams whole pages, kLaneVecs loads in flight per lane before
// their stores, with no per-vector division (a page's vectors are the warp's lanes and unrolled
// steps).
__global__ void __launch_bounds__(kThreads)
    gather_mapped_kernel(const uint4* __restrict__ host, uint4* __restrict__ pool,
                         const uint2* moves, uint32_t n_pages, uint32_t slot_vecs,
                         uint32_t pages_per_cta) {
  __shared__ uint2 s_moves[kMaxCtaPages];
  const uint32_t first = blockIdx.x * pages_per_cta;
  const uint32_t count = min(pages_per_cta, n_pages - first);
  for (uint32_t p = threadIdx.x; p < count; p += kThreads) s_moves[p] = moves[first + p];
  __syncthreads();
  const uint32_t lane = threadIdx.x % 32;
  for (uint32_t p = threadIdx.x / 32; p < count; p += kWarps) {
    const uint4* src = host + uint64_t{s_moves[p].x} * slot_vecs;
    uint4* dst = pool + uint64_t{s_moves[p].y} * slot_vecs;
    for (uint32_t v0 = lane; v0 < slot_vecs; v0 += 32 * kLaneVecs) {
      uint4 r[kLaneVecs];
#pragma unroll
      for (uint32_t u = 0; u < kLaneVecs; ++u)
        if (v0 + 32 * u < slot_vecs) r[u] = src[v0 + 32 * u];
#pragma unroll
      for (uint32_t u = 0; u < kLaneVecs; ++u)
        if (v0 + 32 * u < slot_vecs) dst[v0 + 32 * u] = r[u];
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
  Result move_mapped(const PageMove* moves, std::size_t n, void* stream) noexcept override;
  Result move_copies(const PageMove* moves, std::size_t n, void* stream) noexcept override;

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
  // The copies path's batch: a copy's destination, source and bytes (grown to the largest step).
  std::vector<void*> copy_dsts_;
  std::vector<const void*> copy_srcs_;
  std::vector<std::size_t> copy_sizes_;
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

Result PagePool::move_mapped(const PageMove* moves, std::size_t n, void* stream_ptr) noexcept {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  // The list is read by the kernel over PCIe: the previous step's kernel must be done with it.
  if (Result r = from_cuda(cudaEventSynchronize(moves_free_.get()), "move list wait"); !r.ok)
    return r;
  std::memcpy(moves_host_.get(), moves, n * sizeof(PageMove));
  const auto n_pages = static_cast<uint32_t>(n);
  // A warp per page; pages per CTA a multiple of the warps, more than one warp's worth each only
  // when there are more pages than a wave of CTAs has warps.
  const uint32_t wave_warps = multiprocessors_ * kCtasPerSm * kWarps;
  const uint32_t pages_per_cta =
      std::min(kMaxCtaPages, kWarps * ((n_pages + wave_warps - 1) / wave_warps));
  const uint32_t grid = (n_pages + pages_per_cta - 1) / pages_per_cta;
  gather_mapped_kernel<<<grid, kThreads, 0, stream>>>(
      static_cast<const uint4*>(host_pool_device_), static_cast<uint4*>(pool_.get()),
      static_cast<const uint2*>(moves_device_), n_pages, slot_vecs_, pages_per_cta);
  if (Result r = from_cuda.launched("mapped gather launch"); !r.ok) return r;
  return from_cuda(cudaEventRecord(moves_free_.get(), stream), "event");
}

Result PagePool::move_copies(const PageMove* moves, std::size_t n, void* stream_ptr) noexcept {
  const std::size_t slot_bytes = config_.slot_bytes;
  const auto* host = static_cast<const unsigned char*>(config_.host_pool);
  auto* device = static_cast<unsigned char*>(pool_.get());
  try {
    copy_dsts_.clear();
    copy_srcs_.clear();
    copy_sizes_.clear();
    for (std::size_t i = 0; i < n; ++i) {
      // A page adjacent to the previous one in both pools extends its copy (a mirror's new pages).
      if (i > 0 && moves[i].host_slot == moves[i - 1].host_slot + 1 &&
          moves[i].device_slot == moves[i - 1].device_slot + 1) {
        copy_sizes_.back() += slot_bytes;
        continue;
      }
      copy_dsts_.push_back(device + std::size_t{moves[i].device_slot} * slot_bytes);
      copy_srcs_.push_back(host + std::size_t{moves[i].host_slot} * slot_bytes);
      copy_sizes_.push_back(slot_bytes);
    }
  } catch (const std::bad_alloc&) {
    return Result::out_of_memory("page cache: the copies path's batch lists");
  }
  cudaMemcpyAttributes attributes{};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // the pool is written between steps
  std::size_t first_copy = 0;
  return from_cuda(cudaMemcpyBatchAsync(copy_dsts_.data(), copy_srcs_.data(), copy_sizes_.data(),
                                        copy_sizes_.size(), &attributes, &first_copy, 1,
                                        static_cast<cudaStream_t>(stream_ptr)),
                   "copies (cudaMemcpyBatchAsync)");
}

}  // namespace cuda
}  // namespace kvsift::gpu
