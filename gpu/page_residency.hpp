// Which host pages a device page cache holds, in which of its slots, and which to evict: the
// bookkeeping of gpu/page_transfer.hpp's DevicePageCache, in plain C++ with no device, so that it
// is tested and its hit rates measured anywhere.
//
// Ids: a host page is its host pool slot id (lib/cache/page_pool.hpp), < host_slots < 2^32 - 1; a
// device page is a slot of the cache's device pool, < capacity. One step names the pages it needs;
// plan() maps each to a device slot, keeping the resident ones (hits) and giving each missing one
// (miss) a free slot or a victim's. Every page the step names is pinned for that step: a victim is
// never one of them, so a step that needs more distinct pages than the capacity is refused whole.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/host_memory.hpp"

namespace kvsift::gpu {

enum class EvictionPolicy : uint8_t {
  // Least recently used: exact recency, a doubly-linked list over the slots.
  lru,
  // CLOCK (second chance): a reference bit per slot and a sweeping hand, approximating LRU.
  clock,
};

const char* eviction_policy_name(EvictionPolicy policy) noexcept;

// The replacement policy behind one small interface: told of every use, asked for victims. A
// step's hits come in one batch, so that the per-page work (a store or a few) is not behind a
// virtual call a page; its misses, a few in a hundred on a decode step, one call each.
class ReplacementPolicy {
 public:
  virtual ~ReplacementPolicy() = default;
  // The slots were used this step (hits, or fills after misses), each named once, in order of use.
  virtual void on_use(const uint32_t* slots, std::size_t n) noexcept = 0;
  // A slot whose pinned_step differs from step, to be refilled (every slot holds a page when this
  // is asked, and at least one is not pinned). The step's hits were used (on_use) before its first
  // victim, and each fill is used before the next victim is asked for; the call itself does not
  // mark the slot used.
  virtual uint32_t victim(const uint64_t* pinned_step, uint64_t step) noexcept = 0;
};

std::unique_ptr<ReplacementPolicy> make_replacement_policy(EvictionPolicy policy,
                                                           uint32_t capacity);

// Whether a plan() starts a step or adds pages to the step the last plan() started, so that a
// caller can plan a step in pieces and send each piece's misses while it plans the next (the
// offload step, lib/offload/offload_attention.cpp).
enum class StepMode : uint8_t { next, same };

// One miss: the host page to copy into the device slot.
struct PageMove {
  uint32_t host_slot;
  uint32_t device_slot;
};

// What one plan() did. Hits and misses count distinct pages; requested counts ids as passed.
struct StepCounts {
  uint64_t requested = 0;
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;  // misses that replaced a resident page (the rest took free slots)
};

// Not thread-safe: one owner. Movable.
class PageResidency {
 public:
  static constexpr uint32_t kNone = 0xffffffffu;

  PageResidency() = default;
  PageResidency(PageResidency&&) noexcept = default;
  PageResidency& operator=(PageResidency&&) noexcept = default;

  // capacity: device slots, 1..2^31 - 1. host_slots: ids accepted, 1..2^32 - 1. Allocates every
  // workspace plan() uses. Invalid arguments: Result{ok = false} naming the argument.
  Result init(uint32_t capacity, uint64_t host_slots, EvictionPolicy policy);

  // Maps host_slots[0..n) to device slots in device_slots[0..n) (duplicates get the same slot) and
  // lists this plan's misses, in first-request order, in moves(). Refuses, changing nothing: an
  // id >= host_slots (message names its index), or more distinct ids than the capacity. Allocates
  // nothing.
  // StepMode::same adds the pages to the step of the last plan() (a new step when there was none):
  // the pages planned earlier in the step stay pinned and count against the capacity, and a page
  // planned earlier in the step is neither a hit nor a miss again (each distinct page of a step is
  // counted once, by the plan that first names it). A refused plan changes nothing but pins its
  // hits for the rest of its step.
  Result plan(const uint32_t* host_slots, std::size_t n, uint32_t* device_slots,
              StepMode mode = StepMode::next) noexcept;

