// Dense matrix products through oneDNN, with primitives created once per shape and reused.
//
// kvsift uses oneDNN only where the work is matrix-shaped: the model's projections and MLP, and
// prefill attention (research/env.md section 8). Decode attention has its own kernels.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

namespace kvsift {

enum class MatType { f32, bf16 };

// How the right-hand matrix W is stored.
enum class WeightLayout {
  rows_are_outputs,  // W is [N, K] row-major (GGUF/PyTorch linear weights, K in memory): y = x W^T
  rows_are_inputs,   // W is [K, N] row-major: y = x W
};

class Matmul {
 public:
  Matmul();
  ~Matmul();
  Matmul(Matmul&&) noexcept;
  Matmul& operator=(Matmul&&) noexcept;

  // y[M, N] (float32, row-major, overwritten) = x[M, K] (row-major, type x_type) times W.
  // x and W must have the same type (oneDNN 2.6 has no mixed f32 x bf16 product). Throws
  // Error(internal) when oneDNN cannot create the primitive.
  void run(MatType type, const void* x, int64_t M, int64_t K, const void* w, WeightLayout layout,
           int64_t N, float* y);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvsift
