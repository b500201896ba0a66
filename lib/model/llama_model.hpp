// A Llama-family decoder (RMSNorm, RoPE on adjacent pairs as GGUF stores it, GQA attention,
// SwiGLU MLP, tied or separate output head) with its KV cache in kvsift's paged host cache and its
// decode attention through kvsift's DecodeEngine: the runner. It holds the sequences, their logits,
// the cache and the engine, and runs the prefill and decode loops; the arithmetic outside
// attention is a ForwardPass (lib/model/forward_pass.hpp), on the CPU or on a device, over the
// weights lib/model/llama_weights.hpp loads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "lib/cache/kv_cache.hpp"
#include "lib/core/kernel_runtime.hpp"
#include "lib/engine/decode_engine.hpp"
#include "lib/model/forward_pass.hpp"
#include "lib/model/llama_weights.hpp"
#include "lib/model/matmul.hpp"
#include "lib/model/tokenizer.hpp"
#include "lib/select/selector.hpp"

namespace kvsift::model {

struct ModelOptions {
  uint32_t n_ctx = 0;            // positions per sequence; 0 = the model's training context
  uint32_t max_seqs = 1;         // sequences decoded together
  uint32_t prefill_chunk = 256;  // tokens per prefill step
  MatType weight_type = MatType::bf16;
  // Keep the linear layers whose tensors are Q8_0, Q4_0 or Q4_1 in the file's blocks (decode
  // multiplies them with simd's matvec_quant); the rest in weight_type. CPU only.
  bool keep_quantized = false;
  simd::Dtype kv_dtype = simd::Dtype::f16;
  uint32_t page_tokens = 16;
  int n_threads = 0;  // the model's thread pool, caller included; 0 = the CPUs it may run on
  simd::Level isa = simd::Level::best;  // simd::resolve_level: the CPU and the process cap
  // Offload mode: a CUDA device index, or -1 for the CPU only. With a device the weights live and
  // the products, norms, RoPE, SwiGLU and the prefill's attention run there (gpu/device_llama.hpp;
  // weight_type must be bf16), while the KV cache stays in host memory (pinned): each layer's K/V
  // go to the host cache, selection runs on the CPU, and decode attention runs on the device over
  // the selected pages and rows only (lib/offload/offload_attention.hpp).
  int device = -1;
  // Device page cache slots per layer; 0 holds every page the sequences can reach (the KV of
  // max_seqs * n_ctx tokens per layer), so that after the prompt only the pages that change move.
  uint32_t device_cache_pages = 0;
};

// One decode step, summed over its layers (and sequences).
struct StepStats {
  uint64_t kv_bytes_read = 0;     // K/V bytes the attention read
  uint64_t tokens_read = 0;       // tokens attended, summed over layers and KV heads
  uint64_t index_bytes_read = 0;  // what the selector read
  uint64_t pairs = 0;             // (sequence, layer, KV head) pairs
  double kept_estimate = 1.0;     // the estimated share of mass kept, averaged over the pairs
  double dropped_bound = 0.0;     // the largest proven bound on the dropped share (NaN: none)
  // Time, in microseconds: CPU selection, and attention (CPU: the kernel; offload: the device's
  // transfers and its kernel, each an event interval).
  double select_us = 0.0;
  double transfer_us = 0.0;
  double attend_us = 0.0;
  // Offload mode only: the host's planning of the page moves (CPU; the moves wait for it, so
  // transfer_us holds it where the device is idle by then); selection time hidden behind device
  // work, bytes host to device (pages, rows, q, lists), and the device page cache's hits and misses
  // (pages).
  double plan_us = 0.0;
  double overlap_us = 0.0;
  uint64_t h2d_bytes = 0;
  uint64_t cache_hits = 0;
  uint64_t cache_misses = 0;
  // Of h2d_bytes, the token rows', and what they would have cost as values (LayerStepStats).
  uint64_t row_h2d_bytes = 0;
  uint64_t rows_equivalent_bytes = 0;
};

struct ModelStats {
  uint64_t prefill_tokens = 0;
  double prefill_seconds = 0;
  uint64_t decode_tokens = 0;  // tokens decoded (summed over sequences)
  double decode_seconds = 0;
  double decode_attention_seconds = 0;
  StepStats last_step;
};

// Sees every layer of every decode step after its attention ran: the evaluation measures
// selections against exact attention through it. Called on the decoding thread; must not throw.
class DecodeObserver {
 public:
  virtual ~DecodeObserver() = default;
  // q, out: [seq_ids.size(), n_heads, head_dim]; q unscaled. The cache holds the step's token.
  virtual void on_layer(uint32_t layer, std::span<const int32_t> seq_ids, const float* q,
                        const select::Selection& selection, const float* out) noexcept = 0;
};

class LlamaModel {
 public:
  // Throws Error: io_error, invalid_file (malformed, missing tensors or metadata, inconsistent
  // shapes), unsupported (architecture, tensor types, head_dim), invalid_argument (options).
  static std::unique_ptr<LlamaModel> load(const std::string& path, const ModelOptions& options);

