// S4R (docs/methods.md, S4R) as a selector: it changes what the cache stores.
//
// The first time a (sequence, layer) is selected for (prepare()), its prompt is compressed: the
// tokens of the full pages between the sink pages and the last full page, [first, end), are read
// back before RoPE, low-rank bases of a hybrid sample of them are fitted (s4r_core.hpp), every
// one of them is projected to coefficients, and their exact pages are released to the pool. The
// sink pages (policy.sink_pages: 16 tokens at the defaults, the paper's s = 4 sinks and the rest
// of their page) and every token from `end` on (the prompt's partial last page and all generated
// tokens) stay exact in the cache and are always attended.
//
// Each step then ranks the compressed tokens by latent relevance (the projected queries of the
// last policy.s4r.window steps against the key coefficients), keeps the last s4r.window of them
// plus the best of the rest, m in all, reconstructs only those (K then RoPE at each token's
// position, V), and hands them to attention as row chunks beside the exact pages; or, where the
// attention reconstructs them itself (SelectCall::latent_rows: the offload backend, which holds the
// bases on the device), hands it their coefficients and positions instead (Selection::latent) and
// reconstructs nothing. The ranking stays here either way. Budget: as for
// the page selectors, tokens attended per (layer, KV head) counting the exact ones, so m = budget
// - exact tokens, at least min(s4r.window, compressed tokens).
//
// Bases: one per layer over the concatenated KV heads (D' = n_kv_heads * head_dim, the paper's
// default: one token selection per layer) or one per KV head (policy.s4r.per_head_bases). The
// rank comes from policy.s4r.compression through the paper's memory model at compression time.
//
// Needs a cache that takes pre-RoPE keys (it rotates keys and can rotate them back). A forked
// sequence is compressed on its own; a compressed one cannot be forked (the cache refuses).
#pragma once

#include <cstdint>
#include <vector>

#include "lib/select/s4r_core.hpp"
#include "lib/select/selector.hpp"

namespace kvsift::select {

class S4rSelector final : public Selector {
 public:
  // Throws Error(invalid_argument) for a post-RoPE cache, out_of_memory.
  S4rSelector(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
              ThreadPool& pool, const simd::Kernels& kernels);

  void on_page_sealed(const SealedPage&) noexcept override {}
  void on_sequence_freed(int32_t seq_id) noexcept override;
  void prepare(const SelectCall& call, Selection& out) override;
  void select(const SelectCall& call, Selection& out) noexcept override;
  uint64_t held_bytes() const noexcept override;

  // The compressed token range and rank of one (sequence, layer); rank 0 while not compressed.
  struct Compressed {
    uint64_t first = 0, end = 0;
    uint32_t rank = 0;
  };
  Compressed compressed(int32_t seq_id, uint32_t layer) const noexcept;
  // Wall time spent compressing (read-back, bases, projection), summed since creation.
  double compress_seconds() const noexcept { return compress_seconds_; }
  // The host reconstruction of the rows a select() of `call` returned as coefficients (out.latent):
  // writes out.row_chunks as a select() without latent_rows would have. The reference the device
  // reconstruction is tested against; requires the same call and Selection, before another
  // select().
  void reconstruct_rows(const SelectCall& call, Selection& out) noexcept;

 private:
  // One basis and its coefficients: all KV heads of a layer, or one KV head.
  struct Unit {
    s4r::Basis keys, values;
    std::vector<uint16_t> key_coeffs, value_coeffs;  // [end - first, rank], row_dtype()
    std::vector<float> queries;                      // [s4r.window, G, rank], oldest first
    uint32_t n_queries = 0;
    uint64_t basis_id = 0;  // LatentUnit::basis_id: unique to this fit in the process
  };
  enum class State : uint8_t { fresh, exact, compressed };
  struct LayerState {
    State state = State::fresh;
    uint64_t first = 0, end = 0;  // compressed tokens
    std::vector<Unit> units;
  };

  uint32_t heads_per_unit() const noexcept;
  // Grows the per-step workspaces to n_tokens compressed tokens and max_rows reconstructed ones.
  void grow_workspaces(uint64_t n_tokens, uint64_t max_rows);
  void compress(int32_t seq_id, uint32_t layer, LayerState& st);
  // Chooses one unit's rows for one sequence, and reconstructs them into `out` or describes them
  // as coefficients (call.latent_rows); returns the index bytes read and the kept estimate.
  uint64_t select_unit(const SelectCall& call, uint32_t seq_index, uint32_t unit, LayerState& st,
                       Selection& out, uint64_t exact_tokens, float& kept) noexcept;
  // Reconstructs one unit's chosen rows (the positions select_unit wrote) into out.row_chunks.
  void write_rows(uint32_t seq_index, uint32_t unit, const LayerState& st, Selection& out) noexcept;

  std::vector<std::vector<LayerState>> states_;  // [sequence id][layer]
  double compress_seconds_ = 0.0;
  // Per-step workspaces, grown by prepare() to what the step needs.
  std::vector<float> query_rows_;  // [G, D'] the unit's pre-RoPE queries
  std::vector<float> relevance_ws_, relevance_;
  std::vector<uint32_t> top_ws_, chosen_;
  std::vector<float> rows_;  // [max rows, D'] reconstructed K or V
  std::vector<float> reconstruct_ws_;
};

}  // namespace kvsift::select
