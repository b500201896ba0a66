// The Llama-family forward pass on the GPU, layer by layer, without the decode attention: that
// stays kvsift's host-KV path (the cache and the selectors live in host memory), so
// the host model runner (lib/model) drives each layer in pieces and does the attention between
// them. Plain C++: lib/ includes this without CUDA headers. The class is the host's facade over the
// CUDA backend's implementation (gpu/backend.hpp, gpu/device_llama.cu); where the backend is absent
// every call returns Result{unsupported} saying why.
//
// One forward pass over `rows` tokens (a prefill chunk of one sequence, or one token of each of a
// batch of sequences):
//
//   embed(tokens) or load_embeddings(x)
//   for each layer l, in order:
//     attention_inputs(l, positions)       q (RoPE'd), k, v (both pre-RoPE) -> q_host(), k_host(),
//                                          v_host(); the host appends k, v to its cache
//     either  prefill_attention(l, pos0)   causal attention on the device (one sequence)
//             finish_layer(l, false)
//     or      the host writes attn_host()  decode attention through the host cache
//             finish_layer(l, true)
//   logits(rows_idx)                       final RMSNorm and output head of the chosen rows
//
// Decode graphs: a decode step's device work between two host attention calls is tens of small
// launches a layer, the same sequence on every step with the same rows, and it took about 3.5 of
// the 5.4 ms of a token (SmolLM2-135M, one sequence, on an H200), launch overhead for the most
// part. So finish_layer(l, true) launches one CUDA graph for (l, rows): the rest of layer l, then
// layer l + 1's attention_inputs work at layer l's positions (a pass's layers share them), which
// attention_inputs(l + 1) then only waits for (or redoes, where its positions differ). A graph is
// captured on the second use of its (l, rows) (the first is an ungraphed warm-up) and replayed on
// every later one, for at most kMaxGraphRows distinct rows values (other rows run ungraphed).
// Prefill chunks (finish_layer(l, false)) launch their kernels one by one. A failed capture turns
// the graphs off for the handle (graph_stats() says why) and the step runs ungraphed. Graphed and
// ungraphed results are the same bit for bit: the same kernels and cuBLAS calls, on the same
// workspace.
//
// Numerics follow the CPU pass (lib/model/cpu_forward_pass.cpp) step for step: bf16 weights, fp32
// activations, every product's input rounded to bf16 (round to nearest even) with fp32
// accumulation (cuBLAS, CUBLAS_COMPUTE_32F); RMSNorm's sum of squares in float64 and its scale
// rounded once to fp32; RoPE on adjacent pairs (2i, 2i+1) with the cos/sin table of
// lib/cache/rope.cpp (angles in float64, rounded once) and no fused multiply-add, so q matches the
// CPU's bit for bit given the same input; SwiGLU = silu(gate) * up in fp32. The prefill scratch
// stores post-RoPE keys and values rounded to the host cache's dtype, as the cache stores them,
// so the device prefill attention reads the values the CPU's prefill attention reads; for a q8
// cache, the cache's dequantized values (simd/page_rows.hpp's rule, per KV head and row) held in
// fp16, within 2^-11 (relative) of them (and within fp16's range, as an fp16 cache is).
//
// Data layouts (row-major throughout; q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim):
// - weights [out, in] bf16 (the raw uint16_t bits), rows in the order the header lists;
// - q_host, attn_host: [rows, q_dim] fp32, query head h at h * head_dim; query head h reads KV
//   head h / (n_heads / n_kv_heads) (GQA);
// - k_host, v_host: [rows, kv_dim] fp32, KV head h at h * head_dim;
// - the prefill scratch: per layer [max_prefill_tokens, kv_dim] K then the same for V, position
//   p at row p, in kv_dtype (fp16 for q8).
//
// Threading and streams: one non-blocking stream owns all the work, in issue order. The calls that
// hand data to the host (attention_inputs, logits, read_hidden, read_attention) wait for the
// stream; the others enqueue and return. Every call makes the handle's device current on the
// calling thread first. Use from one host thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/host_memory.hpp"
#include "simd/kernels.hpp"

