// Louver's filter pass on CUDA (gpu/louver_filter.hpp has the contract and the layouts).
//
// Two kernels per run, both over every item of the batch at once (grid y = item): the bounds (one
// thread per cluster: all subspaces, all heads of the item, q in shared memory) into a workspace,
// then the filter (one thread per indexed key: its S assignments, the summed bound per head, a
// warp ballot into the mask word). The bounds are materialised rather than recomputed per key
// because each cluster holds r keys: recomputing costs r times the FMAs and the center reads.
// The batch's parameters (item table, q, |q_s|, t) travel in one copy from pinned staging, and
// the masks, packed item after item, return in one copy into pinned memory (a copy costs a few
// microseconds of fixed overhead, so one per item would dominate a batch of small indexes); run()
// then waits on the stream.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/cuda_backend.cuh"
#include "gpu/cuda_handles.cuh"
#include "gpu/cuda_result.cuh"
#include "gpu/louver_filter.hpp"

namespace kvsift::gpu {
namespace {

constexpr uint32_t kThreads = 256;
constexpr uint32_t kMaxS = simd::kLouverMaxSubspaces;
constexpr uint32_t kMaxGroup = simd::kLouverMaxGroup;
constexpr uint32_t kMaxHeadDim = 256;

constexpr CudaErrors from_cuda{"louver filter"};

Result invalid(const std::string& message) {
  return from_cuda.invalid(message);
}

uint32_t round_up(uint64_t n, uint32_t to) {
  return static_cast<uint32_t>((n + to - 1) / to * to);
}

// One item of a run as the kernels read it, followed in the staging by its floats: q [group, d],
// q_norm [group, kMaxS], t [group].
struct ItemParams {
  const __half* centers;
  const float* radii;
  const uint32_t* assign;
  float* ub;       // [group][S][cluster_capacity]
  uint32_t* mask;  // [ceil(n_indexed / 32)]
  uint32_t n_clusters, n_indexed, cluster_capacity, key_capacity;
  uint32_t n_subspaces, group, head_dim, fused;
  uint32_t offset[kMaxS + 1];
};

// Floats of one item after its ItemParams, and the byte stride of one staged item.
uint32_t item_floats(const LouverFilterShape& shape) {
  return shape.max_group * (shape.head_dim + kMaxS + 1);
}
std::size_t item_stride(const LouverFilterShape& shape) {
  return (sizeof(ItemParams) + item_floats(shape) * sizeof(float) + 15) / 16 * 16;
}

// UB_s(c) for every subspace and head of the item, in the arithmetic of the index's CPU table
// (simd/louver_avx512.cpp, simd/louver_scalar.cpp: ball_bounds); the explicit _rn intrinsics
// keep nvcc from contracting or reordering.
__global__ void __launch_bounds__(kThreads)
    bounds_kernel(const unsigned char* __restrict__ staging, uint32_t stride) {
  __shared__ float q[kMaxGroup * kMaxHeadDim];
  const auto* base = staging + std::size_t{blockIdx.y} * stride;
  const ItemParams& p = *reinterpret_cast<const ItemParams*>(base);
  const uint32_t n_clusters = p.n_clusters;
  if (blockIdx.x * kThreads >= n_clusters) return;  // the whole block: no barrier below is missed
  const uint32_t group = p.group, d = p.head_dim, S = p.n_subspaces, cap = p.cluster_capacity;
  const float* floats = reinterpret_cast<const float*>(base + sizeof(ItemParams));
  for (uint32_t i = threadIdx.x; i < group * d; i += kThreads) q[i] = floats[i];
  const float* q_norm = floats + group * d;
  __syncthreads();
  const uint32_t c = blockIdx.x * kThreads + threadIdx.x;
  if (c >= n_clusters) return;
  for (uint32_t s = 0; s < S; ++s) {
    const uint32_t o = p.offset[s], w = p.offset[s + 1] - o;
    const __half* center = p.centers + std::size_t{cap} * o + std::size_t{c / 16} * w * 16 + c % 16;
    const float rho = p.radii[std::size_t{s} * cap + c];
    float a0[kMaxGroup], a1[kMaxGroup];
    if (p.fused) {
#pragma unroll
      for (uint32_t g = 0; g < kMaxGroup; ++g) {
        a0[g] = g < group ? __fmul_rn(q_norm[g * kMaxS + s], rho) : 0.0f;
        a1[g] = 0.0f;
      }
      for (uint32_t j = 0; j < w; ++j) {
        const float x = __half2float(center[j * 16]);
#pragma unroll
        for (uint32_t g = 0; g < kMaxGroup; ++g) {
          if (g >= group) break;
          const float qj = q[g * d + o + j];
          if (j & 1)
            a1[g] = __fmaf_rn(qj, x, a1[g]);
          else
            a0[g] = __fmaf_rn(qj, x, a0[g]);
        }
      }
#pragma unroll
      for (uint32_t g = 0; g < kMaxGroup; ++g)
        if (g < group) p.ub[(std::size_t{g} * S + s) * cap + c] = __fadd_rn(a0[g], a1[g]);
    } else {
#pragma unroll
      for (uint32_t g = 0; g < kMaxGroup; ++g) a0[g] = 0.0f;
      for (uint32_t j = 0; j < w; ++j) {
        const float x = __half2float(center[j * 16]);
#pragma unroll
        for (uint32_t g = 0; g < kMaxGroup; ++g) {
          if (g >= group) break;
          a0[g] = __fadd_rn(a0[g], __fmul_rn(q[g * d + o + j], x));
        }
      }
#pragma unroll
      for (uint32_t g = 0; g < kMaxGroup; ++g)
        if (g < group)
          p.ub[(std::size_t{g} * S + s) * cap + c] =
              __fadd_rn(a0[g], __fmul_rn(q_norm[g * kMaxS + s], rho));
    }
  }
}

// Key i is kept when, for some head g, sum_s ub[g][s][assign_s(i)] (added in subspace order from
// 0, as the CPU filter does) reaches t[g]. One ballot per warp writes one mask word.
__global__ void __launch_bounds__(kThreads)
    filter_kernel(const unsigned char* __restrict__ staging, uint32_t stride) {
  const auto* base = staging + std::size_t{blockIdx.y} * stride;
  const ItemParams& p = *reinterpret_cast<const ItemParams*>(base);
  const uint32_t n = p.n_indexed;
  if (blockIdx.x * kThreads >= n) return;  // whole blocks only: every warp below is full
  const uint32_t group = p.group, S = p.n_subspaces, cap = p.cluster_capacity;
  const float* t =
      reinterpret_cast<const float*>(base + sizeof(ItemParams)) + group * (p.head_dim + kMaxS);
  const uint32_t i = blockIdx.x * kThreads + threadIdx.x;
  bool keep = false;
  if (i < n) {
    for (uint32_t g = 0; g < group && !keep; ++g) {
      const float* ub = p.ub + std::size_t{g} * S * cap;
      float sum = 0.0f;
      for (uint32_t s = 0; s < S; ++s)
        sum = __fadd_rn(sum,
                        ub[std::size_t{s} * cap + p.assign[std::size_t{s} * p.key_capacity + i]]);
      keep = sum >= t[g];
    }
  }
  const uint32_t word = __ballot_sync(0xffffffffu, keep);
  if (threadIdx.x % 32 == 0 && i < n) p.mask[i / 32] = word;
}

struct Slot {
  bool live = false;
  uint32_t n_subspaces = 0, head_dim = 0;
  uint32_t offset[kMaxS + 1] = {};
  simd::Level isa = simd::Level::scalar;
  uint32_t n_clusters = 0, n_indexed = 0;  // uploaded so far
  uint32_t cluster_capacity = 0, key_capacity = 0;
  DeviceBuffer<__half> centers;
  DeviceBuffer<float> radii;
  DeviceBuffer<uint32_t> assign;

