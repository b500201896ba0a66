#include "lib/select/page_selector.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gpu/locks_scorer.hpp"
#include "lib/core/error.hpp"
#include "lib/select/locks_summary.hpp"

namespace kvsift::select {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Bounds |fl(q . k) - q . k| / (|q| |k|) for the float32 dot products and the few products after
// them in a page score (about (d + r) * 2^-24 for d <= 256; this is several times that).
constexpr float kFloatMargin = 2e-4f;

float norm(const float* x, uint32_t n) noexcept {
  double sq = 0.0;
  for (uint32_t i = 0; i < n; ++i) sq += double{x[i]} * x[i];
  return static_cast<float>(std::sqrt(sq));
}

// Orders pages by score, best first; equal scores by the lower page id (the papers' deterministic
// exact-b rule).
struct BetterPage {
  const float* score;
  bool operator()(uint32_t a, uint32_t b) const noexcept {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  }
};

}  // namespace

PageSelector::PageSelector(const Policy& policy, KvCache& cache, uint32_t max_batch,
                           uint64_t max_pages, ThreadPool& pool)
    : Selector(policy, cache, max_batch, max_pages, pool),
      scale_(1.0f / std::sqrt(static_cast<float>(cache.geometry().head_dim))) {
  const CacheGeometry& g = cache.geometry();
  const std::size_t per_head = std::size_t{g.group_size} * max_pages;
  region_.resize(std::size_t{max_batch} * g.n_kv_heads + 1);
  scratch_.resize(static_cast<std::size_t>(pool_.size()));
  for (Scratch& s : scratch_) {
    s.keys.resize(g.page_elems());
    s.head = LazyArray<float>(per_head);
    s.mass = LazyArray<float>(per_head);
    s.slack = LazyArray<float>(per_head);
    s.suffix = LazyArray<double>(std::size_t{g.group_size} * (max_pages + 1));
    s.combined = LazyArray<float>(max_pages);
    s.order = LazyArray<uint32_t>(max_pages);
    s.chosen = LazyArray<uint8_t>(max_pages);
  }
}

void PageSelector::add_pending(uint32_t slot) noexcept {
  if (pending_index_[slot] != 0) return;
  pending_[n_pending_] = slot;
  pending_index_[slot] = static_cast<uint32_t>(++n_pending_);
}

void PageSelector::remove_pending(uint32_t slot) noexcept {
  const uint32_t at = pending_index_[slot];
  if (at == 0) return;
  const uint32_t last = pending_[--n_pending_];
  pending_[at - 1] = last;
  pending_index_[last] = at;
  pending_index_[slot] = 0;
}

void PageSelector::on_page_sealed(const SealedPage& page) noexcept {
  if (!summarises()) return;
  const std::size_t offset = reinterpret_cast<const std::byte*>(page.k) - cache_.pool().base();
  add_pending(static_cast<uint32_t>(offset / cache_.pool().slot_bytes()));
}

void PageSelector::on_sequence_freed(int32_t seq_id) noexcept {
  if (!summarises()) return;
  const CacheGeometry& g = geometry();
  for (uint32_t layer = 0; layer < g.n_layers; ++layer) {
    const uint64_t pages = g.pages_for(cache_.length_unchecked(seq_id, layer));
    for (uint32_t h = 0; h < g.n_kv_heads; ++h) {
      const uint32_t* table = cache_.page_table(seq_id, layer, h);
      for (uint64_t p = 0; p < pages; ++p) remove_pending(table[p]);
    }
  }
}

void PageSelector::summarise_existing() {
  if (!summarises()) return;
  pending_ = LazyArray<uint32_t>(cache_.pool().capacity());
  pending_index_ = LazyArray<uint32_t>(cache_.pool().capacity());
  const CacheGeometry& g = geometry();
  for (int32_t seq = 0; seq < cache_.sequence_id_bound(); ++seq) {
    if (!cache_.has_sequence(seq)) continue;
    for (uint32_t layer = 0; layer < g.n_layers; ++layer) {
      const uint64_t sealed = cache_.length_unchecked(seq, layer) / g.page_tokens;
      for (uint32_t h = 0; h < g.n_kv_heads; ++h) {
        const uint32_t* table = cache_.page_table(seq, layer, h);
        for (uint64_t p = 0; p < sealed; ++p) add_pending(table[p]);
      }
    }
  }
  build_summaries();
}

