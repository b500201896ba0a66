// Selectors: per decode step and layer, which pages (and, for token-level selectors: Louver,
// S4R, which tokens) each (sequence, KV head) attends to.
//
// One interface for every method (docs/methods.md); lib/select/registry.hpp lists them, one file
// each. A selector listens to the cache's page seals and keeps its per-page data (summaries) in
// arrays indexed by pool slot, sized when it is created; pages sealed since the last step are
// summarised at the start of the next select(), in parallel across pages and heads (after a
// prefill that is every page of it). Per step it is given the layer's queries and fills a
// Selection: per (sequence, KV head) ascending page ids, shared by the G query heads of the group,
// which the exact attention kernel then reads.
//
// Budget, sink and window pages: lib/select/page_plan.hpp, which every selector follows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string_view>
#include <vector>

#include "lib/attend/decode_attention.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/core/aligned.hpp"
#include "lib/core/lazy_array.hpp"
#include "lib/core/thread_pool.hpp"
#include "lib/select/page_plan.hpp"
#include "lib/select/registry.hpp"

namespace kvsift::select {

// How the G query heads of a group turn their page scores into one ranking (docs/methods.md).
enum class GqaCombine : uint8_t {
  share_avg,  // the paper: average over heads of each page's estimated mass share
  nrm,        // the authors' code: sum over heads of exp(score - the head's best score)
  max,        // the best head's score
  count       // not a mode: how many there are
};

// The larger of two dropped-mass bounds, where NaN (nothing proven) wins over any number.
inline double worse_bound(double a, double b) noexcept {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}
std::string_view combine_name(GqaCombine combine) noexcept;

// LOCKS (locks and locks_certified).
struct LocksPolicy {
  bool int8_query = true;  // score with q rounded to int8 per head, as the reference does
  // locks_certified: grow the selection until the proven bound on the dropped share of softmax
  // mass is below epsilon for every query head of the group, or the budget is reached.
  double epsilon = 1e-3;
};

// S4R.
struct S4rPolicy {
  // The target compression of the prompt's K/V (dense bytes / S4R bytes, >= 1), which sets the
  // rank.
  double compression = 2.5;
  // The query window: the last `window` queries rank the compressed tokens, and the last `window`
  // compressed tokens are always reconstructed.
  uint32_t window = 32;
  // One basis per KV head, or one per layer over all KV heads (the paper's default).
  bool per_head_bases = false;
};

// The fields every selector reads, then one group per method that has fields of its own (Louver
// has none).
struct Policy {
  Kind kind = Kind::dense;
  // Tokens per (layer, KV head) per step: a fraction of the context when in (0, 1], else a token
  // count (lib/select/page_plan.hpp). The dense selector takes none (0); the others require one
  // > 0. For locks_certified it is the most the selection may grow to.
  double budget = 0.0;
  uint32_t sink_pages = 1;
  uint32_t window_pages = 1;
  // How the page-level selectors that estimate masses (oracle, locks, locks_certified) combine
  // their heads; quest always takes the max. The default is the LOCKS authors' code's combine,
  // which the paper's numbers came from (docs/methods.md).
  GqaCombine combine = GqaCombine::nrm;
  // Selection on a CUDA device, or -1 for the CPU. louver: the device holds a copy of the indexes'
  // centers, radii and assignments and runs the filter pass (gpu/louver_filter.hpp); the same
  // tokens are chosen either way. locks: the device holds a copy of the pages' LOCKS records and
  // scores and selects there (gpu/locks_scorer.hpp); the same pages are chosen but at near-ties of
  // the combined score (float rounding); int8 queries only, not locks_certified. Other selectors
  // ignore it. Creating the selector fails with unsupported where the build has no CUDA or the
  // device is not usable.
  int32_t device = -1;
  LocksPolicy locks;
  S4rPolicy s4r;

