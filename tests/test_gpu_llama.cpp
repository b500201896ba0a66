// The device Llama forward pass (gpu/device_llama.hpp) against float64 references on tiny random
// models: each stage on the device's own inputs (embedding, RMSNorm + QKV + RoPE, the rest of a
// layer, prefill attention across chunks and at a few thousand positions, the output head), a whole
// 2-layer forward (a prefill of 37 tokens in chunks, then 3 decode steps with the attention done
// here in float64, as the host runner does it) against a float64 forward of the same tokens, a
// prefill continued through load_prefix, decode graphs against the ungraphed path (bit for bit, and
// their cap on rows values), and the argument and order checks.
//
// The references round where the device (and the CPU runner) rounds: every product's input to
// bf16, stored keys (after RoPE) and values to the cache's dtype (q8: per KV head and row, then
// fp16 as the device's scratch holds them); everything else is float64.
// What is left to differ is fp32 arithmetic (relative 1e-7 per operation, 1e-6 over a dot
// product) and the elements whose fp32 and float64 values round to different bf16 neighbours.
// Such a flip moves one input of one row by a bf16 step (2^-8 relative), which moves that row's
// product by about 2^-8 / sqrt(in): about 1e-4 relative over the 13 rows of a stage test, and in
// a whole forward, once it reaches a stored key or value, every later row (about 1e-3 each). The
// bounds: 5e-4 on a stage whose rounding follows an RMSNorm (flips are rare there), 1e-3 on the
// rest of a layer (its SwiGLU rounding follows a product, where cancellation makes them common;
// 6e-5 measured on a CPU emulation of the kernels), 1e-4 on the attention, which rounds nothing
// but the stored keys and values (1e-6 measured), and 1e-2 on the whole forward (the METHOD's
// bf16 range; 2e-3 measured on the emulation). A wrong layout, position or head mapping gives
// errors of order 1.
//
// The device tests skip where the build has no CUDA or no usable device (the dev box and CI); the
// argument checks run everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu/device_llama.hpp"
#include "gpu/host_memory.hpp"
#include "simd/half.hpp"
#include "simd/page_rows.hpp"
#include "tests/gpu_skip.hpp"

using namespace kvsift;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

#define ASSERT_OK(expr)                         \
  do {                                          \
    const gpu::Result result_ = (expr);         \
    ASSERT_TRUE(result_.ok) << result_.message; \
  } while (0)

// Two shapes: head_dim 64 with groups of 3 and fp16 keys over 2 layers; head_dim 128 with one KV
// head for 4 query heads and bf16 keys. Odd widths everywhere else.
gpu::LlamaShape shape_64() {
  gpu::LlamaShape s;
  s.n_layers = 2;
  s.n_embd = 100;
  s.n_ff = 234;
  s.n_heads = 6;
  s.n_kv_heads = 2;
  s.head_dim = 64;
  s.n_vocab = 517;
  s.rope_theta = 10000.0f;
  s.rms_eps = 1e-5f;
  s.max_rows = 16;
  s.max_positions = 64;
  s.max_prefill_tokens = 48;
  s.kv_dtype = simd::Dtype::f16;
  return s;
}

gpu::LlamaShape shape_128() {
  gpu::LlamaShape s;
  s.n_layers = 1;
  s.n_embd = 72;
  s.n_ff = 90;
  s.n_heads = 4;
  s.n_kv_heads = 1;
  s.head_dim = 128;
  s.n_vocab = 131;
  s.rope_theta = 500000.0f;
  s.rms_eps = 1e-6f;
  s.max_rows = 24;
  s.max_positions = 100;
  s.max_prefill_tokens = 60;
  s.kv_dtype = simd::Dtype::bf16;
  return s;
}

double bf16_round(double v) {
  return simd::bf16_to_f32(simd::f32_to_bf16(static_cast<float>(v)));
}

// One token's kv_dim values (KV head h at h * head_dim) as the host cache stores them and reads
// them back: fp16 and bf16 element by element; q8 per KV head by simd/page_rows.hpp's rule, as
// scale * code. With `scratch`, then as the device's prefill scratch holds them: a q8 cache's
// values in fp16 (gpu/device_llama.hpp).
template <class T>
void cache_round(T* x, const gpu::LlamaShape& s, bool scratch) {
  const uint32_t d = s.head_dim;
  std::vector<float> row(d);
  std::vector<int8_t> codes(d);
  for (uint32_t h = 0; h < s.n_kv_heads; ++h) {
    T* head = x + std::size_t{h} * d;
    for (uint32_t c = 0; c < d; ++c) row[c] = static_cast<float>(head[c]);
    if (s.kv_dtype == simd::Dtype::q8) {
      const float scale = simd::quantize_q8_row(row.data(), d, codes.data());
      for (uint32_t c = 0; c < d; ++c) row[c] = scale * static_cast<float>(codes[c]);
    }
    for (uint32_t c = 0; c < d; ++c) {
      if (s.kv_dtype == simd::Dtype::bf16)
        row[c] = simd::bf16_to_f32(simd::f32_to_bf16(row[c]));
      else if (s.kv_dtype == simd::Dtype::f16 || scratch)
        row[c] = simd::f16_to_f32(simd::f32_to_f16(row[c]));
      head[c] = static_cast<T>(row[c]);
    }
  }
}

gpu::LlamaShape with_kv(gpu::LlamaShape s, simd::Dtype dtype) {
  s.kv_dtype = dtype;
  return s;
}

std::vector<uint16_t> random_bf16(std::size_t n, double scale, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.0f, static_cast<float>(scale));
  std::vector<uint16_t> out(n);
  for (uint16_t& h : out) h = simd::f32_to_bf16(dist(rng));
  return out;
}

