// The arithmetic of a Llama-family forward pass outside attention: embeddings, RMSNorm, the
// projections, RoPE on the queries, the SwiGLU MLP and the output head. The runner
// (lib/model/llama_model.hpp) drives a pass layer by layer and owns what lies between a layer's
// attention inputs and its output: appending K/V to the host cache, and the decode attention
// through its DecodeEngine. Two implementations: CpuForwardPass (lib/model/cpu_forward_pass.hpp)
// and DeviceForwardPass (lib/model/device_forward_pass.hpp, over gpu/device_llama.hpp).
//
// A pass covers `rows` tokens: one token of each of a batch of sequences (decode), or a chunk of
// one sequence's prompt (prefill). Decode and prefill have their own calls because they may run
// different arithmetic: on the CPU the decode rows take matrix-vector products and prefill always
// matrix products, so that a prompt's logits do not depend on how it was chunked. One pass:
//
//   prefill_begin(seq_id, pos0)                  prefill only, before embed
//   embed(tokens)
//   for each layer l, in order:
//     io = decode_inputs(l, positions)           or prefill_inputs
//     the runner appends io.k, io.v to the cache
//     the runner writes io.out (decode)          or prefill_attention(l, seq_id, pos0, io)
//     decode_finish(l)                           or prefill_finish(l)
//   decode_logits(first, n, out)                 or prefill_logits; any number of times
//
// Every call throws Error on failure (a device's: unsupported where it is gone, else internal).
#pragma once

#include <cstdint>
#include <span>

namespace kvsift::model {

// A layer's attention inputs and output, [rows, ...] row-major (q_dim = n_heads * head_dim,
// kv_dim = n_kv_heads * head_dim; query head h at h * head_dim). Valid from the inputs call until
// the layer's finish call.
struct AttentionIo {
  const float* q = nullptr;  // [rows, q_dim], RoPE'd, unscaled
  const float* k = nullptr;  // [rows, kv_dim], before RoPE (the cache rotates its keys)
  const float* v = nullptr;  // [rows, kv_dim]
  float* out = nullptr;      // [rows, q_dim]: the attention output the finish call reads
};

class ForwardPass {
 public:
  virtual ~ForwardPass() = default;

  // Starts a pass over tokens (1..max_rows of them, each in the vocabulary: the runner checks):
  // the residual stream is their embedding rows.
  virtual void embed(std::span<const int32_t> tokens) = 0;

  // Decode. The next layer's RMSNorm, QKV product and RoPE on q at positions[r] (one a row).
  virtual AttentionIo decode_inputs(uint32_t layer, const uint64_t* positions) = 0;
  // The rest of the layer, once io.out holds its attention: output product and residual,
  // RMSNorm, gate/up product, SwiGLU, down product and residual.
  virtual void decode_finish(uint32_t layer) = 0;
  // After the last layer: final RMSNorm and output head of rows [first, first + n) into
  // out [n, n_vocab].
  virtual void decode_logits(uint32_t first, uint32_t n, float* out) = 0;

  // Prefill of a chunk of seq_id at positions pos0, pos0 + 1, ... (the cache holds its positions
  // [0, pos0)); before the chunk's embed().
  virtual void prefill_begin(int32_t seq_id, uint64_t pos0) = 0;
  // As decode_inputs, positions[r] == pos0 + r.
  virtual AttentionIo prefill_inputs(uint32_t layer, const uint64_t* positions) = 0;
  // Causal attention of the chunk into io.out (or where prefill_finish reads it), after the
  // runner appended the chunk's K/V to the layer: query row r sees positions [0, pos0 + r].
  virtual void prefill_attention(uint32_t layer, int32_t seq_id, uint64_t pos0,
                                 const AttentionIo& io) = 0;
  virtual void prefill_finish(uint32_t layer) = 0;
  virtual void prefill_logits(uint32_t first, uint32_t n, float* out) = 0;

  // seq_id was freed; its id may come back for another sequence.
  virtual void forget_sequence(int32_t seq_id) noexcept = 0;
};

}  // namespace kvsift::model