  // Throws Error(invalid_argument) naming the first bad field.
  void validate() const;
  // Tokens the budget allows for a context of `tokens` tokens.
  uint64_t budget_tokens(uint64_t tokens) const noexcept {
    return select::budget_tokens(budget, tokens);
  }
  // The page plan of a (sequence, KV head) of `tokens` tokens.
  PagePlan page_plan(uint32_t page_tokens, uint64_t tokens) const noexcept {
    return select::page_plan(sink_pages, window_pages, page_tokens, tokens, budget_tokens(tokens));
  }
};

// What one select() call chose for each of its n_seqs * n_kv_heads (sequence, KV head) pairs,
// sequence-major, in compressed rows. Storage is sized by reserve (pages) and by the selector's
// prepare() (rows); select() does not allocate.
struct Selection {
  uint32_t n_pairs = 0;
  AlignedVector<uint32_t> offsets;  // [pairs + 1]
  // Sized for the most pages one call can choose and lazy (lib/core/lazy_array.hpp): resident
  // memory follows the pages calls really choose.
  LazyArray<uint32_t> page_ids;  // ascending logical page ids per pair
  // Per chosen page: the selector's combined score (estimated log-mass for oracle and locks, the
  // q.k upper bound for quest); +inf for mandatory pages, which are chosen unscored.
  LazyArray<float> scores;
  // Per pair: the estimated share of the group's softmax mass the chosen pages hold (1 when every
  // page is chosen; S4R: the share of its latent relevance; NaN where the selector makes no
  // estimate: Louver), and a proven upper bound on the share left out (the largest over the G
  // query heads; NaN where the selector proves none).
  AlignedVector<float> kept_estimate;
  AlignedVector<float> dropped_bound;
  uint64_t index_bytes_read = 0;  // summaries / keys the selection itself read, all pairs
  // Token-level selectors: per pair, token rows attended besides the pages (gathered from the
  // cache or reconstructed), packed as pages are (decode_attention.hpp RowChunks).
  bool has_rows = false;
  AlignedVector<std::byte> row_chunks;
  AlignedVector<uint32_t> chunk_offsets;  // [pairs + 1]
  AlignedVector<uint32_t> row_counts;     // [pairs]
  // The token position of each row, row r of a pair at chunk_offsets[pair] * page_tokens + r.
  AlignedVector<uint32_t> row_tokens;
  // Whether the rows came as coefficients (SelectCall::latent_rows, S4R): then row_chunks were not
  // written, and latent_units (n_pairs / heads_per_unit of them) describe the rows for a backend
  // that reconstructs them (lib/attend/decode_attention.hpp LatentRows).
  bool latent = false;
  uint32_t heads_per_unit = 0;
  std::vector<LatentUnit> latent_units;  // [max pairs]