std::vector<float> random_floats(std::size_t n, float mean, float stddev, std::mt19937& rng) {
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

// A random model whose activations stay of order 1: weights N(0, 1/in), norms near 1.
struct TinyModel {
  struct Layer {
    std::vector<uint16_t> wqkv, wo, w_gate_up, w_down;
    std::vector<float> attn_norm, ffn_norm;
  };
  gpu::LlamaShape shape;
  std::vector<Layer> layers;
  std::vector<uint16_t> token_embd, output;  // output empty: tied
  std::vector<float> output_norm;

  TinyModel(const gpu::LlamaShape& s, uint32_t seed, bool tied) : shape(s) {
    std::mt19937 rng(seed);
    const uint32_t E = s.n_embd, F = s.n_ff, qdim = s.q_dim(), kvdim = s.kv_dim();
    for (uint32_t l = 0; l < s.n_layers; ++l) {
      Layer L;
      L.wqkv = random_bf16(std::size_t{qdim + 2 * kvdim} * E, 1.0 / std::sqrt(E), rng);
      L.wo = random_bf16(std::size_t{E} * qdim, 1.0 / std::sqrt(qdim), rng);
      L.w_gate_up = random_bf16(std::size_t{2} * F * E, 1.0 / std::sqrt(E), rng);
      L.w_down = random_bf16(std::size_t{E} * F, 1.0 / std::sqrt(F), rng);
      L.attn_norm = random_floats(E, 1.0f, 0.1f, rng);
      L.ffn_norm = random_floats(E, 1.0f, 0.1f, rng);
      layers.push_back(std::move(L));
    }
    token_embd = random_bf16(std::size_t{s.n_vocab} * E, 1.0, rng);
    if (!tied) output = random_bf16(std::size_t{s.n_vocab} * E, 1.0 / std::sqrt(E), rng);
    output_norm = random_floats(E, 1.0f, 0.1f, rng);
  }

  const std::vector<uint16_t>& head() const { return output.empty() ? token_embd : output; }

  gpu::LlamaWeights weights() const {
    gpu::LlamaWeights w;
    for (const Layer& L : layers)
      w.layers.push_back({L.wqkv.data(), L.wo.data(), L.w_gate_up.data(), L.w_down.data(),
                          L.attn_norm.data(), L.ffn_norm.data()});
    w.token_embd = token_embd.data();
    w.output = head().data();
    w.output_norm = output_norm.data();
    return w;
  }
};

// y [rows, out] = x [rows, in] * w^T, w bf16 [out, in], in float64.
std::vector<double> product(const std::vector<uint16_t>& w, uint32_t out, uint32_t in,
                            const std::vector<double>& x, uint32_t rows) {
  std::vector<double> y(std::size_t{rows} * out);
  for (uint32_t r = 0; r < rows; ++r)
    for (uint32_t o = 0; o < out; ++o) {
      double sum = 0.0;
      for (uint32_t i = 0; i < in; ++i)
        sum += double{simd::bf16_to_f32(w[std::size_t{o} * in + i])} * x[std::size_t{r} * in + i];
      y[std::size_t{r} * out + o] = sum;
    }
  return y;
}

// bf16(x * rsqrt(mean(x^2) + eps) * weight), row by row: a product's input.
std::vector<double> rms_norm(const std::vector<double>& x, uint32_t rows, uint32_t n,
                             const std::vector<float>& weight, float eps) {
  std::vector<double> y(x.size());
  for (uint32_t r = 0; r < rows; ++r) {
    const double* xr = x.data() + std::size_t{r} * n;
    double sum = 0.0;
    for (uint32_t i = 0; i < n; ++i) sum += xr[i] * xr[i];
    const double inv = 1.0 / std::sqrt(sum / n + double{eps});
    for (uint32_t i = 0; i < n; ++i)
      y[std::size_t{r} * n + i] = bf16_round(xr[i] * inv * weight[i]);
  }
  return y;
}

// RoPE on adjacent pairs, in float64.
void rotate(double* v, uint32_t n_heads, uint32_t head_dim, uint64_t pos, float theta) {
  for (uint32_t h = 0; h < n_heads; ++h)
    for (uint32_t i = 0; i < head_dim / 2; ++i) {
      const double angle = static_cast<double>(pos) * std::pow(double{theta}, -2.0 * i / head_dim);
      double* p = v + std::size_t{h} * head_dim + 2 * i;
      const double a = p[0], b = p[1];
      p[0] = a * std::cos(angle) - b * std::sin(angle);
      p[1] = a * std::sin(angle) + b * std::cos(angle);
    }
}

// lib/cache/rope.cpp's rotation, in fp32 with its table (float64 angles rounded once).
void rotate_f32(float* v, uint32_t n_heads, uint32_t head_dim, uint64_t pos, float theta) {
  for (uint32_t h = 0; h < n_heads; ++h)
    for (uint32_t i = 0; i < head_dim / 2; ++i) {
      const double angle = static_cast<double>(pos) * std::pow(double{theta}, -2.0 * i / head_dim);
      const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(std::sin(angle));
      float* p = v + std::size_t{h} * head_dim + 2 * i;
      const float a = p[0], b = p[1];
      p[0] = a * c - b * s;
      p[1] = a * s + b * c;
    }
}

// The host cache of one sequence, as the test keeps it: per layer, keys after RoPE and values,
// both rounded as cache_round(scratch) rounds them, by position.
struct HostCache {
  gpu::LlamaShape shape;
  bool scratch;
  std::vector<std::vector<double>> keys, values;  // [layer][pos * kv_dim + c]

  explicit HostCache(const gpu::LlamaShape& s, bool scratch_rounding = true)
      : shape(s), scratch(scratch_rounding), keys(s.n_layers), values(s.n_layers) {}

  // k (pre-RoPE) and v of one token at position pos.
  template <class T>
  void store(uint32_t layer, uint64_t pos, const T* k, const T* v) {
    const uint32_t kvdim = shape.kv_dim();
    std::vector<double> key(k, k + kvdim), value(v, v + kvdim);
    rotate(key.data(), shape.n_kv_heads, shape.head_dim, pos, shape.rope_theta);
    cache_round(key.data(), shape, scratch);
    cache_round(value.data(), shape, scratch);
    keys[layer].resize(std::max(keys[layer].size(), (pos + 1) * kvdim));
    values[layer].resize(keys[layer].size());
    std::copy(key.begin(), key.end(), keys[layer].begin() + pos * kvdim);
    std::copy(value.begin(), value.end(), values[layer].begin() + pos * kvdim);
  }

  // out [q_dim] = softmax(q k^T / sqrt(d)) v over positions [0, visible), every query head.
  template <class T>
  void attend(uint32_t layer, const T* q, uint64_t visible, double* out) const {
    const uint32_t d = shape.head_dim, kvdim = shape.kv_dim();
    const uint32_t group = shape.n_heads / shape.n_kv_heads;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    std::vector<double> scores(visible);
    for (uint32_t h = 0; h < shape.n_heads; ++h) {
      const std::size_t channel = std::size_t{h / group} * d;
      double m = -std::numeric_limits<double>::infinity();
      for (uint64_t j = 0; j < visible; ++j) {
        double dot = 0.0;
        for (uint32_t c = 0; c < d; ++c)
          dot += double(q[std::size_t{h} * d + c]) * keys[layer][j * kvdim + channel + c];
        scores[j] = dot * scale;
        m = std::max(m, scores[j]);
      }
      double sum = 0.0;
      for (uint64_t j = 0; j < visible; ++j) sum += scores[j] = std::exp(scores[j] - m);
      for (uint32_t c = 0; c < d; ++c) {
        double acc = 0.0;
        for (uint64_t j = 0; j < visible; ++j)
          acc += scores[j] * values[layer][j * kvdim + channel + c];
        out[std::size_t{h} * d + c] = acc / sum;
      }
    }
  }
};

// The float64 forward of one sequence's tokens at positions 0 .. n-1: logits [n, n_vocab].
std::vector<double> reference_forward(const TinyModel& m, const std::vector<int32_t>& tokens) {
  const gpu::LlamaShape& s = m.shape;
  const uint32_t n = static_cast<uint32_t>(tokens.size()), E = s.n_embd, F = s.n_ff;
  const uint32_t qdim = s.q_dim(), kvdim = s.kv_dim(), stride = qdim + 2 * kvdim;
  std::vector<double> x(std::size_t{n} * E);
  for (uint32_t r = 0; r < n; ++r)
    for (uint32_t i = 0; i < E; ++i)
      x[std::size_t{r} * E + i] = simd::bf16_to_f32(m.token_embd[std::size_t(tokens[r]) * E + i]);
  HostCache cache(s);
  for (uint32_t l = 0; l < s.n_layers; ++l) {
    const TinyModel::Layer& L = m.layers[l];
    std::vector<double> qkv =
        product(L.wqkv, stride, E, rms_norm(x, n, E, L.attn_norm, s.rms_eps), n);
    for (uint32_t r = 0; r < n; ++r) {
      double* row = qkv.data() + std::size_t{r} * stride;
      rotate(row, s.n_heads, s.head_dim, r, s.rope_theta);
      cache.store(l, r, row + qdim, row + qdim + kvdim);
    }
    std::vector<double> attn(std::size_t{n} * qdim);
    for (uint32_t r = 0; r < n; ++r)
      cache.attend(l, qkv.data() + std::size_t{r} * stride, r + 1,
                   attn.data() + std::size_t{r} * qdim);
    for (double& a : attn) a = bf16_round(a);
    const std::vector<double> o = product(L.wo, E, qdim, attn, n);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += o[i];
    const std::vector<double> gu =
        product(L.w_gate_up, 2 * F, E, rms_norm(x, n, E, L.ffn_norm, s.rms_eps), n);
    std::vector<double> f(std::size_t{n} * F);
    for (uint32_t r = 0; r < n; ++r)
      for (uint32_t i = 0; i < F; ++i) {
        const double g = gu[std::size_t{r} * 2 * F + i], u = gu[std::size_t{r} * 2 * F + F + i];
        f[std::size_t{r} * F + i] = bf16_round(g / (1.0 + std::exp(-g)) * u);
      }
    const std::vector<double> down = product(L.w_down, E, F, f, n);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += down[i];
  }
  return product(m.head(), s.n_vocab, E, rms_norm(x, n, E, m.output_norm, s.rms_eps), n);
}

template <class A, class B>
double relative_error(const A& a, const B& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (!std::isfinite(double(a[i]))) return std::numeric_limits<double>::infinity();
    diff += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    norm += double(b[i]) * double(b[i]);
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

std::vector<int32_t> random_tokens(std::size_t n, uint32_t n_vocab, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(n_vocab) - 1);
  std::vector<int32_t> out(n);
  for (int32_t& t : out) t = dist(rng);
  return out;
}

class GpuLlama : public ::testing::Test {
 protected:
  void SetUp() override { KVSIFT_SKIP_WITHOUT_DEVICE(); }
};

std::vector<float> read_hidden(gpu::DeviceLlama& llama) {
  std::vector<float> x(std::size_t{llama.rows()} * llama.shape().n_embd, kNaN);
  const gpu::Result r = llama.read_hidden(x.data());
  EXPECT_TRUE(r.ok) << r.message;
  return x;
}

std::vector<float> read_attention(gpu::DeviceLlama& llama) {
  std::vector<float> a(std::size_t{llama.rows()} * llama.shape().q_dim(), kNaN);
  const gpu::Result r = llama.read_attention(a.data());
  EXPECT_TRUE(r.ok) << r.message;
  return a;
}

template <class T>
std::vector<double> to_double(const std::vector<T>& v) {
  return std::vector<double>(v.begin(), v.end());
}

}  // namespace

