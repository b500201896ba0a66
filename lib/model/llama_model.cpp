#include "lib/model/llama_model.hpp"

#include <algorithm>
#include <chrono>

#include "gpu/host_memory.hpp"
#include "lib/core/error.hpp"
#include "lib/model/cpu_forward_pass.hpp"
#include "lib/model/device_forward_pass.hpp"

namespace kvsift::model {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

std::unique_ptr<LlamaModel> LlamaModel::load(const std::string& path, const ModelOptions& options) {
  require(options.device >= -1, "device=", options.device,
          " is neither -1 (CPU) nor a device index");
  if (options.device >= 0) {
    // Before anything is allocated: the offload mode's first need is a device.
    int n_devices = 0;
    gpu::check(gpu::device_count(&n_devices), "device=", options.device, " (offload mode): ");
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
    : tokenizer_(std::move(tokenizer)),
      config_(config),
      options_(options),
      n_ctx_(context_for(config, options)),
      runtime_(options.isa),
      cache_(geometry_for(config, options), cache_options_for(config, options), runtime_.kernels()),
      engine_(cache_, runtime_.kernels(), engine_options_for(config, options)) {
  require(options.prefill_chunk >= 1 && options.prefill_chunk <= 4096,
          "prefill_chunk=", options.prefill_chunk, " is not in 1..4096");
  LlamaWeights weights = LlamaWeights::load(std::move(file), config, options.weight_type,
                                            runtime_.kernels(), engine_.pool(),
                                            options.keep_quantized);
  const uint32_t max_rows = std::max(options.prefill_chunk, options.max_seqs);
  if (options.device >= 0)
    forward_ = std::make_unique<DeviceForwardPass>(
        std::move(weights), config, cache_, options.device, max_rows, n_ctx_, options.kv_dtype);
  else
    forward_ =
        std::make_unique<CpuForwardPass>(std::move(weights), config, cache_, runtime_.kernels(),
                                         engine_.pool(), max_rows, options.prefill_chunk, n_ctx_);
}

int32_t LlamaModel::create_sequence() {
  const int32_t id = cache_.create_sequence();
  if (logits_.size() <= static_cast<std::size_t>(id)) {
    logits_.resize(id + 1);
    has_logits_.resize(id + 1);
  }
  logits_[id].assign(config_.n_vocab, 0.0f);
  has_logits_[id] = 0;
  return id;
}

int32_t LlamaModel::fork_sequence(int32_t src) {
  check_sequence(src);
  const int32_t id = cache_.fork_sequence(src);
  if (logits_.size() <= static_cast<std::size_t>(id)) {
    logits_.resize(id + 1);
    has_logits_.resize(id + 1);
  }
  logits_[id] = logits_[src];
  has_logits_[id] = has_logits_[src];
  return id;
}

void LlamaModel::set_selector(const select::Policy& policy) {
  engine_.set_selector(policy);
}

void LlamaModel::free_sequence(int32_t seq_id) {
  cache_.free_sequence(seq_id);
  forward_->forget_sequence(seq_id);
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

void LlamaModel::check_layers_in_step(int32_t seq_id) const {
  check_sequence(seq_id);
  const uint64_t first = cache_.length(seq_id, 0);
  for (uint32_t l = 1; l < config_.n_layers; ++l)
    if (const uint64_t n = cache_.length(seq_id, l); n != first)
      fail(Status::invalid_argument, "sequence ", seq_id,
           "'s layers hold different lengths (layer 0: ", first, " tokens, layer ", l, ": ", n,
           "): append_kv the missing K/V to every layer before a prefill or decode step");
}

void LlamaModel::append_kv(int32_t seq_id, uint32_t layer, uint64_t n_tokens, const float* k,
                           const float* v) {
  check_sequence(seq_id);
  require(layer < config_.n_layers, "layer=", layer, " is not in 0..", config_.n_layers - 1);
  require(n_tokens >= 1, "n_tokens=0: nothing to append");
  const uint64_t held = cache_.length(seq_id, layer);
  if (n_tokens > n_ctx_ - std::min<uint64_t>(held, n_ctx_))
    fail(Status::capacity_exceeded, "layer ", layer, " of sequence ", seq_id, " would hold ",
         held + n_tokens, " tokens, beyond the context of ", n_ctx_, " positions");
  if (layer > 0)
    if (const uint64_t below = cache_.length(seq_id, layer - 1); held + n_tokens > below)
      fail(Status::invalid_argument, "layers out of step: layer ", layer, " of sequence ", seq_id,
           " would hold ", held + n_tokens, " tokens, more than layer ", layer - 1, "'s ", below,
           " (layers fill in order)");
  // The keys are rotated already: stored as they come, where the runner's own are rotated by the
  // cache (cache_options_for).
  cache_.append(seq_id, layer, static_cast<uint32_t>(n_tokens), k, v, KeyForm::post_rope);
  has_logits_[seq_id] = 0;
  // Off the decode path, as a prefill builds them layer by layer.
  engine_.build_summaries();
}

void LlamaModel::prefill(int32_t seq_id, std::span<const int32_t> tokens, float* all_logits,
                         void (*progress)(uint64_t, uint64_t, void*), void* user) {
  check_layers_in_step(seq_id);
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
  const uint32_t chunk = options_.prefill_chunk;
  std::vector<uint64_t> positions(chunk);
  for (std::size_t done = 0; done < tokens.size();) {
    const uint32_t T = static_cast<uint32_t>(std::min<std::size_t>(chunk, tokens.size() - done));
    const uint64_t pos0 = start + done;
    for (uint32_t t = 0; t < T; ++t) positions[t] = pos0 + t;
    forward_->prefill_begin(seq_id, pos0);
    forward_->embed(tokens.subspan(done, T));
    for (uint32_t l = 0; l < config_.n_layers; ++l) {
      const AttentionIo io = forward_->prefill_inputs(l, positions.data());
      cache_.append(seq_id, l, T, io.k, io.v);
      forward_->prefill_attention(l, seq_id, pos0, io);
      forward_->prefill_finish(l);
      // On a device, while it runs the rest of the layer.
      engine_.build_summaries();
    }
    done += T;
    if (all_logits != nullptr) {
      forward_->prefill_logits(0, T, all_logits + (done - T) * config_.n_vocab);
      if (done == tokens.size())
        std::copy_n(all_logits + (done - 1) * config_.n_vocab, config_.n_vocab,
                    logits_[seq_id].begin());
    } else if (done == tokens.size()) {
      forward_->prefill_logits(T - 1, 1, logits_[seq_id].data());
    }
    if (progress) progress(done, tokens.size(), user);
  }
  has_logits_[seq_id] = 1;
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
    check_layers_in_step(seq_ids[i]);
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
  const uint32_t kvdim = config_.kv_dim();
  forward_->embed(tokens);
  AttendCall call;
  call.n_seqs = n;
  call.seq_ids = seq_ids.data();
  StepStats step;
  double kept_sum = 0.0;
  for (uint32_t l = 0; l < config_.n_layers; ++l) {
    const AttentionIo io = forward_->decode_inputs(l, positions.data());
    const auto a0 = Clock::now();
    for (uint32_t r = 0; r < n; ++r)
      cache_.append(seq_ids[r], l, 1, io.k + std::size_t{r} * kvdim, io.v + std::size_t{r} * kvdim);
    call.layer = l;
    call.q = io.q;
    call.out = io.out;
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
    step.plan_us += s.plan_us;
    step.attend_us += s.attend_us;
    step.h2d_bytes += s.h2d_bytes;
    step.row_h2d_bytes += s.row_h2d_bytes;
    step.rows_equivalent_bytes += s.rows_equivalent_bytes;
    step.cache_hits += s.cache_hits;
    step.cache_misses += s.cache_misses;
    attention_seconds += seconds_since(a0);
    if (observer_ != nullptr) observer_->on_layer(l, seq_ids, io.q, engine_.selection(), io.out);
    forward_->decode_finish(l);
    // On a device, while it runs the rest of the layer.
    engine_.build_summaries();
  }
  for (uint32_t r = 0; r < n; ++r) {
    forward_->decode_logits(r, 1, logits_[seq_ids[r]].data());
    has_logits_[seq_ids[r]] = 1;
  }
  stats_.decode_tokens += n;
  stats_.decode_seconds += seconds_since(t0);
  stats_.decode_attention_seconds += attention_seconds;
  step.kept_estimate = step.pairs > 0 ? kept_sum / static_cast<double>(step.pairs) : 1.0;
  stats_.last_step = step;
}

std::span<const float> LlamaModel::logits(int32_t seq_id) const {
  check_sequence(seq_id);
  if (!has_logits_[seq_id])
    fail(Status::invalid_argument, "sequence ", seq_id,
         " has no logits yet: no prefill or decode step ran on it since it was created or given "
         "K/V through append_kv");
  return logits_[seq_id];
}

}  // namespace kvsift::model
