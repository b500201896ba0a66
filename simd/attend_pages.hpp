// The page walk of a decode-attention job (simd/kernels.hpp, AttendJob), shared by the kernels
// that attend (simd/attend_body.hpp, simd/x86/attend_avx512_vnni.cpp): the job's fresh online-
// softmax state, and its pages in order with each one's token count. Include only from a kernel
// translation unit: everything here has internal linkage.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "simd/kernels.hpp"

namespace kvsift::simd {
namespace {

// m = -inf, l = 0 and acc = 0 for the job's heads: the state before its first page.
inline void start_attend(const AttendJob& job) noexcept {
  const std::size_t G = job.group, d = job.layout.head_dim;
  for (std::size_t g = 0; g < G; ++g) {
    job.m[g] = -std::numeric_limits<float>::infinity();
    job.l[g] = 0.0f;
  }
  for (std::size_t i = 0; i < G * d; ++i) job.acc[i] = 0.0f;
}

// Calls page(bytes, n) for each of the job's pages in order: its slot's bytes and its tokens
// (the page holding the last token may be partial).
template <class PageFn>
void walk_pages(const AttendJob& job, PageFn&& page) noexcept {
  const PageLayout layout = job.layout;
  const uint32_t B = layout.page_tokens;
  auto page_of = [&job](uint32_t i) {
    return job.logical ? job.logical[job.first + i] : job.first + i;
  };
  for (uint32_t i = 0; i < job.count; ++i) {
    const uint32_t p = page_of(i);
    const std::size_t slot = job.table ? job.table[p] : p;
    const std::byte* bytes = layout.slot(job.pool, slot);
    const uint64_t left = job.seq_tokens - uint64_t{p} * B;
    const uint32_t n = left < B ? static_cast<uint32_t>(left) : B;
    // A next page that is not the adjacent slot starts no hardware prefetch stream: it is
    // fetched into L2 while this one is computed (BM_attend_scattered, llama8b 128K, one
    // thread: 7.4 GB/s without this, 8.8 with it, against 17 for adjacent pages). Adjacent
    // pages are left to the hardware: prefetching them too made them slower on Zen 4. Unless
    // the slot is not a whole number of 4 KiB memory pages (a q8 slot is 2Td + 8T bytes,
    // simd/page_layout.hpp): the hardware streams stop at every 4 KiB boundary, which then falls
    // mid-slot, so adjacent q8 pages are prefetched too (llama8b 128K q8, two threads, Intel Xeon
    // family 6 model 207: 0.76 of the read probe without, 0.96 with; fp16 unchanged).
    constexpr std::size_t kMemoryPage = 4096;
    if (i + 1 < job.count) {
      const uint32_t next_page = page_of(i + 1);
      const std::size_t next = job.table ? job.table[next_page] : next_page;
      if (next != slot + 1 || layout.slot_bytes() % kMemoryPage != 0) {
        const std::byte* ahead = layout.slot(job.pool, next);
        for (std::size_t o = 0; o < layout.slot_bytes(); o += 64)
          __builtin_prefetch(ahead + o, 0, 2);
      }
    }
    page(bytes, n);
  }
}

}  // namespace
}  // namespace kvsift::simd