TEST_F(GpuLlama, embeds_tokens_and_host_rows_exactly) {
  const TinyModel m(shape_64(), 11, true);
  gpu::DeviceLlama llama;
  ASSERT_OK(llama.init(m.shape, m.weights(), 0));
  std::mt19937 rng(12);
  std::vector<int32_t> tokens = random_tokens(13, m.shape.n_vocab, rng);
  tokens[0] = 0;
  tokens[12] = static_cast<int32_t>(m.shape.n_vocab) - 1;
  ASSERT_OK(llama.embed(tokens.data(), 13));
  const std::vector<float> x = read_hidden(llama);
  for (uint32_t r = 0; r < 13; ++r)
    for (uint32_t i = 0; i < m.shape.n_embd; ++i)
      ASSERT_EQ(x[r * m.shape.n_embd + i],
                simd::bf16_to_f32(m.token_embd[std::size_t(tokens[r]) * m.shape.n_embd + i]))
          << "row " << r << " channel " << i;

  const std::vector<float> rows = random_floats(11 * m.shape.n_embd, 0.0f, 1.0f, rng);
  ASSERT_OK(llama.load_embeddings(rows.data(), 11));
  EXPECT_EQ(llama.rows(), 11u);
  EXPECT_EQ(read_hidden(llama), rows);
  EXPECT_GT(llama.device_bytes(), 0u);
}

// Each stage of a whole pass on the device's own inputs: RMSNorm + QKV + RoPE (attention_inputs),
// the rest of the layer from host attention (finish_layer), the output head of chosen rows.
TEST_F(GpuLlama, every_stage_matches_the_reference_on_its_inputs) {
  for (const gpu::LlamaShape& shape : {shape_64(), shape_128()}) {
    SCOPED_TRACE("head_dim " + std::to_string(shape.head_dim));
    const TinyModel m(shape, 21 + shape.head_dim, false);
    const uint32_t E = shape.n_embd, F = shape.n_ff, qdim = shape.q_dim(), kvdim = shape.kv_dim(),
                   stride = qdim + 2 * kvdim, rows = 13;
    gpu::DeviceLlama llama;
    ASSERT_OK(llama.init(shape, m.weights(), 0));
    std::mt19937 rng(22);
    const std::vector<int32_t> tokens = random_tokens(rows, shape.n_vocab, rng);
    std::vector<uint64_t> positions(rows);
    std::uniform_int_distribution<uint64_t> pos_dist(0, shape.max_positions - 1);
    for (uint64_t& p : positions) p = pos_dist(rng);
    positions[0] = shape.max_positions - 1;
    ASSERT_OK(llama.embed(tokens.data(), rows));
    for (uint32_t l = 0; l < shape.n_layers; ++l) {
      SCOPED_TRACE("layer " + std::to_string(l));
      const TinyModel::Layer& L = m.layers[l];
      const std::vector<double> x0 = to_double(read_hidden(llama));
      ASSERT_OK(llama.attention_inputs(l, positions.data(), rows));
      std::vector<double> qkv =
          product(L.wqkv, stride, E, rms_norm(x0, rows, E, L.attn_norm, shape.rms_eps), rows);
      std::vector<double> q_ref, k_ref, v_ref;
      for (uint32_t r = 0; r < rows; ++r) {
        double* row = qkv.data() + std::size_t{r} * stride;
        rotate(row, shape.n_heads, shape.head_dim, positions[r], shape.rope_theta);
        q_ref.insert(q_ref.end(), row, row + qdim);
        k_ref.insert(k_ref.end(), row + qdim, row + qdim + kvdim);
        v_ref.insert(v_ref.end(), row + qdim + kvdim, row + stride);
      }
      const std::vector<float> q(llama.q_host(), llama.q_host() + rows * qdim),
          k(llama.k_host(), llama.k_host() + rows * kvdim),
          v(llama.v_host(), llama.v_host() + rows * kvdim);
      EXPECT_LT(relative_error(q, q_ref), 5e-4);
      EXPECT_LT(relative_error(k, k_ref), 5e-4);
      EXPECT_LT(relative_error(v, v_ref), 5e-4);

      // Host attention: any values will do for the rest of the layer.
      const std::vector<float> attn = random_floats(std::size_t{rows} * qdim, 0.0f, 1.0f, rng);
      std::copy(attn.begin(), attn.end(), llama.attn_host());
      ASSERT_OK(llama.finish_layer(l, true));
      EXPECT_EQ(read_attention(llama), attn);
      std::vector<double> a = to_double(attn);
      for (double& e : a) e = bf16_round(e);
      std::vector<double> x1 = product(L.wo, E, qdim, a, rows);
      for (std::size_t i = 0; i < x1.size(); ++i) x1[i] += x0[i];
      const std::vector<double> gu =
          product(L.w_gate_up, 2 * F, E, rms_norm(x1, rows, E, L.ffn_norm, shape.rms_eps), rows);
      std::vector<double> f(std::size_t{rows} * F);
      for (uint32_t r = 0; r < rows; ++r)
        for (uint32_t i = 0; i < F; ++i) {
          const double g = gu[std::size_t{r} * 2 * F + i], u = gu[std::size_t{r} * 2 * F + F + i];
          f[std::size_t{r} * F + i] = bf16_round(g / (1.0 + std::exp(-g)) * u);
        }
      std::vector<double> x2 = product(L.w_down, E, F, f, rows);
      std::vector<double> update(x2.size());  // the layer's own contribution, unmasked by x0
      for (std::size_t i = 0; i < x2.size(); ++i) {
        update[i] = x1[i] - x0[i] + x2[i];
        x2[i] += x1[i];
      }
      const std::vector<float> x = read_hidden(llama);
      EXPECT_LT(relative_error(x, x2), 1e-3);
      std::vector<double> device_update(x.size());
      for (std::size_t i = 0; i < x.size(); ++i) device_update[i] = x[i] - x0[i];
      EXPECT_LT(relative_error(device_update, update), 1e-3);
    }
    const std::vector<uint32_t> chosen = {4, 0, 12, 4};
    std::vector<float> logits(chosen.size() * shape.n_vocab, kNaN);
    ASSERT_OK(llama.logits(chosen.data(), static_cast<uint32_t>(chosen.size()), logits.data()));
    const std::vector<double> x = to_double(read_hidden(llama));
    std::vector<double> picked;
    for (uint32_t r : chosen)
      picked.insert(picked.end(), x.begin() + r * E, x.begin() + (r + 1) * E);
    const std::vector<double> ref = product(
        m.head(), shape.n_vocab, E,
        rms_norm(picked, static_cast<uint32_t>(chosen.size()), E, m.output_norm, shape.rms_eps),
        static_cast<uint32_t>(chosen.size()));
    EXPECT_LT(relative_error(logits, ref), 5e-4);
  }
}

