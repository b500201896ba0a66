// Host memory regions for the page pool and workspaces.
#pragma once

#include <cstddef>

namespace kvsift {

// One contiguous region of host memory, 64-byte aligned (in fact 4 KiB aligned).
//  - pageable: an anonymous mmap, committed lazily by the OS as pages are first written, so a
//    large pool reserved up front costs only the memory actually used;
//  - pinned: page-locked through the CUDA runtime (committed up front), for GPU transfers.
// Move-only; frees on destruction.
class HostRegion {
 public:
  HostRegion() = default;
  // Throws Error: out_of_memory, or unsupported for pinned memory without CUDA. huge_pages
  // (pageable only): advise the OS to back the region with 2 MiB pages.
  HostRegion(std::size_t bytes, bool pinned, bool huge_pages = true);
  HostRegion(HostRegion&& other) noexcept;
  HostRegion& operator=(HostRegion&& other) noexcept;
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;
  ~HostRegion();

  std::byte* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return bytes_; }
  bool pinned() const noexcept { return pinned_; }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
  bool pinned_ = false;
};

}  // namespace kvsift
