#include "lib/cache/geometry.hpp"

#include "lib/core/error.hpp"

namespace kvsift {

void CacheGeometry::validate() const {
  require(n_layers >= 1 && n_layers <= kMaxLayers, "n_layers=", n_layers, " is not in 1..",
          kMaxLayers);
  require(n_kv_heads >= 1 && n_kv_heads <= kMaxKvHeads, "n_kv_heads=", n_kv_heads, " is not in 1..",
          kMaxKvHeads);
  require(group_size >= 1 && group_size <= kMaxGroupSize, "group_size=", group_size,
          " is not in 1..", kMaxGroupSize);
  if (head_dim != 64 && head_dim != 128 && head_dim != 256)
    fail(Status::unsupported, "head_dim=", head_dim, " is not supported (64, 128 or 256)");
  if (page_tokens != 16 && page_tokens != 32 && page_tokens != 64)
    fail(Status::unsupported, "page_tokens=", page_tokens, " is not supported (16, 32 or 64)");
  require(dtype == simd::Dtype::f16 || dtype == simd::Dtype::bf16 || dtype == simd::Dtype::q8,
          "dtype=", static_cast<int>(dtype), " is not fp16, bf16 or q8");
}

}  // namespace kvsift
