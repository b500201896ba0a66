#include "lib/model/cpu_forward_pass.hpp"

#include <algorithm>
#include <cmath>

#include "lib/model/dequantize.hpp"
#include "simd/quant.hpp"

namespace kvsift::model {

CpuForwardPass::CpuForwardPass(LlamaWeights weights, const LlamaConfig& config,
                               const KvCache& cache, const simd::Kernels& kernels, ThreadPool& pool,
                               uint32_t max_rows, uint32_t max_chunk, uint32_t n_ctx)
    : weights_(std::move(weights)),
      config_(config),
      cache_(cache),
      kernels_(kernels),
      pool_(pool),
      matmul_(&pool),
      rope_(config.rope_theta, config.head_dim),
      prefill_attention_(cache.geometry(), max_chunk, n_ctx) {
  rope_.reserve(n_ctx);
  const uint32_t E = config.n_embd, qdim = config.q_dim(), kvdim = config.kv_dim();
  const std::size_t rows = max_rows;
  x_.resize(rows * E);
  h_.resize(rows * E);
  qkv_.resize(rows * (qdim + 2 * kvdim));
  q_.resize(rows * qdim);
  attn_.resize(rows * qdim);
  k_.resize(rows * kvdim);
  v_.resize(rows * kvdim);
  gate_up_.resize(rows * 2 * config.n_ff);
  ffn_.resize(rows * config.n_ff);
  x_bf16_.resize(rows * std::max({E, qdim, config.n_ff}));
  x_rounded_.resize(simd::kMaxVectors * std::max({E, qdim, config.n_ff}));
  if (weights_.any_quantized()) {
    const std::size_t max_in = std::max({E, qdim, config.n_ff});
    x_codes_.resize(simd::kMaxVectors * max_in);
    x_scales_.resize(simd::kMaxVectors * max_in / simd::kQuantBlock);
    x_sums_.resize(simd::kMaxVectors * max_in / simd::kQuantBlock);
    tile_bf16_.resize(std::size_t{kQuantTileRows} * max_in);
    tile_y_.resize(rows * kQuantTileRows);
    tile_rows_.resize(static_cast<std::size_t>(pool.size()) * max_in);
  }
}

void CpuForwardPass::embed(std::span<const int32_t> tokens) {
  rows_ = static_cast<uint32_t>(tokens.size());
  for (uint32_t r = 0; r < rows_; ++r)
    weights_.embed(tokens[r], x_.data() + std::size_t{r} * config_.n_embd);
}

void CpuForwardPass::matmul(const Linear& w, const float* x, uint32_t rows, float* y) {
  if (w.quantized()) {
    matmul_quantized(w, x, rows, y);
  } else if (weights_.type() == MatType::bf16) {
    kernels_.encode(x, x_bf16_.data(), std::size_t{rows} * w.in, simd::Dtype::bf16);
    matmul_.run(MatType::bf16, x_bf16_.data(), rows, w.in, w.bf16.data(),
                WeightLayout::rows_are_outputs, w.out, y);
  } else {
    matmul_.run(MatType::f32, x, rows, w.in, w.f32.data(), WeightLayout::rows_are_outputs, w.out,
                y);
  }
}

void CpuForwardPass::matvec(const Linear& w, const float* x, uint32_t rows, float* y) {
  if (w.quantized() && rows <= simd::kMaxVectors) {
    matvec_quantized(w, x, rows, y);
    return;
  }
  if (w.quantized() || weights_.type() != MatType::bf16 || rows > simd::kMaxVectors || w.in % 16 != 0) {
    matmul(w, x, rows, y);
    return;
  }
  const std::size_t n = std::size_t{rows} * w.in;
  kernels_.encode(x, x_bf16_.data(), n, simd::Dtype::bf16);
  kernels_.decode(x_bf16_.data(), x_rounded_.data(), n, simd::Dtype::bf16);
  const simd::Kernels& kernels = kernels_;
  pool_.parallel_static(w.out, [&](uint64_t first, uint64_t last, int) noexcept {
    kernels.matvec_bf16(w.bf16.data() + first * w.in, last - first, w.in, x_rounded_.data(), rows,
                        y + first, w.out);
  });
}

void CpuForwardPass::matvec_quantized(const Linear& w, const float* x, uint32_t rows, float* y) {
  simd::quantize_vectors(x, rows, w.in, x_codes_.data(), x_scales_.data(), x_sums_.data());
  const simd::QuantizedVectors xq{x_codes_.data(), x_scales_.data(), x_sums_.data()};
  const simd::Kernels& kernels = kernels_;
  parallel_row_groups(pool_, w.out, [&](uint64_t first, uint64_t last, int) noexcept {
    uint64_t start = 0;  // the first output row of each tensor
    for (const BlockRows& part : w.blocks) {
      const uint64_t lo = std::max(first, start), hi = std::min(last, start + part.rows);
      if (lo < hi)
        kernels.matvec_quant(part.format, part.data + (lo - start) * part.row_bytes, hi - lo, w.in,
                             xq, rows, y + lo, w.out);
      start += part.rows;
    }
  });
}

void CpuForwardPass::matmul_quantized(const Linear& w, const float* x, uint32_t rows, float* y) {
  kernels_.encode(x, x_bf16_.data(), std::size_t{rows} * w.in, simd::Dtype::bf16);
  const simd::Kernels& kernels = kernels_;
  for (uint32_t tile = 0; tile < w.out; tile += kQuantTileRows) {
    const uint32_t n = std::min(kQuantTileRows, w.out - tile);
    pool_.parallel_for(n, 16, [&](uint64_t first, uint64_t last, int thread) noexcept {
      float* row = tile_rows_.data() + std::size_t{w.in} * thread;
      for (uint64_t r = first; r < last; ++r) {
        uint64_t at = tile + r;  // the row within its tensor
        const BlockRows* part = w.blocks.data();
        while (at >= part->rows) at -= (part++)->rows;
        dequantize_row(*part, at, w.in, row);
        kernels.encode(row, tile_bf16_.data() + r * w.in, w.in, simd::Dtype::bf16);
      }
    });
    matmul_.run(MatType::bf16, x_bf16_.data(), rows, w.in, tile_bf16_.data(),
                WeightLayout::rows_are_outputs, n, tile_y_.data());
    for (uint32_t r = 0; r < rows; ++r)
      std::copy_n(tile_y_.data() + std::size_t{r} * n, n, y + std::size_t{r} * w.out + tile);
  }
}

void CpuForwardPass::rms_norm(const float* x, const std::vector<float>& weight, uint32_t rows,
                              float* y) const {
  const uint32_t E = config_.n_embd;
  for (uint32_t r = 0; r < rows; ++r) {
    const float* xr = x + std::size_t{r} * E;
    double sum = 0.0;
    for (uint32_t i = 0; i < E; ++i) sum += double{xr[i]} * xr[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(sum / E + config_.rms_eps));
    float* yr = y + std::size_t{r} * E;
    for (uint32_t i = 0; i < E; ++i) yr[i] = xr[i] * inv * weight[i];
  }
}

AttentionIo CpuForwardPass::inputs(uint32_t layer, const uint64_t* positions, Product product) {
  const uint32_t qdim = config_.q_dim(), kvdim = config_.kv_dim();
  const LayerWeights& L = weights_.layer(layer);
  rms_norm(x_.data(), L.attn_norm, rows_, h_.data());
  (this->*product)(L.wqkv, h_.data(), rows_, qkv_.data());
  for (uint32_t r = 0; r < rows_; ++r) {
    const float* row = qkv_.data() + std::size_t{r} * (qdim + 2 * kvdim);
    float* q = q_.data() + std::size_t{r} * qdim;
    float* k = k_.data() + std::size_t{r} * kvdim;
    std::copy_n(row, qdim, q);
    std::copy_n(row + qdim, kvdim, k);
    std::copy_n(row + qdim + kvdim, kvdim, v_.data() + std::size_t{r} * kvdim);
    rope_.rotate(q, config_.n_heads, positions[r]);
  }
  return {q_.data(), k_.data(), v_.data(), attn_.data()};
}

void CpuForwardPass::prefill_attention(uint32_t layer, int32_t seq_id, uint64_t pos0,
                                       const AttentionIo& io) {
  prefill_attention_.run(cache_, seq_id, layer, pos0, rows_, io.q, io.out, matmul_, pool_);
}

void CpuForwardPass::finish(uint32_t layer, Product product) {
  const uint32_t E = config_.n_embd, F = config_.n_ff;
  const LayerWeights& L = weights_.layer(layer);
  (this->*product)(L.wo, attn_.data(), rows_, h_.data());
  for (std::size_t i = 0; i < std::size_t{rows_} * E; ++i) x_[i] += h_[i];
  rms_norm(x_.data(), L.ffn_norm, rows_, h_.data());
  (this->*product)(L.w_gate_up, h_.data(), rows_, gate_up_.data());
  for (uint32_t r = 0; r < rows_; ++r) {
    const float* gate = gate_up_.data() + std::size_t{r} * 2 * F;
    const float* up = gate + F;
    float* out = ffn_.data() + std::size_t{r} * F;
    for (uint32_t i = 0; i < F; ++i)
      out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];  // SiLU(gate) * up
  }
  (this->*product)(L.w_down, ffn_.data(), rows_, h_.data());
  for (std::size_t i = 0; i < std::size_t{rows_} * E; ++i) x_[i] += h_[i];
}

void CpuForwardPass::logits(uint32_t first, uint32_t n, float* out, Product product) {
  rms_norm(x_.data() + std::size_t{first} * config_.n_embd, weights_.output_norm(), n, h_.data());
  (this->*product)(weights_.output(), h_.data(), n, out);
}

}  // namespace kvsift::model