  // max_pages: the most pages one call chooses over all its pairs; rows: whether the selector
  // also returns token rows (their storage grows with reserve_rows).
  void reserve(uint32_t max_pairs, uint64_t max_pages, bool rows = false);
  // Room for `chunks` chunks of page_tokens rows over all pairs (grows, never shrinks). Throws
  // Error(out_of_memory).
  void reserve_rows(uint64_t chunks, uint32_t page_tokens, std::size_t chunk_bytes);
  // For selectors that fill the pairs in order (the token-level ones): start a call over `pairs`
  // pairs; list pair's pages [0, n_pages) but the gap [gap_first, gap_end) as mandatory (+inf);
  // give pair `rows` rows (its chunks follow the previous pair's).
  void begin_pairs(uint32_t pairs) noexcept;
  void list_pages_outside(uint32_t pair, uint64_t n_pages, uint64_t gap_first,
                          uint64_t gap_end) noexcept;
  void set_rows(uint32_t pair, uint32_t rows, uint32_t page_tokens) noexcept;
  PageLists lists() const noexcept { return PageLists{offsets.data(), page_ids.data()}; }
  RowChunks rows() const noexcept {
    return RowChunks{row_chunks.data(), chunk_offsets.data(), row_counts.data()};
  }
  LatentRows latent_rows() const noexcept {
    return LatentRows{heads_per_unit, latent_units.data()};
  }
  // Telemetry over the pairs: the sum of kept_estimate, and the largest dropped_bound (NaN when
  // some pair proves none).
  double kept_estimate_sum() const noexcept;
  double worst_dropped_bound() const noexcept;
  uint64_t pages_chosen() const noexcept { return n_pairs == 0 ? 0 : offsets[n_pairs]; }
};

struct SelectCall {
  uint32_t layer = 0;
  uint32_t n_seqs = 0;
  const int32_t* seq_ids = nullptr;  // [n_seqs], validated by the caller
  const float* q = nullptr;          // [n_seqs, n_query_heads, head_dim], not yet scaled
  // The caller's attention reconstructs token rows from their coefficients (AttendCall::latent):
  // a selector that holds rows in that form (S4R) returns them so (Selection::latent) and skips
  // its own reconstruction; the others ignore it. The decode engine asks for it when its backend
  // is the offload one and can reconstruct (lib/engine/decode_engine.cpp).
  bool latent_rows = false;
};

class Selector : public SealListener {
 public:
  // Registers itself with the cache as a seal listener (and removes itself when destroyed) and
  // summarises the pages already sealed. max_batch: most sequences per select(); max_pages: most
  // pages one (sequence, layer, KV head) holds; pool: the threads of the handle it serves
  // (borrowed: it must outlive the selector); kernels: the handle's table (a static one). Throws
  // Error (invalid_argument for a bad policy, out_of_memory).
  static std::unique_ptr<Selector> create(const Policy& policy, KvCache& cache, uint32_t max_batch,
                                          uint64_t max_pages, ThreadPool& pool,
                                          const simd::Kernels& kernels);
  ~Selector() override;

  // Work a step needs before select() that may fail: S4R compresses the prompt of each (sequence,
  // layer) the first time it is selected for, and token-level selectors grow `out`'s rows to what
  // this call can return. Call it with the same call and Selection, before select(). Throws Error
  // (out_of_memory, invalid_argument).
  virtual void prepare(const SelectCall& /*call*/, Selection& /*out*/) {}
  // Requires a Selection reserved by reserve_selection() and a prepare() of the same call. Builds
  // pending summaries first.
  virtual void select(const SelectCall& call, Selection& out) noexcept = 0;

  // Queues the pages already sealed in the cache for a summary and builds them (create() calls it
  // once, after registering the selector).
  virtual void summarise_existing() {}
  // Builds the per-page data (summaries) of the pages sealed since the last build, which select()
  // otherwise builds first. The model runner calls it after each prefill layer, so the prompt's
  // summaries are built as the prefill proceeds (in offload mode, while the device computes)
  // rather than by the first decode step.
  virtual void build_summaries() noexcept {}

  void reserve_selection(Selection& selection) const;
  const Policy& policy() const noexcept { return policy_; }
  // Bytes of per-page data kept per (page, KV head); 0 for dense and oracle.
  virtual std::size_t summary_bytes_per_page() const noexcept { return 0; }
  // Host bytes the selector holds for the cache's tokens besides the pages (S4R: bases,
  // coefficients and query windows); page summaries are counted by summary_bytes_per_page.
  virtual uint64_t held_bytes() const noexcept { return 0; }

 protected:
  Selector(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
           ThreadPool& pool, const simd::Kernels& kernels);
  // Whether select() returns token rows besides pages: the token-level selectors.
  bool selects_rows() const noexcept { return selector_info(policy_.kind).level == Level::token; }
  KvCache& cache_;
  Policy policy_;
  uint32_t max_batch_;
  uint64_t max_pages_;
  ThreadPool& pool_;
  const simd::Kernels& kernels_;  // the handle's level (lib/core/kernel_runtime.hpp)
};

}  // namespace kvsift::select
