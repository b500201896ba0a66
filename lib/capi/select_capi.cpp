// kvsift_select: the cache's selector without the attention, for engines that attend with their
// own paged kernel (kvsift.h documents the contract).
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "kvsift/kvsift.h"
#include "lib/capi/cache_handle.hpp"
#include "lib/capi/guard.hpp"
#include "lib/core/error.hpp"
#include "lib/core/finite.hpp"

using kvsift::Status;
using kvsift::capi::guard;
using kvsift::capi::require_pointer;

namespace {

// What the batch stores in the layer, summed over its pairs: the most any selector returns.
struct Needed {
  uint64_t pages = 0;
  uint64_t tokens = 0;
};

Needed stored(const kvsift_cache& handle, uint32_t layer, uint32_t n_seqs, const int32_t* seq_ids) {
  const kvsift::CacheGeometry& g = handle.cache.geometry();
  Needed n;
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const uint64_t length = handle.cache.length_unchecked(seq_ids[i], layer);
    n.pages += uint64_t{g.n_kv_heads} * g.pages_for(length);
    n.tokens += uint64_t{g.n_kv_heads} * length;
  }
  return n;
}

}  // namespace

extern "C" {

kvsift_status kvsift_select(kvsift_cache* cache, uint32_t layer, uint32_t n_seqs,
                            const int32_t* seq_ids, const float* q,
                            const kvsift_selection* selection, size_t* n_page_ids,
                            size_t* n_token_positions, kvsift_selection_stats* stats) {
  return guard(__func__, [&] {
    require_pointer(cache, "cache");
    require_pointer(selection, "selection");
    require_pointer(n_page_ids, "n_page_ids");
    require_pointer(n_token_positions, "n_token_positions");
    // validate_sequences also checks the output of an attention, which this call has not: q's end
    // stands in for it (never dereferenced, never overlapping q).
    const kvsift::CacheGeometry& g = cache->cache.geometry();
    const std::size_t q_elems = std::size_t{n_seqs} * g.n_query_heads() * g.head_dim;
    kvsift::AttendCall call{layer, n_seqs, seq_ids, q, nullptr, nullptr};
    if (q != nullptr && n_seqs <= cache->engine.max_batch())
      call.out = const_cast<float*>(q) + q_elems;
    cache->engine.validate_sequences(call);
    kvsift::require_finite(q, q_elems, "q");
    const kvsift_selection& s = *selection;
    require_pointer(s.page_offsets, "selection->page_offsets");
    kvsift::require(s.page_ids != nullptr || s.page_capacity == 0,
                    "selection->page_ids is NULL with page_capacity=", s.page_capacity);
    kvsift::require(s.token_positions != nullptr || s.token_capacity == 0,
                    "selection->token_positions is NULL with token_capacity=", s.token_capacity);

    // Sized before selecting, so that a refused call has selected nothing (S4R and Louver change
    // state when they select).
    const bool rows = cache->engine.selection().has_rows;
    const Needed need = stored(*cache, layer, n_seqs, seq_ids);
    const uint64_t need_tokens = rows ? need.tokens : 0;
    if (s.page_capacity < need.pages || s.token_capacity < need_tokens) {
      *n_page_ids = static_cast<size_t>(need.pages);
      *n_token_positions = static_cast<size_t>(need_tokens);
      kvsift::fail(Status::buffer_too_small, "selection needs page_capacity >= ", need.pages,
                   " and token_capacity >= ", need_tokens, " (given ", s.page_capacity, " and ",
                   s.token_capacity, ")");
    }
    kvsift::require(!rows || s.token_offsets != nullptr,
                    "selection->token_offsets is NULL for the token-level selector ",
                    kvsift::select::kind_name(cache->engine.selector().policy().kind));

    cache->engine.select(call);
    const kvsift::select::Selection& sel = cache->engine.selection();
    const uint32_t pairs = sel.n_pairs;
    std::copy_n(sel.offsets.data(), pairs + 1, s.page_offsets);
    std::copy_n(sel.page_ids.data(), sel.pages_chosen(), s.page_ids);
    uint64_t n_tokens = 0;
    if (s.token_offsets != nullptr) s.token_offsets[0] = 0;
    for (uint32_t pair = 0; pair < pairs; ++pair) {
      if (sel.has_rows) {
        // Rows sit in the order the selector produced them (S4R: by relevance, then the most
        // recent); the caller gets positions in ascending order.
        const uint32_t* from =
            sel.row_tokens.data() + std::size_t{sel.chunk_offsets[pair]} * g.page_tokens;
        uint32_t* to = s.token_positions + n_tokens;
        std::copy_n(from, sel.row_counts[pair], to);
        std::sort(to, to + sel.row_counts[pair]);
        n_tokens += sel.row_counts[pair];
      }
      if (s.token_offsets != nullptr) s.token_offsets[pair + 1] = static_cast<uint32_t>(n_tokens);
      if (s.kept_estimate != nullptr) s.kept_estimate[pair] = sel.kept_estimate[pair];
      if (s.dropped_bound != nullptr) s.dropped_bound[pair] = sel.dropped_bound[pair];
    }
    *n_page_ids = static_cast<size_t>(sel.pages_chosen());
    *n_token_positions = static_cast<size_t>(n_tokens);
    if (stats == nullptr) return;
    *stats = kvsift_selection_stats{};
    stats->pairs = pairs;
    stats->pages_chosen = sel.pages_chosen();
    stats->pages_stored = need.pages;
    const kvsift::LayerStepStats& step = cache->engine.last_step();
    stats->index_bytes_read = step.index_bytes_read;
    stats->kept_estimate = pairs > 0 ? step.kept_estimate_sum / pairs : 1.0;
    stats->dropped_bound = step.dropped_bound;
  });
}

}  // extern "C"
