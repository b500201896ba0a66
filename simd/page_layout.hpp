// Where token t of a pool slot keeps its K and V: the one place that knows.
//
// A slot holds one page of one (sequence, layer, KV head). In a 16-bit dtype (f16, bf16) it is K
// as [page_tokens, head_dim], then V as [page_tokens, head_dim], 2 bytes a value:
// 4 * page_tokens * head_dim bytes. In q8 it is K codes [page_tokens, head_dim] int8, V codes
// [page_tokens, head_dim] int8, then K scales [page_tokens] float32 and V scales [page_tokens]
// float32: 2 * page_tokens * head_dim + 8 * page_tokens bytes (a multiple of 64 for every
// allowed shape). A q8 row stands for scale * code (quantize_q8_row in simd/page_rows.hpp).
// Token rows that selectors gather or reconstruct (Louver, S4R) are packed in chunks of the same
// layout, so one kernel reads pages and rows alike. The pool (lib/cache/page_pool.hpp) places
// slot s at base + s * slot_bytes(), 64-byte aligned.
//
// The cache's append and read, the attention kernels, Louver's gather, S4R's release and
// reconstruction, and the device attention kernel (gpu/sparse_attention.cu) address slots through
// this type; nothing else computes an offset inside a slot (copies of whole slots need only
// slot_bytes()).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

// The device kernels read slots through the same functions.
#ifdef __CUDACC__
#define KVSIFT_HOST_DEVICE __host__ __device__
#else
#define KVSIFT_HOST_DEVICE
#endif

namespace kvsift::simd {

// How the cache stores K and V: two 16-bit floats, or int8 codes with a float32 scale per row.
enum class Dtype : uint8_t { f16 = 0, bf16 = 1, q8 = 2 };

struct PageLayout {
  uint32_t page_tokens = 16;
  uint32_t head_dim = 128;
  Dtype dtype = Dtype::f16;

  KVSIFT_HOST_DEVICE constexpr bool quantized() const noexcept { return dtype == Dtype::q8; }
  // Bytes of one stored value (a q8 code is one byte; its row's scale is counted apart).
  KVSIFT_HOST_DEVICE constexpr std::size_t element_bytes() const noexcept {
    return quantized() ? 1 : 2;
  }
  KVSIFT_HOST_DEVICE constexpr std::size_t page_elems() const noexcept {
    return std::size_t{page_tokens} * head_dim;
  }
  // Bytes of one row of values or codes (a q8 row's scale not included).
  KVSIFT_HOST_DEVICE constexpr std::size_t row_bytes() const noexcept {
    return head_dim * element_bytes();
  }
  KVSIFT_HOST_DEVICE constexpr std::size_t slot_bytes() const noexcept {
    return 2 * page_elems() * element_bytes() + (quantized() ? 2 * page_tokens * 4 : 0);
  }
  // K bytes of one token (and as many V bytes), its scale included.
  KVSIFT_HOST_DEVICE constexpr std::size_t key_bytes() const noexcept {
    return row_bytes() + (quantized() ? 4 : 0);
  }
  KVSIFT_HOST_DEVICE constexpr std::size_t token_bytes() const noexcept { return 2 * key_bytes(); }

  // 16-bit dtypes: the K (V) row of token t (0 <= t < page_tokens) of the slot at `slot`.
  KVSIFT_HOST_DEVICE const uint16_t* key(const std::byte* slot, uint32_t t = 0) const noexcept {
    return reinterpret_cast<const uint16_t*>(slot) + std::size_t{t} * head_dim;
  }
  KVSIFT_HOST_DEVICE const uint16_t* value(const std::byte* slot, uint32_t t = 0) const noexcept {
    return key(slot, t) + page_elems();
  }
  KVSIFT_HOST_DEVICE uint16_t* key(std::byte* slot, uint32_t t = 0) const noexcept {
    return reinterpret_cast<uint16_t*>(slot) + std::size_t{t} * head_dim;
  }
  KVSIFT_HOST_DEVICE uint16_t* value(std::byte* slot, uint32_t t = 0) const noexcept {
    return key(slot, t) + page_elems();
  }
  // q8: the K (V) codes of token t, and the K (V) scales of the page's tokens ([page_tokens]).
  KVSIFT_HOST_DEVICE const int8_t* key_codes(const std::byte* slot, uint32_t t = 0) const noexcept {
    return reinterpret_cast<const int8_t*>(slot) + std::size_t{t} * head_dim;
  }
  KVSIFT_HOST_DEVICE const int8_t* value_codes(const std::byte* slot,
                                               uint32_t t = 0) const noexcept {
    return key_codes(slot, t) + page_elems();
  }
  KVSIFT_HOST_DEVICE int8_t* key_codes(std::byte* slot, uint32_t t = 0) const noexcept {
    return reinterpret_cast<int8_t*>(slot) + std::size_t{t} * head_dim;
  }
  KVSIFT_HOST_DEVICE int8_t* value_codes(std::byte* slot, uint32_t t = 0) const noexcept {
    return key_codes(slot, t) + page_elems();
  }
  KVSIFT_HOST_DEVICE const float* key_scales(const std::byte* slot) const noexcept {
    return reinterpret_cast<const float*>(slot + 2 * page_elems());
  }
  KVSIFT_HOST_DEVICE const float* value_scales(const std::byte* slot) const noexcept {
    return key_scales(slot) + page_tokens;
  }
  KVSIFT_HOST_DEVICE float* key_scales(std::byte* slot) const noexcept {
    return reinterpret_cast<float*>(slot + 2 * page_elems());
  }
  KVSIFT_HOST_DEVICE float* value_scales(std::byte* slot) const noexcept {
    return key_scales(slot) + page_tokens;
  }

  // Copies token `from_t` of slot `from` (K and V, with their scales) to token `to_t` of slot `to`
  // (a gather of single tokens into packed chunks).
  void copy_token(const std::byte* from, uint32_t from_t, std::byte* to,
                  uint32_t to_t) const noexcept {
    if (quantized()) {
      std::memcpy(key_codes(to, to_t), key_codes(from, from_t), head_dim);
      std::memcpy(value_codes(to, to_t), value_codes(from, from_t), head_dim);
      key_scales(to)[to_t] = key_scales(from)[from_t];
      value_scales(to)[to_t] = value_scales(from)[from_t];
    } else {
      std::memcpy(key(to, to_t), key(from, from_t), row_bytes());
      std::memcpy(value(to, to_t), value(from, from_t), row_bytes());
    }
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
