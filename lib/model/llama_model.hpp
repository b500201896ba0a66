// A Llama-family decoder (RMSNorm, RoPE on adjacent pairs as GGUF stores it, GQA attention,
// SwiGLU MLP, tied or separate output head) running on the CPU, with its KV cache in kvsift's
// paged host cache and its attention through kvsift's attention.
//
// Weights are dequantized at load to bf16 (default) or f32 and multiplied with oneDNN. Memory
// this costs, for SmolLM2-135M: 134.5M parameters x 2 bytes = 269 MB in bf16 (538 MB in f32),
// against 98 MB for the Q4_1 file. The projection type (Linear) is the one place a
// quantized-weight kernel would plug in.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gpu/device_llama.hpp"
#include "lib/attend/decode_attention.hpp"
#include "lib/attend/prefill_attention.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/cache/rope.hpp"
#include "lib/core/aligned.hpp"
#include "lib/core/matmul.hpp"
#include "lib/engine/decode_engine.hpp"
#include "lib/model/gguf_file.hpp"
#include "lib/model/tokenizer.hpp"
#include "lib/select/selector.hpp"

namespace kvsift::model {

struct LlamaConfig {
  uint32_t n_layers = 0;
  uint32_t n_embd = 0;
  uint32_t n_ff = 0;
  uint32_t n_heads = 0;
  uint32_t n_kv_heads = 0;
  uint32_t head_dim = 0;
  uint32_t n_ctx_train = 0;
  uint32_t n_vocab = 0;
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  bool tied_output = true;
};

struct ModelOptions {
  uint32_t n_ctx = 0;            // positions per sequence; 0 = the model's training context
  uint32_t max_seqs = 1;         // sequences decoded together
  uint32_t prefill_chunk = 256;  // tokens per prefill step
  MatType weight_type = MatType::bf16;
  simd::Dtype kv_dtype = simd::Dtype::f16;
  uint32_t page_tokens = 16;
  int n_threads = 0;  // the model's thread pool, caller included; 0 = the CPUs it may run on
  simd::Isa isa = simd::Isa::avx512;
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
  // Offload mode only: selection time hidden behind device work, bytes host to device (pages,
  // rows, q, lists), and the device page cache's hits and misses (pages).
  double overlap_us = 0.0;
  uint64_t h2d_bytes = 0;
  uint64_t cache_hits = 0;
  uint64_t cache_misses = 0;
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

  // Next-token logits of a sequence, [n_vocab]; valid until its next prefill/decode.
  std::span<const float> logits(int32_t seq_id) const;

 private:
  struct Linear {
    AlignedVector<uint16_t> bf16;  // [out, in] when weight_type is bf16
    AlignedVector<float> f32;      // [out, in] when weight_type is f32
    uint32_t in = 0, out = 0;
  };
  // Q, K and V are one product (rows stacked [q | k | v]), as are gate and up: fewer, larger
  // products, which matters most at decode where each is a matrix-vector product.
  struct Layer {
    std::vector<float> attn_norm, ffn_norm;
    Linear wqkv, wo, w_gate_up, w_down;
  };

  LlamaModel(GgufFile file, Tokenizer tokenizer, const LlamaConfig& config,
             const ModelOptions& options);
  // The named [in, out_i] tensors stacked along their outputs into one [sum out_i, in] weight.
  Linear load_linear(const std::vector<std::pair<std::string, uint32_t>>& parts, uint32_t in) const;
  void project(const Linear& w, const float* x, uint32_t rows, float* y);
  void embed(int32_t token, float* x) const;
  void rms_norm(const float* x, const std::vector<float>& weight, uint32_t rows, float* y) const;
  // The transformer blocks over `rows` tokens in x_; attend(layer) appends the layer's K/V from
  // k_, v_ and writes attn_ from q_ (prefill and decode differ only there).
  //
  // attend(l, q, k, v, attn): q [rows, q_dim] (RoPE'd, unscaled), k, v [rows, kv_dim] (pre-RoPE);
  // it writes attn [rows, q_dim] and returns true, or returns false when the device computed the
  // attention itself (device prefill). On the CPU the buffers are q_, k_, v_, attn_; in offload
  // mode the device model's pinned ones.
  template <class Attend>
  void blocks(uint32_t rows, const uint64_t* positions, Attend&& attend);
  // Next-token logits of rows [first, first + rows) of the last blocks() pass into out.
  void pass_logits(uint32_t first, uint32_t rows, float* out);
  // Offload mode, before a prefill of seq_id from pos0: the device's prefill scratch must hold the
  // sequence's positions [0, pos0), reloaded from the host cache where it does not.
  void restore_prefill_scratch(int32_t seq_id, uint64_t pos0);
  // Throws capacity_exceeded unless the pool has pages_per_head free pages for every (layer, KV
  // head): what a prefill or decode step about to append will take.
  void require_free_pages(uint64_t pages_per_head, const char* what) const;
  void output_logits(const float* hidden, uint32_t rows, float* logits);
  void check_sequence(int32_t seq_id) const;

  GgufFile file_;
  Tokenizer tokenizer_;
  LlamaConfig config_;
  ModelOptions options_;
  uint32_t n_ctx_;
  std::vector<Layer> layers_;
  std::vector<float> output_norm_;
  Linear output_;  // [n_vocab, n_embd]: token_embd when tied
  const GgufTensor* token_embd_;
  Rope rope_;

  KvCache cache_;
  DecodeEngine engine_;                       // after cache_, which it listens to
  std::unique_ptr<gpu::DeviceLlama> device_;  // offload mode: the weights and the compute
  int32_t prefill_seq_ = -1;                  // the sequence the device's prefill scratch holds
  std::vector<uint32_t> pass_rows_;           // offload mode: 0, 1, ..., max_rows_ - 1
  DecodeObserver* observer_ = nullptr;
  PrefillAttention prefill_attention_;
  Matmul matmul_{&engine_.pool()};
  ModelStats stats_;
  bool decoding_ = false;  // inside decode(): project() takes the matrix-vector path

  // Workspaces sized for max(prefill_chunk, max_seqs) rows.
  uint32_t max_rows_;
  AlignedVector<float> x_, h_, qkv_, q_, k_, v_, attn_, gate_up_, ffn_;
  AlignedVector<uint16_t> x_bf16_;
  AlignedVector<float> x_rounded_;  // x_bf16_ back in float32, for matvec_bf16 (decode rows)
  std::vector<std::vector<float>> logits_;  // per sequence id
};

}  // namespace kvsift::model
