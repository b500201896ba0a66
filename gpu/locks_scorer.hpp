// LOCKS page selection on a GPU (docs/methods.md, LOCKS; lib/select/locks_selector.cpp is the CPU
// original): the device holds a copy of every pool slot's LOCKS record (the bytes of
// lib/select/locks_summary.hpp, layout in simd/locks_record.hpp; the KV itself stays in host
// memory), and for a batch of (sequence, KV head) pairs scores every sealed page for the group's
// query heads, combines the heads into one ranking, keeps the top pages within the budget and
// returns, per pair, the ascending chosen page ids with their scores and the kept-mass estimate,
// as PageSelector::select_pair does. Plain C++: lib/ includes this without CUDA headers. The class
// is the host's facade over the CUDA backend's implementation (gpu/backend.hpp,
// gpu/locks_scorer.cu); where the backend is absent every call returns Result{unsupported}.
//
// Arithmetic, and how close it comes to the CPU's:
// - Page scores (int8 queries, the policy default; the only mode offered): q is rounded per head
//   on the device exactly as simd's locks_score does it (s_q = max|q| / 127 in float, codes
//   nearbyint(q / s_q)); V^T q~ and mu . q~ are exact integer sums on the device (as the AVX-512
//   VNNI kernel takes them), the logits and the log-sum-exp float32 in another order than the
//   CPU's: scores agree to a few float32 ulps of the logits.
// - The open page (partial, attended anyway) gets its exact log-sum-exp from its keys, which the
//   host copies into the batch, as PageSelector::exact_page_lse; it feeds only the estimate.
// - Combine (share_avg, nrm, max), masses, the exact-b choice with ties to the lower page id and
//   the kept estimate follow PageSelector's definitions; exp is CUDA's, so combined scores may
//   differ from the CPU's by an ulp or so and the chosen set only at near-ties.
// - Mandatory pages and the pages the budget allows: lib/select/page_plan.hpp, as the CPU; pairs
//   the CPU attends whole (nothing selectable, or a budget of the whole context) are filled on
//   the host (every page, +inf, estimate 1) without device work.
//
// Device data: records [slots][record_bytes] (pool-slot indexed, as the host's array), uploaded
// by upload() for the slots summarised since the last one, through a pinned staging of
// kUploadChunk records (one copy and one scatter kernel per chunk); copies of named page tables
// (table_copies). Per run, one copy up (pair parameters, queries, the sealed pages' slots the
// copies lack, the open pages' keys) packed in pinned staging, a scoring kernel (four lanes per
// page and up to 8 heads; it rounds the queries to int8 and extends the table copies), a
// selection kernel (a cluster of 8 CTAs per pair, the scores in their shared memory: combine,
// radix select of the b-th best (score, page) key, ordered compaction, estimate), one copy back
// (estimates, ids, scores), one wait.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "gpu/host_memory.hpp"
#include "lib/select/page_plan.hpp"
#include "simd/kernels.hpp"