  void free_device() noexcept {
    centers.reset();
    radii.reset();
    assign.reset();
    cluster_capacity = key_capacity = n_clusters = n_indexed = 0;
  }
};

}  // namespace

namespace cuda {

// The backend's LouverFilter (gpu/backend.hpp).
class LouverFilter final : public backend::LouverFilter {
 public:
  Result init(int device, const LouverFilterShape& shape) override;
  Result sync(uint32_t slot, const LouverIndexView& view) override;
  void release(uint32_t slot) noexcept override;
  Result validate(const LouverFilterItem* items, uint32_t n_items) const override;
  Result run(const LouverFilterItem* items, uint32_t n_items) noexcept override;
  const uint32_t* mask(uint32_t item) const noexcept override;
  uint32_t mask_keys(uint32_t item) const noexcept override;
  const LouverFilterShape& shape() const noexcept override { return shape_; }
  uint64_t device_bytes() const noexcept override;
  float last_run_ms() const noexcept override;

 private:
  struct Device;
  std::unique_ptr<Device> device_;
  LouverFilterShape shape_{};
};

std::unique_ptr<backend::LouverFilter> make_louver_filter() {
  return std::make_unique<LouverFilter>();
}

// Members go in reverse: the slots' and the workspace's memory, then the events and the stream.
struct LouverFilter::Device {
  int device = 0;
  Stream stream;
  Event start, stop;
  PinnedBuffer<unsigned char> staging_host;    // [max_items] x item_stride
  DeviceBuffer<unsigned char> staging_device;  // the same on the device
  // Workspace shared by the slots, per item: bounds and masks.
  std::size_t ub_stride = 0;    // floats per item
  std::size_t mask_stride = 0;  // words per item
  DeviceBuffer<float> ub;
  DeviceBuffer<uint32_t> mask_device;
  PinnedBuffer<uint32_t> mask_host;
  std::vector<Slot> slots;
  std::vector<uint32_t> item_keys;   // n_indexed per item of the last run
  std::vector<std::size_t> item_at;  // first mask word per item of the last run
  std::vector<uint64_t> stamp;       // per slot: the validate() call that last saw it
  uint64_t validations = 0;
};

Result LouverFilter::init(int device, const LouverFilterShape& shape) {
  if (shape.head_dim == 0 || shape.head_dim % 16 != 0 || shape.head_dim > kMaxHeadDim)
    return invalid("head_dim=" + std::to_string(shape.head_dim) +
                   " is not a multiple of 16 in 16..256");
  if (shape.max_group == 0 || shape.max_group > kMaxGroup)
    return invalid("max_group=" + std::to_string(shape.max_group) + " is not in 1..16");
  if (shape.max_items == 0 || shape.max_items > 65535)
    return invalid("max_items=" + std::to_string(shape.max_items) + " is not in 1..65535");
  // The ordinal is checked against the count first: cudaSetDevice with a bad one is an API
  // error a sanitizer reports, and the message here is clearer.
  if (device < 0) return invalid("device=" + std::to_string(device) + " is negative");
  int n_devices = 0;
  if (Result r = device_count(&n_devices); !r.ok) return r;
  if (device >= n_devices)
    return invalid("device=" + std::to_string(device) + " is not in 0.." +
                   std::to_string(n_devices - 1));
  device_.reset();
  Result r = from_cuda(cudaSetDevice(device), "cudaSetDevice");
  if (!r.ok) return r;
  auto d = std::make_unique<Device>();
  d->device = device;
  const std::size_t staging = shape.max_items * item_stride(shape);
  r = from_cuda(d->stream.create(cudaStreamNonBlocking), "stream");
  if (r.ok) r = from_cuda(d->start.create(), "event");
  if (r.ok) r = from_cuda(d->stop.create(), "event");
  if (r.ok)
    r = from_cuda(d->staging_host.allocate(staging, cudaHostAllocPortable), "pinned staging");
  if (r.ok) r = from_cuda(d->staging_device.allocate(staging), "device staging");
  if (!r.ok) return r;
  d->item_keys.resize(shape.max_items);
  d->item_at.resize(shape.max_items);
  device_ = std::move(d);
  shape_ = shape;
  return r;
}

Result LouverFilter::sync(uint32_t slot, const LouverIndexView& view) {
  if (!device_) return invalid("sync before init");
  const uint32_t S = view.n_subspaces;
  if (view.head_dim != shape_.head_dim)
    return invalid("the index's head_dim=" + std::to_string(view.head_dim) +
                   " is not the shape's " + std::to_string(shape_.head_dim));
  if (S == 0 || S > kMaxS) return invalid("n_subspaces=" + std::to_string(S) + " is not in 1..32");
  if (view.offset[0] != 0 || view.offset[S] != view.head_dim)
    return invalid("subspace offsets do not cover head_dim");
  for (uint32_t s = 0; s < S; ++s)
    if (view.offset[s + 1] <= view.offset[s]) return invalid("subspace offsets are not increasing");
  if (view.isa != simd::Level::avx512 && view.isa != simd::Level::scalar)
    return invalid("isa is neither avx512 nor scalar");
  for (uint32_t s = 0; s < S; ++s)
    if ((view.n_clusters > 0 && (!view.centers[s] || !view.radii[s])) ||
        (view.n_indexed > 0 && !view.assignments[s]))
      return invalid("a null array in subspace " + std::to_string(s));
  Device& dev = *device_;
  if (slot >= dev.slots.size()) {
    dev.slots.resize(std::size_t{slot} + 1);
    dev.stamp.resize(dev.slots.size());
  }
  Slot& sl = dev.slots[slot];
  if (sl.live) {
    const bool same = sl.n_subspaces == S && sl.isa == view.isa &&
                      std::equal(view.offset, view.offset + S + 1, sl.offset);
    if (!same)
      return invalid("slot " + std::to_string(slot) + " held an index of another geometry");
    if (view.n_clusters < sl.n_clusters || view.n_indexed < sl.n_indexed)
      return invalid("slot " + std::to_string(slot) + " held a larger index (release it first)");
  }
  // The new assignments must name existing clusters: the device gathers by them.
  const uint32_t first_key = sl.live ? sl.n_indexed : 0;
  for (uint32_t s = 0; s < S; ++s)
    for (uint32_t i = first_key; i < view.n_indexed; ++i)
      if (view.assignments[s][i] >= view.n_clusters)
        return invalid("key " + std::to_string(i) + " is assigned to cluster " +
                       std::to_string(view.assignments[s][i]) + " of " +
                       std::to_string(view.n_clusters));
  Result r = from_cuda(cudaSetDevice(dev.device), "cudaSetDevice");
  if (!r.ok) return r;
  if (!sl.live || view.n_clusters > sl.cluster_capacity || view.n_indexed > sl.key_capacity) {
    // A quarter of headroom: a flush adds buffer_keys / r clusters, so reallocations (and the
    // full upload they bring) come every quarter of growth of the context.
    const uint32_t clusters = round_up(view.n_clusters + view.n_clusters / 4 + 64, 16);
    const uint32_t keys = round_up(uint64_t{view.n_indexed} + view.n_indexed / 4 + 256, 32);
    sl.free_device();
    r = from_cuda(sl.centers.allocate(std::size_t{clusters} * view.head_dim * 2), "centers");
    if (r.ok) r = from_cuda(sl.radii.allocate(std::size_t{clusters} * S * 4), "radii");
    if (r.ok) r = from_cuda(sl.assign.allocate(std::size_t{keys} * S * 4), "assignments");
    if (!r.ok) {
      sl.free_device();
      sl.live = false;
      return r;
    }
    sl.cluster_capacity = clusters;
    sl.key_capacity = keys;
    sl.live = true;
    sl.n_subspaces = S;
    sl.head_dim = view.head_dim;
    sl.isa = view.isa;
    std::copy(view.offset, view.offset + S + 1, sl.offset);
  }
  // The workspace, sized to the largest slot for any item of a run.
  const std::size_t ub_stride = std::size_t{shape_.max_group} * S * sl.cluster_capacity;
  const std::size_t mask_stride = sl.key_capacity / 32;
  if (ub_stride > dev.ub_stride) {
    dev.ub.reset();
    dev.ub_stride = 0;
    r = from_cuda(dev.ub.allocate(ub_stride * shape_.max_items * 4), "bounds workspace");
    if (!r.ok) return r;
    dev.ub_stride = ub_stride;
  }
  if (mask_stride > dev.mask_stride) {
    dev.mask_device.reset();
    dev.mask_host.reset();
    dev.mask_stride = 0;
    const std::size_t bytes = mask_stride * shape_.max_items * 4;
    r = from_cuda(dev.mask_device.allocate(bytes), "mask workspace");
    if (r.ok) r = from_cuda(dev.mask_host.allocate(bytes, cudaHostAllocPortable), "pinned masks");
    if (!r.ok) return r;
    dev.mask_stride = mask_stride;
  }
  // Only what the index added since the slot's last sync: the clusters from the block holding the
  // first new one (a block is 16 clusters and is rewritten whole) and the new assignments.
  const uint32_t block0 = sl.n_clusters / 16, block1 = (view.n_clusters + 15) / 16;
  for (uint32_t s = 0; s < S && r.ok; ++s) {
    const uint32_t w = sl.offset[s + 1] - sl.offset[s];
    if (block1 > block0)
      r = from_cuda(
          cudaMemcpyAsync(sl.centers.get() + std::size_t{sl.cluster_capacity} * sl.offset[s] +
                              std::size_t{block0} * w * 16,
                          view.centers[s] + std::size_t{block0} * w * 16,
                          std::size_t{block1 - block0} * w * 16 * 2, cudaMemcpyHostToDevice,
                          dev.stream.get()),
          "centers upload");
    if (r.ok && view.n_clusters > sl.n_clusters)
      r = from_cuda(
          cudaMemcpyAsync(sl.radii.get() + std::size_t{s} * sl.cluster_capacity + sl.n_clusters,
                          view.radii[s] + sl.n_clusters,
                          std::size_t{view.n_clusters - sl.n_clusters} * 4, cudaMemcpyHostToDevice,
                          dev.stream.get()),
          "radii upload");
    if (r.ok && view.n_indexed > sl.n_indexed)
      r = from_cuda(
          cudaMemcpyAsync(sl.assign.get() + std::size_t{s} * sl.key_capacity + sl.n_indexed,
                          view.assignments[s] + sl.n_indexed,
                          std::size_t{view.n_indexed - sl.n_indexed} * 4, cudaMemcpyHostToDevice,
                          dev.stream.get()),
          "assignments upload");
  }
  if (r.ok) r = from_cuda(cudaStreamSynchronize(dev.stream.get()), "upload");
  if (!r.ok) {
    sl.free_device();
    sl.live = false;
    return r;
  }
  sl.n_clusters = view.n_clusters;
  sl.n_indexed = view.n_indexed;
  return r;
}

void LouverFilter::release(uint32_t slot) noexcept {
  if (!device_ || slot >= device_->slots.size() || !device_->slots[slot].live) return;
  device_->slots[slot].free_device();
  device_->slots[slot].live = false;
}

Result LouverFilter::validate(const LouverFilterItem* items, uint32_t n_items) const {
  if (!device_) return invalid("run before init");
  if (n_items == 0 || n_items > shape_.max_items)
    return invalid(std::to_string(n_items) +
                   " items is not in 1..max_items=" + std::to_string(shape_.max_items));
  Device& dev = *device_;
  const uint64_t stamp = ++dev.validations;
  for (uint32_t i = 0; i < n_items; ++i) {
    const LouverFilterItem& item = items[i];
    // The message is built only on failure: select() validates every step.
    const auto which = [i] { return "item " + std::to_string(i) + ": "; };
    if (item.slot >= dev.slots.size() || !dev.slots[item.slot].live)
      return invalid(which() + "slot " + std::to_string(item.slot) + " was never synced");
    if (dev.stamp[item.slot] == stamp)
      return invalid(which() + "slot " + std::to_string(item.slot) + " appears twice");
    dev.stamp[item.slot] = stamp;
    if (item.group == 0 || item.group > shape_.max_group)
      return invalid(which() + "group=" + std::to_string(item.group) +
                     " is not in 1..max_group=" + std::to_string(shape_.max_group));
    if (!item.q || !item.q_norm || !item.t) return invalid(which() + "a null pointer");
    // A workspace that failed to grow in sync() leaves the slot usable only within the old one.
    const Slot& sl = dev.slots[item.slot];
    if (std::size_t{shape_.max_group} * sl.n_subspaces * sl.cluster_capacity > dev.ub_stride ||
        sl.key_capacity / 32 > dev.mask_stride)
      return invalid(which() + "the workspace for slot " + std::to_string(item.slot) +
                     " could not be allocated");
  }
  return Result{};
}

Result LouverFilter::run(const LouverFilterItem* items, uint32_t n_items) noexcept {
  Device& dev = *device_;
  const std::size_t stride = item_stride(shape_);
  const uint32_t d = shape_.head_dim;
  uint32_t cluster_blocks = 0, key_blocks = 0;
  std::size_t words = 0;
  for (uint32_t i = 0; i < n_items; ++i) {
    const LouverFilterItem& item = items[i];
    const Slot& sl = dev.slots[item.slot];
    unsigned char* base = dev.staging_host.get() + i * stride;
    ItemParams p{};
    p.centers = sl.centers.get();
    p.radii = sl.radii.get();
    p.assign = sl.assign.get();
    p.ub = dev.ub.get() + i * dev.ub_stride;
    p.mask = dev.mask_device.get() + words;
    p.n_clusters = sl.n_clusters;
    p.n_indexed = sl.n_indexed;
    p.cluster_capacity = sl.cluster_capacity;
    p.key_capacity = sl.key_capacity;
    p.n_subspaces = sl.n_subspaces;
    p.group = item.group;
    p.head_dim = d;
    p.fused = sl.isa == simd::Level::avx512;
    std::copy(sl.offset, sl.offset + kMaxS + 1, p.offset);
    std::memcpy(base, &p, sizeof(p));
    auto* floats = reinterpret_cast<float*>(base + sizeof(ItemParams));
    std::memcpy(floats, item.q, std::size_t{item.group} * d * 4);
    std::memcpy(floats + item.group * d, item.q_norm, std::size_t{item.group} * kMaxS * 4);
    std::memcpy(floats + item.group * (d + kMaxS), item.t, std::size_t{item.group} * 4);
    cluster_blocks = std::max(cluster_blocks, (sl.n_clusters + kThreads - 1) / kThreads);
    key_blocks = std::max(key_blocks, (sl.n_indexed + kThreads - 1) / kThreads);
    dev.item_keys[i] = sl.n_indexed;
    dev.item_at[i] = words;
    words += (sl.n_indexed + 31) / 32;
  }
  const uint32_t n = n_items;
  Result r = from_cuda(cudaSetDevice(dev.device), "cudaSetDevice");
  const cudaStream_t stream = dev.stream.get();
  if (r.ok) r = from_cuda(cudaEventRecord(dev.start.get(), stream), "event");
  if (r.ok)
    r = from_cuda(cudaMemcpyAsync(dev.staging_device.get(), dev.staging_host.get(), n * stride,
                                  cudaMemcpyHostToDevice, stream),
                  "batch upload");
  if (r.ok && cluster_blocks > 0) {
    bounds_kernel<<<dim3(cluster_blocks, n), kThreads, 0, stream>>>(dev.staging_device.get(),
                                                                    static_cast<uint32_t>(stride));
    r = from_cuda.launched("bounds launch");
  }
  if (r.ok && key_blocks > 0) {
    filter_kernel<<<dim3(key_blocks, n), kThreads, 0, stream>>>(dev.staging_device.get(),
                                                                static_cast<uint32_t>(stride));
    r = from_cuda.launched("filter launch");
  }
  if (r.ok && words > 0)
    r = from_cuda(cudaMemcpyAsync(dev.mask_host.get(), dev.mask_device.get(), words * 4,
                                  cudaMemcpyDeviceToHost, stream),
                  "mask download");
  if (r.ok) r = from_cuda(cudaEventRecord(dev.stop.get(), stream), "event");
  if (r.ok) r = from_cuda(cudaStreamSynchronize(stream), "run");
  return r;
}

const uint32_t* LouverFilter::mask(uint32_t item) const noexcept {
  return device_->mask_host.get() + device_->item_at[item];
}

uint32_t LouverFilter::mask_keys(uint32_t item) const noexcept {
  return device_->item_keys[item];
}

uint64_t LouverFilter::device_bytes() const noexcept {
  if (!device_) return 0;
  uint64_t bytes = 0;
  for (const Slot& s : device_->slots)
    if (s.live)
      bytes += uint64_t{s.cluster_capacity} * (s.head_dim * 2 + s.n_subspaces * 4) +
               uint64_t{s.key_capacity} * s.n_subspaces * 4;
  return bytes;
}

float LouverFilter::last_run_ms() const noexcept {
  float ms = 0.0f;
  if (!device_ ||
      cudaEventElapsedTime(&ms, device_->start.get(), device_->stop.get()) != cudaSuccess) {
    cudaGetLastError();
    return 0.0f;
  }
  return ms;
}

}  // namespace cuda
}  // namespace kvsift::gpu