// q's rotation is lib/cache/rope.cpp's, bit for bit: the same pass at position 0 (no rotation)
// and at other positions, the second checked against the CPU formula applied in fp32 to the first.
TEST_F(GpuLlama, rope_on_q_is_the_cpu_rotation_bit_for_bit) {
  const gpu::LlamaShape shape = shape_64();
  const TinyModel m(shape, 31, true);
  gpu::DeviceLlama llama;
  ASSERT_OK(llama.init(shape, m.weights(), 0));
  const uint32_t rows = 9, qdim = shape.q_dim();
  std::mt19937 rng(32);
  const std::vector<int32_t> tokens = random_tokens(rows, shape.n_vocab, rng);
  std::vector<uint64_t> zeros(rows, 0), positions(rows);
  for (uint32_t r = 0; r < rows; ++r) positions[r] = (r * 7 + 5) % shape.max_positions;
  ASSERT_OK(llama.embed(tokens.data(), rows));
  ASSERT_OK(llama.attention_inputs(0, zeros.data(), rows));
  const std::vector<float> q0(llama.q_host(), llama.q_host() + rows * qdim);
  ASSERT_OK(llama.embed(tokens.data(), rows));
  ASSERT_OK(llama.attention_inputs(0, positions.data(), rows));
  for (uint32_t r = 0; r < rows; ++r) {
    std::vector<float> expected(q0.begin() + std::size_t{r} * qdim,
                                q0.begin() + std::size_t{r + 1} * qdim);
    rotate_f32(expected.data(), shape.n_heads, shape.head_dim, positions[r], shape.rope_theta);
    for (uint32_t c = 0; c < qdim; ++c)
      ASSERT_EQ(llama.q_host()[std::size_t{r} * qdim + c], expected[c])
          << "row " << r << " channel " << c;
  }
}

// Prefill attention in chunks against float64 attention over the keys and values the device's
// scratch holds, every layer, both shapes (GQA groups of 3 and 4, fp16 and bf16 storage) and both
// with a q8 cache. A q8 cache's scratch holds its values in fp16, each within 2^-11 (relative) of
// the values the CPU's prefill attention reads (lib/model/prefill_attention.cpp): random errors
// that move a logit by about 2^-12 |q| |k| / sqrt(d) and the output by as much (2.7e-4 relative,
// measured on a float64 emulation with unit-variance q, k and v, as here), so against attention
// over the cache's own values the bound is 2e-3.
TEST_F(GpuLlama, prefill_attention_matches_the_reference_across_chunks) {
  for (const gpu::LlamaShape& shape :
       {shape_64(), shape_128(), with_kv(shape_64(), simd::Dtype::q8),
        with_kv(shape_128(), simd::Dtype::q8)}) {
    const bool q8 = shape.kv_dtype == simd::Dtype::q8;
    SCOPED_TRACE("head_dim " + std::to_string(shape.head_dim) + (q8 ? " q8" : ""));
    const TinyModel m(shape, 41 + shape.head_dim, true);
    const uint32_t qdim = shape.q_dim(), kvdim = shape.kv_dim();
    gpu::DeviceLlama llama;
    ASSERT_OK(llama.init(shape, m.weights(), 0));
    std::mt19937 rng(42);
    const uint32_t n = shape.max_prefill_tokens - 3;  // a partial last chunk
    const std::vector<int32_t> tokens = random_tokens(n, shape.n_vocab, rng);
    HostCache cache(shape), cpu_cache(shape, /*scratch_rounding=*/false);
    for (uint32_t pos0 = 0; pos0 < n; pos0 += shape.max_rows) {
      const uint32_t rows = std::min(shape.max_rows, n - pos0);
      SCOPED_TRACE("chunk at " + std::to_string(pos0));
      std::vector<uint64_t> positions(rows);
      std::iota(positions.begin(), positions.end(), uint64_t{pos0});
      ASSERT_OK(llama.embed(tokens.data() + pos0, rows));
      for (uint32_t l = 0; l < shape.n_layers; ++l) {
        ASSERT_OK(llama.attention_inputs(l, positions.data(), rows));
        for (uint32_t r = 0; r < rows; ++r)
          for (HostCache* c : {&cache, &cpu_cache})
            c->store(l, pos0 + r, llama.k_host() + std::size_t{r} * kvdim,
                     llama.v_host() + std::size_t{r} * kvdim);
        ASSERT_OK(llama.prefill_attention(l, pos0, rows));
        EXPECT_EQ(llama.prefill_held(l), pos0 + rows);
        std::vector<double> ref(std::size_t{rows} * qdim), cpu_ref(ref.size());
        for (uint32_t r = 0; r < rows; ++r) {
          cache.attend(l, llama.q_host() + std::size_t{r} * qdim, pos0 + r + 1,
                       ref.data() + std::size_t{r} * qdim);
          cpu_cache.attend(l, llama.q_host() + std::size_t{r} * qdim, pos0 + r + 1,
                           cpu_ref.data() + std::size_t{r} * qdim);
        }
        const std::vector<float> attn = read_attention(llama);
        EXPECT_LT(relative_error(attn, ref), 1e-4) << "layer " << l;
        if (q8) {
          EXPECT_LT(relative_error(attn, cpu_ref), 2e-3) << "layer " << l;
        }
        ASSERT_OK(llama.finish_layer(l, false));
      }
    }
  }
}

