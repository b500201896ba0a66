// Fixed-size page slots in one host region, handed out and taken back by id.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "lib/core/host_memory.hpp"

namespace kvsift {

class PagePool {
 public:
  // capacity slots of slot_bytes each. Throws Error: invalid_argument (zero or overflowing sizes),
  // out_of_memory, unsupported (pinned without CUDA).
  PagePool(std::size_t slot_bytes, uint64_t capacity, bool pinned);

  // Makes the next n acquire() calls infallible. Throws Error(capacity_exceeded) when fewer than
  // n slots are free, or out_of_memory; changes nothing visible then. Call it before a multi-page
  // append so that the append fails before it changes anything.
  void reserve(uint64_t n, const char* what);
  // A free slot id. Precondition: reserve() covered this call.
  uint32_t acquire() noexcept;
  // Cannot fail: the free list's room for every slot ever handed out was reserved by reserve().
  void release(uint32_t slot) noexcept;

  uint64_t available() const noexcept { return capacity_ - in_use_; }
  uint64_t capacity() const noexcept { return capacity_; }
  uint64_t in_use() const noexcept { return in_use_; }
  uint64_t high_water() const noexcept { return never_used_from_; }
  std::size_t slot_bytes() const noexcept { return slot_bytes_; }
  const HostRegion& region() const noexcept { return region_; }
  std::byte* base() const noexcept { return region_.data(); }
  std::byte* slot(uint32_t id) const noexcept { return region_.data() + id * slot_bytes_; }

 private:
  std::size_t slot_bytes_;
  uint64_t capacity_;
  HostRegion region_;
  std::vector<uint32_t> free_;    // released slots, reused last-in first-out (still warm in cache)
  uint64_t never_used_from_ = 0;  // slots at or above this id were never handed out
  uint64_t in_use_ = 0;
};

}  // namespace kvsift
