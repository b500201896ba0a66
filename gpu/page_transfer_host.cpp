// The host side of the transfer engine that both builds share (gpu/page_transfer.hpp): names,
// configuration checks and the CPU gather of the staged path.
#include <omp.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <string>

#include "gpu/page_transfer.hpp"

namespace kvsift::gpu {
namespace {

// Below this many bytes one thread copies alone: a page copy runs at ~10 GB/s per core
// (9.3 GB/s single-thread streaming: docs/platform-notes.md, CPU: read bandwidth), so 128 KiB is
// ~13 us, past the few microseconds an OpenMP fork and join costs.
constexpr std::size_t kParallelGatherBytes = std::size_t{128} << 10;
// The largest slot kvsift makes is 64 KiB (64 tokens x 256 dims x K, V x 2 bytes); the bounds keep
// a chunk's 16-byte vectors countable in 32 bits.
constexpr std::size_t kMaxSlotBytes = std::size_t{1} << 20;
constexpr std::size_t kMaxChunkBytes = std::size_t{1} << 30;

// Staging is written once and read by the copy engine, never by the CPU: streaming stores skip
// the read-for-ownership of each destination line, so a gathered byte costs DRAM one read and one
// write instead of two reads and a write. The staged path is bound by DRAM bandwidth on the H200
// host (16 threads gather alone at 67-84 GB/s, yet gather + copy pipelined reached only 16-22 GB/s
// while the DMA read the staging too: bench/bench_gpu_transfer.cpp).
void copy_page(unsigned char* to, const unsigned char* from, std::size_t bytes, bool aligned) {
#if defined(__SSE2__)
  if (aligned) {
    auto* d = reinterpret_cast<__m128i*>(to);
    const auto* s = reinterpret_cast<const __m128i*>(from);
    for (std::size_t i = 0; i < bytes / 16; ++i) _mm_stream_si128(d + i, _mm_load_si128(s + i));
    _mm_sfence();  // visible before the copy engine is told to read them
    return;
  }
#endif
  (void)aligned;
  std::memcpy(to, from, bytes);
}

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
  if (c.slot_bytes < 16 || c.slot_bytes > kMaxSlotBytes || (c.slot_bytes & (c.slot_bytes - 1)) != 0)
    return invalid("slot_bytes " + std::to_string(c.slot_bytes) +
                   " is not a power of two in 16..1 MiB");
  if (c.capacity == 0 || c.capacity >= (uint32_t{1} << 31))
    return invalid("capacity " + std::to_string(c.capacity) + " slots is outside 1..2^31 - 1");
  if (c.reserved_slots > (uint64_t{1} << 31) - c.capacity)
    return invalid("capacity + reserved_slots " + std::to_string(c.capacity + c.reserved_slots) +
                   " is above 2^31");
  if (c.host_slots == 0 || c.host_slots > PageResidency::kNone)
    return invalid("host_slots " + std::to_string(c.host_slots) + " is outside 1..2^32 - 1");
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

void gather_pages(const void* host_pool, std::size_t slot_bytes, const PageMove* moves,
                  std::size_t n, void* staging, uint32_t threads) noexcept {
  const auto* from = static_cast<const unsigned char*>(host_pool);
  auto* to = static_cast<unsigned char*>(staging);
  const auto count = static_cast<long long>(n);
  const int team = threads > 0 ? static_cast<int>(threads) : omp_get_max_threads();
  const bool aligned =
      (reinterpret_cast<std::uintptr_t>(from) | reinterpret_cast<std::uintptr_t>(to) | slot_bytes) %
          16 ==
      0;
#pragma omp parallel for schedule(static) \
    num_threads(team) if (n * slot_bytes >= kParallelGatherBytes)
  for (long long i = 0; i < count; ++i)
    copy_page(to + static_cast<std::size_t>(i) * slot_bytes,
              from + std::size_t{moves[i].host_slot} * slot_bytes, slot_bytes, aligned);
  auto* slots = reinterpret_cast<uint32_t*>(to + n * slot_bytes);
  for (std::size_t i = 0; i < n; ++i) slots[i] = moves[i].device_slot;
}

}  // namespace kvsift::gpu
