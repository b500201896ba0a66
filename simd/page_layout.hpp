// Where token t of a pool slot keeps its K and V: the one place that knows.
//
// A slot holds one page of one (sequence, layer, KV head): K as [page_tokens, head_dim], then V
// as [page_tokens, head_dim], both in the 2-byte storage dtype (simd::Dtype), so a slot is
// 2 * page_tokens * head_dim * 2 bytes. Token rows that selectors gather or reconstruct (Louver,
// S4R) are packed in chunks of the same layout, so one kernel reads pages and rows alike. The
// pool (lib/cache/page_pool.hpp) places slot s at base + s * slot_bytes(), 64-byte aligned.
//
// The cache's append and read, the attention kernels, Louver's gather, S4R's release and
// reconstruction, and the device attention kernel (gpu/sparse_attention.cu) address slots through
// this type; nothing else computes an offset inside a slot (copies of whole slots need only
// slot_bytes()).
#pragma once

#include <cstddef>
#include <cstdint>

// The device kernels read slots through the same functions.
#ifdef __CUDACC__
#define KVSIFT_HOST_DEVICE __host__ __device__
#else
#define KVSIFT_HOST_DEVICE
#endif

namespace kvsift::simd {

struct PageLayout {
  uint32_t page_tokens = 16;
  uint32_t head_dim = 128;

  static constexpr std::size_t kElementBytes = 2;  // fp16 or bf16

  KVSIFT_HOST_DEVICE constexpr std::size_t page_elems() const noexcept {
    return std::size_t{page_tokens} * head_dim;
  }
  KVSIFT_HOST_DEVICE constexpr std::size_t row_bytes() const noexcept {
    return head_dim * kElementBytes;
  }
  // Elements from a slot's start to its V block.
  KVSIFT_HOST_DEVICE constexpr std::size_t value_offset_elems() const noexcept {
    return page_elems();
  }
  KVSIFT_HOST_DEVICE constexpr std::size_t slot_bytes() const noexcept {
    return 2 * page_elems() * kElementBytes;
  }
  // K and V bytes of one token.
  KVSIFT_HOST_DEVICE constexpr std::size_t token_bytes() const noexcept { return 2 * row_bytes(); }

  // The K (V) row of token t (0 <= t < page_tokens) of the slot starting at `slot`.
  KVSIFT_HOST_DEVICE const uint16_t* key(const std::byte* slot, uint32_t t = 0) const noexcept {
    return reinterpret_cast<const uint16_t*>(slot) + std::size_t{t} * head_dim;
  }
  KVSIFT_HOST_DEVICE const uint16_t* value(const std::byte* slot, uint32_t t = 0) const noexcept {
    return key(slot, t) + value_offset_elems();
  }
  KVSIFT_HOST_DEVICE uint16_t* key(std::byte* slot, uint32_t t = 0) const noexcept {
    return reinterpret_cast<uint16_t*>(slot) + std::size_t{t} * head_dim;
  }
  KVSIFT_HOST_DEVICE uint16_t* value(std::byte* slot, uint32_t t = 0) const noexcept {
    return key(slot, t) + value_offset_elems();
  }
  // The start of slot s of an array of slots (a pool, or packed row chunks).
  KVSIFT_HOST_DEVICE const std::byte* slot(const std::byte* base, std::size_t s) const noexcept {
    return base + s * slot_bytes();
  }
  KVSIFT_HOST_DEVICE std::byte* slot(std::byte* base, std::size_t s) const noexcept {
    return base + s * slot_bytes();
  }
};

}  // namespace kvsift::simd
