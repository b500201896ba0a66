#include "tests/reference_attention.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace kvsift {

void reference_attention(const float* q, const float* k, const float* v, std::size_t n, uint32_t G,
                         uint32_t d, double* out) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> logits(n);
  for (uint32_t g = 0; g < G; ++g) {
    const float* qg = q + std::size_t{g} * d;
    double m = -std::numeric_limits<double>::infinity();
    for (std::size_t t = 0; t < n; ++t) {
      double dot = 0.0;
      for (uint32_t c = 0; c < d; ++c) dot += double{qg[c]} * double{k[t * d + c]};
      logits[t] = dot * scale;
      m = std::max(m, logits[t]);
    }
    double* o = out + std::size_t{g} * d;
    for (uint32_t c = 0; c < d; ++c) o[c] = 0.0;
    double sum = 0.0;
    for (std::size_t t = 0; t < n; ++t) {
      const double p = std::exp(logits[t] - m);
      sum += p;
      for (uint32_t c = 0; c < d; ++c) o[c] += p * double{v[t * d + c]};
    }
    if (n > 0)
      for (uint32_t c = 0; c < d; ++c) o[c] /= sum;
  }
}

}  // namespace kvsift
