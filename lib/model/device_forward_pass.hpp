// The forward pass on a CUDA device (lib/model/forward_pass.hpp) through gpu/device_llama.hpp:
// the weights live on the device and the products, norms, RoPE, SwiGLU, the output head and the
// prefill attention run there, while the K/V stay in the host cache (the runner appends the
// layer's k and v from pinned buffers) and decode attention runs through the runner's engine.
// Its numerics follow CpuForwardPass with bf16 weights (gpu/device_llama.hpp says how far).
//
// Prefill attention reads a device scratch copy of one sequence's K/V: prefill_begin() reloads
// from the host cache whatever positions the scratch lacks (the sequence decoded since, or
// another sequence was prefilled since).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "gpu/device_llama.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/model/forward_pass.hpp"
#include "lib/model/llama_weights.hpp"

namespace kvsift::model {

class DeviceForwardPass final : public ForwardPass {
 public:
  // Copies the weights (bf16) to `device` for passes of up to max_rows tokens at positions below
  // n_ctx, whose prefill scratch stores K/V as kv_dtype rounds them (gpu/device_llama.hpp); `cache`
  // (borrowed: it must outlive the pass) is where the scratch is reloaded from. Throws Error:
  // invalid_argument (f32 weights), unsupported (no usable device), internal (a device failure).
  DeviceForwardPass(LlamaWeights weights, const LlamaConfig& config, const KvCache& cache,
                    int device, uint32_t max_rows, uint32_t n_ctx, simd::Dtype kv_dtype);

  // The rows are dequantized on the host, exact where the bf16 table's values are not.
  void embed(std::span<const int32_t> tokens) override;

  AttentionIo decode_inputs(uint32_t layer, const uint64_t* positions) override {
    return inputs(layer, positions);
  }
  // Uploads io.out; through a decode graph (gpu/device_llama.hpp).
  void decode_finish(uint32_t layer) override;
  void decode_logits(uint32_t first, uint32_t n, float* out) override { logits(first, n, out); }

  void prefill_begin(int32_t seq_id, uint64_t pos0) override;
  AttentionIo prefill_inputs(uint32_t layer, const uint64_t* positions) override {
    return inputs(layer, positions);
  }
  // On the device, into its own attention output (io.out is not written).
  void prefill_attention(uint32_t layer, int32_t seq_id, uint64_t pos0,
                         const AttentionIo& io) override;
  void prefill_finish(uint32_t layer) override;
  void prefill_logits(uint32_t first, uint32_t n, float* out) override { logits(first, n, out); }

  void forget_sequence(int32_t seq_id) noexcept override;

 private:
  AttentionIo inputs(uint32_t layer, const uint64_t* positions);
  void logits(uint32_t first, uint32_t n, float* out);

  LlamaWeights weights_;
  LlamaConfig config_;
  const KvCache& cache_;
  gpu::DeviceLlama device_;
  int32_t prefill_seq_ = -1;         // the sequence the device's prefill scratch holds
  std::vector<uint32_t> pass_rows_;  // 0, 1, ..., max_rows - 1: the rows logits() reads
  std::vector<float> x_;             // [max_rows, n_embd]: the embeddings load_embeddings() takes
  uint32_t rows_ = 0;                // the pass's
};

}  // namespace kvsift::model
