// The forward pass on the CPU (lib/model/forward_pass.hpp): bf16 or f32 weights multiplied with
// oneDNN (lib/model/matmul.hpp), or, for decode rows with bf16 weights, with the matrix-vector
// kernels that stream the weights once; prefill attention through PrefillAttention over the host
// cache. Every product's input is rounded to the weights' type first (bf16: round to nearest
// even), with float32 accumulation.
//
// Layers kept in the file's blocks (Linear::quantized): decode rows go through matvec_quant, with
// the inputs quantized per block of 32 (simd/quant.hpp), as llama.cpp runs them; prefill
// dequantizes kQuantTileRows output rows at a time to bf16 and multiplies each tile with oneDNN
// (no oneDNN 2.6 product reads ggml's blocks), so a prefill costs one pass of dequantization over
// the weights besides the products.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "lib/model/prefill_attention.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/cache/rope.hpp"
#include "lib/core/aligned.hpp"
#include "lib/model/matmul.hpp"
#include "lib/core/thread_pool.hpp"
#include "lib/model/forward_pass.hpp"
#include "lib/model/llama_weights.hpp"

namespace kvsift::model {

class CpuForwardPass final : public ForwardPass {
 public:
  // Output rows of a quantized layer dequantized per prefill tile.
  static constexpr uint32_t kQuantTileRows = 256;

  // Passes of up to max_rows tokens (prefill chunks of up to max_chunk) at positions below n_ctx,
  // with the prefill attention reading `cache`, the conversions and matrix-vector products through
  // `kernels` (the handle's table) and the work on `pool` (all borrowed: they must outlive the
  // pass). Throws Error: invalid_argument (sizes), out_of_memory.
  CpuForwardPass(LlamaWeights weights, const LlamaConfig& config, const KvCache& cache,
                 const simd::Kernels& kernels, ThreadPool& pool, uint32_t max_rows,
                 uint32_t max_chunk, uint32_t n_ctx);

  void embed(std::span<const int32_t> tokens) override;

  AttentionIo decode_inputs(uint32_t layer, const uint64_t* positions) override {
    return inputs(layer, positions, &CpuForwardPass::matvec);
  }
  void decode_finish(uint32_t layer) override { finish(layer, &CpuForwardPass::matvec); }
  void decode_logits(uint32_t first, uint32_t n, float* out) override {
    logits(first, n, out, &CpuForwardPass::matvec);
  }

  void prefill_begin(int32_t, uint64_t) override {}  // the cache holds what attention reads
  AttentionIo prefill_inputs(uint32_t layer, const uint64_t* positions) override {
    return inputs(layer, positions, &CpuForwardPass::matmul);
  }
  void prefill_attention(uint32_t layer, int32_t seq_id, uint64_t pos0,
                         const AttentionIo& io) override;
  void prefill_finish(uint32_t layer) override { finish(layer, &CpuForwardPass::matmul); }
  void prefill_logits(uint32_t first, uint32_t n, float* out) override {
    logits(first, n, out, &CpuForwardPass::matmul);
  }

  void forget_sequence(int32_t) noexcept override {}

 private:
  // y [rows, w.out] = x [rows, w.in] times w's transpose.
  using Product = void (CpuForwardPass::*)(const Linear& w, const float* x, uint32_t rows,
                                           float* y);
  // A matrix product through oneDNN; bf16 weights round x to bf16 first.
  void matmul(const Linear& w, const float* x, uint32_t rows, float* y);
  // Matrix-vector products over the rows (a few sequences' decode tokens) that stream the weights
  // once, split by output rows across the threads; x rounded to bf16 as matmul() rounds it. Where
  // the kernel does not apply (f32 weights, more rows than simd::kMaxVectors, w.in not a multiple
  // of 16), matmul(). Quantized layers: matvec_quant for up to kMaxVectors rows.
  void matvec(const Linear& w, const float* x, uint32_t rows, float* y);
  // The two products of a quantized layer.
  void matvec_quantized(const Linear& w, const float* x, uint32_t rows, float* y);
  void matmul_quantized(const Linear& w, const float* x, uint32_t rows, float* y);

  AttentionIo inputs(uint32_t layer, const uint64_t* positions, Product product);
  void finish(uint32_t layer, Product product);
  void logits(uint32_t first, uint32_t n, float* out, Product product);
  void rms_norm(const float* x, const std::vector<float>& weight, uint32_t rows, float* y) const;

  LlamaWeights weights_;
  LlamaConfig config_;
  const KvCache& cache_;
  const simd::Kernels& kernels_;
  ThreadPool& pool_;
  Matmul matmul_;  // the projections' and the prefill attention's
  Rope rope_;      // the queries'; the cache rotates the keys with its own
  PrefillAttention prefill_attention_;
  uint32_t rows_ = 0;  // the pass's

  // Workspaces sized for max_rows rows.
  AlignedVector<float> x_, h_, qkv_, q_, k_, v_, attn_, gate_up_, ffn_;
  AlignedVector<uint16_t> x_bf16_;
  AlignedVector<float> x_rounded_;  // x_bf16_ back in float32, for matvec_bf16 (decode rows)
  // Quantized layers: the decode rows' codes, scales and block sums (simd::QuantizedVectors); a
  // prefill tile of weights in bf16, its outputs, and a float32 row per thread to dequantize into.
  AlignedVector<int8_t> x_codes_;
  AlignedVector<float> x_scales_;
  AlignedVector<int32_t> x_sums_;
  AlignedVector<uint16_t> tile_bf16_;
  AlignedVector<float> tile_y_, tile_rows_;
};

}  // namespace kvsift::model