namespace kvsift::gpu {

namespace backend {
class DeviceLlama;
}

struct LlamaShape {
  uint32_t n_layers = 0;    // 1..4096
  uint32_t n_embd = 0;      // 1..65536
  uint32_t n_ff = 0;        // 1..262144
  uint32_t n_heads = 0;     // 1..1024, a multiple of n_kv_heads
  uint32_t n_kv_heads = 0;  // >= 1
  uint32_t head_dim = 0;    // 64 or 128
  uint32_t n_vocab = 0;     // 1..2^24
  float rope_theta = 10000.0f;
  float rms_eps = 1e-5f;
  uint32_t max_rows = 0;       // tokens per call: max(prefill chunk, decode batch), 1..4096
  uint32_t max_positions = 0;  // positions a sequence may reach (n_ctx): the RoPE table, 1..2^20
  // K/V positions the prefill scratch holds for one sequence, 0..max_positions; 0: no device
  // prefill attention (prefill_attention and load_prefix are refused).
  uint32_t max_prefill_tokens = 0;
  simd::Dtype kv_dtype = simd::Dtype::f16;  // the host cache's storage dtype: f16, bf16 or q8
  // finish_layer(l, true) replays CUDA graphs (see the top of this file); false: never.
  bool decode_graphs = true;

  uint32_t q_dim() const noexcept { return n_heads * head_dim; }
  uint32_t kv_dim() const noexcept { return n_kv_heads * head_dim; }
};

// Host copies of the weights, read only during init(). bf16 arrays are the raw bits.
struct LlamaLayerWeights {
  const uint16_t* wqkv = nullptr;       // [q_dim + 2 * kv_dim, n_embd], rows q | k | v
  const uint16_t* wo = nullptr;         // [n_embd, q_dim]
  const uint16_t* w_gate_up = nullptr;  // [2 * n_ff, n_embd], rows gate | up
  const uint16_t* w_down = nullptr;     // [n_embd, n_ff]
  const float* attn_norm = nullptr;     // [n_embd]
  const float* ffn_norm = nullptr;      // [n_embd]
};

struct LlamaWeights {
  std::vector<LlamaLayerWeights> layers;  // n_layers
  const uint16_t* token_embd = nullptr;   // [n_vocab, n_embd]
  const uint16_t* output = nullptr;       // [n_vocab, n_embd]; == token_embd: one device copy
  const float* output_norm = nullptr;     // [n_embd]
};

// How the decode graphs fared since init() (DeviceLlama::graph_stats()).
struct DecodeGraphStats {
  uint64_t captured = 0;       // graphs captured and instantiated (one per (layer, rows) used)
  uint64_t replays = 0;        // graph launches, each graph's first launch included
  uint64_t ungraphed = 0;      // finish_layer(l, true) calls with decode_graphs set run without
                               // a graph (a warm-up, graphs turned off, or rows beyond
                               // kMaxGraphRows values)
  uint64_t inputs_reused = 0;  // attention_inputs calls whose work a graph had already done
  std::string off;             // why the graphs were turned off; empty while they are on
};

// Distinct rows values a handle captures decode graphs for: a batch size or two in practice; a
// cap so that an unusual caller cannot fill the device with graphs.
inline constexpr uint32_t kMaxGraphRows = 8;

// Owns a cuBLAS handle, a stream, the device copy of the weights, the activations of one forward
// pass, the prefill scratch and pinned host buffers. Movable, not copyable.
//
// Device memory: the weights (2 bytes a parameter; a tied output head is not counted twice), plus
// about max_rows * (4 * (n_embd + 2 * q_dim + 4 * kv_dim + 2 * n_ff + n_vocab) + 2 * max(n_embd,
// q_dim, n_ff)) bytes of activations (the logits dominate), plus, from a layer's first
// prefill_attention or load_prefix on, 4 * max_prefill_tokens * kv_dim bytes of prefill scratch
// for that layer (a model that only decodes never holds it), plus 4 * max_positions * head_dim
// bytes of RoPE table, plus a 32 MiB cuBLAS workspace, plus the decode graphs (small: one kernel
// node per launch): device_bytes() says exactly, but for the graphs.
//
// Errors: a call with bad arguments, or out of order, returns ok=false naming the argument and
// leaves the device untouched. A CUDA or cuBLAS failure returns ok=false naming the call
// (unsupported=true where no driver or device is present) and abandons the forward pass in
// flight: the next call must be embed() or load_embeddings().
class DeviceLlama {
 public:
  DeviceLlama();
  ~DeviceLlama();
  DeviceLlama(DeviceLlama&& other) noexcept;
  DeviceLlama& operator=(DeviceLlama&& other) noexcept;
  DeviceLlama(const DeviceLlama&) = delete;
  DeviceLlama& operator=(const DeviceLlama&) = delete;

  // Checks the shape and the weight pointers before touching the device, so bad arguments are
  // reported as such where no device is present; then allocates on `device` and copies the
  // weights there (blocking). A second init() replaces the first.
  Result init(const LlamaShape& shape, const LlamaWeights& host_weights, int device);

  // Starts a forward pass: x = the embedding rows of tokens[0, rows) (bf16 table -> fp32).
  // tokens: host, [rows], each in [0, n_vocab); copied before the call returns.
  Result embed(const int32_t* tokens, uint32_t rows);
  // Starts a forward pass from host embeddings x [rows, n_embd] fp32 (e.g. the CPU runner's own
  // dequantized rows, exact where the table's values are not bf16); copied before the call returns.
  Result load_embeddings(const float* x, uint32_t rows);