// The tiles of the prefill attention kernel at a few thousand positions: a prompt of one row and
// then 70, and a prefix restored by load_prefix (random keys and values, an unaligned length)
// continued by chunks of odd sizes, so that chunks start inside a key tile and a row tile, end
// short of both, and hold single rows; GQA groups of 3 and 4, head_dim 64 and 128, fp16 and bf16
// keys. Rows at and next to the 16-row tile edges and at both ends of a chunk, all heads, against
// float64 attention over the scratch's values, bound as above.
TEST_F(GpuLlama, prefill_attention_tiles_match_the_reference_at_longer_context) {
  struct Case {
    uint32_t head_dim, group;
    simd::Dtype dtype;
  };
  for (const Case& c : {Case{64, 3, simd::Dtype::f16}, Case{128, 4, simd::Dtype::bf16},
                        Case{128, 3, simd::Dtype::f16}, Case{64, 4, simd::Dtype::bf16}}) {
    SCOPED_TRACE("head_dim " + std::to_string(c.head_dim) + " group " + std::to_string(c.group) +
                 (c.dtype == simd::Dtype::bf16 ? " bf16" : " f16"));
    gpu::LlamaShape shape;
    shape.n_layers = 1;
    shape.n_embd = 80;
    shape.n_ff = 96;
    shape.n_kv_heads = 2;
    shape.n_heads = c.group * shape.n_kv_heads;
    shape.head_dim = c.head_dim;
    shape.n_vocab = 101;
    shape.rope_theta = 500000.0f;
    shape.rms_eps = 1e-5f;
    shape.max_rows = 160;
    shape.max_positions = 3072;
    shape.max_prefill_tokens = 3072;
    shape.kv_dtype = c.dtype;
    const TinyModel m(shape, 71 + c.head_dim + c.group, true);
    const uint32_t qdim = shape.q_dim(), kvdim = shape.kv_dim();
    gpu::DeviceLlama llama;
    ASSERT_OK(llama.init(shape, m.weights(), 0));
    std::mt19937 rng(72 + c.head_dim + c.group);

    // Prefills chunks of the given sizes from pos0 on, checking each against cache.
    auto chunks = [&](HostCache& cache, uint32_t pos0, const std::vector<uint32_t>& sizes) {
      for (const uint32_t rows : sizes) {
        SCOPED_TRACE("chunk of " + std::to_string(rows) + " at " + std::to_string(pos0));
        const std::vector<int32_t> tokens = random_tokens(rows, shape.n_vocab, rng);
        std::vector<uint64_t> positions(rows);
        std::iota(positions.begin(), positions.end(), uint64_t{pos0});
        ASSERT_OK(llama.embed(tokens.data(), rows));
        ASSERT_OK(llama.attention_inputs(0, positions.data(), rows));
        for (uint32_t r = 0; r < rows; ++r)
          cache.store(0, pos0 + r, llama.k_host() + std::size_t{r} * kvdim,
                      llama.v_host() + std::size_t{r} * kvdim);
        ASSERT_OK(llama.prefill_attention(0, pos0, rows));
        const std::vector<float> attn = read_attention(llama);
        std::vector<float> got;
        std::vector<double> ref;
        for (uint32_t r = 0; r < rows; ++r) {
          if (r >= 2 && r + 2 < rows && (r + 1) % 16 > 2) continue;
          got.insert(got.end(), attn.begin() + std::size_t{r} * qdim,
                     attn.begin() + std::size_t{r + 1} * qdim);
          ref.resize(got.size());
          cache.attend(0, llama.q_host() + std::size_t{r} * qdim, pos0 + r + 1,
                       ref.data() + ref.size() - qdim);
        }
        EXPECT_LT(relative_error(got, ref), 1e-4);
        ASSERT_OK(llama.finish_layer(0, false));
        pos0 += rows;
      }
    };

    {
      SCOPED_TRACE("from position 0");
      HostCache cache(shape);
      chunks(cache, 0, {1, 70});
    }
    llama.reset_prefill();
    {
      SCOPED_TRACE("after a restored prefix");
      const uint32_t prefix = 2713;
      const std::vector<float> keys = random_floats(std::size_t{prefix} * kvdim, 0.0f, 1.0f, rng);
      const std::vector<float> values = random_floats(keys.size(), 0.0f, 1.0f, rng);
      ASSERT_OK(llama.load_prefix(0, 0, keys.data(), values.data(), prefix));
      HostCache cache(shape);
      cache.keys[0].assign(keys.begin(), keys.end());
      cache.values[0].assign(values.begin(), values.end());
      for (uint32_t pos = 0; pos < prefix; ++pos) {
        cache_round(cache.keys[0].data() + std::size_t{pos} * kvdim, shape, true);
        cache_round(cache.values[0].data() + std::size_t{pos} * kvdim, shape, true);
      }
      chunks(cache, prefix, {160, 1, 97, 45});
    }
  }
}

// The runner's whole use: a 37-token prompt prefilled in chunks of 16 with device attention, then
// 3 decode steps with the attention done here (float64 over the host cache), every row's logits
// against the float64 forward of the 40 tokens.
TEST_F(GpuLlama, whole_forward_matches_a_float64_forward) {
  const gpu::LlamaShape shape = shape_64();
  const TinyModel m(shape, 51, true);
  const uint32_t qdim = shape.q_dim(), kvdim = shape.kv_dim(), V = shape.n_vocab;
  const uint32_t prompt = 37, steps = 3;
  std::mt19937 rng(52);
  const std::vector<int32_t> tokens = random_tokens(prompt + steps, V, rng);
  gpu::DeviceLlama llama;
  ASSERT_OK(llama.init(shape, m.weights(), 0));
  HostCache cache(shape);
  std::vector<float> logits(std::size_t{prompt + steps} * V, kNaN);
  for (uint32_t pos0 = 0; pos0 < prompt; pos0 += shape.max_rows) {
    const uint32_t rows = std::min(shape.max_rows, prompt - pos0);
    std::vector<uint64_t> positions(rows);
    std::iota(positions.begin(), positions.end(), uint64_t{pos0});
    ASSERT_OK(llama.embed(tokens.data() + pos0, rows));
    for (uint32_t l = 0; l < shape.n_layers; ++l) {
      ASSERT_OK(llama.attention_inputs(l, positions.data(), rows));
      for (uint32_t r = 0; r < rows; ++r)
        cache.store(l, pos0 + r, llama.k_host() + std::size_t{r} * kvdim,
                    llama.v_host() + std::size_t{r} * kvdim);
      ASSERT_OK(llama.prefill_attention(l, pos0, rows));
      ASSERT_OK(llama.finish_layer(l, false));
    }
    std::vector<uint32_t> all(rows);
    std::iota(all.begin(), all.end(), 0u);
    ASSERT_OK(llama.logits(all.data(), rows, logits.data() + std::size_t{pos0} * V));
  }
  std::vector<double> attn(qdim);
  for (uint32_t t = prompt; t < prompt + steps; ++t) {
    const uint64_t pos = t;
    const uint32_t row = 0;
    ASSERT_OK(llama.embed(&tokens[t], 1));
    for (uint32_t l = 0; l < shape.n_layers; ++l) {
      ASSERT_OK(llama.attention_inputs(l, &pos, 1));
      cache.store(l, pos, llama.k_host(), llama.v_host());
      cache.attend(l, llama.q_host(), pos + 1, attn.data());
      std::copy(attn.begin(), attn.end(), llama.attn_host());
      ASSERT_OK(llama.finish_layer(l, true));
    }
    ASSERT_OK(llama.logits(&row, 1, logits.data() + std::size_t{t} * V));
  }
  const std::vector<double> ref = reference_forward(m, tokens);
  EXPECT_LT(relative_error(logits, ref), 1e-2);
  for (uint32_t t = 0; t < prompt + steps; ++t) {
    const std::vector<float> row(logits.begin() + std::size_t{t} * V,
                                 logits.begin() + std::size_t{t + 1} * V);
    const std::vector<double> ref_row(ref.begin() + std::size_t{t} * V,
                                      ref.begin() + std::size_t{t + 1} * V);
    EXPECT_LT(relative_error(row, ref_row), 2e-2) << "token " << t;
  }
}

