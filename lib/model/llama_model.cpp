#include "lib/model/llama_model.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "lib/core/error.hpp"
#include "lib/model/dequantize.hpp"

namespace kvsift::model {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

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

}  // namespace

std::unique_ptr<LlamaModel> LlamaModel::load(const std::string& path, const ModelOptions& options) {
  require(options.device >= -1, "device=", options.device,
          " is neither -1 (CPU) nor a device index");
  if (options.device >= 0) {
    // Before anything is allocated: the offload mode's first need is a device.
    int n_devices = 0;
    const gpu::Result r = gpu::device_count(&n_devices);
    if (!r.ok)
      fail(r.unsupported || !gpu::built_with_cuda() ? Status::unsupported : Status::internal,
           "device=", options.device, " (offload mode): ", r.message);
    require(options.device < n_devices, "device=", options.device, " is not in 0..", n_devices - 1);
  }
  GgufFile file = GgufFile::open(path);
  const LlamaConfig config = read_config(file);
  Tokenizer tokenizer = Tokenizer::from_gguf(file);
  if (tokenizer.vocab_size() != config.n_vocab)
    fail(Status::invalid_file, "the tokenizer has ", tokenizer.vocab_size(),
         " tokens but token_embd has ", config.n_vocab, " rows");
  return std::unique_ptr<LlamaModel>(
      new LlamaModel(std::move(file), std::move(tokenizer), config, options));
}

namespace {

// The device model's failures: no device is "unsupported", the rest internal.
void device_check(const gpu::Result& r, const char* what) {
  if (!r.ok)
    fail(r.unsupported ? Status::unsupported : Status::internal, "device model: ", what, ": ",
         r.message);
}

uint32_t context_for(const LlamaConfig& config, const ModelOptions& options) {
  const uint32_t n = options.n_ctx == 0 ? config.n_ctx_train : options.n_ctx;
  require(n <= config.n_ctx_train, "n_ctx=", n, " is beyond the model's ", config.n_ctx_train,
          " positions");
  return n;
}

CacheGeometry geometry_for(const LlamaConfig& config, const ModelOptions& options) {
  CacheGeometry g;
  g.n_layers = config.n_layers;
  g.n_kv_heads = config.n_kv_heads;
  g.group_size = config.n_heads / config.n_kv_heads;
  g.head_dim = config.head_dim;
  g.page_tokens = options.page_tokens;
  g.dtype = options.kv_dtype;
  g.validate();
  return g;
}

CacheOptions cache_options_for(const LlamaConfig& config, const ModelOptions& options) {
  require(options.max_seqs >= 1 && options.max_seqs <= 4096, "max_seqs=", options.max_seqs,
          " is not in 1..4096");
  const uint64_t n_ctx = context_for(config, options);
  CacheOptions o;
  o.max_pages = uint64_t{options.max_seqs} * config.n_layers * config.n_kv_heads *
                ((n_ctx + options.page_tokens - 1) / options.page_tokens);
  o.isa = options.isa;
  // The runner hands the cache pre-RoPE keys: the cache rotates them with the same Rope code the
  // runner uses for queries, and a selector that works before RoPE (S4R) can read them back.
  o.key_form = KeyForm::pre_rope;
  o.rope_theta = config.rope_theta;
  // The offload path's device reads pages straight from the pool over PCIe.
  o.pinned = options.device >= 0;
  return o;
}

EngineOptions engine_options_for(const LlamaConfig& config, const ModelOptions& options) {
  EngineOptions o;
  o.max_batch = options.max_seqs;
  o.n_threads = options.n_threads;
  // A pair never holds more pages than a sequence's context.
  o.max_pages_per_pair = geometry_for(config, options).pages_for(context_for(config, options));
  o.device = options.device;
  o.device_cache_pages = options.device_cache_pages;
  return o;
}

}  // namespace