void PageSelector::build_summaries() noexcept {
  if (n_pending_ == 0) return;
  pool_.parallel_for(n_pending_, 16, [&](uint64_t begin, uint64_t end, int) noexcept {
    for (uint64_t i = begin; i < end; ++i) {
      const uint32_t slot = pending_[i];
      summarise(slot, reinterpret_cast<const uint16_t*>(cache_.pool().slot(slot)));
    }
  });
  summaries_built(pending_.data(), n_pending_);
  for (std::size_t i = 0; i < n_pending_; ++i) pending_index_[pending_[i]] = 0;
  n_pending_ = 0;
}

uint64_t PageSelector::exact_page_lse(const PairView& pair, uint32_t page,
                                      Scratch& s) const noexcept {
  const CacheGeometry& g = geometry();
  const uint32_t B = g.page_tokens, d = g.head_dim;
  const uint64_t left = pair.tokens - uint64_t{page} * B;
  const uint32_t n = left < B ? static_cast<uint32_t>(left) : B;
  const auto* k = reinterpret_cast<const uint16_t*>(cache_.pool().slot(pair.table[page]));
  cache_.kernels().decode(k, s.keys.data(), std::size_t{n} * d, g.dtype);
  float key_norm = 0.0f;  // only a certified bound reads the slack
  if (certified())
    for (uint32_t t = 0; t < n; ++t) key_norm = std::max(key_norm, norm(s.keys.data() + t * d, d));
  for (uint32_t h = 0; h < g.group_size; ++h) {
    const float* q = pair.q + std::size_t{h} * d;
    float logits[64];  // page_tokens <= 64
    float top = -kInf;
    for (uint32_t t = 0; t < n; ++t) {
      const float* kt = s.keys.data() + std::size_t{t} * d;
      float dot = 0.0f;
      for (uint32_t c = 0; c < d; ++c) dot += q[c] * kt[c];
      logits[t] = dot * scale_;
      top = std::max(top, logits[t]);
    }
    float sum = 0.0f;
    for (uint32_t t = 0; t < n; ++t) sum += std::exp(logits[t] - top);
    s.head[h * max_pages_ + page] = top + std::log(sum);
    s.slack[h * max_pages_ + page] = scale_ * norm(q, d) * kFloatMargin * key_norm;
  }
  return uint64_t{n} * d * sizeof(uint16_t);
}

void PageSelector::select(const SelectCall& call, Selection& out) noexcept {
  build_summaries();
  const CacheGeometry& g = geometry();
  const uint32_t H = g.n_kv_heads, G = g.group_size, d = g.head_dim;
  const uint32_t pairs = call.n_seqs * H;
  out.n_pairs = pairs;
  uint64_t bytes = 0;
  // Each pair writes into a region as large as its stored pages (distinct pairs hold distinct
  // slots, so the regions fit in the pool's capacity), compacted afterwards.
  region_[0] = 0;
  for (uint32_t i = 0; i < pairs; ++i) {
    const uint64_t tokens = cache_.length_unchecked(call.seq_ids[i / H], call.layer);
    region_[i + 1] = region_[i] + static_cast<uint32_t>(g.pages_for(tokens));
  }
  std::atomic<uint64_t> bytes_sum{0};
  pool_.parallel_for(pairs, 1, [&](uint64_t i, uint64_t, int thread) noexcept {
    const uint32_t seq_index = static_cast<uint32_t>(i) / H, h = static_cast<uint32_t>(i) % H;
    const int32_t seq = call.seq_ids[seq_index];
    PairView pair;
    pair.q = call.q + (std::size_t{seq_index} * H * G + std::size_t{h} * G) * d;
    pair.table = cache_.page_table(seq, call.layer, h);
    pair.tokens = cache_.length_unchecked(seq, call.layer);
    pair.n_pages = region_[i + 1] - region_[i];
    uint64_t pair_bytes = 0;
    select_pair(pair, static_cast<uint32_t>(i), region_[i], out,
                scratch_[static_cast<std::size_t>(thread)], pair_bytes);
    bytes_sum.fetch_add(pair_bytes, std::memory_order_relaxed);
  });
  bytes = bytes_sum.load(std::memory_order_relaxed);
  // Compact: offsets[i + 1] held pair i's count.
  uint32_t at = 0;
  for (uint32_t i = 0; i < pairs; ++i) {
    const uint32_t count = out.offsets[i + 1], from = region_[i];
    if (at != from) {
      std::memmove(out.page_ids.data() + at, out.page_ids.data() + from, count * sizeof(uint32_t));
      std::memmove(out.scores.data() + at, out.scores.data() + from, count * sizeof(float));
    }
    out.offsets[i] = at;
    at += count;
  }
  out.offsets[pairs] = at;
  out.index_bytes_read = bytes;
}

