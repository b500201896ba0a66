#include "lib/core/host_memory.hpp"

#include <sys/mman.h>

#include <utility>

#include "gpu/host_memory.hpp"
#include "lib/core/error.hpp"

namespace kvsift {

HostRegion::HostRegion(std::size_t bytes, bool pinned, bool huge_pages)
    : bytes_(bytes), pinned_(pinned) {
  if (bytes == 0) return;
  if (pinned) {
    void* p = nullptr;
    gpu::check(gpu::pinned_alloc(bytes, &p));
    data_ = static_cast<std::byte*>(p);
    return;
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    fail(Status::out_of_memory, "cannot reserve ", bytes, " bytes of host memory");
  // Transparent huge pages (Debian's default is "madvise"): a decode step streams the whole
  // selection, and 2 MiB pages take TLB misses out of that stream. Advice only: failure is fine.
  if (huge_pages) madvise(p, bytes, MADV_HUGEPAGE);
  data_ = static_cast<std::byte*>(p);
}

HostRegion::HostRegion(HostRegion&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      pinned_(other.pinned_) {}

HostRegion& HostRegion::operator=(HostRegion&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    pinned_ = other.pinned_;
  }
  return *this;
}

HostRegion::~HostRegion() {
  release();
}

void HostRegion::release() noexcept {
  if (data_ == nullptr) return;
  if (pinned_)
    gpu::pinned_free(data_);
  else
    munmap(data_, bytes_);
  data_ = nullptr;
}

}  // namespace kvsift
