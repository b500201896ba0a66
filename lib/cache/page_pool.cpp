#include "lib/cache/page_pool.hpp"

#include <algorithm>
#include <limits>

#include "lib/cache/geometry.hpp"
#include "lib/core/error.hpp"

namespace kvsift {

namespace {

HostRegion make_region(std::size_t slot_bytes, uint64_t capacity, bool pinned) {
  require(slot_bytes > 0 && slot_bytes % 64 == 0, "slot_bytes=", slot_bytes,
          " is not a positive multiple of 64");
  require(capacity >= 1 && capacity <= kMaxPages, "max_pages=", capacity, " is not in 1..",
          kMaxPages);
  require(capacity <= std::numeric_limits<std::size_t>::max() / slot_bytes, "max_pages=", capacity,
          " times ", slot_bytes, " bytes per page overflows the address space");
  return HostRegion(capacity * slot_bytes, pinned);
}

}  // namespace

PagePool::PagePool(std::size_t slot_bytes, uint64_t capacity, bool pinned)
    : slot_bytes_(slot_bytes),
      capacity_(capacity),
      region_(make_region(slot_bytes, capacity, pinned)) {}

void PagePool::reserve(uint64_t n, const char* what) {
  if (n > available())
    fail(Status::capacity_exceeded, what, " needs ", n, " more pages but only ", available(),
         " of ", capacity_, " are free (raise max_pages or free sequences)");
  // Room in the free list for every slot that could be released, grown ahead of need.
  const uint64_t handed_out = never_used_from_ + (n > free_.size() ? n - free_.size() : 0);
  if (free_.capacity() < handed_out)
    free_.reserve(
        std::min<uint64_t>(capacity_, std::max<uint64_t>(handed_out, 2 * free_.capacity())));
}

uint32_t PagePool::acquire() noexcept {
  ++in_use_;
  if (!free_.empty()) {
    const uint32_t id = free_.back();
    free_.pop_back();
    return id;
  }
  return static_cast<uint32_t>(never_used_from_++);
}

void PagePool::release(uint32_t slot) noexcept {
  free_.push_back(slot);
  --in_use_;
}

}  // namespace kvsift