// A prefill that continues a sequence after another one used the scratch: restoring the prefix
// from the host cache (post-RoPE keys, as it stores them) gives the logits of a prefill that
// never left it, for an fp16 and a q8 cache.
TEST_F(GpuLlama, load_prefix_continues_a_prefill_as_if_never_interrupted) {
  for (simd::Dtype dtype : {simd::Dtype::f16, simd::Dtype::q8}) {
    SCOPED_TRACE(dtype == simd::Dtype::q8 ? "q8" : "f16");
    const gpu::LlamaShape shape = with_kv(shape_64(), dtype);
    const TinyModel m(shape, 61, true);
    const uint32_t kvdim = shape.kv_dim(), V = shape.n_vocab, first = 21, more = 9;
    std::mt19937 rng(62);
    const std::vector<int32_t> a = random_tokens(first + more, V, rng);
    const std::vector<int32_t> b = random_tokens(7, V, rng);
    gpu::DeviceLlama llama;
    ASSERT_OK(llama.init(shape, m.weights(), 0));

    // Prefills tokens[pos0, pos0 + n) of one sequence with device attention, keeping its keys and
    // values as the host cache stores them (keys rotated by the CPU's fp32 RoPE, both rounded to
    // the cache's dtype) and reads them back (in fp32, cache_round); returns the logits of the last
    // chunk's rows.
    std::vector<std::vector<float>> keys(shape.n_layers), values(shape.n_layers);
    auto prefill = [&](const std::vector<int32_t>& tokens, uint32_t pos0, uint32_t n) {
      std::vector<float> out;
      for (uint32_t done = 0; done < n; done += shape.max_rows) {
        const uint32_t rows = std::min(shape.max_rows, n - done), at = pos0 + done;
        std::vector<uint64_t> positions(rows);
        std::iota(positions.begin(), positions.end(), uint64_t{at});
        EXPECT_TRUE(llama.embed(tokens.data() + at, rows).ok);
        for (uint32_t l = 0; l < shape.n_layers; ++l) {
          EXPECT_TRUE(llama.attention_inputs(l, positions.data(), rows).ok);
          keys[l].resize(std::size_t{at + rows} * kvdim);
          values[l].resize(keys[l].size());
          for (uint32_t r = 0; r < rows; ++r) {
            float* k = keys[l].data() + std::size_t{at + r} * kvdim;
            float* v = values[l].data() + std::size_t{at + r} * kvdim;
            std::copy_n(llama.k_host() + std::size_t{r} * kvdim, kvdim, k);
            std::copy_n(llama.v_host() + std::size_t{r} * kvdim, kvdim, v);
            rotate_f32(k, shape.n_kv_heads, shape.head_dim, at + r, shape.rope_theta);
            cache_round(k, shape, /*scratch=*/false);
            cache_round(v, shape, /*scratch=*/false);
          }
          const gpu::Result r = llama.prefill_attention(l, at, rows);
          EXPECT_TRUE(r.ok) << r.message;
          EXPECT_TRUE(llama.finish_layer(l, false).ok);
        }
        std::vector<uint32_t> all(rows);
        std::iota(all.begin(), all.end(), 0u);
        out.assign(std::size_t{rows} * V, kNaN);
        EXPECT_TRUE(llama.logits(all.data(), rows, out.data()).ok);
      }
      return out;
    };

    prefill(a, 0, first);
    const std::vector<float> uninterrupted = prefill(a, first, more);

    llama.reset_prefill();
    prefill(a, 0, first);
    const std::vector<std::vector<float>> a_keys = keys, a_values = values;
    llama.reset_prefill();
    prefill(b, 0, static_cast<uint32_t>(b.size()));
    EXPECT_EQ(llama.prefill_held(0), b.size());

    // Without the prefix the continuation is refused.
    llama.reset_prefill();
    const std::vector<uint64_t> positions = {first};
    ASSERT_OK(llama.embed(&a[first], 1));
    ASSERT_OK(llama.attention_inputs(0, positions.data(), 1));
    const gpu::Result refused = llama.prefill_attention(0, first, 1);
    EXPECT_FALSE(refused.ok);
    EXPECT_NE(refused.message.find("load_prefix"), std::string::npos) << refused.message;

    // Restored in two pieces per layer, the second starting where the first ended.
    for (uint32_t l = 0; l < shape.n_layers; ++l) {
      ASSERT_OK(llama.load_prefix(l, 0, a_keys[l].data(), a_values[l].data(), 5));
      ASSERT_OK(llama.load_prefix(l, 5, a_keys[l].data() + 5 * kvdim,
                                  a_values[l].data() + 5 * kvdim, first - 5));
      EXPECT_EQ(llama.prefill_held(l), first);
    }
    const std::vector<float> resumed = prefill(a, first, more);
    // The restored keys are the device's own bit for bit (the same rotation, the same rounding;
    // for q8, the cache's rule in gpu/device_llama.cu's q8_round_row, then fp16 both ways), so the
    // same kernels give the same logits.
    EXPECT_LT(relative_error(resumed, uninterrupted), 1e-6);
  }
}

// Bitwise equality of two traces, naming the first value that differs.
void expect_same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      ADD_FAILURE() << "value " << i << " of " << a.size() << ": " << a[i] << " vs " << b[i];
      return;
    }
}

// One decode pass of tokens.size() sequences (row r: caches[r], at positions[r]) with the
// attention done here in float64, as the host runner does it; odd layers see the positions plus
// odd_layer_shift (a caller whose layers' positions differ). Appends to trace each layer's q, k
// and v, then the pass's hidden state and every row's logits.
void decode_pass(gpu::DeviceLlama& llama, std::vector<HostCache>& caches,
                 const std::vector<int32_t>& tokens, const std::vector<uint64_t>& positions,
                 uint64_t odd_layer_shift, std::vector<float>& trace) {
  const gpu::LlamaShape& s = llama.shape();
  const uint32_t rows = static_cast<uint32_t>(tokens.size()), qdim = s.q_dim(), kvdim = s.kv_dim();
  ASSERT_OK(llama.embed(tokens.data(), rows));
  std::vector<double> attn(qdim);
  for (uint32_t l = 0; l < s.n_layers; ++l) {
    std::vector<uint64_t> at = positions;
    if (l % 2 == 1)
      for (uint64_t& p : at) p += odd_layer_shift;
    ASSERT_OK(llama.attention_inputs(l, at.data(), rows));
    trace.insert(trace.end(), llama.q_host(), llama.q_host() + std::size_t{rows} * qdim);
    trace.insert(trace.end(), llama.k_host(), llama.k_host() + std::size_t{rows} * kvdim);
    trace.insert(trace.end(), llama.v_host(), llama.v_host() + std::size_t{rows} * kvdim);
    for (uint32_t r = 0; r < rows; ++r) {
      caches[r].store(l, at[r], llama.k_host() + std::size_t{r} * kvdim,
                      llama.v_host() + std::size_t{r} * kvdim);
      caches[r].attend(l, llama.q_host() + std::size_t{r} * qdim, at[r] + 1, attn.data());
      std::copy(attn.begin(), attn.end(), llama.attn_host() + std::size_t{r} * qdim);
    }
    ASSERT_OK(llama.finish_layer(l, true));
  }
  const std::vector<float> x = read_hidden(llama);
  trace.insert(trace.end(), x.begin(), x.end());
  std::vector<uint32_t> all(rows);
  std::iota(all.begin(), all.end(), 0u);
  std::vector<float> logits(std::size_t{rows} * s.n_vocab, kNaN);
  ASSERT_OK(llama.logits(all.data(), rows, logits.data()));
  trace.insert(trace.end(), logits.begin(), logits.end());
}