void PageSelector::select_pair(const PairView& pair, uint32_t pair_index, uint32_t first,
                               Selection& out, Scratch& s, uint64_t& bytes) const noexcept {
  const uint32_t n_pages = pair.n_pages, B = geometry().page_tokens, G = geometry().group_size;
  const uint32_t sink = std::min(policy_.sink_pages, n_pages);
  const uint32_t window = std::min(std::max(policy_.window_pages, 1u), n_pages - sink);
  const uint32_t sel_first = sink, sel_last = n_pages - window;  // selectable [first, last)
  const uint64_t budget_tokens = policy_.budget_tokens(pair.tokens);
  const uint64_t budget_pages = budget_tokens / B;
  uint32_t* ids = out.page_ids.data() + first;
  float* scores = out.scores.data() + first;

  const bool everything =
      policy_.kind == Kind::dense || sel_last <= sel_first || budget_tokens >= pair.tokens;
  if (everything) {
    for (uint32_t p = 0; p < n_pages; ++p) {
      ids[p] = p;
      scores[p] = kInf;
    }
    out.offsets[pair_index + 1] = n_pages;
    out.kept_estimate[pair_index] = 1.0f;
    out.dropped_bound[pair_index] = 0.0f;
    return;
  }

  // Per-head scores of every page: sealed ones by the method, the open page exactly when the
  // method deals in log-masses (it is attended anyway; its score only feeds the estimates).
  const uint32_t sealed = static_cast<uint32_t>(pair.tokens / B);
  bytes += score(pair, s);
  if (sealed < n_pages) {
    if (scores_are_log_mass()) {
      bytes += exact_page_lse(pair, sealed, s);
    } else {
      for (uint32_t h = 0; h < G; ++h) s.head[h * max_pages_ + sealed] = kInf;
    }
  }

  if (scores_are_log_mass() || combine_mode() != GqaCombine::max) masses(s, sel_first, sel_last);
  combine(s, sel_first, sel_last);
  std::fill(s.chosen.begin(), s.chosen.begin() + n_pages, uint8_t{0});
  for (uint32_t p = 0; p < sink; ++p) s.chosen[p] = 1;
  for (uint32_t p = sel_last; p < n_pages; ++p) s.chosen[p] = 1;
  const uint32_t mandatory = sink + window, n_sel = sel_last - sel_first;
  uint32_t* order = s.order.data();
  for (uint32_t j = 0; j < n_sel; ++j) order[j] = sel_first + j;
  const BetterPage better{s.combined.data()};

  float bound = std::numeric_limits<float>::quiet_NaN();
  uint32_t take;
  if (certified()) {
    std::sort(order, order + n_sel, better);
    certify(pair, s, sel_first, sel_last, budget_pages, take, bound);
  } else {
    take = static_cast<uint32_t>(
        std::min<uint64_t>(n_sel, budget_pages > mandatory ? budget_pages - mandatory : 0));
    if (take > 0 && take < n_sel) std::nth_element(order, order + take - 1, order + n_sel, better);
  }
  for (uint32_t j = 0; j < take; ++j) s.chosen[order[j]] = 1;

  uint32_t count = 0;
  for (uint32_t p = 0; p < n_pages; ++p) {
    if (!s.chosen[p]) continue;
    ids[count] = p;
    scores[count++] = p < sel_first || p >= sel_last ? kInf : s.combined[p];
  }
  out.offsets[pair_index + 1] = count;
  out.dropped_bound[pair_index] = bound;

  // Estimated share kept, averaged over the group's heads.
  if (!scores_are_log_mass()) {
    out.kept_estimate[pair_index] = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // s.mass holds the selectable pages' masses relative to the head's best selectable page; the
  // few mandatory pages are added in float64, where no realistic score overflows.
  double kept_sum = 0.0;
  for (uint32_t h = 0; h < G; ++h) {
    const float* sh = s.head.data() + h * max_pages_;
    const float* mh = s.mass.data() + h * max_pages_;
    double kept = 0.0, mandatory_mass = 0.0;
    for (uint32_t j = 0; j < take; ++j) kept += mh[order[j]];
    for (uint32_t p = 0; p < n_pages; ++p)
      if (p < sel_first || p >= sel_last)
        mandatory_mass += std::exp(static_cast<double>(sh[p]) - s.top[h]);
    kept_sum += (kept + mandatory_mass) / (s.selectable_mass[h] + mandatory_mass);
  }
  out.kept_estimate[pair_index] = static_cast<float>(kept_sum / G);
}

void PageSelector::combine(Scratch& s, uint32_t first, uint32_t last) const noexcept {
  const uint32_t G = geometry().group_size;
  float* S = s.combined.data();
  if (combine_mode() == GqaCombine::max) {
    for (uint32_t p = first; p < last; ++p) {
      float best = -kInf;
      for (uint32_t h = 0; h < G; ++h) best = std::max(best, s.head[h * max_pages_ + p]);
      S[p] = best;
    }
  } else {
    // s.mass rows are e^(score - the head's best selectable score): share_avg divides each
    // head's row by its sum; nrm rescales it to e^(score - the head's best page, sinks included),
    // as the authors' kernel normalises (tests/test_locks_peer.cpp; docs/methods.md).
    std::fill(S + first, S + last, 0.0f);
    for (uint32_t h = 0; h < G; ++h) {
      const float* mh = s.mass.data() + h * max_pages_;
      float weight = 1.0f / (static_cast<float>(s.selectable_mass[h]) * G);
      if (combine_mode() == GqaCombine::nrm) {
        const float* sh = s.head.data() + h * max_pages_;
        weight = std::exp(static_cast<float>(s.top[h]) - *std::max_element(sh, sh + last));
      }
      for (uint32_t p = first; p < last; ++p) S[p] += mh[p] * weight;
    }
  }
  // A NaN (from a NaN query) would break the ordering the choice sorts by: it ranks last.
  for (uint32_t p = first; p < last; ++p)
    if (std::isnan(S[p])) S[p] = -kInf;
}

void PageSelector::masses(Scratch& s, uint32_t first, uint32_t last) const noexcept {
  const uint32_t G = geometry().group_size;
  for (uint32_t h = 0; h < G; ++h) {
    const float* sh = s.head.data() + h * max_pages_;
    float* mh = s.mass.data() + h * max_pages_;
    const float top = *std::max_element(sh + first, sh + last);
    s.top[h] = top;
    s.selectable_mass[h] = cache_.kernels().exp_sum(sh + first, top, mh + first, last - first);
  }
}

namespace {

// Widens a page's log-mass bounds for the float32 rounding in computing its estimate (a few ulps
// of the terms summed; 1e-4 relative is far above that).
double rounding_margin(float log_mass) noexcept {
  return 1e-4 * (1.0 + std::fabs(double{log_mass}));
}

}  // namespace

// Grows the chosen set in s.order until every head's proven dropped share is below epsilon or the
// budget is spent. Per head, with U and L upper and lower bounds on each page's log-mass: dropped
// share <= sum_dropped e^U / (sum_chosen e^L + sum_dropped e^U), since x / (a + x) grows with x
// and falls with a.
void PageSelector::certify(const PairView& pair, Scratch& s, uint32_t first, uint32_t last,
                           uint64_t budget, uint32_t& n_chosen, float& bound) const noexcept {
  const uint32_t G = geometry().group_size, n_pages = pair.n_pages, n_sel = last - first;
  const uint32_t mandatory = n_pages - n_sel;
  const uint32_t* order = s.order.data();
  double chosen_low[kMaxGroupSize], top[kMaxGroupSize];
  for (uint32_t h = 0; h < G; ++h) {
    const float* sh = s.head.data() + h * max_pages_;
    const float* sl = s.slack.data() + h * max_pages_;
    auto upper = [&](uint32_t p) { return double{sh[p]} + sl[p] + rounding_margin(sh[p]); };
    auto lower = [&](uint32_t p) { return double{sh[p]} - sl[p] - rounding_margin(sh[p]); };
    double t = -kInf;
    for (uint32_t p = 0; p < n_pages; ++p) t = std::max(t, upper(p));
    top[h] = t;
    chosen_low[h] = 0.0;
    for (uint32_t p = 0; p < n_pages; ++p)
      if (p < first || p >= last) chosen_low[h] += std::exp(lower(p) - t);
    // suffix[j] = sum over order[j..] of e^U: what stays dropped when the first j are chosen.
    double* suffix = s.suffix.data() + h * (max_pages_ + 1);
    suffix[n_sel] = 0.0;
    for (uint32_t j = n_sel; j-- > 0;) suffix[j] = suffix[j + 1] + std::exp(upper(order[j]) - t);
  }
  const uint64_t cap = std::max<uint64_t>(budget, mandatory) - mandatory;
  for (uint32_t j = 0;; ++j) {
    double worst = 0.0;
    for (uint32_t h = 0; h < G; ++h) {
      const double dropped = s.suffix[h * (max_pages_ + 1) + j];
      worst = std::max(worst, dropped / (chosen_low[h] + dropped));
    }
    if (worst < policy_.epsilon || j == n_sel || j >= cap) {
      n_chosen = j;
      // Rounded up to float so the reported number is still a bound.
      const auto f = static_cast<float>(worst);
      bound = f < worst ? std::nextafter(f, kInf) : f;
      return;
    }
    for (uint32_t h = 0; h < G; ++h) {
      const float m = s.head[h * max_pages_ + order[j]];
      chosen_low[h] +=
          std::exp(double{m} - s.slack[h * max_pages_ + order[j]] - rounding_margin(m) - top[h]);
    }
  }
}

// ---- Methods -------------------------------------------------------------------------------

namespace {

// Every page, every step: exact attention.
class DenseSelector final : public PageSelector {
 public:
  using PageSelector::PageSelector;
  uint64_t score(const PairView&, Scratch&) const noexcept override { return 0; }
};

// Exact page log-sum-exp from every key: the ceiling of any budgeted top-b page selector.
class OracleSelector final : public PageSelector {
 public:
  using PageSelector::PageSelector;
  uint64_t score(const PairView& pair, Scratch& s) const noexcept override {
    uint64_t bytes = 0;
    const auto sealed = static_cast<uint32_t>(pair.tokens / geometry().page_tokens);
    for (uint32_t p = 0; p < sealed; ++p) bytes += exact_page_lse(pair, p, s);
    return bytes;
  }
};

// Quest: per-page channel-wise min and max of the keys (stored values, so exact in the storage
// dtype); a page's score is the upper bound sum_c max(q_c min_c, q_c max_c) on its logits.
class QuestSelector final : public PageSelector {
 public:
  QuestSelector(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
                ThreadPool& pool)
      : PageSelector(policy, cache, max_batch, max_pages, pool),
        bounds_(cache.pool().capacity() * 2 * cache.geometry().head_dim, /*huge_pages=*/true) {}

  std::size_t summary_bytes_per_page() const noexcept override {
    return 2 * std::size_t{geometry().head_dim} * sizeof(uint16_t);
  }

 protected:
  bool summarises() const noexcept override { return true; }
  bool scores_are_log_mass() const noexcept override { return false; }
  // A page bound for the group is the largest of its heads' bounds; averaging or summing
  // exponentiated bounds as if they were masses lost the needle on every generated task
  // (kvsift-eval, 2K and 4K: 0 of 4 at every budget with share_avg).
  GqaCombine combine_mode() const noexcept override { return GqaCombine::max; }

  void summarise(uint32_t slot, const uint16_t* k) noexcept override {
    const CacheGeometry& g = geometry();
    const uint32_t B = g.page_tokens, d = g.head_dim;
    float keys[64 * 256];  // page_tokens * head_dim at most
    cache_.kernels().decode(k, keys, std::size_t{B} * d, g.dtype);
    uint16_t* lo = bounds_.data() + std::size_t{slot} * 2 * d;
    uint16_t* hi = lo + d;
    for (uint32_t c = 0; c < d; ++c) {
      uint32_t arg_lo = 0, arg_hi = 0;
      for (uint32_t t = 1; t < B; ++t) {
        if (keys[t * d + c] < keys[arg_lo * d + c]) arg_lo = t;
        if (keys[t * d + c] > keys[arg_hi * d + c]) arg_hi = t;
      }
      lo[c] = k[arg_lo * d + c];
      hi[c] = k[arg_hi * d + c];
    }
  }

  uint64_t score(const PairView& pair, Scratch& s) const noexcept override {
    const CacheGeometry& g = geometry();
    const uint32_t d = g.head_dim, G = g.group_size;
    const auto sealed = static_cast<uint32_t>(pair.tokens / g.page_tokens);
    for (uint32_t p = 0; p < sealed; ++p) {
      cache_.kernels().decode(bounds_.data() + std::size_t{pair.table[p]} * 2 * d, s.keys.data(),
                              2 * std::size_t{d}, g.dtype);
      const float* lo = s.keys.data();
      const float* hi = lo + d;
      for (uint32_t h = 0; h < G; ++h) {
        const float* q = pair.q + std::size_t{h} * d;
        float bound = 0.0f;
        for (uint32_t c = 0; c < d; ++c) bound += std::max(q[c] * lo[c], q[c] * hi[c]);
        s.head[h * max_pages_ + p] = bound * scale_;
      }
    }
    return uint64_t{sealed} * summary_bytes_per_page();
  }

 private:
  LazyArray<uint16_t> bounds_;  // [pool slots, 2, head_dim]: min then max
};

// LOCKS (papers.md section 2): page-local rank-r summaries, int4 basis, int8 coefficients and
// centroid, built when a page seals; a page scores the log-sum-exp of its reconstructed logits.
// locks_certified also keeps each page's largest key norm, and bounds each page's log-mass by the
// score +- scale |q| (residual + float margin * key norm), scoring with the exact query.
//
// Device mode (policy.device >= 0; gpu/locks_scorer.hpp): the records are mirrored on the
// device (the slots summarised since the last upload travel in prepare(), or in select() when
// prepare() could not send them), and select() runs the scoring, combine and top-b of every pair
// of the call there in one batch. Should the device fail at select time, the step runs on the CPU
// (the records are still here) and device_fallbacks() counts it; a query that is not finite also
// takes the CPU path (the device does not repeat the CPU's NaN handling), uncounted.
class LocksSelector final : public PageSelector {
 public:
  LocksSelector(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
                ThreadPool& pool)
      : PageSelector(policy, cache, max_batch, max_pages, pool),
        shape_{cache.geometry().head_dim, cache.geometry().page_tokens, kLocksDefaultRank},
        record_bytes_(locks_record_bytes(shape_)),
        records_(cache.pool().capacity() * record_bytes_, /*huge_pages=*/true),
        key_norms_(certified() ? cache.pool().capacity() : 0, /*huge_pages=*/true) {
    locks_check_shape(shape_);
    if (policy.device >= 0) start_device(max_batch, max_pages);
  }

  std::size_t summary_bytes_per_page() const noexcept override {
    // The paper's bytes; certified selection adds the residual bound and the key norm.
    return locks_paper_bytes(shape_) + (certified() ? 2 * sizeof(float) : 0);
  }

  uint64_t device_fallbacks() const noexcept override { return device_fallbacks_; }
  uint64_t device_bytes() const noexcept override { return scorer_ ? scorer_->device_bytes() : 0; }

  void prepare(const SelectCall& call, Selection&) override {
    if (!scorer_) return;
    // Room to name the call's tables, so that select() allocates nothing.
    for (uint32_t i = 0; i < call.n_seqs; ++i)
      if (call.seq_ids[i] >= 0 && static_cast<std::size_t>(call.seq_ids[i]) >= table_names_.size())
        table_names_.resize(static_cast<std::size_t>(call.seq_ids[i]) + 1, 0);
    // A failed upload stays pending: select() tries again, and falls back to the CPU.
    build_summaries();
    upload_pending();
  }

  void select(const SelectCall& call, Selection& out) noexcept override {
    if (!scorer_ || !select_on_device(call, out)) PageSelector::select(call, out);
  }

  // A sequence's sealed table entries change only when it is freed (its id may come back with
  // other pages) or its pages are released: its tables get new names for the scorer then.
  void on_sequence_freed(int32_t seq_id) noexcept override {
    PageSelector::on_sequence_freed(seq_id);
    rename_tables(seq_id);
  }
  void on_pages_released(int32_t seq_id, uint32_t, uint64_t, uint64_t) noexcept override {
    rename_tables(seq_id);
  }

 protected:
  bool summarises() const noexcept override { return true; }
  bool certified() const noexcept override { return policy_.kind == Kind::locks_certified; }

  void summaries_built(const uint32_t* slots, std::size_t n) noexcept override {
    if (!scorer_) return;
    for (std::size_t i = 0; i < n; ++i) {
      if (upload_marked_[slots[i]]) continue;
      upload_marked_[slots[i]] = 1;
      upload_slots_[n_upload_++] = slots[i];  // room for every slot: each is listed once
    }
  }

  void summarise(uint32_t slot, const uint16_t* k) noexcept override {
    locks_build(shape_, k, geometry().dtype, records_.data() + std::size_t{slot} * record_bytes_);
    if (!certified()) return;
    const uint32_t B = shape_.page_tokens, d = shape_.head_dim;
    float keys[64 * 256];  // page_tokens * head_dim at most
    cache_.kernels().decode(k, keys, std::size_t{B} * d, geometry().dtype);
    float most = 0.0f;
    for (uint32_t t = 0; t < B; ++t) most = std::max(most, norm(keys + std::size_t{t} * d, d));
    key_norms_[slot] = most;
  }

  uint64_t score(const PairView& pair, Scratch& s) const noexcept override {
    const CacheGeometry& g = geometry();
    const uint32_t G = g.group_size, d = g.head_dim;
    const auto sealed = static_cast<uint32_t>(pair.tokens / g.page_tokens);
    simd::LocksScoreJob job;
    job.q = pair.q;
    job.group = G;
    job.head_dim = d;
    job.page_tokens = shape_.page_tokens;
    job.rank = shape_.rank;
    job.int8_query = policy_.int8_query && !certified();  // a bound needs the exact query
    job.scale = scale_;
    job.records = records_.data();
    job.record_bytes = record_bytes_;
    job.slots = pair.table;
    job.count = sealed;
    job.lse = s.slack.data();  // [G, sealed], spread into s.head's rows below
    cache_.kernels().locks_score(job);
    for (uint32_t h = G; h-- > 0;)  // backwards: row h moves to h * max_pages_ >= h * sealed
      std::memmove(s.head.data() + h * max_pages_, s.slack.data() + std::size_t{h} * sealed,
                   sealed * sizeof(float));
    if (certified()) {
      for (uint32_t h = 0; h < G; ++h) {
        const float q_norm = norm(pair.q + std::size_t{h} * d, d);
        for (uint32_t p = 0; p < sealed; ++p) {
          const uint32_t slot = pair.table[p];
          const float residual =
              locks_residual_bound(shape_, records_.data() + std::size_t{slot} * record_bytes_);
          s.slack[h * max_pages_ + p] =
              scale_ * q_norm * (residual + kFloatMargin * key_norms_[slot]);
        }
      }
    }
    return uint64_t{sealed} * summary_bytes_per_page();
  }

 private:
  static_assert(static_cast<int>(gpu::LocksCombine::share_avg) ==
                    static_cast<int>(GqaCombine::share_avg) &&
                static_cast<int>(gpu::LocksCombine::nrm) == static_cast<int>(GqaCombine::nrm) &&
                static_cast<int>(gpu::LocksCombine::max) == static_cast<int>(GqaCombine::max));

  void start_device(uint32_t max_batch, uint64_t max_pages) {
    require(!certified(), "policy.device: certified LOCKS selection runs on the CPU only");
    require(policy_.int8_query, "policy.device: the device scores int8 queries only");
    const CacheGeometry& g = geometry();
    gpu::LocksScorerShape shape;
    shape.head_dim = g.head_dim;
    shape.page_tokens = g.page_tokens;
    shape.rank = shape_.rank;
    shape.group = g.group_size;
    shape.dtype = g.dtype;
    shape.combine = static_cast<gpu::LocksCombine>(combine_mode());
    shape.scale = scale_;
    const uint64_t slots = cache_.pool().capacity();
    shape.slots = static_cast<uint32_t>(slots);
    shape.max_pairs = max_batch * g.n_kv_heads;
    shape.max_pages = std::min<uint64_t>(uint64_t{shape.max_pairs} * max_pages, slots);
    shape.sink_pages = policy_.sink_pages;
    shape.window_pages = policy_.window_pages;
    // The device keeps every layer's tables of a full batch (a run then sends only the slots of
    // pages sealed since the last), within twice the pool's slots of entries.
    shape.max_pair_pages = max_pages;
    shape.table_copies = static_cast<uint32_t>(std::min<uint64_t>(
        uint64_t{g.n_layers} * shape.max_pairs, 2 * slots / std::max<uint64_t>(max_pages, 1)));
    scorer_ = std::make_unique<gpu::LocksScorer>();
    const gpu::Result r = scorer_->init(policy_.device, shape);
    if (!r.ok)
      fail(r.unsupported ? Status::unsupported : Status::invalid_argument,
           "the locks device scorer on device ", policy_.device, ": ", r.message);
    upload_slots_.resize(slots);
    upload_marked_.assign(slots, 0);
    pairs_.resize(shape.max_pairs);
  }

  // Sends the records summarised since the last upload; they stay pending on failure.
  bool upload_pending() noexcept {
    if (n_upload_ == 0) return true;
    if (!scorer_->upload(records_.data(), upload_slots_.data(), n_upload_).ok) return false;
    for (std::size_t i = 0; i < n_upload_; ++i) upload_marked_[upload_slots_[i]] = 0;
    n_upload_ = 0;
    return true;
  }

  // The first of the names of a sequence's tables (one per layer and KV head) for the scorer; 0
  // (unnamed: sent whole) for an id prepare() did not see.
  uint64_t table_name(int32_t seq) noexcept {
    const auto at = static_cast<std::size_t>(seq);
    if (at >= table_names_.size()) return 0;
    if (table_names_[at] == 0) {
      table_names_[at] = next_table_name_;
      next_table_name_ += uint64_t{geometry().n_layers} * geometry().n_kv_heads;
    }
    return table_names_[at];
  }
  void rename_tables(int32_t seq) noexcept {
    if (static_cast<std::size_t>(seq) < table_names_.size()) table_names_[seq] = 0;
  }

  // The whole call on the device; false (out untouched) when the CPU must run it.
  bool select_on_device(const SelectCall& call, Selection& out) noexcept {
    build_summaries();
    if (!upload_pending()) {
      ++device_fallbacks_;
      return false;
    }
    const CacheGeometry& g = geometry();
    const uint32_t H = g.n_kv_heads, G = g.group_size, d = g.head_dim, B = g.page_tokens;
    const uint32_t n_pairs = call.n_seqs * H;
    if (n_pairs == 0) return false;
    uint64_t bytes = 0;
    for (uint32_t i = 0; i < n_pairs; ++i) {
      const int32_t seq = call.seq_ids[i / H];
      gpu::LocksPair& pair = pairs_[i];
      pair.q = call.q + std::size_t{i} * G * d;
      for (std::size_t c = 0; c < std::size_t{G} * d; ++c)
        if (!std::isfinite(pair.q[c])) return false;
      pair.table = cache_.page_table(seq, call.layer, i % H);
      const uint64_t name = table_name(seq);
      pair.table_id = name == 0 ? 0 : name + uint64_t{call.layer} * H + i % H;
      pair.tokens = cache_.length_unchecked(seq, call.layer);
      pair.budget_tokens = policy_.budget_tokens(pair.tokens);
      const uint64_t sealed = pair.tokens / B, open = pair.tokens % B;
      pair.open_keys =
          open == 0 ? nullptr
                    : reinterpret_cast<const uint16_t*>(cache_.pool().slot(pair.table[sealed]));
      // What the CPU path reports: the summaries and the open page's keys of the scored pairs.
      if (!gpu::locks_pair_plan(scorer_->shape(), pair.tokens, pair.budget_tokens).whole)
        bytes += sealed * summary_bytes_per_page() + open * d * sizeof(uint16_t);
    }
    if (!scorer_->validate(pairs_.data(), n_pairs).ok || !scorer_->run(pairs_.data(), n_pairs).ok) {
      ++device_fallbacks_;
      return false;
    }
    const uint32_t* offsets = scorer_->offsets();
    const uint32_t total = offsets[n_pairs];
    out.n_pairs = n_pairs;
    std::copy_n(offsets, n_pairs + 1, out.offsets.data());
    std::copy_n(scorer_->page_ids(), total, out.page_ids.data());
    std::copy_n(scorer_->scores(), total, out.scores.data());
    std::copy_n(scorer_->kept_estimate(), n_pairs, out.kept_estimate.data());
    std::fill_n(out.dropped_bound.data(), n_pairs, std::numeric_limits<float>::quiet_NaN());
    out.index_bytes_read = bytes;
    return true;
  }

  LocksShape shape_;
  std::size_t record_bytes_;
  LazyArray<std::byte> records_;  // [pool slots, record_bytes_]
  LazyArray<float> key_norms_;    // [pool slots] certified: the page's largest key norm
  // Device mode: the scorer, the slots summarised since the last upload (each listed once), the
  // call's pairs.
  std::unique_ptr<gpu::LocksScorer> scorer_;
  AlignedVector<uint32_t> upload_slots_;
  std::vector<uint8_t> upload_marked_;
  std::size_t n_upload_ = 0;
  std::vector<gpu::LocksPair> pairs_;
  std::vector<uint64_t> table_names_;  // per sequence id: table_name()'s, 0 until named
  uint64_t next_table_name_ = 1;
  uint64_t device_fallbacks_ = 0;
};

}  // namespace

std::unique_ptr<PageSelector> make_page_selector(const Policy& policy, KvCache& cache,
                                                 uint32_t max_batch, uint64_t max_pages,
                                                 ThreadPool& pool) {
  switch (policy.kind) {
    case Kind::dense:
      return std::make_unique<DenseSelector>(policy, cache, max_batch, max_pages, pool);
    case Kind::oracle:
      return std::make_unique<OracleSelector>(policy, cache, max_batch, max_pages, pool);
    case Kind::quest:
      return std::make_unique<QuestSelector>(policy, cache, max_batch, max_pages, pool);
    case Kind::locks:
    case Kind::locks_certified:
      return std::make_unique<LocksSelector>(policy, cache, max_batch, max_pages, pool);
    case Kind::s4r:
    case Kind::louver: break;  // token-level: Selector::create makes them
  }
  fail(Status::invalid_argument, "policy.kind=", static_cast<int>(policy.kind),
       " is not a page selector");
}

}  // namespace kvsift::select
