#include "lib/select/louver_selector.hpp"

#include <algorithm>
#include <cstring>
#include <limits>

#include "lib/core/error.hpp"

namespace kvsift::select {

LouverSelector::LouverSelector(const Policy& policy, KvCache& cache, uint32_t max_batch,
                               uint64_t max_pages, int n_threads)
    : Selector(policy, cache, max_batch, max_pages, n_threads) {
  const CacheGeometry& g = cache.geometry();
  require(g.group_size <= 16, "the louver selector serves groups of up to 16 query heads, not ",
          g.group_size);
  params_.head_dim = g.head_dim;
  params_.max_group = g.group_size;
  params_.isa = cache.kernels().isa;
  key_.resize(g.head_dim);
}

void LouverSelector::on_sequence_freed(int32_t seq_id) noexcept {
  if (static_cast<std::size_t>(seq_id) < indexes_.size())
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
        index.emplace(LouverIndex::from_cache(cache_, seq, call.layer, h, params_));
        LouverQuery query;  // the form select() asks, so that its query() cannot fail
        query.tau_mode = LouverTau::token_budget;
        query.budget_tokens = 1;
        index->validate(g.group_size, query);
        continue;
      }
      // The keys stored since the last step (one per decode step).
      for (uint64_t t = index->size(); t < length; ++t) {
        cache_.read_tokens(seq, call.layer, h, t, 1, key_.data(), nullptr);
        index->append(key_.data());
      }
    }
  }
  out.reserve_rows(chunks, g.page_tokens, g.slot_bytes());
}

void LouverSelector::select(const SelectCall& call, Selection& out) noexcept {
  const CacheGeometry& g = cache_.geometry();
  const uint32_t H = g.n_kv_heads, G = g.group_size, d = g.head_dim, B = g.page_tokens;
  const std::size_t row_bytes = std::size_t{d} * sizeof(uint16_t);
  const std::size_t slot_bytes = g.slot_bytes(), v_offset = g.page_elems() * sizeof(uint16_t);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  out.begin_pairs(call.n_seqs * H);
  for (uint32_t i = 0; i < call.n_seqs; ++i) {
    const int32_t seq = call.seq_ids[i];
    const uint64_t length = cache_.length_unchecked(seq, call.layer);
    const uint64_t n_pages = g.pages_for(length);
    // Mandatory pages: [0, sink_end) and [window_first, n_pages).
    const uint64_t sink_end = std::min<uint64_t>(policy_.sink_pages, n_pages);
    const uint64_t window_first =
        std::max(sink_end, n_pages - std::min<uint64_t>(policy_.window_pages, n_pages));
    const uint64_t mandatory_tokens =
        std::min(length, sink_end * B) + (length - std::min(length, window_first * B));
    const uint64_t budget = policy_.budget_tokens(length);
    for (uint32_t h = 0; h < H; ++h) {
      const uint32_t pair = i * H + h;
      out.list_pages_outside(pair, n_pages, sink_end, window_first);
      out.kept_estimate[pair] = nan;
      out.dropped_bound[pair] = nan;
      uint32_t rows = 0;
      if (budget > mandatory_tokens) {
        LouverIndex& index =
            *indexes_[static_cast<std::size_t>(seq)][std::size_t{call.layer} * H + h];
        LouverQuery query;
        query.tau_mode = LouverTau::token_budget;
        query.budget_tokens = budget - mandatory_tokens;
        const LouverResult found = index.query(call.q + std::size_t{pair} * G * d, G, query);
        out.index_bytes_read += found.bytes_read;
        // Gather the found tokens outside the mandatory pages, K and V rows in storage form.
        const uint32_t* table = cache_.page_table(seq, call.layer, h);
        std::byte* chunks =
            out.row_chunks.data() + std::size_t{out.chunk_offsets[pair]} * slot_bytes;
        uint32_t* tokens = out.row_tokens.data() + std::size_t{out.chunk_offsets[pair]} * B;
        for (const uint32_t t : found.token_ids) {
          const uint64_t page = t / B;
          if (page < sink_end || page >= window_first) continue;
          const std::byte* from = cache_.pool().slot(table[page]) + (t % B) * row_bytes;
          std::byte* to = chunks + std::size_t{rows / B} * slot_bytes + (rows % B) * row_bytes;
          std::memcpy(to, from, row_bytes);
          std::memcpy(to + v_offset, from + v_offset, row_bytes);
          tokens[rows++] = t;
        }
      }
      out.set_rows(pair, rows, B);
    }
  }
}

}  // namespace kvsift::select
