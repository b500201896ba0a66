// std::vector storage aligned to cache lines: kernels load whole 64-byte lines, and an AVX-512
// load split across two lines runs 1.75x slower (docs/platform-notes.md, CPU: split loads).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace kvsift {

inline constexpr std::size_t kCacheLine = 64;

template <class T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{kCacheLine}));
  }
  void deallocate(T* p, std::size_t) noexcept {
    ::operator delete (p, std::align_val_t{kCacheLine});
  }
  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

// n rounded up to a whole number of cache lines' worth of T.
template <class T>
constexpr std::size_t round_to_lines(std::size_t n) {
  constexpr std::size_t per_line = kCacheLine / sizeof(T);
  return (n + per_line - 1) / per_line * per_line;
}

}  // namespace kvsift