  const LlamaConfig& config() const noexcept { return config_; }
  const Tokenizer& tokenizer() const noexcept { return tokenizer_; }
  const KvCache& cache() const noexcept { return cache_; }
  const ModelStats& stats() const noexcept { return stats_; }
  uint32_t n_ctx() const noexcept { return n_ctx_; }
  // Where decode attention runs: "cpu" or "cuda:<device>".
  const char* attention_backend() const noexcept { return engine_.backend().name(); }

  int32_t create_sequence();
  // A new sequence holding a copy of src's tokens, K/V and logits (one prefill, many decodes).
  int32_t fork_sequence(int32_t src);
  void free_sequence(int32_t seq_id);

  // The selector every later decode step uses (dense at load). Summarises the pages already
  // stored. Throws invalid_argument for a bad policy.
  void set_selector(const select::Policy& policy);
  const select::Selector& selector() const noexcept { return engine_.selector(); }
  // nullptr removes it; the observer must outlive its registration.
  void set_observer(DecodeObserver* observer) noexcept { observer_ = observer; }
  uint64_t position(int32_t seq_id) const;  // tokens processed so far

  // Runs the tokens through the model in chunks, appending their K/V. Afterwards logits(seq)
  // holds the next-token logits after the last token. all_logits, when not null, receives
  // [tokens.size(), n_vocab]. progress(done, total) is called after each chunk.
  void prefill(int32_t seq_id, std::span<const int32_t> tokens, float* all_logits,
               void (*progress)(uint64_t done, uint64_t total, void* user), void* user);

  // One token for each listed sequence (distinct ids), decoded together.
  void decode(std::span<const int32_t> seq_ids, std::span<const int32_t> tokens);

  // Stores K/V computed elsewhere (a prefix another engine prefilled) as the next n_tokens
  // positions of one layer of a sequence: k, v [n_tokens, n_kv_heads, head_dim], keys rotated at
  // their positions (the layer's length onwards) with the model's RoPE. Layers fill in order, so a
  // layer never holds more tokens than the one before it; prefill and decode refuse the sequence
  // until every layer holds as many as layer 0. The sequence has no logits until its next prefill
  // or decode step. Throws not_found, invalid_argument (layer, n_tokens, out of step, non-finite
  // values), capacity_exceeded (beyond n_ctx or the pool), out_of_memory.
  void append_kv(int32_t seq_id, uint32_t layer, uint64_t n_tokens, const float* k, const float* v);

  // Next-token logits of a sequence, [n_vocab]; valid until its next prefill/decode. Throws
  // invalid_argument for a sequence no prefill or decode step has run on since it was created or
  // given K/V through append_kv.
  std::span<const float> logits(int32_t seq_id) const;

 private:
  LlamaModel(GgufFile file, Tokenizer tokenizer, const LlamaConfig& config,
             const ModelOptions& options);
  // Throws capacity_exceeded unless the pool has pages_per_head free pages for every (layer, KV
  // head): what a prefill or decode step about to append will take.
  void require_free_pages(uint64_t pages_per_head, const char* what) const;
  void check_sequence(int32_t seq_id) const;
  // check_sequence, then that every layer holds as many tokens as layer 0 (append_kv fills them
  // one at a time): what prefill and decode need to step the whole stack.
  void check_layers_in_step(int32_t seq_id) const;

  Tokenizer tokenizer_;
  LlamaConfig config_;
  ModelOptions options_;
  uint32_t n_ctx_;
  KernelRuntime runtime_;  // the model's kernel level: its cache, engine and products run it
  KvCache cache_;
  DecodeEngine engine_;                   // after cache_, which it listens to
  std::unique_ptr<ForwardPass> forward_;  // after cache_ and engine_, which it borrows
  DecodeObserver* observer_ = nullptr;
  ModelStats stats_;
  std::vector<std::vector<float>> logits_;  // per sequence id
  std::vector<uint8_t> has_logits_;         // per sequence id: logits_ follows its last token
};

}  // namespace kvsift::model
