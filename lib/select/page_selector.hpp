// The machinery every page selector shares (internal to lib/select): seal bookkeeping and the
// parallel summary build, the budget and mandatory pages, scoring through one virtual call per
// (sequence, KV head), the GQA combine, the deterministic top-b choice and the kept-mass estimate.
// A method supplies only how a page is summarised and scored; each lives in its own file
// (dense_selector.cpp, oracle_selector.cpp, quest_selector.cpp, locks_selector.cpp).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "lib/core/aligned.hpp"
#include "lib/core/lazy_array.hpp"
#include "lib/select/selector.hpp"

namespace kvsift::select {

// Bounds |fl(q . k) - q . k| / (|q| |k|) for the float32 dot products and the few products after
// them in a page score (about (d + r) * 2^-24 for d <= 256; this is several times that).
inline constexpr float kFloatMargin = 2e-4f;

// The Euclidean norm of x[0, n), summed in double.
inline float l2_norm(const float* x, uint32_t n) noexcept {
  double sq = 0.0;
  for (uint32_t i = 0; i < n; ++i) sq += double{x[i]} * x[i];
  return static_cast<float>(std::sqrt(sq));
}

// One (sequence, KV head) being scored: its G query heads and its pages.
struct PairView {
  const float* q;         // [G, head_dim], unscaled
  const uint32_t* table;  // slot of each logical page
  uint64_t tokens;        // stored tokens; the last page may be partial
  uint32_t n_pages;
};

// Per-thread workspace, sized at creation for the most pages a pair can hold; the rows are lazy
// (lib/core/lazy_array.hpp), so resident memory follows the pages the pairs really hold.
struct Scratch {
  AlignedVector<float> keys;  // [page_tokens, head_dim]
  LazyArray<float> head;      // [G, max_pages] per-head page scores
  LazyArray<float> slack;     // [G, max_pages] certified: score uncertainty per head and page
  LazyArray<float> mass;      // [G, max_pages] e^(score - top[h]) of the selectable pages
  double top[kMaxGroupSize];  // per head: its best selectable page score
  double selectable_mass[kMaxGroupSize];  // per head: sum of its row of `mass`
  LazyArray<double> suffix;   // [G, max_pages + 1] certified: bound on the mass left out
  LazyArray<float> combined;  // [max_pages]
  LazyArray<uint32_t> order;  // [max_pages]
  LazyArray<uint8_t> chosen;  // [max_pages]
};

class PageSelector : public Selector {
 public:
  void on_page_sealed(const SealedPage& page) noexcept override;
  void on_sequence_freed(int32_t seq_id) noexcept override;
  void select(const SelectCall& call, Selection& out) noexcept override;
  void build_summaries() noexcept override;

  void summarise_existing() override;

  // Device selection (locks with policy.device >= 0): steps whose device selection failed
  // and ran on the CPU instead, and the device bytes of the summaries' copy. 0 otherwise.
  virtual uint64_t device_fallbacks() const noexcept { return 0; }
  virtual uint64_t device_bytes() const noexcept { return 0; }

  PageSelector(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
               ThreadPool& pool, const simd::Kernels& kernels);

 protected:
  // Whether every page is chosen unscored, whatever the plan (dense).
  virtual bool selects_everything() const noexcept { return false; }
  // Whether sealed pages need a summary at all.
  virtual bool summarises() const noexcept { return false; }
  // keys: the slot's [page_tokens, head_dim] keys as float32 (simd::load_rows).
  virtual void summarise(uint32_t /*slot*/, const float* /*keys*/) noexcept {}
  // Called after each build with the slots just summarised (a device copy follows them).
  virtual void summaries_built(const uint32_t* /*slots*/, std::size_t /*n*/) noexcept {}
  // Scores pages [0, pair.n_pages) for each of the G heads into s.head[g * max_pages + p] (log
  // scale: estimated log-mass, or for quest a logit bound). Certified selectors also fill
  // s.slack. Returns the index bytes read.
  virtual uint64_t score(const PairView& pair, Scratch& s) const noexcept = 0;
  // Whether score() gives estimated log-masses, so a kept-mass estimate can be formed.
  virtual bool scores_are_log_mass() const noexcept { return true; }
  virtual bool certified() const noexcept { return false; }
  // How the group's heads combine page scores: the policy's, unless the method fixes one.
  virtual GqaCombine combine_mode() const noexcept { return policy_.combine; }

  // Exact log-sum-exp of the scaled logits of one page's n tokens for the G heads into
  // s.head[g * max_pages + page]. Returns the bytes read.
  uint64_t exact_page_lse(const PairView& pair, uint32_t page, Scratch& s) const noexcept;

  const CacheGeometry& geometry() const noexcept { return cache_.geometry(); }
  float scale_;  // 1 / sqrt(head_dim)

 private:
  void select_pair(const PairView& pair, uint32_t pair_index, uint32_t first, Selection& out,
                   Scratch& s, uint64_t& bytes) const noexcept;
  // Ranks the selectable pages [first, last) into s.combined by the policy's GQA combine.
  void combine(Scratch& s, uint32_t first, uint32_t last) const noexcept;
  // Fills s.mass, s.top and s.selectable_mass for the selectable pages [first, last).
  void masses(Scratch& s, uint32_t first, uint32_t last) const noexcept;
  void certify(const PairView& pair, Scratch& s, uint32_t first, uint32_t last, uint32_t most,
               uint32_t& n_chosen, float& bound) const noexcept;

  // Slots sealed since the last build and not freed since, each listed once: pending_[0, n) and,
  // per slot, 1 + its index there (0: not pending). A freed slot leaves the list at once, so a
  // summary is only ever built from the content of a live sealed page, and the list never holds
  // more than the pool's slots.
  LazyArray<uint32_t> pending_;
  LazyArray<uint32_t> pending_index_;
  std::size_t n_pending_ = 0;
  void add_pending(uint32_t slot) noexcept;
  void remove_pending(uint32_t slot) noexcept;
  std::vector<Scratch> scratch_;  // [n_threads]
  std::vector<uint32_t> region_;  // [max pairs + 1] where each pair's pages go in a Selection
};

}  // namespace kvsift::select