// The runner's use with decode graphs on and off: a prompt prefilled in chunks (device attention:
// never graphed), then decode steps of one sequence, of three (the prompt's and two new ones), of
// one again, and one step whose layers' positions differ. Every q, k, v, hidden state and logit is
// the same bit for bit, and the counters say which steps replayed graphs: each rows value's first
// step is the warm-up, its second captures, every later one replays.
TEST_F(GpuLlama, decode_graphs_give_the_ungraphed_results_bit_for_bit) {
  const gpu::LlamaShape base = shape_64();
  const TinyModel m(base, 91, true);
  const uint32_t kvdim = base.kv_dim(), V = base.n_vocab, L = base.n_layers, prompt = 21;
  std::mt19937 rng(92);
  const std::vector<int32_t> tokens = random_tokens(64, V, rng);

  auto run = [&](bool graphs, std::vector<float>& trace, gpu::DecodeGraphStats& stats) {
    gpu::LlamaShape shape = base;
    shape.decode_graphs = graphs;
    gpu::DeviceLlama llama;
    ASSERT_OK(llama.init(shape, m.weights(), 0));
    std::vector<HostCache> caches(3, HostCache(shape));
    for (uint32_t pos0 = 0; pos0 < prompt; pos0 += shape.max_rows) {
      const uint32_t rows = std::min(shape.max_rows, prompt - pos0);
      std::vector<uint64_t> positions(rows);
      std::iota(positions.begin(), positions.end(), uint64_t{pos0});
      ASSERT_OK(llama.embed(tokens.data() + pos0, rows));
      for (uint32_t l = 0; l < L; ++l) {
        ASSERT_OK(llama.attention_inputs(l, positions.data(), rows));
        for (uint32_t r = 0; r < rows; ++r)
          caches[0].store(l, pos0 + r, llama.k_host() + std::size_t{r} * kvdim,
                          llama.v_host() + std::size_t{r} * kvdim);
        ASSERT_OK(llama.prefill_attention(l, pos0, rows));
        ASSERT_OK(llama.finish_layer(l, false));
      }
      const std::vector<float> x = read_hidden(llama);
      trace.insert(trace.end(), x.begin(), x.end());
    }
    EXPECT_EQ(
        llama.graph_stats().captured + llama.graph_stats().replays + llama.graph_stats().ungraphed,
        0u)
        << "the prefill used the decode graphs";

    uint64_t next[3] = {prompt, 0, 0};
    auto step = [&](uint32_t rows, uint64_t odd_layer_shift) {
      std::vector<int32_t> step_tokens(rows);
      std::vector<uint64_t> positions(rows);
      for (uint32_t r = 0; r < rows; ++r) {
        step_tokens[r] = tokens[(next[r] * 3 + r) % tokens.size()];
        positions[r] = next[r]++;
      }
      decode_pass(llama, caches, step_tokens, positions, odd_layer_shift, trace);
    };
    for (int i = 0; i < 4; ++i) ASSERT_NO_FATAL_FAILURE(step(1, 0));
    for (int i = 0; i < 4; ++i) ASSERT_NO_FATAL_FAILURE(step(3, 0));
    for (int i = 0; i < 2; ++i) ASSERT_NO_FATAL_FAILURE(step(1, 0));
    ASSERT_NO_FATAL_FAILURE(step(1, 1));
    stats = llama.graph_stats();
  };

  std::vector<float> off_trace, on_trace;
  gpu::DecodeGraphStats off, on;
  ASSERT_NO_FATAL_FAILURE(run(false, off_trace, off));
  ASSERT_NO_FATAL_FAILURE(run(true, on_trace, on));
  expect_same_bits(on_trace, off_trace);

  EXPECT_EQ(off.captured + off.replays + off.ungraphed + off.inputs_reused, 0u);
  EXPECT_EQ(on.off, "");
  EXPECT_EQ(on.captured, 2 * L);  // rows 1 and 3, every layer
  // Rows 1: 7 steps, the first a warm-up; rows 3: 4 steps, the first a warm-up.
  EXPECT_EQ(on.replays, (6 + 3) * L);
  EXPECT_EQ(on.ungraphed, 2 * L);
  // Every replayed step's layers after the first, but the step whose positions differed.
  EXPECT_EQ(on.inputs_reused, (6 + 3 - 1) * (L - 1));
}

// More rows values than kMaxGraphRows, each in two host-attention passes: the first values get
// graphs, the rest run ungraphed, and every pass ends in the ungraphed handle's state bit for bit.
TEST_F(GpuLlama, decode_graphs_are_kept_for_at_most_kMaxGraphRows_rows_values) {
  gpu::LlamaShape shape = shape_64();
  const TinyModel m(shape, 101, true);
  const uint32_t L = shape.n_layers, qdim = shape.q_dim(), values = gpu::kMaxGraphRows + 2;
  ASSERT_LE(values, shape.max_rows);
  std::mt19937 rng(102);
  const std::vector<int32_t> tokens = random_tokens(values, shape.n_vocab, rng);
  gpu::DeviceLlama on, off;
  ASSERT_OK(on.init(shape, m.weights(), 0));
  shape.decode_graphs = false;
  ASSERT_OK(off.init(shape, m.weights(), 0));
  for (uint32_t rows = 1; rows <= values; ++rows)
    for (int pass = 0; pass < 2; ++pass) {
      SCOPED_TRACE("rows " + std::to_string(rows) + " pass " + std::to_string(pass));
      std::vector<uint64_t> positions(rows);
      for (uint32_t r = 0; r < rows; ++r) positions[r] = (r * 5 + 3 + pass) % shape.max_positions;
      for (gpu::DeviceLlama* llama : {&on, &off}) {
        ASSERT_OK(llama->embed(tokens.data(), rows));
        for (uint32_t l = 0; l < L; ++l) {
          ASSERT_OK(llama->attention_inputs(l, positions.data(), rows));
          // Any attention output will do, as long as it is the handle's own.
          std::copy_n(llama->q_host(), std::size_t{rows} * qdim, llama->attn_host());
          ASSERT_OK(llama->finish_layer(l, true));
        }
      }
      expect_same_bits(read_hidden(on), read_hidden(off));
    }
  const gpu::DecodeGraphStats& stats = on.graph_stats();
  EXPECT_EQ(stats.off, "");
  EXPECT_EQ(stats.captured, gpu::kMaxGraphRows * L);
  EXPECT_EQ(stats.replays, gpu::kMaxGraphRows * L);
  EXPECT_EQ(stats.ungraphed, 2 * values * L - stats.replays);
}

