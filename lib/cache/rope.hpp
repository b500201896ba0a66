// Rotary position embedding as GGUF stores Llama weights: each adjacent pair (2i, 2i+1) of a
// head's channels rotates by pos * theta^(-2i/d). One implementation for the model runner and for
// a cache that takes pre-RoPE keys, so both rotate bit-identically.
#pragma once

#include <cstdint>
#include <vector>

namespace kvsift {

class Rope {
 public:
  // Throws Error(invalid_argument) for theta <= 0 (or not finite) or an odd head_dim.
  Rope(float theta, uint32_t head_dim);

  // Makes the cos/sin table cover positions [0, positions). Throws out_of_memory.
  void reserve(uint64_t positions);
  uint64_t positions() const noexcept { return positions_; }
  float theta() const noexcept { return theta_; }

  // x: [n_heads, head_dim], rotated in place to (rotate) or back from (unrotate) position pos.
  // Require pos < positions().
  void rotate(float* x, uint32_t n_heads, uint64_t pos) const noexcept { turn(x, n_heads, pos, 1); }
  void unrotate(float* x, uint32_t n_heads, uint64_t pos) const noexcept {
    turn(x, n_heads, pos, -1);
  }

 private:
  // By +angle (direction 1) or -angle (-1): sin(-a) = -sin(a), so unrotating is exact as well.
  void turn(float* x, uint32_t n_heads, uint64_t pos, float direction) const noexcept;

  float theta_;
  uint32_t head_dim_;
  uint64_t positions_ = 0;
  std::vector<float> cos_, sin_;  // [positions, head_dim / 2]
};

}  // namespace kvsift
