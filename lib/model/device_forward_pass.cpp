#include "lib/model/device_forward_pass.hpp"

#include <algorithm>
#include <numeric>

#include "lib/core/error.hpp"

namespace kvsift::model {

namespace {

// The device model's failures, with gpu/result.hpp's statuses.
void device_check(const gpu::Result& r, const char* what) {
  gpu::check(r, "device model: ", what, ": ");
}

}  // namespace

DeviceForwardPass::DeviceForwardPass(LlamaWeights weights, const LlamaConfig& config,
                                     const KvCache& cache, int device, uint32_t max_rows,
                                     uint32_t n_ctx, simd::Dtype kv_dtype)
    : weights_(std::move(weights)), config_(config), cache_(cache) {
  require(weights_.type() == MatType::bf16,
          "the offload mode (device >= 0) runs bf16 weights; weight_type f32 is CPU only");
  require(!weights_.any_quantized(),
          "the offload mode (device >= 0) runs bf16 weights; quantized weights are CPU only");
  x_.resize(std::size_t{max_rows} * config.n_embd);
  gpu::LlamaShape shape;
  shape.n_layers = config.n_layers;
  shape.n_embd = config.n_embd;
  shape.n_ff = config.n_ff;
  shape.n_heads = config.n_heads;
  shape.n_kv_heads = config.n_kv_heads;
  shape.head_dim = config.head_dim;
  shape.n_vocab = config.n_vocab;
  shape.rope_theta = config.rope_theta;
  shape.rms_eps = config.rms_eps;
  shape.max_rows = max_rows;
  shape.max_positions = n_ctx;
  shape.max_prefill_tokens = n_ctx;
  shape.kv_dtype = kv_dtype;
  gpu::LlamaWeights host;
  for (uint32_t l = 0; l < weights_.n_layers(); ++l) {
    const LayerWeights& L = weights_.layer(l);
    host.layers.push_back({L.wqkv.bf16.data(), L.wo.bf16.data(), L.w_gate_up.bf16.data(),
                           L.w_down.bf16.data(), L.attn_norm.data(), L.ffn_norm.data()});
  }
  // The embedding rows come from the host's dequantisation (load_embeddings), exact where bf16
  // is not; the table is passed for the output head, which is the same tensor when tied.
  host.token_embd = weights_.output().bf16.data();
  host.output = weights_.output().bf16.data();
  host.output_norm = weights_.output_norm().data();
  pass_rows_.resize(max_rows);
  std::iota(pass_rows_.begin(), pass_rows_.end(), 0u);
  device_check(device_.init(shape, host, device), "init");
}

void DeviceForwardPass::embed(std::span<const int32_t> tokens) {
  rows_ = static_cast<uint32_t>(tokens.size());
  for (uint32_t r = 0; r < rows_; ++r)
    weights_.embed(tokens[r], x_.data() + std::size_t{r} * config_.n_embd);
  device_check(device_.load_embeddings(x_.data(), rows_), "load_embeddings");
}

AttentionIo DeviceForwardPass::inputs(uint32_t layer, const uint64_t* positions) {
  device_check(device_.attention_inputs(layer, positions, rows_), "attention_inputs");
  return {device_.q_host(), device_.k_host(), device_.v_host(), device_.attn_host()};
}

void DeviceForwardPass::decode_finish(uint32_t layer) {
  device_check(device_.finish_layer(layer, /*attn_from_host=*/true), "finish_layer");
}

void DeviceForwardPass::prefill_begin(int32_t seq_id, uint64_t pos0) {
  if (prefill_seq_ != seq_id) {
    device_.reset_prefill();
    prefill_seq_ = seq_id;
  }
  const uint32_t H = config_.n_kv_heads, d = config_.head_dim, kvdim = H * d;
  std::vector<float> k, v, head_k, head_v;
  for (uint32_t l = 0; l < config_.n_layers; ++l) {
    const uint64_t held = std::min(device_.prefill_held(l), pos0);
    if (held == pos0) continue;
    // Positions appended since (decode steps) or never held (another sequence's prefill since),
    // as the cache reads them back (a q8 cache's rows dequantized; the device rounds them to its
    // scratch's dtype).
    const uint64_t n = pos0 - held;
    k.resize(n * kvdim);
    v.resize(n * kvdim);
    head_k.resize(n * d);
    head_v.resize(n * d);
    for (uint32_t h = 0; h < H; ++h) {
      cache_.read_tokens(seq_id, l, h, held, n, head_k.data(), head_v.data(), KeyForm::post_rope);
      for (uint64_t t = 0; t < n; ++t) {
        std::copy_n(head_k.data() + t * d, d, k.data() + t * kvdim + h * d);
        std::copy_n(head_v.data() + t * d, d, v.data() + t * kvdim + h * d);
      }
    }
    device_check(device_.load_prefix(l, held, k.data(), v.data(), n), "load_prefix");
  }
}

void DeviceForwardPass::prefill_attention(uint32_t layer, int32_t, uint64_t pos0,
                                          const AttentionIo&) {
  device_check(device_.prefill_attention(layer, pos0, rows_), "prefill_attention");
}

void DeviceForwardPass::prefill_finish(uint32_t layer) {
  device_check(device_.finish_layer(layer, /*attn_from_host=*/false), "finish_layer");
}

void DeviceForwardPass::logits(uint32_t first, uint32_t n, float* out) {
  device_check(device_.logits(pass_rows_.data() + first, n, out), "logits");
}

void DeviceForwardPass::forget_sequence(int32_t seq_id) noexcept {
  // Its id may come back (create or fork): the scratch must not pass for the new sequence's.
  if (prefill_seq_ == seq_id) prefill_seq_ = -1;
}

}  // namespace kvsift::model