LlamaModel::LlamaModel(GgufFile file, Tokenizer tokenizer, const LlamaConfig& config,
                       const ModelOptions& options)
    : file_(std::move(file)),
      tokenizer_(std::move(tokenizer)),
      config_(config),
      options_(options),
      n_ctx_(context_for(config, options)),
      rope_(config.rope_theta, config.head_dim),
      cache_(geometry_for(config, options), cache_options_for(config, options)),
      engine_(cache_, engine_options_for(config, options)),
      prefill_attention_(geometry_for(config, options),
                         std::clamp<uint32_t>(options.prefill_chunk, 1, 4096), n_ctx_) {
  require(options.prefill_chunk >= 1 && options.prefill_chunk <= 4096,
          "prefill_chunk=", options.prefill_chunk, " is not in 1..4096");
  const uint32_t E = config.n_embd, qdim = config.n_heads * config.head_dim,
                 kvdim = config.n_kv_heads * config.head_dim;
  layers_.resize(config.n_layers);
  for (uint32_t l = 0; l < config.n_layers; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    Layer& L = layers_[l];
    for (auto [name, dst] :
         {std::pair{"attn_norm.weight", &L.attn_norm}, std::pair{"ffn_norm.weight", &L.ffn_norm}}) {
      const GgufTensor& t = file_.require_tensor(p + name);
      check_dims(t, E, 1);
      dst->resize(E);
      dequantize(t.type, t.data, dst->data(), E);
    }
    L.wqkv = load_linear(
        {{p + "attn_q.weight", qdim}, {p + "attn_k.weight", kvdim}, {p + "attn_v.weight", kvdim}},
        E);
    L.wo = load_linear({{p + "attn_output.weight", E}}, qdim);
    L.w_gate_up =
        load_linear({{p + "ffn_gate.weight", config.n_ff}, {p + "ffn_up.weight", config.n_ff}}, E);
    L.w_down = load_linear({{p + "ffn_down.weight", E}}, config.n_ff);
  }
  const GgufTensor& norm = file_.require_tensor("output_norm.weight");
  check_dims(norm, E, 1);
  output_norm_.resize(E);
  dequantize(norm.type, norm.data, output_norm_.data(), E);
  token_embd_ = &file_.require_tensor("token_embd.weight");
  row_bytes(token_embd_->type, E);  // validates the type and row length
  output_ = load_linear(
      {{config.tied_output ? "token_embd.weight" : "output.weight", config.n_vocab}}, E);

  rope_.reserve(n_ctx_);  // queries; the cache rotates the keys

  max_rows_ = std::max(options.prefill_chunk, options.max_seqs);
  const std::size_t rows = max_rows_;
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

  if (options.device >= 0) {
    require(options.weight_type == MatType::bf16,
            "the offload mode (device >= 0) runs bf16 weights; weight_type f32 is CPU only");
    gpu::LlamaShape shape;
    shape.n_layers = config.n_layers;
    shape.n_embd = E;
    shape.n_ff = config.n_ff;
    shape.n_heads = config.n_heads;
    shape.n_kv_heads = config.n_kv_heads;
    shape.head_dim = config.head_dim;
    shape.n_vocab = config.n_vocab;
    shape.rope_theta = config.rope_theta;
    shape.rms_eps = config.rms_eps;
    shape.max_rows = max_rows_;
    shape.max_positions = n_ctx_;
    shape.max_prefill_tokens = n_ctx_;
    shape.kv_dtype = options.kv_dtype;
    gpu::LlamaWeights weights;
    for (const Layer& L : layers_)
      weights.layers.push_back({L.wqkv.bf16.data(), L.wo.bf16.data(), L.w_gate_up.bf16.data(),
                                L.w_down.bf16.data(), L.attn_norm.data(), L.ffn_norm.data()});
    // The embedding rows come from the CPU's dequantisation (load_embeddings), exact where bf16
    // is not; the table is passed for the output head, which is the same tensor when tied.
    weights.token_embd = output_.bf16.data();
    weights.output = output_.bf16.data();
    weights.output_norm = output_norm_.data();
    pass_rows_.resize(max_rows_);
    std::iota(pass_rows_.begin(), pass_rows_.end(), 0u);
    device_ = std::make_unique<gpu::DeviceLlama>();
    device_check(device_->init(shape, weights, options.device), "init");
  }
}

