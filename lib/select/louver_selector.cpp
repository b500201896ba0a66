#include "lib/select/louver_selector.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>

#include "lib/core/error.hpp"

namespace kvsift::select {
namespace {

// A pair's pages and the tokens its range search is aimed at: mandatory pages [0, sink_end) and
// [window_first, n_pages); query_tokens = 0 when the mandatory pages use up the budget.
struct PairPlan {
  uint64_t n_pages, sink_end, window_first, query_tokens;
};

PairPlan plan_pair(const Policy& policy, uint32_t page_tokens, uint64_t length) noexcept {
  const PagePlan pages = policy.page_plan(page_tokens, length);
  PairPlan p;
  p.n_pages = pages.n_pages;
  p.sink_end = pages.sink;
  p.window_first = pages.sel_last;
  const uint64_t mandatory_tokens = std::min(length, p.sink_end * page_tokens) +
                                    (length - std::min(length, p.window_first * page_tokens));
  const uint64_t budget = policy.budget_tokens(length);
  p.query_tokens = budget > mandatory_tokens ? budget - mandatory_tokens : 0;
  return p;
}

LouverQuery query_for(uint64_t tokens) noexcept {
  LouverQuery query;
  query.tau_mode = LouverTau::token_budget;
  query.budget_tokens = tokens;
  return query;
}

}  // namespace

gpu::LouverIndexView louver_device_view(const LouverIndex& index) noexcept {
  gpu::LouverIndexView view;
  view.head_dim = index.params().head_dim;
  view.n_subspaces = index.n_subspaces();
  for (uint32_t s = 0; s < view.n_subspaces; ++s) {
    view.offset[s + 1] = index.subspace_offset(s) + index.subspace_width(s);
    view.centers[s] = index.centers_data(s);
    view.radii[s] = index.radii_data(s);
    view.assignments[s] = index.assignments_data(s);
  }
  view.n_clusters = index.n_clusters();
  view.n_indexed = static_cast<uint32_t>(index.indexed());
  view.isa = index.kernels().level;
  return view;
}

LouverSelector::LouverSelector(const Policy& policy, KvCache& cache, uint32_t max_batch,
                               uint64_t max_pages, ThreadPool& pool, const simd::Kernels& kernels)
    : Selector(policy, cache, max_batch, max_pages, pool, kernels) {
  const CacheGeometry& g = cache.geometry();
  require(g.group_size <= 16, "the louver selector serves groups of up to 16 query heads, not ",
          g.group_size);
  params_.head_dim = g.head_dim;
  params_.max_group = g.group_size;
  params_.isa = kernels.level;
  key_.resize(g.head_dim);
  if (policy.device >= 0) {
    gpu::LouverFilterShape shape;
    shape.head_dim = g.head_dim;
    shape.max_group = g.group_size;
    shape.max_items = max_batch * g.n_kv_heads;
    filter_ = std::make_unique<gpu::LouverFilter>();
    gpu::check(filter_->init(policy.device, shape), "the louver device filter on device ",
               policy.device, ": ");
    items_.resize(shape.max_items);
    q_norms_.resize(std::size_t{shape.max_items} * g.group_size * simd::kLouverMaxSubspaces);
    taus_.resize(std::size_t{shape.max_items} * g.group_size);
    item_of_pair_.resize(shape.max_items);
  }
}

uint32_t LouverSelector::slot_of(int32_t seq, uint32_t layer, uint32_t kv_head) const noexcept {
  const CacheGeometry& g = cache_.geometry();
  return (static_cast<uint32_t>(seq) * g.n_layers + layer) * g.n_kv_heads + kv_head;
}

void LouverSelector::on_sequence_freed(int32_t seq_id) noexcept {
  if (static_cast<std::size_t>(seq_id) >= indexes_.size()) return;
  if (filter_) {
    const CacheGeometry& g = cache_.geometry();
    for (uint32_t layer = 0; layer < g.n_layers; ++layer)
      for (uint32_t h = 0; h < g.n_kv_heads; ++h) filter_->release(slot_of(seq_id, layer, h));
  }
  indexes_[static_cast<std::size_t>(seq_id)].clear();
}

uint64_t LouverSelector::held_bytes() const noexcept {
  uint64_t bytes = 0;
  for (const auto& seq : indexes_)
    for (const auto& index : seq)
      if (index) bytes += index->index_bytes();
  return bytes;
}

void LouverSelector::prepare(const SelectCall& call, Selection& out) {
  const CacheGeometry& g = cache_.geometry();
  const uint32_t H = g.n_kv_heads;
  // The range search returns what reaches tau (the sample only aims it at the budget): up to
  // every stored token of each pair.
  uint64_t chunks = 0;
  for (uint32_t i = 0; i < call.n_seqs; ++i) {
    const int32_t seq = call.seq_ids[i];
    const auto s = static_cast<std::size_t>(seq);
    if (indexes_.size() <= s) indexes_.resize(s + 1);
    if (indexes_[s].empty()) indexes_[s].resize(std::size_t{g.n_layers} * H);
    const uint64_t length = cache_.length(seq, call.layer);
    chunks += uint64_t{H} * g.pages_for(length);
    for (uint32_t h = 0; h < H; ++h) {
      std::optional<LouverIndex>& index = indexes_[s][std::size_t{call.layer} * H + h];
      if (!index) {
        index.emplace(LouverIndex::from_cache(cache_, seq, call.layer, h, params_, &pool_));
        // The form select() asks, so that its query() cannot fail.
        index->validate(g.group_size, query_for(1));
      } else {
        // The keys stored since the last step (one per decode step).
        for (uint64_t t = index->size(); t < length; ++t) {
          cache_.read_tokens(seq, call.layer, h, t, 1, key_.data(), nullptr);
          index->append(key_.data());
        }
      }
      if (filter_) {
        // The device copy follows the index: only a flush (or the first build) uploads anything.
        gpu::check(filter_->sync(slot_of(seq, call.layer, h), louver_device_view(*index)),
                   "louver device filter: ");
      }
    }
  }
  out.reserve_rows(chunks, g.page_tokens, g.slot_bytes());
}

void LouverSelector::run_device_filter(const SelectCall& call) noexcept {
  const CacheGeometry& g = cache_.geometry();
  const uint32_t H = g.n_kv_heads, G = g.group_size, d = g.head_dim;
  uint32_t n_items = 0;
  LouverGateTerms terms[simd::kLouverMaxGroup];
  for (uint32_t i = 0; i < call.n_seqs; ++i) {
    const int32_t seq = call.seq_ids[i];
    const PairPlan plan =
        plan_pair(policy_, g.page_tokens, cache_.length_unchecked(seq, call.layer));
    for (uint32_t h = 0; h < H; ++h) {
      const uint32_t pair = i * H + h;
      item_of_pair_[pair] = -1;
      if (plan.query_tokens == 0) continue;
      LouverIndex& index =
          *indexes_[static_cast<std::size_t>(seq)][std::size_t{call.layer} * H + h];
      const float* q = call.q + std::size_t{pair} * G * d;
      index.begin_query(q, G, query_for(plan.query_tokens), terms);
      float* q_norm = q_norms_.data() + std::size_t{n_items} * G * simd::kLouverMaxSubspaces;
      float* t = taus_.data() + std::size_t{n_items} * G;
      for (uint32_t head = 0; head < G; ++head) {
        std::copy_n(terms[head].q_norm, simd::kLouverMaxSubspaces,
                    q_norm + std::size_t{head} * simd::kLouverMaxSubspaces);
        t[head] = terms[head].t;
      }
      items_[n_items] = gpu::LouverFilterItem{slot_of(seq, call.layer, h), G, q, q_norm, t};
      item_of_pair_[pair] = static_cast<int32_t>(n_items++);
    }
  }
  device_ok_ = n_items == 0 || (filter_->validate(items_.data(), n_items).ok &&
                                filter_->run(items_.data(), n_items).ok);
  device_fallbacks_ += !device_ok_;
}

void LouverSelector::select(const SelectCall& call, Selection& out) noexcept {
  const CacheGeometry& g = cache_.geometry();
  const uint32_t H = g.n_kv_heads, G = g.group_size, d = g.head_dim, B = g.page_tokens;
  const simd::PageLayout layout = g.layout();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (filter_) run_device_filter(call);
  out.begin_pairs(call.n_seqs * H);
  for (uint32_t i = 0; i < call.n_seqs; ++i) {
    const int32_t seq = call.seq_ids[i];
    const PairPlan plan = plan_pair(policy_, B, cache_.length_unchecked(seq, call.layer));
    const uint64_t sink_end = plan.sink_end, window_first = plan.window_first;
    for (uint32_t h = 0; h < H; ++h) {
      const uint32_t pair = i * H + h;
      out.list_pages_outside(pair, plan.n_pages, sink_end, window_first);
      out.kept_estimate[pair] = nan;
      out.dropped_bound[pair] = nan;
      uint32_t rows = 0;
      if (plan.query_tokens > 0) {
        LouverIndex& index =
            *indexes_[static_cast<std::size_t>(seq)][std::size_t{call.layer} * H + h];
        const LouverQuery query = query_for(plan.query_tokens);
        const float* q = call.q + std::size_t{pair} * G * d;
        // The device's candidates, or (CPU mode, or the device failed) the CPU filter's.
        const LouverResult found =
            filter_ && device_ok_
                ? index.finish_query(q, G, query,
                                     filter_->mask(static_cast<uint32_t>(item_of_pair_[pair])))
                : index.query(q, G, query);
        out.index_bytes_read += found.bytes_read;
        // Gather the found tokens outside the mandatory pages, K and V rows in storage form.
        const uint32_t* table = cache_.page_table(seq, call.layer, h);
        std::byte* chunks = layout.slot(out.row_chunks.data(), out.chunk_offsets[pair]);
        uint32_t* tokens = out.row_tokens.data() + std::size_t{out.chunk_offsets[pair]} * B;
        for (const uint32_t t : found.token_ids) {
          const uint64_t page = t / B;
          if (page < sink_end || page >= window_first) continue;
          const std::byte* from = cache_.pool().slot(table[page]);
          std::byte* to = layout.slot(chunks, rows / B);
          layout.copy_token(from, t % B, to, rows % B);
          tokens[rows++] = t;
        }
      }
      out.set_rows(pair, rows, B);
    }
  }
}

std::unique_ptr<Selector> make_louver_selector(const Policy& policy, KvCache& cache,
                                               uint32_t max_batch, uint64_t max_pages,
                                               ThreadPool& pool, const simd::Kernels& kernels) {
  return std::make_unique<LouverSelector>(policy, cache, max_batch, max_pages, pool, kernels);
}

}  // namespace kvsift::select
