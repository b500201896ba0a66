// PageResidency and its two replacement policies (gpu/page_residency.hpp).
#include "gpu/page_residency.hpp"

#include <algorithm>
#include <bit>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvsift::gpu {
namespace {

// Exact LRU: slots in a doubly-linked list, most recent at the head; the victim is the first
// unpinned slot from the tail. The step's hits are used before its misses ask for victims, so the
// tail is unpinned and the walk stops at once. (A queue of uses with lazy deletion, two sequential
// stores a use, measured slower: nearly every entry went stale and its compaction cost more than
// the list's stores, which stay in L1 or L2 at a step's few thousand slots.)
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

  void on_use(const uint32_t* slots, std::size_t n) noexcept override {
    for (std::size_t i = 0; i < n; ++i) {
      const uint32_t slot = slots[i];
      if (slot == head_) continue;
      unlink(slot);
      prev_[slot] = kEnd;
      next_[slot] = head_;
      prev_[head_] = slot;
      head_ = slot;
    }
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

  void on_use(const uint32_t* slots, std::size_t n) noexcept override {
    for (std::size_t i = 0; i < n; ++i) referenced_[slots[i]] = 1;
  }

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

// Bit j set when key[j] == key: the lanes of a bucket holding a key (at most one) or, for kNone,
// the empty ones.
uint32_t lanes_equal(const uint32_t* keys, uint32_t key) noexcept {
#if defined(__SSE2__)
  const __m128i k = _mm_set1_epi32(static_cast<int>(key));
  const __m128i lo = _mm_cmpeq_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(keys)), k);
  const __m128i hi = _mm_cmpeq_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(keys + 4)), k);
  return static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(lo)) |
                               _mm_movemask_ps(_mm_castsi128_ps(hi)) << 4);
#else
  uint32_t lanes = 0;
  for (uint32_t j = 0; j < 8; ++j) lanes |= uint32_t{keys[j] == key} << j;
  return lanes;
#endif
}

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
  // At most half full: the map holds <= capacity pages and, during a plan, <= capacity pending
  // misses (the step is refused before one more).
  const uint64_t buckets = std::bit_ceil(4 * (uint64_t{capacity} + 1)) / 8;
  bucket_mask_ = static_cast<uint32_t>(buckets - 1);
  buckets_.resize(buckets);
  overflow_.resize(buckets);
  clear_map();
  host_of_.assign(capacity, kNone);
  pinned_step_.assign(capacity, 0);
  free_.resize(capacity);
  for (uint32_t s = 0; s < capacity; ++s) free_[s] = capacity - 1 - s;  // slot 0 first
  missed_.assign(capacity, 0);
  pending_.assign(capacity, nullptr);
  used_.assign(capacity, 0);
  moves_.clear();
  moves_.reserve(capacity);
  policy_ = make_replacement_policy(policy, capacity);
  step_ = 0;
  step_pages_ = 0;
  counts_ = {};
  return Result{};
}

void PageResidency::clear_map() noexcept {
  for (Bucket& b : buckets_) std::fill(std::begin(b.key), std::end(b.key), kNone);
  std::fill(overflow_.begin(), overflow_.end(), 0);
}

uint32_t PageResidency::find_value(uint32_t key) const noexcept {
  for (uint32_t b = bucket_of(key);; b = (b + 1) & bucket_mask_) {
    if (const uint32_t lanes = lanes_equal(buckets_[b].key, key); lanes != 0)
      return buckets_[b].value[std::countr_zero(lanes)];
    if (overflow_[b] == 0) return kNone;
  }
}

uint32_t PageResidency::find(uint32_t host_slot) const noexcept {
  return buckets_.empty() ? kNone : find_value(host_slot);
}

uint32_t* PageResidency::map_insert(uint32_t key, uint32_t value) noexcept {
  for (uint32_t b = bucket_of(key);; b = (b + 1) & bucket_mask_) {
    if (const uint32_t empty = lanes_equal(buckets_[b].key, kNone); empty != 0) {
      const int j = std::countr_zero(empty);
      buckets_[b].key[j] = key;
      buckets_[b].value[j] = value;
      return &buckets_[b].value[j];
    }
    ++overflow_[b];
  }
}

