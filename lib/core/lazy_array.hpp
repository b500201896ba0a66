// Arrays sized by a capacity but paid for by use: a fixed number of zero-initialised elements in
// anonymous memory the OS commits page by page as they are first written
// (lib/core/host_memory.hpp), the way the page pool holds its slots. Selectors keep per-slot data
// (summaries, seal bookkeeping) and per-thread score rows sized by the pool's capacity; a cache
// created with room for 2^26 pages but holding a few then costs a few pages of resident memory, not
// gigabytes.
#pragma once

#include <cstddef>
#include <limits>
#include <type_traits>

#include "lib/core/error.hpp"
#include "lib/core/host_memory.hpp"

namespace kvsift {

template <class T>
class LazyArray {
  static_assert(std::is_trivially_copyable_v<T> && std::is_trivially_default_constructible_v<T>,
                "the elements start as zero bytes and are never constructed");

 public:
  LazyArray() = default;
  // n zero elements. Throws Error(out_of_memory) when the address space cannot be reserved.
  // huge_pages: whether the OS may back it with 2 MiB pages (right for arrays filled from the
  // front, as slots are handed out; wrong for arrays touched at scattered rows).
  explicit LazyArray(std::size_t n, bool huge_pages = false)
      : region_(checked_bytes(n), /*pinned=*/false, huge_pages), size_(n) {}

  T* data() noexcept { return reinterpret_cast<T*>(region_.data()); }
  const T* data() const noexcept { return reinterpret_cast<const T*>(region_.data()); }
  T& operator[](std::size_t i) noexcept { return data()[i]; }
  const T& operator[](std::size_t i) const noexcept { return data()[i]; }
  T* begin() noexcept { return data(); }
  T* end() noexcept { return data() + size_; }
  const T* begin() const noexcept { return data(); }
  const T* end() const noexcept { return data() + size_; }
  std::size_t size() const noexcept { return size_; }

 private:
  static std::size_t checked_bytes(std::size_t n) {
    if (n > std::numeric_limits<std::size_t>::max() / sizeof(T))
      fail(Status::out_of_memory, "an array of ", n, " elements of ", sizeof(T), " bytes");
    return n * sizeof(T);
  }
  HostRegion region_;
  std::size_t size_ = 0;
};

}  // namespace kvsift