  // The misses of the last successful plan(); valid until the next call.
  const std::vector<PageMove>& moves() const noexcept { return moves_; }
  // The last successful plan()'s counts (of a step planned in pieces, the last piece's).
  const StepCounts& last_counts() const noexcept { return counts_; }

  // Forgets the last plan's misses (their transfer failed): their slots become free and the
  // pages are misses again next time.
  void forget_moves() noexcept;

  // Forgets every resident page, as if the cache were new: every slot is free and every page is
  // a miss at its next plan() (a benchmark's cold step). Allocates nothing.
  void clear() noexcept;

  // The device slot holding a host page, or kNone.
  uint32_t find(uint32_t host_slot) const noexcept;
  uint32_t capacity() const noexcept { return capacity_; }
  uint32_t resident() const noexcept { return capacity_ - static_cast<uint32_t>(free_.size()); }

 private:
  // The map: open addressing over a power-of-two table of buckets, each one cache line of 8 keys
  // then their 8 values (kNone keys are empty), at most half full with the resident pages and a
  // plan's pending misses (their value kMissed | index, so that duplicates find them). A lookup
  // compares its key with a bucket's 8 at once, and moves to the next bucket only while overflow_
  // says some key stored further on passed this one: with 8 lanes at half load that is rare, so
  // nearly every lookup is one line and no data-dependent branch but hit or miss. (Linear probing
  // over single entries took ~1.4 probes a lookup, and the mispredicted end of the probe loop was a
  // third of plan().) Entries never move, so removal only clears the lane and undoes the overflow
  // counts its insert added.
  struct alignas(64) Bucket {
    uint32_t key[8];
    uint32_t value[8];
  };
  // Fibonacci hashing: a layer's host slots are strided (interleaved with other layers'), so their
  // low bits alone would share buckets.
  uint32_t bucket_of(uint32_t key) const noexcept {
    return static_cast<uint32_t>((key * 0x9e3779b97f4a7c15ull) >> 32) & bucket_mask_;
  }
  void clear_map() noexcept;
  // The value of key, or kNone.
  uint32_t find_value(uint32_t key) const noexcept;
  // Where key's value is stored; valid until the key is erased.
  uint32_t* map_insert(uint32_t key, uint32_t value) noexcept;
  void map_erase(uint32_t key) noexcept;
  // A free slot, or the policy's victim with its page unmapped.
  uint32_t take_slot() noexcept;
  // Refuses a plan whose step would need more distinct pages than the capacity, erasing its
  // n_missed pending misses from the map (a cold path).
  Result refuse_step(const uint32_t* host_slots, std::size_t n, std::size_t n_missed);

  uint32_t capacity_ = 0;
  uint64_t host_slots_ = 0;
  uint32_t bucket_mask_ = 0;
  std::vector<Bucket> buckets_;        // host -> device
  std::vector<uint32_t> overflow_;     // [buckets] keys stored past the bucket from before it
  std::vector<uint32_t> host_of_;      // [capacity] the page a slot holds, or kNone
  std::vector<uint64_t> pinned_step_;  // [capacity] the last step that used the slot
  std::vector<uint32_t> free_;         // slots holding no page
  // Per-step workspaces of capacity entries, filled from the front by plan().
  std::vector<uint32_t> missed_;    // the step's distinct missing ids
  std::vector<uint32_t*> pending_;  // their values in the map
  std::vector<uint32_t> used_;      // the step's distinct hits' slots
  std::vector<PageMove> moves_;
  std::unique_ptr<ReplacementPolicy> policy_;
  uint64_t step_ = 0;
  uint64_t step_pages_ = 0;  // distinct pages pinned by the step's accepted plans
  StepCounts counts_{};
};

}  // namespace kvsift::gpu