TEST_F(GpuLlama, refuses_out_of_order_calls_and_bad_arguments) {
  const gpu::LlamaShape shape = shape_64();
  const TinyModel m(shape, 71, true);
  gpu::DeviceLlama llama;
  ASSERT_OK(llama.init(shape, m.weights(), 0));
  auto refused = [](const gpu::Result& r, const char* needle) {
    EXPECT_FALSE(r.ok);
    EXPECT_FALSE(r.unsupported);
    EXPECT_NE(r.message.find(needle), std::string::npos) << r.message;
  };
  const std::vector<uint64_t> positions = {0, 1, 2, 3};
  const std::vector<uint64_t> far = {0, 1, 2, shape.max_positions};
  std::vector<float> out(4 * shape.n_vocab);
  refused(llama.attention_inputs(0, positions.data(), 4), "no forward pass");
  const std::vector<int32_t> bad_tokens = {1, 2, static_cast<int32_t>(shape.n_vocab)};
  refused(llama.embed(bad_tokens.data(), 3), "tokens[2]");
  const std::vector<int32_t> negative = {-1};
  refused(llama.embed(negative.data(), 1), "tokens[0]");
  std::vector<int32_t> many(shape.max_rows + 1, 0);
  refused(llama.embed(many.data(), shape.max_rows + 1), "rows=");
  const std::vector<int32_t> tokens = {5, 6, 7, 8};
  ASSERT_OK(llama.embed(tokens.data(), 4));
  refused(llama.attention_inputs(1, positions.data(), 4), "out of order");
  refused(llama.attention_inputs(0, positions.data(), 3), "rows=3");
  refused(llama.attention_inputs(0, far.data(), 4), "positions[3]");
  refused(llama.finish_layer(0, true), "before attention_inputs");
  const std::vector<uint32_t> row0 = {0};
  refused(llama.logits(row0.data(), 1, out.data()), "has not run");
  ASSERT_OK(llama.attention_inputs(0, positions.data(), 4));
  refused(llama.finish_layer(0, false), "after attention_inputs");  // no device attention ran
  refused(llama.prefill_attention(0, 1, 4), "pos0=1");
  ASSERT_OK(llama.finish_layer(0, true));
  ASSERT_OK(llama.attention_inputs(1, positions.data(), 4));
  ASSERT_OK(llama.finish_layer(1, true));
  const std::vector<uint32_t> beyond = {0, 4};
  refused(llama.logits(beyond.data(), 2, out.data()), "rows_idx[1]");
  ASSERT_OK(llama.logits(row0.data(), 1, out.data()));
  refused(llama.attention_inputs(2, positions.data(), 4), "out of order");

  // The scratch's bounds.
  std::vector<float> kv(std::size_t{shape.max_prefill_tokens + 1} * shape.kv_dim(), 0.5f);
  refused(llama.load_prefix(0, 1, kv.data(), kv.data(), 1), "first=1");
  refused(llama.load_prefix(0, 0, kv.data(), kv.data(), shape.max_prefill_tokens + 1),
          "max_prefill_tokens");
  refused(llama.load_prefix(shape.n_layers, 0, kv.data(), kv.data(), 1), "n_layers");
  ASSERT_OK(llama.load_prefix(0, 0, kv.data(), kv.data(), shape.max_prefill_tokens - 2));
  std::vector<uint64_t> tail(4);
  std::iota(tail.begin(), tail.end(), uint64_t{shape.max_prefill_tokens - 2});
  ASSERT_OK(llama.embed(tokens.data(), 4));
  ASSERT_OK(llama.attention_inputs(0, tail.data(), 4));
  refused(llama.prefill_attention(0, shape.max_prefill_tokens - 2, 4), "max_prefill_tokens");
  refused(llama.prefill_attention(0, 2, 4), "positions[0]");  // not the positions of the inputs
  EXPECT_EQ(llama.prefill_held(0), shape.max_prefill_tokens - 2);
}

// Runs everywhere: the checks come before any device call.
TEST(GpuLlamaArguments, init_refuses_bad_shapes_before_touching_the_device) {
  const TinyModel m(shape_64(), 81, true);
  const gpu::LlamaWeights weights = m.weights();
  struct Case {
    const char* needle;
    void (*change)(gpu::LlamaShape&);
  };
  const Case cases[] = {
      {"n_layers", [](gpu::LlamaShape& s) { s.n_layers = 0; }},
      {"n_embd", [](gpu::LlamaShape& s) { s.n_embd = 0; }},
      {"n_ff", [](gpu::LlamaShape& s) { s.n_ff = 0; }},
      {"n_kv_heads", [](gpu::LlamaShape& s) { s.n_kv_heads = 4; }},
      {"n_kv_heads", [](gpu::LlamaShape& s) { s.n_kv_heads = 0; }},
      {"head_dim", [](gpu::LlamaShape& s) { s.head_dim = 96; }},
      {"n_vocab", [](gpu::LlamaShape& s) { s.n_vocab = 0; }},
      {"rope_theta", [](gpu::LlamaShape& s) { s.rope_theta = std::nanf(""); }},
      {"rms_eps", [](gpu::LlamaShape& s) { s.rms_eps = 0.0f; }},
      {"max_rows", [](gpu::LlamaShape& s) { s.max_rows = 0; }},
      {"max_rows", [](gpu::LlamaShape& s) { s.max_rows = 4097; }},
      {"max_positions", [](gpu::LlamaShape& s) { s.max_positions = 0; }},
      {"max_prefill_tokens",
       [](gpu::LlamaShape& s) { s.max_prefill_tokens = s.max_positions + 1; }},
      {"kv_dtype", [](gpu::LlamaShape& s) { s.kv_dtype = static_cast<simd::Dtype>(7); }},
  };
  for (const Case& c : cases) {
    gpu::LlamaShape shape = m.shape;
    c.change(shape);
    gpu::DeviceLlama llama;
    const gpu::Result r = llama.init(shape, weights, 0);
    EXPECT_FALSE(r.ok) << c.needle;
    if (!gpu::backend_status().ok) {  // the shape is the backend's to check
      EXPECT_TRUE(r.unsupported);
      continue;
    }
    EXPECT_FALSE(r.unsupported) << r.message;
    EXPECT_NE(r.message.find(c.needle), std::string::npos) << r.message;
  }
  if (!gpu::backend_status().ok) return;
  gpu::LlamaWeights missing_layer = weights;
  missing_layer.layers.pop_back();
  gpu::LlamaWeights null_weight = weights;
  null_weight.layers[1].w_down = nullptr;
  gpu::LlamaWeights null_head = weights;
  null_head.output_norm = nullptr;
  for (const auto& [w, needle] :
       {std::pair{&missing_layer, "layers"}, std::pair{&null_weight, "layer 1"},
        std::pair{&null_head, "output_norm"}}) {
    gpu::DeviceLlama llama;
    const gpu::Result r = llama.init(m.shape, *w, 0);
    EXPECT_FALSE(r.ok);
    EXPECT_FALSE(r.unsupported) << r.message;
    EXPECT_NE(r.message.find(needle), std::string::npos) << r.message;
  }
  // Before init, every call is refused.
  gpu::DeviceLlama idle;
  const int32_t token = 0;
  EXPECT_FALSE(idle.embed(&token, 1).ok);
  EXPECT_FALSE(idle.finish_layer(0, true).ok);
  EXPECT_EQ(idle.q_host(), nullptr);
}
