#include "lib/select/page_selector.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "lib/core/error.hpp"
#include "simd/page_rows.hpp"

namespace kvsift::select {

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

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
                           uint64_t max_pages, ThreadPool& pool, const simd::Kernels& kernels)
    : Selector(policy, cache, max_batch, max_pages, pool, kernels),
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
  const std::size_t offset = page.slot - cache_.pool().base();
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
      const simd::PageLayout layout = geometry().layout();
      alignas(64) float keys[64 * 256];  // page_tokens * head_dim at most
      simd::load_rows(kernels_, layout, cache_.pool().slot(slot), simd::SlotPart::key, 0,
                      layout.page_tokens, keys);
      summarise(slot, keys);
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
  simd::load_rows(kernels_, g.layout(), cache_.pool().slot(pair.table[page]), simd::SlotPart::key,
                  0, n, s.keys.data());
  float key_norm = 0.0f;  // only a certified bound reads the slack
  if (certified())
    for (uint32_t t = 0; t < n; ++t)
      key_norm = std::max(key_norm, l2_norm(s.keys.data() + t * d, d));
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
    s.slack[h * max_pages_ + page] = scale_ * l2_norm(q, d) * kFloatMargin * key_norm;
  }
  return uint64_t{n} * g.layout().key_bytes();
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
  const PagePlan plan = policy_.page_plan(B, pair.tokens);
  const uint32_t sink = plan.sink;
  const uint32_t sel_first = sink, sel_last = plan.sel_last;  // selectable [first, last)
  uint32_t* ids = out.page_ids.data() + first;
  float* scores = out.scores.data() + first;

  if (selects_everything() || plan.whole) {
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
  const uint32_t n_sel = plan.selectable();
  uint32_t* order = s.order.data();
  for (uint32_t j = 0; j < n_sel; ++j) order[j] = sel_first + j;
  const BetterPage better{s.combined.data()};

  float bound = std::numeric_limits<float>::quiet_NaN();
  uint32_t take = plan.take;
  if (certified()) {
    std::sort(order, order + n_sel, better);
    certify(pair, s, sel_first, sel_last, plan.take, take, bound);
  } else if (take > 0 && take < n_sel) {
    std::nth_element(order, order + take - 1, order + n_sel, better);
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
    s.selectable_mass[h] = kernels_.exp_sum(sh + first, top, mh + first, last - first);
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
// budget's `most` pages are chosen. Per head, with U and L upper and lower bounds on each page's
// log-mass: dropped share <= sum_dropped e^U / (sum_chosen e^L + sum_dropped e^U), since x / (a +
// x) grows with x and falls with a.
void PageSelector::certify(const PairView& pair, Scratch& s, uint32_t first, uint32_t last,
                           uint32_t most, uint32_t& n_chosen, float& bound) const noexcept {
  const uint32_t G = geometry().group_size, n_pages = pair.n_pages, n_sel = last - first;
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
  for (uint32_t j = 0;; ++j) {
    double worst = 0.0;
    for (uint32_t h = 0; h < G; ++h) {
      const double dropped = s.suffix[h * (max_pages_ + 1) + j];
      worst = std::max(worst, dropped / (chosen_low[h] + dropped));
    }
    if (worst < policy_.locks.epsilon || j >= most) {
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

}  // namespace kvsift::select
