#include "lib/model/llama_weights.hpp"

#include <algorithm>

#include "lib/core/error.hpp"
#include "lib/model/dequantize.hpp"
#include "simd/quant.hpp"

namespace kvsift::model {

namespace {

uint32_t get_u32(const GgufFile& file, const std::string& key) {
  const uint64_t value = file.get_uint(key);
  if (value == 0 || value > (1u << 30))
    fail(Status::invalid_file, key, "=", value, " is out of range");
  return static_cast<uint32_t>(value);
}

void check_dims(const GgufTensor& t, uint64_t d0, uint64_t d1) {
  const bool ok = d1 == 1 ? (t.n_dims == 1 || (t.n_dims == 2 && t.dims[1] == 1)) && t.dims[0] == d0
                          : t.n_dims == 2 && t.dims[0] == d0 && t.dims[1] == d1;
  if (!ok)
    fail(Status::invalid_file, "tensor '", t.name, "' has shape [", t.dims[0], ", ", t.dims[1],
         "], expected [", d0, ", ", d1, "]");
}

// A norm's weight vector [n], dequantized to float32.
std::vector<float> load_vector(const GgufFile& file, const std::string& name, uint32_t n) {
  const GgufTensor& t = file.require_tensor(name);
  check_dims(t, n, 1);
  std::vector<float> v(n);
  dequantize(t.type, t.data, v.data(), n);
  return v;
}

// Repacks w's Q4_0 parts that start at a multiple of 16 stacked rows into w.interleaved as
// q4_0x16 (Linear, llama_weights.hpp): once per weight, the file's bytes untouched but released
// from the resident set (the copy replaces them; embed() may read a tied table's rows again).
void interleave_q4_0(Linear& w, const GgufFile& file, ThreadPool& pool) {
  constexpr uint64_t group_rows = simd::kInterleavedRows;
  const auto eligible = [](const BlockRows& part, uint64_t start) {
    return part.format == simd::BlockFormat::q4_0 && start % group_rows == 0;
  };
  std::size_t bytes = 0;
  uint64_t start = 0;
  for (const BlockRows& part : w.blocks) {
    if (eligible(part, start)) bytes += part.rows * part.row_bytes;
    start += part.rows;
  }
  if (bytes == 0) return;
  w.interleaved.resize(bytes);
  std::byte* dst = w.interleaved.data();
  start = 0;
  for (BlockRows& part : w.blocks) {
    if (eligible(part, start)) {
      const uint64_t units = (part.rows + group_rows - 1) / group_rows;
      pool.parallel_for(units, 64, [&](uint64_t a, uint64_t b, int) noexcept {
        const uint64_t first = a * group_rows, last = std::min<uint64_t>(b * group_rows, part.rows);
        simd::repack_q4_0x16(part.data + first * part.row_bytes, last - first, w.in,
                             dst + first * part.row_bytes);
      });
      file.release(part.data, part.rows * part.row_bytes);
      part.data = dst;
      part.format = simd::BlockFormat::q4_0x16;
      dst += part.rows * part.row_bytes;
    }
    start += part.rows;
  }
}

}  // namespace

LlamaConfig read_config(const GgufFile& file) {
  const std::string& arch = file.get_string("general.architecture");
  if (arch != "llama")
    fail(Status::unsupported, "general.architecture='", arch,
         "': kvsift runs the Llama family ('llama')");
  LlamaConfig c;
  c.n_layers = get_u32(file, "llama.block_count");
  c.n_embd = get_u32(file, "llama.embedding_length");
  c.n_ff = get_u32(file, "llama.feed_forward_length");
  c.n_heads = get_u32(file, "llama.attention.head_count");
  c.n_kv_heads = file.find("llama.attention.head_count_kv")
                     ? get_u32(file, "llama.attention.head_count_kv")
                     : c.n_heads;
  c.n_ctx_train = get_u32(file, "llama.context_length");
  if (file.find("llama.rope.freq_base"))
    c.rope_theta = static_cast<float>(file.get_float("llama.rope.freq_base"));
  c.rms_eps = static_cast<float>(file.get_float("llama.attention.layer_norm_rms_epsilon"));
  if (c.n_embd % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0)
    fail(Status::invalid_file, "embedding_length=", c.n_embd, ", head_count=", c.n_heads,
         ", head_count_kv=", c.n_kv_heads, " do not divide");
  c.head_dim = c.n_embd / c.n_heads;
  if (file.find("llama.rope.dimension_count") &&
      file.get_uint("llama.rope.dimension_count") != c.head_dim)
    fail(Status::unsupported,
         "llama.rope.dimension_count=", file.get_uint("llama.rope.dimension_count"),
         ": partial rotary embeddings are not supported (head_dim ", c.head_dim, ")");
  if (!(c.rope_theta > 0.0f) || !(c.rms_eps > 0.0f))
    fail(Status::invalid_file, "rope freq_base and rms epsilon must be positive");
  const GgufTensor& embd = file.require_tensor("token_embd.weight");
  if (embd.n_dims != 2 || embd.dims[0] != c.n_embd)
    fail(Status::invalid_file, "token_embd.weight has row length ", embd.dims[0], ", expected ",
         c.n_embd);
  c.n_vocab = static_cast<uint32_t>(embd.dims[1]);
  c.tied_output = file.tensor("output.weight") == nullptr;
  return c;
}

std::optional<simd::BlockFormat> block_format(GgmlType type) noexcept {
  switch (type) {
    case GgmlType::q8_0: return simd::BlockFormat::q8_0;
    case GgmlType::q4_0: return simd::BlockFormat::q4_0;
    case GgmlType::q4_1: return simd::BlockFormat::q4_1;
    default: return std::nullopt;
  }
}

bool LlamaWeights::any_quantized() const noexcept {
  for (const LayerWeights& L : layers_)
    for (const Linear* w : {&L.wqkv, &L.wo, &L.w_gate_up, &L.w_down})
      if (w->quantized()) return true;
  return output_.quantized();
}

void dequantize_row(const BlockRows& part, uint64_t row, uint32_t in, float* out) noexcept {
  constexpr std::size_t group_rows = simd::kInterleavedRows;
  if (part.format != simd::BlockFormat::q4_0x16 || row >= part.rows / group_rows * group_rows) {
    dequantize(part.type, part.data + row * part.row_bytes, out, in);
    return;
  }
  constexpr std::size_t block_bytes = simd::block_format_bytes(simd::BlockFormat::q4_0);
  const std::byte* group = part.data + row / group_rows * group_rows * part.row_bytes;
  std::byte block[block_bytes];
  for (std::size_t b = 0; b < in / simd::kQuantBlock; ++b) {
    simd::q4_0x16_row(group + b * group_rows * block_bytes, simd::kQuantBlock, row % group_rows,
                      block);
    dequantize(GgmlType::q4_0, block, out + b * simd::kQuantBlock, simd::kQuantBlock);
  }
}

LlamaWeights LlamaWeights::load(GgufFile file, const LlamaConfig& config, MatType type,
                                const simd::Kernels& kernels, ThreadPool& pool,
                                bool keep_quantized) {
  LlamaWeights w(std::move(file), type, keep_quantized);
  const GgufFile& f = w.file_;
  const uint32_t E = config.n_embd, qdim = config.q_dim(), kvdim = config.kv_dim();
  w.n_embd_ = E;
  w.layers_.resize(config.n_layers);
  for (uint32_t l = 0; l < config.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    LayerWeights& L = w.layers_[l];
    L.attn_norm = load_vector(f, p + "attn_norm.weight", E);
    L.ffn_norm = load_vector(f, p + "ffn_norm.weight", E);
    L.wqkv = w.load_linear(
        {{p + "attn_q.weight", qdim}, {p + "attn_k.weight", kvdim}, {p + "attn_v.weight", kvdim}},
        E, kernels, pool);
    L.wo = w.load_linear({{p + "attn_output.weight", E}}, qdim, kernels, pool);
    L.w_gate_up =
        w.load_linear({{p + "ffn_gate.weight", config.n_ff}, {p + "ffn_up.weight", config.n_ff}}, E,
                      kernels, pool);
    L.w_down = w.load_linear({{p + "ffn_down.weight", E}}, config.n_ff, kernels, pool);
  }
  w.output_norm_ = load_vector(f, "output_norm.weight", E);
  w.token_embd_ = &f.require_tensor("token_embd.weight");
  w.embd_stride_ = row_bytes(w.token_embd_->type, E);  // validates the type and row length
  w.output_ =
      w.load_linear({{config.tied_output ? "token_embd.weight" : "output.weight", config.n_vocab}},
                    E, kernels, pool);
  return w;
}

Linear LlamaWeights::load_linear(const std::vector<std::pair<std::string, uint32_t>>& parts,
                                 uint32_t in, const simd::Kernels& kernels,
                                 ThreadPool& pool) const {
  Linear w;
  w.in = in;
  for (const auto& part : parts) w.out += part.second;
  if (keep_quantized_) {
    // Kept in blocks only when every tensor has a kernel: one layer is one format per row range.
    bool all = true;
    for (const auto& part : parts) all = all && block_format(file_.require_tensor(part.first).type);
    if (all) {
      for (const auto& [name, out] : parts) {
        const GgufTensor& t = file_.require_tensor(name);
        check_dims(t, in, out);
        BlockRows rows;
        rows.format = *block_format(t.type);
        rows.type = t.type;
        // Throws invalid_file when `in` is not a whole number of blocks of 32.
        rows.row_bytes = row_bytes(t.type, in);
        require(rows.row_bytes == in / simd::kQuantBlock * simd::block_format_bytes(rows.format),
                "tensor '", name, "': block size disagrees with the kernels' format");
        rows.data = reinterpret_cast<const std::byte*>(t.data);
        rows.rows = out;
        w.blocks.push_back(rows);
      }
      interleave_q4_0(w, file_, pool);
      return w;
    }
  }
  const bool bf16 = type_ == MatType::bf16;
  if (bf16)
    w.bf16.resize(std::size_t{in} * w.out);
  else
    w.f32.resize(std::size_t{in} * w.out);
  std::vector<float> row_buffers(bf16 ? std::size_t{in} * pool.size() : 0);  // [threads, in]
  uint32_t first_row = 0;
  for (const auto& [name, out] : parts) {
    const GgufTensor& t = file_.require_tensor(name);
    check_dims(t, in, out);
    const std::size_t stride = row_bytes(t.type, in);
    pool.parallel_for(out, 64, [&](uint64_t first, uint64_t last, int thread) noexcept {
      float* row = row_buffers.data() + std::size_t{in} * thread;
      for (uint64_t r = first; r < last; ++r) {
        const std::size_t dst_row = (first_row + r) * std::size_t{in};
        float* dst = bf16 ? row : w.f32.data() + dst_row;
        dequantize(t.type, t.data + r * stride, dst, in);
        if (bf16) kernels.encode(row, w.bf16.data() + dst_row, in, simd::Dtype::bf16);
      }
    });
    first_row += out;
  }
  return w;
}

void LlamaWeights::embed(int32_t token, float* x) const noexcept {
  dequantize(token_embd_->type, token_embd_->data + std::size_t(token) * embd_stride_, x, n_embd_);
}

}  // namespace kvsift::model