void PageResidency::map_erase(uint32_t key) noexcept {
  for (uint32_t b = bucket_of(key);; b = (b + 1) & bucket_mask_) {
    if (const uint32_t lanes = lanes_equal(buckets_[b].key, key); lanes != 0) {
      buckets_[b].key[std::countr_zero(lanes)] = kNone;
      return;
    }
    --overflow_[b];
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

Result PageResidency::refuse_step(const uint32_t* host_slots, std::size_t n, std::size_t n_missed) {
  for (std::size_t j = 0; j < n_missed; ++j) map_erase(missed_[j]);
  // The exact count for the message (a cold path: the step is refused, so it may allocate).
  try {
    std::vector<uint32_t> ids(host_slots, host_slots + n);
    std::sort(ids.begin(), ids.end());
    const auto distinct = std::unique(ids.begin(), ids.end()) - ids.begin();
    return invalid("page cache: the step needs " + std::to_string(distinct) + " distinct pages" +
                   (step_pages_ > 0
                        ? " besides the " + std::to_string(step_pages_) + " of its earlier pieces"
                        : std::string()) +
                   ", more than the cache's " + std::to_string(capacity_) + " slots");
  } catch (...) {
    return invalid("page cache: the step needs more distinct pages than its slots");
  }
}

Result PageResidency::plan(const uint32_t* host_slots, std::size_t n, uint32_t* device_slots,
                           StepMode mode) noexcept {
  if (!policy_) return invalid("page cache: plan() before init()");
  if (n > 0 && (host_slots == nullptr || device_slots == nullptr))
    return invalid("page cache: null id arrays");
  for (std::size_t i = 0; i < n; ++i)
    if (host_slots[i] >= host_slots_)
      return invalid("page cache: host slot " + std::to_string(host_slots[i]) + " at index " +
                     std::to_string(i) + " is outside the pool's " + std::to_string(host_slots_) +
                     " slots");
  // A fresh step number pins this step's slots; a refused step leaves only stale stamps behind.
  // A piece of a step keeps the number, so the earlier pieces' slots stay pinned.
  if (mode == StepMode::next || step_ == 0) {
    ++step_;
    step_pages_ = 0;
  }
  const uint64_t held = step_pages_;
  counts_ = {};
  counts_.requested = n;
  moves_.clear();
  // A miss enters the map at once as pending, kMissed | its index in missed_, so that its
  // duplicates find it there (their bucket is the line the lookup already read) rather than in a
  // set of their own; the value becomes its slot once the step is accepted. Slots are below 2^31
  // (init), so the flag is unambiguous, and kNone (absent) has it too.
  constexpr uint32_t kMissed = uint32_t{1} << 31;
  uint32_t* const used = used_.data();      // distinct hits' slots
  uint32_t* const missed = missed_.data();  // distinct misses' host slots
  std::size_t hits = 0, misses = 0;
  // A step over thousands of pages waits on their buckets' lines: prefetch a few requests ahead
  // (the stamps' lines, found from the buckets', are fewer and nearer).
  constexpr std::size_t kAhead = 16;
  for (std::size_t i = 0; i < std::min(kAhead, n); ++i)
    __builtin_prefetch(&buckets_[bucket_of(host_slots[i])]);
  for (std::size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(&buckets_[bucket_of(host_slots[i + kAhead])]);
    const uint32_t s = find_value(host_slots[i]);
    if (s < kMissed) {  // a hit
      device_slots[i] = s;
      if (pinned_step_[s] != step_) {  // its first request this step
        pinned_step_[s] = step_;
        used[hits++] = s;
      }
    } else if (s != kNone) {  // a pending miss requested again
      device_slots[i] = s;
    } else {
      if (held + hits + misses >= capacity_) return refuse_step(host_slots, n, misses);
      device_slots[i] = kMissed | static_cast<uint32_t>(misses);
      pending_[misses] = map_insert(host_slots[i], kMissed | static_cast<uint32_t>(misses));
      missed[misses++] = host_slots[i];
    }
  }
  // The check above saw the hits before each miss; the step's later hits count too.
  if (held + hits + misses > capacity_) return refuse_step(host_slots, n, misses);
  // Hits first, so that no victim is chosen before every resident page of the step is used.
  policy_->on_use(used, hits);
  for (std::size_t j = 0; j < misses; ++j) {
    const uint32_t host = missed[j];
    const uint32_t s = take_slot();
    host_of_[s] = host;
    pinned_step_[s] = step_;
    *pending_[j] = s;  // evictions clear other entries' lanes, never move one
    moves_.push_back(PageMove{host, s});
    // At once: LRU's walk from the tail would pass over every earlier fill of the step.
    policy_->on_use(&s, 1);
  }
  if (misses > 0)
    for (std::size_t i = 0; i < n; ++i)
      if (device_slots[i] & kMissed)
        device_slots[i] = moves_[device_slots[i] & ~kMissed].device_slot;
  counts_.hits = hits;
  counts_.misses = misses;
  step_pages_ = held + hits + misses;
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
  clear_map();
  std::fill(host_of_.begin(), host_of_.end(), kNone);
  free_.resize(capacity_);  // init() sized it to capacity_: no allocation
  for (uint32_t s = 0; s < capacity_; ++s) free_[s] = capacity_ - 1 - s;
  moves_.clear();
  step_pages_ = 0;  // the step's pages are gone with the rest
}

}  // namespace kvsift::gpu
