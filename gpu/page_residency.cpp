// PageResidency and its two replacement policies (gpu/page_residency.hpp).
#include "gpu/page_residency.hpp"

#include <algorithm>
#include <bit>
#include <string>

namespace kvsift::gpu {
namespace {

// Exact LRU: slots in a doubly-linked list, most recent at the head; the victim is the first
// unpinned slot from the tail. The step's hits are used before its misses ask for victims, so the
// tail is unpinned and the walk stops at once.
class LruPolicy final : public ReplacementPolicy {
 public:
  explicit LruPolicy(uint32_t capacity) : prev_(capacity), next_(capacity) {
    for (uint32_t s = 0; s < capacity; ++s) {
      prev_[s] = s == 0 ? kEnd : s - 1;
      next_[s] = s + 1 == capacity ? kEnd : s + 1;
    }
    head_ = 0;
    tail_ = capacity - 1;
  }

  void on_use(uint32_t slot) noexcept override {
    if (slot == head_) return;
    unlink(slot);
    prev_[slot] = kEnd;
    next_[slot] = head_;
    prev_[head_] = slot;
    head_ = slot;
  }

  uint32_t victim(const uint64_t* pinned_step, uint64_t step) noexcept override {
    uint32_t s = tail_;
    while (pinned_step[s] == step) s = prev_[s];
    return s;
  }

 private:
  static constexpr uint32_t kEnd = 0xffffffffu;

  void unlink(uint32_t slot) noexcept {
    const uint32_t p = prev_[slot], n = next_[slot];
    if (p != kEnd) next_[p] = n;
    if (n != kEnd) prev_[n] = p;
    if (slot == tail_) tail_ = p;
  }

  std::vector<uint32_t> prev_, next_;
  uint32_t head_ = kEnd, tail_ = kEnd;
};

// CLOCK: a use sets the slot's reference bit; the hand clears set bits as it passes and stops at
// the first clear, unpinned slot. Pinned slots are passed over with their bits kept. Every step's
// pages are pinned and at least one slot is not, so two turns of the hand find a victim.
class ClockPolicy final : public ReplacementPolicy {
 public:
  explicit ClockPolicy(uint32_t capacity) : referenced_(capacity, 0) {}

  void on_use(uint32_t slot) noexcept override { referenced_[slot] = 1; }

  uint32_t victim(const uint64_t* pinned_step, uint64_t step) noexcept override {
    const auto n = static_cast<uint32_t>(referenced_.size());
    for (;;) {
      const uint32_t s = hand_;
      hand_ = hand_ + 1 == n ? 0 : hand_ + 1;
      if (pinned_step[s] == step) continue;
      if (referenced_[s]) {
        referenced_[s] = 0;
        continue;
      }
      return s;
    }
  }