namespace kvsift::gpu {

namespace backend {
class LocksScorer;
}

// How the G query heads' page scores combine into one ranking (select::GqaCombine, same order).
enum class LocksCombine : uint8_t { share_avg = 0, nrm = 1, max = 2 };

struct LocksScorerShape {
  uint32_t head_dim = 128;               // 64, 128 or 256
  uint32_t page_tokens = 16;             // 16, 32 or 64
  uint32_t rank = 8;                     // the records' rank: 8 (select::kLocksDefaultRank) only
  uint32_t group = 1;                    // query heads per KV head, 1..64
  simd::Dtype dtype = simd::Dtype::f16;  // of the open pages' keys
  LocksCombine combine = LocksCombine::share_avg;
  float scale = 0.0f;         // attention scale, 1/sqrt(head_dim); > 0
  uint32_t slots = 0;         // pool slots (records on the device), >= 1
  uint32_t max_pairs = 1;     // pairs per run, 1..65535
  uint64_t max_pages = 1;     // pages of all the pairs of one run together (>= 1)
  uint32_t sink_pages = 1;    // mandatory first pages
  uint32_t window_pages = 1;  // mandatory last pages (at least the open one)
  // Named tables (LocksPair::table_id) the device keeps, each of up to max_pair_pages sealed
  // pages; 0: every run sends every table whole.
  uint32_t table_copies = 0;
  uint64_t max_pair_pages = 0;
};

// One (sequence, KV head) of a batch. Pointers are host memory, read by run() before it returns.
struct LocksPair {
  const float* q = nullptr;             // [group, head_dim], unscaled
  const uint32_t* table = nullptr;      // [ceil(tokens / page_tokens)] pool slot of each page (the
                                        // sealed ones must have uploaded records)
  const uint16_t* open_keys = nullptr;  // the open page's keys [tokens % page_tokens, head_dim]
                                        // in the shape's dtype; null when tokens % page_tokens == 0
  uint64_t tokens = 0;                  // stored tokens (none: no pages)
  uint64_t budget_tokens = 0;           // Policy::budget_tokens(tokens)
  // Nonzero: names the table for as long as its sealed entries stay as they are (they may grow);
  // the caller names it anew when they change. The device then keeps a copy and each run sends
  // only the entries added since the last. 0: sent whole.
  uint64_t table_id = 0;
};

// A pair's pages as every selector plans them (lib/select/page_plan.hpp).
using LocksPairPlan = select::PagePlan;

inline LocksPairPlan locks_pair_plan(const LocksScorerShape& shape, uint64_t tokens,
                                     uint64_t budget_tokens) noexcept {
  return select::page_plan(shape.sink_pages, shape.window_pages, shape.page_tokens, tokens,
                           budget_tokens);
}

// Records of this many slots travel per upload copy.
inline constexpr uint32_t kLocksUploadChunk = 4096;

// Owns the stream, the device records, workspaces and pinned staging on one device. Use from one
// host thread at a time. Movable, not copyable.
class LocksScorer {
 public:
  LocksScorer();  // out of line, where the backend's class is complete
  ~LocksScorer();
  LocksScorer(LocksScorer&& other) noexcept;
  LocksScorer& operator=(LocksScorer&& other) noexcept;
  LocksScorer(const LocksScorer&) = delete;
  LocksScorer& operator=(const LocksScorer&) = delete;

  // Checks the shape (invalid argument), then makes `device` current for the calling thread and
  // allocates the records, workspaces and staging (about slots * record_bytes + (4 * group + 12)
  // * max_pages + 4 * table_copies * max_pair_pages bytes of device memory). Without the CUDA
  // backend: Result{unsupported} before any check; without a driver or the device: after them.
  Result init(int device, const LocksScorerShape& shape);

  // Copies the records of n slots to the device: slot slots[i]'s record is read at records +
  // slots[i] * record_bytes (the host's slot-indexed array). Blocks until the copies are done.
  // Invalid argument for a slot >= shape.slots (nothing is copied then).
  Result upload(const std::byte* records, const uint32_t* slots, std::size_t n) noexcept;

  // Host-side checks of a batch: init done, 1..max_pairs pairs, their pages within max_pages, the
  // sealed pages' slots < shape.slots, non-null pointers. Reads no device memory.
  Result validate(const LocksPair* pairs, uint32_t n_pairs) const;
  // Runs a batch validate() accepted and waits for the result. Reports launch and execution
  // errors; the result is then undefined.
  Result run(const LocksPair* pairs, uint32_t n_pairs) noexcept;

  // The last run's result, valid until the next run() or upload(): per pair i, its chosen pages
  // are page_ids()[offsets()[i] .. offsets()[i + 1]) ascending, with scores() alongside (the
  // combined score, +inf for mandatory pages), and kept_estimate()[i].
  const uint32_t* offsets() const noexcept;  // [n_pairs + 1]
  const uint32_t* page_ids() const noexcept;
  const float* scores() const noexcept;
  const float* kept_estimate() const noexcept;  // [n_pairs]
  // For tests: pair's per-head page scores of the last run into out [group, pages of the pair]
  // (the sealed pages' estimated log-masses, then the open page's exact one). Blocks. Invalid
  // argument for a pair the host filled whole (no scores were computed).
  Result head_scores(uint32_t pair, float* out) const;

  const LocksScorerShape& shape() const noexcept;
  // Device bytes of the records copy.
  uint64_t device_bytes() const noexcept;
  // Milliseconds the last run() took on the device (batch upload to the result's arrival).
  float last_run_ms() const noexcept;

 private:
  std::unique_ptr<backend::LocksScorer> impl_;  // made by the first init()
};

}  // namespace kvsift::gpu
