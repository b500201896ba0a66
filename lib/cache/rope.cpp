#include "lib/cache/rope.hpp"

#include <algorithm>
#include <cmath>
#include <new>

#include "lib/core/error.hpp"

namespace kvsift {

Rope::Rope(float theta, uint32_t head_dim) : theta_(theta), head_dim_(head_dim) {
  require(std::isfinite(theta) && theta > 0.0f, "rope theta=", theta, " is not a positive number");
  require(head_dim >= 2 && head_dim % 2 == 0, "rope head_dim=", head_dim, " is not even");
}

void Rope::reserve(uint64_t positions) {
  if (positions <= positions_) return;
  // Grow geometrically: decode appends one position at a time.
  const uint64_t target = std::max(positions, positions_ + positions_ / 2);
  const uint32_t half = head_dim_ / 2;
  try {
    cos_.resize(target * half);
    sin_.resize(target * half);
  } catch (const std::bad_alloc&) {
    fail(Status::out_of_memory, "rope table for ", target, " positions");
  }
  // Angles in double, then rounded once: the table does not depend on how it grew.
  for (uint64_t pos = positions_; pos < target; ++pos)
    for (uint32_t i = 0; i < half; ++i) {
      const double angle =
          static_cast<double>(pos) * std::pow(double{theta_}, -2.0 * i / head_dim_);
      cos_[pos * half + i] = static_cast<float>(std::cos(angle));
      sin_[pos * half + i] = static_cast<float>(std::sin(angle));
    }
  positions_ = target;
}

void Rope::turn(float* x, uint32_t n_heads, uint64_t pos, float direction) const noexcept {
  const uint32_t half = head_dim_ / 2;
  const float* c = cos_.data() + pos * half;
  const float* s = sin_.data() + pos * half;
  for (uint32_t h = 0; h < n_heads; ++h) {
    float* v = x + std::size_t{h} * head_dim_;
    for (uint32_t i = 0; i < half; ++i) {
      const float a = v[2 * i], b = v[2 * i + 1], sn = direction * s[i];
      v[2 * i] = a * c[i] - b * sn;
      v[2 * i + 1] = a * sn + b * c[i];
    }
  }
}

}  // namespace kvsift
