// Dense matrix products through oneDNN, with primitives created once per shape and reused.
//
// kvsift uses oneDNN only where the work is matrix-shaped: the model's projections and MLP, and
// prefill attention (docs/platform-notes.md, CPU: oneDNN). Decode attention has its own kernels.
//
// Threads: Debian's oneDNN is built on OpenMP, whose threads spin by default (thread_pool.hpp says
// why kvsift does not use it). A product is split along N over the handle's pool, and each thread
// runs oneDNN on its slice with its own OpenMP thread count at 1 for the duration of the call, so
// oneDNN never starts an OpenMP team and the host's OpenMP setting is left as it was.
#pragma once

#include <cstdint>
#include <memory>

#include "lib/core/thread_pool.hpp"

namespace kvsift {

enum class MatType { f32, bf16 };

// How the right-hand matrix W is stored.
enum class WeightLayout {
  rows_are_outputs,  // W is [N, K] row-major (GGUF/PyTorch linear weights, K in memory): y = x W^T
  rows_are_inputs,   // W is [K, N] row-major: y = x W
};

class Matmul {
 public:
  // pool: the threads that share each product (borrowed: it must outlive this Matmul); nullptr:
  // the calling thread alone.
  explicit Matmul(ThreadPool* pool = nullptr);
  ~Matmul();
  Matmul(Matmul&&) noexcept;
  Matmul& operator=(Matmul&&) noexcept;

  // y[M, N] (float32, row-major, overwritten) = x[M, K] (row-major, type x_type) times W.
  // x and W must have the same type (oneDNN 2.6 has no mixed f32 x bf16 product). Throws
  // Error(internal) when oneDNN cannot create the primitive, Error(out_of_memory). Like any call
  // on a pool, one thread at a time.
  void run(MatType type, const void* x, int64_t M, int64_t K, const void* w, WeightLayout layout,
           int64_t N, float* y);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvsift
