// ggml block formats to float32 (layouts: docs/eval.md, ggml block layouts).
#pragma once

#include <cstddef>
#include <cstdint>

#include "lib/model/gguf_file.hpp"

namespace kvsift::model {

// Whether kvsift can dequantize the type: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K.
bool is_supported(GgmlType type) noexcept;
// Elements per block and bytes per block (1 and the element size for F32/F16/BF16).
std::size_t block_elements(GgmlType type) noexcept;
std::size_t block_bytes(GgmlType type) noexcept;
// Bytes of a row of n elements; throws Error(invalid_file) when n is not a whole number of blocks
// or the type is unsupported.
std::size_t row_bytes(GgmlType type, uint64_t n);

// n elements (a whole number of blocks) from src to dst.
void dequantize(GgmlType type, const void* src, float* dst, std::size_t n) noexcept;

}  // namespace kvsift::model
