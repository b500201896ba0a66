// DevicePageCache in a build without the CUDA Toolkit: init() checks its arguments, then reports
// "unsupported"; nothing is ever allocated, so ensure() refuses too.
#include <utility>

#include "gpu/page_transfer.hpp"

namespace kvsift::gpu {

struct DevicePageCache::Device {};

DevicePageCache::DevicePageCache() = default;
DevicePageCache::~DevicePageCache() = default;
DevicePageCache::DevicePageCache(DevicePageCache&& other) noexcept = default;
DevicePageCache& DevicePageCache::operator=(DevicePageCache&& other) noexcept = default;

const void* DevicePageCache::device_pool() const noexcept {
  return nullptr;
}

Result DevicePageCache::init(const PageCacheConfig& config) {
  if (Result r = validate(config); !r.ok) return r;
  return without_cuda("GPU page cache");
}

Result DevicePageCache::ensure(const uint32_t*, std::size_t, uint32_t*, void*,
                               TransferPath) noexcept {
  return without_cuda("GPU page cache");
}

Result DevicePageCache::move_staged(void*) noexcept {
  return without_cuda("GPU page cache");
}

Result DevicePageCache::move_mapped(void*) noexcept {
  return without_cuda("GPU page cache");
}

}  // namespace kvsift::gpu