LlamaModel::Linear LlamaModel::load_linear(
    const std::vector<std::pair<std::string, uint32_t>>& parts, uint32_t in) const {
  Linear w;
  w.in = in;
  for (const auto& part : parts) w.out += part.second;
  const bool bf16 = options_.weight_type == MatType::bf16;
  if (bf16)
    w.bf16.resize(std::size_t{in} * w.out);
  else
    w.f32.resize(std::size_t{in} * w.out);
  const simd::Kernels& kernels = cache_.kernels();
  ThreadPool& pool = engine_.pool();
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

void LlamaModel::project(const Linear& w, const float* x, uint32_t rows, float* y) {
  if (options_.weight_type == MatType::bf16 && decoding_ && rows <= simd::kMaxVectors &&
      w.in % 16 == 0) {
    // A decode step (a few sequences): matrix-vector products that stream the weights once, split
    // by output rows across threads. x is rounded to bf16 as the matrix-product path rounds it.
    const simd::Kernels& kernels = cache_.kernels();
    const std::size_t n = std::size_t{rows} * w.in;
    kernels.encode(x, x_bf16_.data(), n, simd::Dtype::bf16);
    kernels.decode(x_bf16_.data(), x_rounded_.data(), n, simd::Dtype::bf16);
    engine_.pool().parallel_static(w.out, [&](uint64_t first, uint64_t last, int) noexcept {
      kernels.matvec_bf16(w.bf16.data() + first * w.in, last - first, w.in, x_rounded_.data(), rows,
                          y + first, w.out);
    });
  } else if (options_.weight_type == MatType::bf16) {
    cache_.kernels().encode(x, x_bf16_.data(), std::size_t{rows} * w.in, simd::Dtype::bf16);
    matmul_.run(MatType::bf16, x_bf16_.data(), rows, w.in, w.bf16.data(),
                WeightLayout::rows_are_outputs, w.out, y);
  } else {
    matmul_.run(MatType::f32, x, rows, w.in, w.f32.data(), WeightLayout::rows_are_outputs, w.out,
                y);
  }
}

void LlamaModel::embed(int32_t token, float* x) const {
  const std::size_t stride = row_bytes(token_embd_->type, config_.n_embd);
  dequantize(token_embd_->type, token_embd_->data + std::size_t(token) * stride, x, config_.n_embd);
}

void LlamaModel::rms_norm(const float* x, const std::vector<float>& weight, uint32_t rows,
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

template <class Attend>
void LlamaModel::blocks(uint32_t rows, const uint64_t* positions, Attend&& attend) {
  const uint32_t E = config_.n_embd, F = config_.n_ff;
  const uint32_t qdim = config_.n_heads * config_.head_dim,
                 kvdim = config_.n_kv_heads * config_.head_dim;
  if (device_ != nullptr) {
    device_check(device_->load_embeddings(x_.data(), rows), "load_embeddings");
    for (uint32_t l = 0; l < config_.n_layers; ++l) {
      device_check(device_->attention_inputs(l, positions, rows), "attention_inputs");
      const bool host =
          attend(l, device_->q_host(), device_->k_host(), device_->v_host(), device_->attn_host());
      device_check(device_->finish_layer(l, host), "finish_layer");
      // While the device runs the rest of the layer.
      engine_.build_summaries();
    }
    return;
  }
  for (uint32_t l = 0; l < config_.n_layers; ++l) {
    Layer& L = layers_[l];
    rms_norm(x_.data(), L.attn_norm, rows, h_.data());
    project(L.wqkv, h_.data(), rows, qkv_.data());
    for (uint32_t r = 0; r < rows; ++r) {
      const float* row = qkv_.data() + std::size_t{r} * (qdim + 2 * kvdim);
      float* q = q_.data() + std::size_t{r} * qdim;
      float* k = k_.data() + std::size_t{r} * kvdim;
      std::copy_n(row, qdim, q);
      std::copy_n(row + qdim, kvdim, k);
      std::copy_n(row + qdim + kvdim, kvdim, v_.data() + std::size_t{r} * kvdim);
      rope_.rotate(q, config_.n_heads, positions[r]);
    }
    attend(l, q_.data(), k_.data(), v_.data(), attn_.data());
    project(L.wo, attn_.data(), rows, h_.data());
    for (std::size_t i = 0; i < std::size_t{rows} * E; ++i) x_[i] += h_[i];
    rms_norm(x_.data(), L.ffn_norm, rows, h_.data());
    project(L.w_gate_up, h_.data(), rows, gate_up_.data());
    for (uint32_t r = 0; r < rows; ++r) {
      const float* gate = gate_up_.data() + std::size_t{r} * 2 * F;
      const float* up = gate + F;
      float* out = ffn_.data() + std::size_t{r} * F;
      for (uint32_t i = 0; i < F; ++i)
        out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];  // SiLU(gate) * up
    }
    project(L.w_down, ffn_.data(), rows, h_.data());
    for (std::size_t i = 0; i < std::size_t{rows} * E; ++i) x_[i] += h_[i];
    engine_.build_summaries();
  }
}

void LlamaModel::output_logits(const float* hidden, uint32_t rows, float* logits) {
  rms_norm(hidden, output_norm_, rows, h_.data());
  project(output_, h_.data(), rows, logits);
}

void LlamaModel::pass_logits(uint32_t first, uint32_t rows, float* out) {
  if (device_ == nullptr) {
    output_logits(x_.data() + std::size_t{first} * config_.n_embd, rows, out);
    return;
  }
  device_check(device_->logits(pass_rows_.data() + first, rows, out), "logits");
}

void LlamaModel::restore_prefill_scratch(int32_t seq_id, uint64_t pos0) {
  if (prefill_seq_ != seq_id) {
    device_->reset_prefill();
    prefill_seq_ = seq_id;
  }
  const uint32_t H = config_.n_kv_heads, d = config_.head_dim, kvdim = H * d;
  std::vector<float> k, v, head_k, head_v;
  for (uint32_t l = 0; l < config_.n_layers; ++l) {
    const uint64_t held = std::min(device_->prefill_held(l), pos0);
    if (held == pos0) continue;
    // Positions appended since (decode steps) or never held (another sequence's prefill since).
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
    device_check(device_->load_prefix(l, held, k.data(), v.data(), n), "load_prefix");
  }
}

int32_t LlamaModel::create_sequence() {
  const int32_t id = cache_.create_sequence();
  if (logits_.size() <= static_cast<std::size_t>(id)) logits_.resize(id + 1);
  logits_[id].assign(config_.n_vocab, 0.0f);
  return id;
}

int32_t LlamaModel::fork_sequence(int32_t src) {
  check_sequence(src);
  const int32_t id = cache_.fork_sequence(src);
  if (logits_.size() <= static_cast<std::size_t>(id)) logits_.resize(id + 1);
  logits_[id] = logits_[src];
  return id;
}

void LlamaModel::set_selector(const select::Policy& policy) {
  engine_.set_selector(policy);
}

void LlamaModel::free_sequence(int32_t seq_id) {
  cache_.free_sequence(seq_id);
  // Its id may come back (create or fork): the scratch must not pass for the new sequence's.
  if (prefill_seq_ == seq_id) prefill_seq_ = -1;
  logits_[seq_id].clear();
  logits_[seq_id].shrink_to_fit();
}

uint64_t LlamaModel::position(int32_t seq_id) const {
  return cache_.length(seq_id, 0);
}

void LlamaModel::require_free_pages(uint64_t pages_per_head, const char* what) const {
  // A step appends layer by layer, so a pool that ran dry halfway would leave the first layers
  // appended and the sequence unusable: the pages of every layer are counted before the first.
  const uint64_t needed =
      pages_per_head * cache_.geometry().n_layers * cache_.geometry().n_kv_heads;
  if (needed > cache_.pool().available())
    fail(Status::capacity_exceeded, what, " needs ", needed, " KV pages; ",
         cache_.pool().available(), " of ", cache_.pool().capacity(), " are free");
}

void LlamaModel::check_sequence(int32_t seq_id) const {
  if (!cache_.has_sequence(seq_id))
    fail(Status::not_found, "seq_id=", seq_id, " is not a live sequence");
}

void LlamaModel::prefill(int32_t seq_id, std::span<const int32_t> tokens, float* all_logits,
                         void (*progress)(uint64_t, uint64_t, void*), void* user) {
  check_sequence(seq_id);
  require(!tokens.empty(), "n_tokens=0: nothing to prefill");
  const uint64_t start = position(seq_id);
  if (start + tokens.size() > n_ctx_)
    fail(Status::capacity_exceeded, "sequence ", seq_id, " would hold ", start + tokens.size(),
         " tokens, beyond the context of ", n_ctx_, " positions");
  for (std::size_t i = 0; i < tokens.size(); ++i)
    require(tokens[i] >= 0 && static_cast<uint32_t>(tokens[i]) < config_.n_vocab, "tokens[", i,
            "]=", tokens[i], " is not in the vocabulary (", config_.n_vocab, " tokens)");
  const CacheGeometry& g = cache_.geometry();
  require_free_pages(g.pages_for(start + tokens.size()) - g.pages_for(start), "the prompt");
  const auto t0 = Clock::now();
  const uint32_t chunk = options_.prefill_chunk, E = config_.n_embd;
  std::vector<uint64_t> positions(chunk);
  for (std::size_t done = 0; done < tokens.size();) {
    const uint32_t T = static_cast<uint32_t>(std::min<std::size_t>(chunk, tokens.size() - done));
    const uint64_t pos0 = start + done;
    for (uint32_t t = 0; t < T; ++t) {
      embed(tokens[done + t], x_.data() + std::size_t{t} * E);
      positions[t] = pos0 + t;
    }
    if (device_ != nullptr) restore_prefill_scratch(seq_id, pos0);
    blocks(T, positions.data(),
           [&](uint32_t l, const float* q, const float* k, const float* v, float* attn) {
             cache_.append(seq_id, l, T, k, v);
             if (device_ != nullptr) {
               device_check(device_->prefill_attention(l, pos0, T), "prefill_attention");
               return false;
             }
             prefill_attention_.run(cache_, seq_id, l, pos0, T, q, attn, matmul_, engine_.pool());
             return true;
           });
    done += T;
    if (all_logits != nullptr) {
      pass_logits(0, T, all_logits + (done - T) * config_.n_vocab);
      if (done == tokens.size())
        std::copy_n(all_logits + (done - 1) * config_.n_vocab, config_.n_vocab,
                    logits_[seq_id].begin());
    } else if (done == tokens.size()) {
      pass_logits(T - 1, 1, logits_[seq_id].data());
    }
    if (progress) progress(done, tokens.size(), user);
  }
  stats_.prefill_tokens += tokens.size();
  stats_.prefill_seconds += seconds_since(t0);
}

void LlamaModel::decode(std::span<const int32_t> seq_ids, std::span<const int32_t> tokens) {
  const uint32_t n = static_cast<uint32_t>(seq_ids.size());
  require(seq_ids.size() >= 1 && seq_ids.size() <= options_.max_seqs, "n_seqs=", seq_ids.size(),
          " is not in 1..", options_.max_seqs, " (max_seqs)");
  require(tokens.size() == seq_ids.size(), "tokens and seq_ids differ in length");
  std::vector<uint64_t> positions(n);
  for (uint32_t i = 0; i < n; ++i) {
    check_sequence(seq_ids[i]);
    for (uint32_t j = 0; j < i; ++j)
      require(seq_ids[j] != seq_ids[i], "seq_ids repeats ", seq_ids[i]);
    require(tokens[i] >= 0 && static_cast<uint32_t>(tokens[i]) < config_.n_vocab, "tokens[", i,
            "]=", tokens[i], " is not in the vocabulary");
    positions[i] = position(seq_ids[i]);
    if (positions[i] >= n_ctx_)
      fail(Status::capacity_exceeded, "sequence ", seq_ids[i], " is full: ", n_ctx_, " positions");
  }
  uint64_t new_pages = 0;  // per (layer, KV head)
  for (uint32_t i = 0; i < n; ++i)
    new_pages +=
        cache_.geometry().pages_for(positions[i] + 1) - cache_.geometry().pages_for(positions[i]);
  require_free_pages(new_pages, "the step");
  const auto t0 = Clock::now();
  double attention_seconds = 0.0;
  // Decode rows take the matrix-vector path; prefill always the matrix products, so a prompt's
  // logits do not depend on how it was chunked.
  struct DecodingScope {
    bool& flag;
    explicit DecodingScope(bool& f) : flag(f) { flag = true; }
    ~DecodingScope() { flag = false; }
  } decoding_scope(decoding_);
  const uint32_t E = config_.n_embd, kvdim = config_.n_kv_heads * config_.head_dim;
  for (uint32_t r = 0; r < n; ++r) embed(tokens[r], x_.data() + std::size_t{r} * E);
  AttendCall call;
  call.n_seqs = n;
  call.seq_ids = seq_ids.data();
  StepStats step;
  double kept_sum = 0.0;
  blocks(n, positions.data(),
         [&](uint32_t l, const float* q, const float* k, const float* v, float* attn) {
           const auto a0 = Clock::now();
           for (uint32_t r = 0; r < n; ++r)
             cache_.append(seq_ids[r], l, 1, k + std::size_t{r} * kvdim,
                           v + std::size_t{r} * kvdim);
           call.layer = l;
           call.q = q;
           call.out = attn;
           // An observer reads the whole batch's selection, so the step selects it in one piece.
           engine_.attend_selected(call, /*whole_batch=*/observer_ != nullptr);
           const LayerStepStats& s = engine_.last_step();
           step.kv_bytes_read += s.attended.bytes_read;
           step.tokens_read += s.attended.tokens_read;
           step.index_bytes_read += s.index_bytes_read;
           step.pairs += s.pairs;
           kept_sum += s.kept_estimate_sum;
           step.dropped_bound = select::worse_bound(step.dropped_bound, s.dropped_bound);
           step.select_us += s.select_us;
           step.overlap_us += s.overlap_us;
           step.transfer_us += s.transfer_us;
           step.attend_us += s.attend_us;
           step.h2d_bytes += s.h2d_bytes;
           step.cache_hits += s.cache_hits;
           step.cache_misses += s.cache_misses;
           attention_seconds += seconds_since(a0);
           if (observer_ != nullptr) observer_->on_layer(l, seq_ids, q, engine_.selection(), attn);
           return true;
         });
  for (uint32_t r = 0; r < n; ++r) pass_logits(r, 1, logits_[seq_ids[r]].data());
  stats_.decode_tokens += n;
  stats_.decode_seconds += seconds_since(t0);
  stats_.decode_attention_seconds += attention_seconds;
  step.kept_estimate = step.pairs > 0 ? kept_sum / static_cast<double>(step.pairs) : 1.0;
  stats_.last_step = step;
}

std::span<const float> LlamaModel::logits(int32_t seq_id) const {
  check_sequence(seq_id);
  return logits_[seq_id];
}

}  // namespace kvsift::model
