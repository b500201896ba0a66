// Exact attention in float64: the reference every kernel and selector is measured against.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvsift {

// For each of G query heads: out[g] = sum_t softmax_t(q[g] . k[t] / sqrt(d)) v[t].
//   q: [G, d]; k, v: [n, d]; out: [G, d]. n == 0 gives zeros.
void reference_attention(const float* q, const float* k, const float* v, std::size_t n, uint32_t G,
                         uint32_t d, double* out);

}  // namespace kvsift
