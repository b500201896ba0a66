// The host half of the transfer engine (gpu/page_transfer.hpp): names, configuration checks, and
// DevicePageCache's bookkeeping over the CUDA backend's device pool (gpu/backend.hpp's PagePool;
// gpu/page_transfer.cu moves the pages).
#include <cstdint>
#include <string>
#include <utility>

#include "gpu/backend_loader.hpp"
#include "gpu/page_transfer.hpp"

namespace kvsift::gpu {
namespace {

// The largest slot kvsift makes is 64 KiB (64 tokens x 256 dims x K, V x 2 bytes); the bounds keep
// a chunk's 16-byte vectors countable in 32 bits.
constexpr std::size_t kMaxSlotBytes = std::size_t{1} << 20;
constexpr std::size_t kMaxChunkBytes = std::size_t{1} << 30;

}  // namespace

const char* transfer_path_name(TransferPath path) noexcept {
  switch (path) {
    case TransferPath::staged: return "staged";
    case TransferPath::mapped: return "mapped";
    default: return "automatic";
  }
}

Result validate(const PageCacheConfig& c) {
  auto invalid = [](const std::string& message) {
    return Result::invalid("page cache: " + message);
  };
  if (c.slot_bytes < 16 || c.slot_bytes > kMaxSlotBytes || c.slot_bytes % 16 != 0)
    return invalid("slot_bytes " + std::to_string(c.slot_bytes) +
                   " is not a multiple of 16 in 16..1 MiB");
  if (c.capacity == 0 || c.capacity >= (uint32_t{1} << 31))
    return invalid("capacity " + std::to_string(c.capacity) + " slots is outside 1..2^31 - 1");
  if (c.reserved_slots > (uint64_t{1} << 31) - c.capacity)
    return invalid("capacity + reserved_slots " + std::to_string(c.capacity + c.reserved_slots) +
                   " is above 2^31");
  if (c.host_slots == 0 || c.host_slots > PageResidency::kNone)
    return invalid("host_slots " + std::to_string(c.host_slots) + " is outside 1..2^32 - 1");
  if (c.mirror && c.capacity != c.host_slots)
    return invalid("a mirror's capacity " + std::to_string(c.capacity) + " is not host_slots " +
                   std::to_string(c.host_slots));
  if (c.host_pool == nullptr) return invalid("host_pool is null");
  if (reinterpret_cast<std::uintptr_t>(c.host_pool) % 16 != 0)
    return invalid("host_pool is not 16-byte aligned");
  if (c.staging_chunk_bytes < c.slot_bytes + sizeof(uint32_t) ||
      c.staging_chunk_bytes > kMaxChunkBytes)
    return invalid("staging_chunk_bytes " + std::to_string(c.staging_chunk_bytes) +
                   " is outside slot_bytes + 4..1 GiB");
  if (c.path != TransferPath::automatic && c.path != TransferPath::staged &&
      c.path != TransferPath::mapped)
    return invalid("unknown transfer path");
  if (c.policy != EvictionPolicy::lru && c.policy != EvictionPolicy::clock)
    return invalid("unknown eviction policy");
  return Result{};
}

DevicePageCache::DevicePageCache() = default;
DevicePageCache::~DevicePageCache() = default;
DevicePageCache::DevicePageCache(DevicePageCache&& other) noexcept = default;
DevicePageCache& DevicePageCache::operator=(DevicePageCache&& other) noexcept = default;

const void* DevicePageCache::device_pool() const noexcept {
  return device_ ? device_->device_pool() : nullptr;
}

Result DevicePageCache::init(const PageCacheConfig& config) {
  device_.reset();
  if (Result r = validate(config); !r.ok) return r;
  std::unique_ptr<backend::PagePool> pool;
  if (Result r = make_impl(&pool, &backend::Backend::make_page_pool, "GPU page cache"); !r.ok)
    return r;
  if (Result r = pool->init(config); !r.ok) return r;
  residency_ = PageResidency{};
  if (!config.mirror)
    if (Result r = residency_.init(config.capacity, config.host_slots, config.policy); !r.ok)
      return r;
  moves_.clear();
  moves_.reserve(config.capacity);
  planned_ = false;
  config_ = config;
  device_ = std::move(pool);
  last_ = {};
  totals_ = {};
  return Result{};
}

Result DevicePageCache::ensure(const uint32_t* host_slots, std::size_t n, uint32_t* device_slots,
                               void* stream, TransferPath path) noexcept {
  if (Result r = plan(host_slots, n, device_slots); !r.ok) return r;
  return move(stream, nullptr, 0, path);
}

Result DevicePageCache::plan(const uint32_t* host_slots, std::size_t n, uint32_t* device_slots,
                             StepMode mode) noexcept {
  if (!device_) return Result::invalid("page cache: plan() before a successful init()");
  if (config_.mirror) return Result::invalid("page cache: a mirror has no residency to plan");
  planned_ = false;
  if (mode == StepMode::next) step_moves_ = 0;
  if (Result r = residency_.plan(host_slots, n, device_slots, mode); !r.ok) return r;
  planned_ = true;
  return Result{};
}

Result DevicePageCache::move(void* stream, const PageMove* extra, std::size_t n_extra,
                             TransferPath path) noexcept {
  if (!device_) return Result::invalid("page cache: move() before a successful init()");
  if (!planned_ && !config_.mirror)
    return Result::invalid("page cache: move() without a plan() of its own");
  planned_ = false;
  // A refused move ends its plan: the plan's misses were mapped to slots that will not be
  // filled, so they are forgotten (misses again next time), as when the transfer fails.
  const auto refuse = [this](const std::string& message) {
    residency_.forget_moves();
    return Result::invalid("page cache: " + message);
  };
  if (path == TransferPath::automatic) path = config_.path;
  if (path == TransferPath::mapped && !device_->host_pool_mapped())
    return refuse("path mapped needs host_pool in mapped pinned memory (pinned_alloc)");
  const std::vector<PageMove>& misses = residency_.moves();
  if (n_extra > 0 && extra == nullptr) return refuse("extra moves are NULL");
  // The mapped path's pinned move list holds capacity() moves (gpu/page_transfer.cu), the step's
  // earlier pieces' first. A mirror plans nothing: each move() is a list of its own.
  const std::size_t list_offset = config_.mirror ? 0 : step_moves_;
  if (list_offset + misses.size() + n_extra > capacity())
    return refuse(std::to_string(misses.size()) + " misses and " + std::to_string(n_extra) +
                  " extra moves after the step's " + std::to_string(list_offset) +
                  " are more than the cache's " + std::to_string(capacity()) + " slots");
  for (std::size_t i = 0; i < n_extra; ++i)
    if (extra[i].host_slot >= config_.host_slots || extra[i].device_slot >= capacity() ||
        (config_.mirror && extra[i].device_slot != extra[i].host_slot))
      return refuse("extra move " + std::to_string(i) + " (host slot " +
                    std::to_string(extra[i].host_slot) + ", device slot " +
                    std::to_string(extra[i].device_slot) + ") is outside the pools" +
                    (config_.mirror ? " or not to its own slot (a mirror)" : ""));
  // A mirror's moves are all first copies or refreshes, told apart by the caller alone: counted
  // as misses here.
  StepCounts counts = residency_.last_counts();
  if (config_.mirror) counts = StepCounts{n_extra, 0, n_extra, 0};
  const uint64_t bytes = counts.misses * config_.slot_bytes;
  const uint64_t sent = (misses.size() + n_extra) * config_.slot_bytes;
  if (path == TransferPath::automatic)
    path = sent < config_.mapped_below_bytes && device_->host_pool_mapped() ? TransferPath::mapped
                                                                            : TransferPath::staged;
  moves_.assign(misses.begin(), misses.end());  // within the capacity reserved: no allocation
  moves_.insert(moves_.end(), extra, extra + n_extra);
  if (!moves_.empty()) {
    Result r = path == TransferPath::mapped
                   ? device_->move_mapped(moves_.data(), moves_.size(), list_offset, stream)
                   : device_->move_staged(moves_.data(), moves_.size(), stream);
    if (!r.ok) {
      residency_.forget_moves();
      return r;
    }
  }
  step_moves_ = list_offset + moves_.size();
  last_ = TransferStats{};
  last_.steps = 1;
  last_.requested = counts.requested;
  last_.hits = counts.hits;
  last_.misses = counts.misses;
  last_.evictions = counts.evictions;
  last_.bytes_moved = bytes;
  last_.staged_steps = !moves_.empty() && path == TransferPath::staged;
  last_.mapped_steps = !moves_.empty() && path == TransferPath::mapped;
  totals_.steps += 1;
  totals_.requested += last_.requested;
  totals_.hits += last_.hits;
  totals_.misses += last_.misses;
  totals_.evictions += last_.evictions;
  totals_.bytes_moved += last_.bytes_moved;
  totals_.staged_steps += last_.staged_steps;
  totals_.mapped_steps += last_.mapped_steps;
  return Result{};
}

}  // namespace kvsift::gpu