 private:
  std::vector<uint8_t> referenced_;
  uint32_t hand_ = 0;
};

Result invalid(std::string message) {
  return Result::invalid(std::move(message));
}

}  // namespace

const char* eviction_policy_name(EvictionPolicy policy) noexcept {
  return policy == EvictionPolicy::lru ? "lru" : "clock";
}

std::unique_ptr<ReplacementPolicy> make_replacement_policy(EvictionPolicy policy,
                                                           uint32_t capacity) {
  if (policy == EvictionPolicy::lru) return std::make_unique<LruPolicy>(capacity);
  return std::make_unique<ClockPolicy>(capacity);
}

Result PageResidency::init(uint32_t capacity, uint64_t host_slots, EvictionPolicy policy) {
  if (capacity == 0 || capacity >= (uint32_t{1} << 31))
    return invalid("page cache: capacity " + std::to_string(capacity) +
                   " slots is outside 1..2^31 - 1");
  if (host_slots == 0 || host_slots > kNone)
    return invalid("page cache: host_slots " + std::to_string(host_slots) +
                   " is outside 1..2^32 - 1");
  if (policy != EvictionPolicy::lru && policy != EvictionPolicy::clock)
    return invalid("page cache: unknown eviction policy");
  capacity_ = capacity;
  host_slots_ = host_slots;
  // Both tables at most half full: the map holds <= capacity pages, the step's seen set stops at
  // capacity + 1 distinct misses.
  const uint64_t table = std::bit_ceil(2 * (uint64_t{capacity} + 1));
  mask_ = static_cast<uint32_t>(table - 1);
  map_.assign(table, Entry{});
  seen_.assign(table, Seen{});
  host_of_.assign(capacity, kNone);
  pinned_step_.assign(capacity, 0);
  free_.resize(capacity);
  for (uint32_t s = 0; s < capacity; ++s) free_[s] = capacity - 1 - s;  // slot 0 first
  missed_.clear();
  missed_.reserve(capacity + 1);
  moves_.clear();
  moves_.reserve(capacity);
  policy_ = make_replacement_policy(policy, capacity);
  step_ = 0;
  counts_ = {};
  return Result{};
}

uint32_t PageResidency::find(uint32_t host_slot) const noexcept {
  if (map_.empty()) return kNone;
  for (uint32_t i = probe_start(host_slot);; i = (i + 1) & mask_) {
    if (map_[i].key == host_slot) return map_[i].value;
    if (map_[i].key == kNone) return kNone;
  }
}

void PageResidency::map_insert(uint32_t key, uint32_t value) noexcept {
  uint32_t i = probe_start(key);
  while (map_[i].key != kNone) i = (i + 1) & mask_;
  map_[i] = Entry{key, value};
}

void PageResidency::map_erase(uint32_t key) noexcept {
  uint32_t i = probe_start(key);
  while (map_[i].key != key) i = (i + 1) & mask_;
  // Backward shift: move later entries of the run into the hole when their home allows it.
  for (uint32_t j = (i + 1) & mask_; map_[j].key != kNone; j = (j + 1) & mask_) {
    const uint32_t home = probe_start(map_[j].key);
    // j's entry may move to i when its home is not in (i, j] (cyclically).
    const bool stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
    if (stays) continue;
    map_[i] = map_[j];
    i = j;
  }
  map_[i] = Entry{};
}

uint32_t PageResidency::seen_insert(uint32_t key) noexcept {
  for (uint32_t i = probe_start(key);; i = (i + 1) & mask_) {
    Seen& e = seen_[i];
    if (e.step != step_) {
      e = Seen{step_, key, static_cast<uint32_t>(missed_.size())};
      missed_.push_back(key);
      return e.missed;
    }
    if (e.key == key) return e.missed;
  }
}

uint32_t PageResidency::take_slot() noexcept {
  if (!free_.empty()) {
    const uint32_t s = free_.back();
    free_.pop_back();
    return s;
  }
  const uint32_t s = policy_->victim(pinned_step_.data(), step_);
  map_erase(host_of_[s]);
  ++counts_.evictions;
  return s;
}

Result PageResidency::plan(const uint32_t* host_slots, std::size_t n,
                           uint32_t* device_slots) noexcept {
  if (!policy_) return invalid("page cache: plan() before init()");
  if (n > 0 && (host_slots == nullptr || device_slots == nullptr))
    return invalid("page cache: null id arrays");
  for (std::size_t i = 0; i < n; ++i)
    if (host_slots[i] >= host_slots_)
      return invalid("page cache: host slot " + std::to_string(host_slots[i]) + " at index " +
                     std::to_string(i) + " is outside the pool's " + std::to_string(host_slots_) +
                     " slots");
  // A fresh step number pins this step's slots; a refused step leaves only stale stamps behind.
  ++step_;
  counts_ = {};
  counts_.requested = n;
  missed_.clear();
  moves_.clear();
  // A miss is written as kMissed | its index in missed_ until its slot is known.
  constexpr uint32_t kMissed = uint32_t{1} << 31;
  // Millions of pages a step wait on their probes' cache lines: prefetch a few requests ahead.
  constexpr std::size_t kAhead = 8;
  uint64_t hits = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const uint32_t ahead = probe_start(host_slots[i + kAhead]);
      __builtin_prefetch(&map_[ahead]);
      __builtin_prefetch(&seen_[ahead]);
    }
    const uint32_t s = find(host_slots[i]);
    if (s != kNone) {
      device_slots[i] = s;
      if (pinned_step_[s] != step_) {
        pinned_step_[s] = step_;
        ++hits;
      }
    } else {
      device_slots[i] = kMissed | seen_insert(host_slots[i]);
      if (hits + missed_.size() > capacity_) break;
    }
  }
  if (hits + missed_.size() > capacity_) {
    // The exact count for the message (a cold path: the step is refused, so it may allocate).
    missed_.clear();
    try {
      std::vector<uint32_t> ids(host_slots, host_slots + n);
      std::sort(ids.begin(), ids.end());
      const auto distinct = std::unique(ids.begin(), ids.end()) - ids.begin();
      return invalid("page cache: the step needs " + std::to_string(distinct) +
                     " distinct pages, more than the cache's " + std::to_string(capacity_) +
                     " slots");
    } catch (...) {
      return invalid("page cache: the step needs more distinct pages than its slots");
    }
  }
  // Hits first, so that no victim is chosen before every resident page of the step is used.
  for (std::size_t i = 0; i < n; ++i)
    if (!(device_slots[i] & kMissed)) policy_->on_use(device_slots[i]);
  for (std::size_t j = 0; j < missed_.size(); ++j) {
    if (j + kAhead < missed_.size()) __builtin_prefetch(&map_[probe_start(missed_[j + kAhead])]);
    const uint32_t host = missed_[j];
    const uint32_t s = take_slot();
    host_of_[s] = host;
    pinned_step_[s] = step_;
    map_insert(host, s);
    policy_->on_use(s);
    moves_.push_back(PageMove{host, s});
  }
  // Slots are below 2^31 (init), so the flag is unambiguous.
  for (std::size_t i = 0; i < n; ++i)
    if (device_slots[i] & kMissed) device_slots[i] = moves_[device_slots[i] & ~kMissed].device_slot;
  counts_.hits = hits;
  counts_.misses = missed_.size();
  return Result{};
}

void PageResidency::forget_moves() noexcept {
  for (const PageMove& m : moves_) {
    map_erase(m.host_slot);
    host_of_[m.device_slot] = kNone;
    free_.push_back(m.device_slot);
  }
  moves_.clear();
}

// The replacement policy keeps its state: it is asked for a victim only once every slot holds a
// page again, and each of those pages was used (on_use) after this call, so what it remembers of
// earlier pages no longer decides anything.
void PageResidency::clear() noexcept {
  std::fill(map_.begin(), map_.end(), Entry{});
  std::fill(host_of_.begin(), host_of_.end(), kNone);
  free_.resize(capacity_);  // init() sized it to capacity_: no allocation
  for (uint32_t s = 0; s < capacity_; ++s) free_[s] = capacity_ - 1 - s;
  missed_.clear();
  moves_.clear();
}

}  // namespace kvsift::gpu