  // Layer `layer` (the next one of the pass): RMSNorm, the QKV product, RoPE on q at positions[r]
  // (host, [rows], each < max_positions; rows: the pass's). Blocks until q_host(), k_host(),
  // v_host() hold the layer's q (RoPE'd, unscaled), k (pre-RoPE: the host cache rotates its keys
  // itself) and v; they stay valid until the next finish_layer() (a decode graph computes the next
  // layer's into them) or attention_inputs().
  Result attention_inputs(uint32_t layer, const uint64_t* positions, uint32_t rows);
  const float* q_host() const noexcept;  // pinned, [max_rows, q_dim]; the pass's rows are valid
  const float* k_host() const noexcept;  // pinned, [max_rows, kv_dim]
  const float* v_host() const noexcept;  // pinned, [max_rows, kv_dim]

  // Pinned [max_rows, q_dim], owned here: for host attention, the host writes the layer's
  // attention output for the pass's rows after attention_inputs() returns and before
  // finish_layer(layer, true), which uploads it.
  float* attn_host() noexcept;

  // Device attention for a prefill chunk of ONE sequence, after attention_inputs(layer, positions)
  // with positions[r] == pos0 + r: rotates the chunk's keys, stores them and its values (in
  // kv_dtype) at scratch positions pos0 .. pos0 + rows - 1 of the layer, and runs causal GQA
  // attention (query row r sees positions 0 .. pos0 + r) into the device attention output.
  // Requires pos0 <= prefill_held(layer) (positions before pos0 are the sequence's: prefilled
  // earlier, or restored with load_prefix) and pos0 + rows <= max_prefill_tokens; afterwards
  // prefill_held(layer) == pos0 + rows.
  Result prefill_attention(uint32_t layer, uint64_t pos0, uint32_t rows);
  // Restores scratch positions [first, first + n) of a layer from the host cache, when a prefill
  // continues a sequence whose positions the scratch lacks (another sequence was prefilled since,
  // or it decoded since). k_post_rope, v: host, [n, kv_dim] fp32, keys after RoPE (what the host
  // cache stores, a q8 cache's dequantized); copied before the call returns. Requires first <=
  // prefill_held(layer) and first + n <= max_prefill_tokens; afterwards prefill_held(layer) ==
  // first + n. Allowed between passes and inside one (it does not disturb the layer in flight).
  Result load_prefix(uint32_t layer, uint64_t first, const float* k_post_rope, const float* v,
                     uint64_t n);
  // Forgets every layer's scratch positions (before prefilling another sequence from 0).
  void reset_prefill() noexcept;
  // Positions [0, prefill_held(layer)) of the layer's scratch hold a sequence's keys and values.
  uint64_t prefill_held(uint32_t layer) const noexcept;

  // The rest of layer `layer`: attention output (from attn_host() when attn_from_host, else from
  // prefill_attention) -> wo product + residual -> RMSNorm -> gate_up product -> SwiGLU -> down
  // product + residual. Enqueued; does not wait. With attn_from_host and decode_graphs, through a
  // decode graph that also computes layer + 1's attention inputs (see the top of this file).
  Result finish_layer(uint32_t layer, bool attn_from_host);

  // After the last layer: final RMSNorm and the output head of rows rows_idx[0, n) (host, each
  // below the pass's rows; repeats allowed; n <= max_rows) into host_out [n, n_vocab] fp32
  // (pinned is faster, pageable works). Blocks until host_out is written. May be called more than
  // once per pass.
  Result logits(const uint32_t* rows_idx, uint32_t n, float* host_out);

  // Diagnostics for tests and parity checks; each blocks. The residual stream x [rows, n_embd]
  // as it stands (after embed, or after the last finish_layer), and the device attention output
  // [rows, q_dim] of the layer in flight (after prefill_attention, or after finish_layer uploaded
  // attn_host()).
  Result read_hidden(float* host_out);
  Result read_attention(float* host_out);

  const LlamaShape& shape() const noexcept;
  uint32_t rows() const noexcept;             // the pass's rows; 0: no pass in flight
  void* stream() const noexcept;              // the cudaStream_t all work is issued on
  std::size_t device_bytes() const noexcept;  // device memory held (weights included)
  const DecodeGraphStats& graph_stats() const noexcept;

 private:
  // The backend's implementation (gpu/backend.hpp, gpu/device_llama.cu), made by the first init().
  std::unique_ptr<backend::DeviceLlama> impl_;
};

}  // namespace kvsift::gpu
