// Louver's filter pass on a GPU (lib/select/louver_index.hpp; docs/methods.md, Louver): the device
// holds, per index (one per (sequence, layer, KV head)), a copy of the cluster centers, radii and
// the indexed keys' assignments (not the keys), and for a batch of (index, query heads,
// thresholds) computes every cluster's ball bound and then every indexed key's summed bound,
// returning a bitmask of the keys that reach the threshold for some head. The host then scores
// those candidates (and the index's buffered keys) exactly, as LouverIndex::finish_query does.
// Plain C++: lib/ includes this without CUDA headers. The class is the host's facade over the CUDA
// backend's implementation (gpu/backend.hpp, gpu/louver_filter.cu); where the backend is absent
// every call returns Result{unsupported} saying why.
//
// Arithmetic. For one head, subspace s and cluster C the device computes
// UB_s(C) = q_s . c + |q_s| rho in float32 in the order of the CPU table the index uses
// (LouverIndexView::isa): avx512, the |q_s| rho product first, then fused multiply-adds into two
// accumulators (even coordinates, odd ones), added at the end; scalar, a rounded product and a
// rounded add per coordinate, then + |q_s| rho. A key's summed bound adds its S clusters' bounds
// in subspace order from 0. So the candidates equal the CPU filter's bit for bit (the test says
// so); and where some other order were used, each bound still lies within the slack the host
// subtracted from tau (its error bound holds for any summation order), so the candidates would
// still contain every key of the answer, and the exact check on the host would return the same
// tokens.
//
// Device data per index (a "slot"), every array in device memory:
// - centers: fp16 [S][cluster_capacity * w_s], subspace s at cluster_capacity * offset[s], each
//   subspace in the host's blocked layout (simd/louver_kernels.hpp: cluster c, coordinate j at
//   ((c / 16) * w + j) * 16 + c % 16), so a flush's new clusters upload as whole blocks;
// - radii: float32 [S][cluster_capacity];
// - assignments: uint32 [S][key_capacity].
// Capacities are the index's sizes plus a quarter when first needed or outgrown (everything is
// then uploaded again). The per-call workspace (bounds [item][group][S][clusters], masks packed
// item after item) is shared by the slots and sized for max_items items of the largest slot seen
// by sync(): at 128K keys, d = 128, S = 4, G = 8 about 5 MiB of bounds per item.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/host_memory.hpp"
#include "simd/isa.hpp"
#include "simd/louver_kernels.hpp"

namespace kvsift::gpu {

namespace backend {
class LouverFilter;
}

// One index's arrays in host memory, as LouverIndex keeps them (its *_data accessors).
struct LouverIndexView {
  uint32_t head_dim = 0;     // a multiple of 16, <= 256
  uint32_t n_subspaces = 0;  // S, 1..simd::kLouverMaxSubspaces
  // Subspace s covers coordinates [offset[s], offset[s + 1]); offset[0] = 0, offset[S] = head_dim.
  uint32_t offset[simd::kLouverMaxSubspaces + 1] = {};
  uint32_t n_clusters = 0;
  uint32_t n_indexed = 0;  // keys with assignments
  // Per subspace: centers, blocked (ceil(n_clusters / 16) blocks of w * 16 fp16), radii
  // [n_clusters], assignments [n_indexed] (each < n_clusters).
  const uint16_t* centers[simd::kLouverMaxSubspaces] = {};
  const float* radii[simd::kLouverMaxSubspaces] = {};
  const uint32_t* assignments[simd::kLouverMaxSubspaces] = {};
  // The CPU table whose bound arithmetic the device repeats (avx512 or scalar).
  simd::Level isa = simd::Level::scalar;
};

struct LouverFilterShape {
  uint32_t head_dim = 128;  // of every index: a multiple of 16, <= 256
  uint32_t max_group = 8;   // query heads per item, 1..simd::kLouverMaxGroup
  uint32_t max_items = 64;  // items per run(), >= 1
};

// One index's query in a batch: `group` heads, head g kept where its summed bound reaches t[g].
// Pointers are host memory, read by run() before it returns.
struct LouverFilterItem {
  uint32_t slot = 0;              // a slot sync() filled
  uint32_t group = 1;             // 1..max_group
  const float* q = nullptr;       // [group, head_dim]
  const float* q_norm = nullptr;  // [group, simd::kLouverMaxSubspaces]: |q_s| rounded up, per
                                  // head (LouverGateTerms::q_norm; the first S are read)
  const float* t = nullptr;       // [group]: thresholds (tau - slack, LouverGateTerms::t)
};

// Owns the stream, the slots' device copies, the workspace and the pinned staging on one device.
// Use from one host thread at a time. Movable, not copyable.
class LouverFilter {
 public:
  LouverFilter();  // out of line, where the backend's class is complete
  ~LouverFilter();
  LouverFilter(LouverFilter&& other) noexcept;
  LouverFilter& operator=(LouverFilter&& other) noexcept;
  LouverFilter(const LouverFilter&) = delete;
  LouverFilter& operator=(const LouverFilter&) = delete;

  // Checks the shape (an invalid one is reported as such, unsupported or not), then makes
  // `device` current for the calling thread, creates the stream and the pinned staging for
  // max_items items. Without the CUDA backend, a driver or the device: Result{unsupported}.
  Result init(int device, const LouverFilterShape& shape);

  // Brings slot `slot` up to date with `view`: the first call (or the first after release())
  // uploads everything; later ones upload only the clusters and assignments added since (a
  // flush), reallocating when a capacity is outgrown. The view must extend the one the slot last
  // saw (the same geometry and isa, no fewer clusters or keys; clusters are never refitted);
  // otherwise invalid argument. Also grows the shared workspace to the slot's capacities. Blocks
  // until the copies have read the host arrays. Slots are any uint32 ids (dense ones: the slot
  // table grows to the largest).
  Result sync(uint32_t slot, const LouverIndexView& view);
  // Frees a slot's device memory; the next sync() of it uploads everything. No-op for a slot
  // never synced.
  void release(uint32_t slot) noexcept;

  // Host-side checks of a batch: init done, 1..max_items items, distinct synced slots, group in
  // 1..max_group, non-null pointers. Reads no device memory.
  Result validate(const LouverFilterItem* items, uint32_t n_items) const;
  // Runs the batch (the items validate() accepted) and waits for the masks: mask(i) is then item
  // i's bitmask over its slot's indexed keys, bit k % 32 of word k / 32 for key k, words
  // ceil(n_indexed / 32), the bits past n_indexed zero. Reports launch and execution errors; the
  // masks are then undefined.
  Result run(const LouverFilterItem* items, uint32_t n_items) noexcept;
  // Valid until the next run(), sync() or release().
  const uint32_t* mask(uint32_t item) const noexcept;
  // Keys item's mask covers, as of the last run().
  uint32_t mask_keys(uint32_t item) const noexcept;

  const LouverFilterShape& shape() const noexcept;
  // Device bytes the slots hold (centers, radii, assignments; not the workspace).
  uint64_t device_bytes() const noexcept;
  // Milliseconds the last run() took on the device (upload of the batch to the masks' arrival).
  float last_run_ms() const noexcept;

 private:
  std::unique_ptr<backend::LouverFilter> impl_;  // made by the first init()
};

}  // namespace kvsift::gpu
