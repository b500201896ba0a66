// A Llama-family model's hyperparameters and weights, read from a GGUF file: the metadata checks,
// the tensor shape checks, and the dequantisation to the type the products run in. The forward
// passes (lib/model/forward_pass.hpp) read these; nothing here computes a token.
//
// Weights are dequantized at load to bf16 (default) or f32. Memory this costs, for SmolLM2-135M:
// 134.5M parameters x 2 bytes = 269 MB in bf16 (538 MB in f32), against 98 MB for the Q4_1 file.
// The embedding table stays in the file's mapping and is dequantized a row at a time (embed()).
// Loaded with keep_quantized, a linear layer whose tensors are all Q8_0, Q4_0 or Q4_1 is not
// converted at all: it reads the file's blocks in place, in the mapping (simd::BlockFormat), 4.5
// bits a weight for Q4_0 against 16 in bf16 (an 8B model's linear layers: 4.2 GB against 15 GB;
// Q4_0's are copied once into the same number of bytes, 16 rows interleaved: Linear); the other
// layers are dequantized to `type` as before.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lib/core/aligned.hpp"
#include "lib/model/matmul.hpp"
#include "lib/core/thread_pool.hpp"
#include "lib/model/gguf_file.hpp"
#include "simd/kernels.hpp"

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

  uint32_t q_dim() const noexcept { return n_heads * head_dim; }
  uint32_t kv_dim() const noexcept { return n_kv_heads * head_dim; }
};

// The hyperparameters from the file's "llama.*" metadata and the embedding table's shape. Throws
// Error: unsupported (architecture, partial rotary embeddings), invalid_file (missing or
// out-of-range values, shapes that do not divide).
LlamaConfig read_config(const GgufFile& file);

// Rows of a linear layer kept in a file tensor's ggml blocks: `rows` rows of row_bytes each from
// `data`, which points into the file's mapping (the weights own the file), or, for Q4_0 repacked
// to q4_0x16 (simd/kernels.hpp, BlockFormat), into the Linear's own `interleaved` bytes.
struct BlockRows {
  const std::byte* data = nullptr;
  uint32_t rows = 0;
  std::size_t row_bytes = 0;
  simd::BlockFormat format = simd::BlockFormat::q8_0;
  GgmlType type = GgmlType::q8_0;  // the same format, as dequantize() names it
};

// A linear layer's weight, [out, in] row-major (outputs are rows), either dequantized to the one
// type the loader was asked for (the other vector stays empty) or, when `blocks` is not empty,
// kept in the file's blocks: its tensors stacked along the outputs, one BlockRows each. Q4_0
// tensors that start at a multiple of 16 stacked rows are repacked at load to q4_0x16, whose
// kernels sum 16 rows at a time (simd/x86/quant_body.hpp), into `interleaved`: the runner splits
// a product's rows between threads at multiples of 16 (cpu_forward_pass.cpp), never inside a
// group. Move-only: blocks may point into interleaved.
struct Linear {
  AlignedVector<uint16_t> bf16;  // the raw bf16 bits, when the type is bf16
  AlignedVector<float> f32;      // when the type is f32
  std::vector<BlockRows> blocks;
  AlignedVector<std::byte> interleaved;
  uint32_t in = 0, out = 0;

  Linear() = default;
  Linear(Linear&&) = default;
  Linear& operator=(Linear&&) = default;
  Linear(const Linear&) = delete;
  Linear& operator=(const Linear&) = delete;

  bool quantized() const noexcept { return !blocks.empty(); }
};

// Row `row` of `part` (`in` values) to float32, exactly, in either layout.
void dequantize_row(const BlockRows& part, uint64_t row, uint32_t in, float* out) noexcept;

// body(first, last, thread) over [0, rows) in chunks that start at multiples of 16 rows (never
// inside a q4_0x16 group), about 4 a thread, handed out first come, first served (as ggml's CPU
// backend does): a thread the busy host deschedules does not hold up the product, and the results
// do not depend on the split (matvec_quant sums each row the same in any range).
template <class Body>
void parallel_row_groups(ThreadPool& pool, uint64_t rows, const Body& body) noexcept {
  constexpr uint64_t group_rows = simd::kInterleavedRows;
  const uint64_t groups = (rows + group_rows - 1) / group_rows;
  const uint64_t chunk = std::max<uint64_t>(1, groups / (4 * static_cast<uint64_t>(pool.size())));
  pool.parallel_for(groups, chunk, [&](uint64_t a, uint64_t b, int thread) noexcept {
    body(a * group_rows, std::min(b * group_rows, rows), thread);
  });
}

// The block format of matvec_quant (simd/kernels.hpp) for a ggml type, if it has one.
std::optional<simd::BlockFormat> block_format(GgmlType type) noexcept;

// Q, K and V are one weight (rows stacked [q | k | v]), as are gate and up: fewer, larger
// products, which matters most at decode where each is a matrix-vector product.
struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;  // [n_embd]
  Linear wqkv, wo, w_gate_up, w_down;
};

class LlamaWeights {
 public:
  // Reads every weight of `config` from the file (which the weights keep: the embedding table is
  // read from its mapping), converted to `type`, except, with keep_quantized, the linear layers
  // whose tensors all have a block format (block_format), which stay in the file's blocks. The
  // conversion runs on `pool`, encoding bf16 with `kernels`. Throws Error: invalid_file (missing
  // tensors, inconsistent shapes, rows that are not whole blocks), unsupported (tensor types).
  static LlamaWeights load(GgufFile file, const LlamaConfig& config, MatType type,
                           const simd::Kernels& kernels, ThreadPool& pool,
                           bool keep_quantized = false);

  // The type of the dequantized layers (every layer without keep_quantized).
  MatType type() const noexcept { return type_; }
  // Whether any linear layer is kept in the file's blocks.
  bool any_quantized() const noexcept;
  const LayerWeights& layer(uint32_t l) const noexcept { return layers_[l]; }
  uint32_t n_layers() const noexcept { return static_cast<uint32_t>(layers_.size()); }
  const std::vector<float>& output_norm() const noexcept { return output_norm_; }
  // [n_vocab, n_embd]: token_embd's values when the output head is tied to it.
  const Linear& output() const noexcept { return output_; }

  // x [n_embd] = the embedding row of token (in [0, n_vocab): the caller checks), dequantized from
  // the file to float32 exactly.
  void embed(int32_t token, float* x) const noexcept;

 private:
  LlamaWeights(GgufFile file, MatType type, bool keep_quantized)
      : file_(std::move(file)), type_(type), keep_quantized_(keep_quantized) {}
  // The named [in, out_i] tensors stacked along their outputs into one [sum out_i, in] weight.
  Linear load_linear(const std::vector<std::pair<std::string, uint32_t>>& parts, uint32_t in,
                     const simd::Kernels& kernels, ThreadPool& pool) const;

  GgufFile file_;
  MatType type_;
  bool keep_quantized_ = false;
  uint32_t n_embd_ = 0;
  std::vector<LayerWeights> layers_;
  std::vector<float> output_norm_;
  Linear output_;
  const GgufTensor* token_embd_ = nullptr;  // in file_, whose tensors do not move with it
  std::size_t embd_stride_ = 0;             // bytes per row of token_embd_
};

}  // namespace kvsift::model
