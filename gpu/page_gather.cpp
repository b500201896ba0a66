// The CPU half of the transfer engine's staged path (gpu/page_transfer.hpp's gather_pages). One
// source, compiled into the host library (benchmarks and tests call it) and into the CUDA module
// (gpu/page_transfer.cu's staged path calls it), so that the module needs no symbol of the host.
#include <omp.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <cstdint>
#include <cstring>

#include "gpu/page_transfer.hpp"

namespace kvsift::gpu {
namespace {

// Below this many bytes one thread copies alone: a page copy runs at ~10 GB/s per core
// (9.3 GB/s single-thread streaming: docs/platform-notes.md, CPU: read bandwidth), so 128 KiB is
// ~13 us, past the few microseconds an OpenMP fork and join costs.
constexpr std::size_t kParallelGatherBytes = std::size_t{128} << 10;

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
