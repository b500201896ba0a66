#include "lib/select/selector.hpp"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <new>

#include "lib/core/error.hpp"

namespace kvsift::select {

namespace {

constexpr std::string_view kCombineNames[] = {"share_avg", "nrm", "max"};
static_assert(std::size(kCombineNames) == static_cast<std::size_t>(GqaCombine::count));

}  // namespace

std::string_view combine_name(GqaCombine combine) noexcept {
  const auto at = static_cast<std::size_t>(combine);
  return at < std::size(kCombineNames) ? kCombineNames[at] : "?";
}

void Policy::validate() const {
  require(known(kind), "policy.kind=", static_cast<int>(kind), " is not a selector (",
          selector_names(), ")");
  require(combine < GqaCombine::count, "policy.combine=", static_cast<int>(combine),
          " is not a GQA combine mode");
  require(std::isfinite(budget) && budget >= 0.0, "policy.budget=", budget,
          " must be a finite number >= 0");
  if (kind == Kind::dense)
    require(budget == 0.0, "policy.budget=", budget,
            ": the dense selector attends to every token and takes no budget");
  else
    require(budget > 0.0, "policy.budget must be > 0 for the ", kind_name(kind), " selector");
  require(std::isfinite(locks.epsilon) && locks.epsilon > 0.0 && locks.epsilon < 1.0,
          "policy.locks.epsilon=", locks.epsilon, " must be in (0, 1)");
  require(std::isfinite(s4r.compression) && s4r.compression >= 1.0,
          "policy.s4r.compression=", s4r.compression, " must be a finite number >= 1");
  require(s4r.window >= 1 && s4r.window <= 4096, "policy.s4r.window=", s4r.window,
          " is not in 1..4096");
  require(device >= -1, "policy.device=", device, " is not a device index or -1");
}

void Selection::reserve(uint32_t max_pairs, uint64_t max_pages, bool rows) {
  offsets.assign(std::size_t{max_pairs} + 1, 0);
  has_rows = rows;
  latent = false;
  latent_units.assign(rows ? max_pairs : 0, LatentUnit{});
  chunk_offsets.assign(std::size_t{max_pairs} + 1, 0);
  row_counts.assign(max_pairs, 0);
  const auto pages = static_cast<std::size_t>(max_pages);
  page_ids = LazyArray<uint32_t>(pages);
  scores = LazyArray<float>(pages);
  kept_estimate.resize(max_pairs);
  dropped_bound.resize(max_pairs);
  n_pairs = 0;
}

void Selection::reserve_rows(uint64_t chunks, uint32_t page_tokens, std::size_t chunk_bytes) {
  const auto bytes = static_cast<std::size_t>(chunks) * chunk_bytes;
  if (bytes <= row_chunks.size()) return;
  try {
    row_chunks.resize(bytes);
    row_tokens.resize(static_cast<std::size_t>(chunks) * page_tokens);
  } catch (const std::bad_alloc&) {
    fail(Status::out_of_memory, "selection rows: ", chunks, " chunks of ", chunk_bytes, " bytes");
  }
}

void Selection::begin_pairs(uint32_t pairs) noexcept {
  n_pairs = pairs;
  index_bytes_read = 0;
  offsets[0] = 0;
  chunk_offsets[0] = 0;
  latent = false;
}

void Selection::list_pages_outside(uint32_t pair, uint64_t n_pages, uint64_t gap_first,
                                   uint64_t gap_end) noexcept {
  uint32_t at = offsets[pair];
  for (uint64_t p = 0; p < n_pages; ++p) {
    if (p >= gap_first && p < gap_end) continue;
    page_ids[at] = static_cast<uint32_t>(p);
    scores[at++] = std::numeric_limits<float>::infinity();
  }
  offsets[pair + 1] = at;
}

void Selection::set_rows(uint32_t pair, uint32_t rows, uint32_t page_tokens) noexcept {
  row_counts[pair] = rows;
  chunk_offsets[pair + 1] = chunk_offsets[pair] + (rows + page_tokens - 1) / page_tokens;
}

double Selection::kept_estimate_sum() const noexcept {
  double sum = 0.0;
  for (uint32_t i = 0; i < n_pairs; ++i) sum += kept_estimate[i];
  return sum;
}

double Selection::worst_dropped_bound() const noexcept {
  double worst = 0.0;
  for (uint32_t i = 0; i < n_pairs; ++i) worst = worse_bound(worst, dropped_bound[i]);
  return worst;
}

Selector::Selector(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
                   ThreadPool& pool, const simd::Kernels& kernels)
    : cache_(cache),
      policy_(policy),
      max_batch_(max_batch),
      max_pages_(max_pages),
      pool_(pool),
      kernels_(kernels) {
  require(max_batch > 0, "max_batch must be > 0");
  require(max_pages > 0, "max_pages must be > 0");
}

Selector::~Selector() {
  cache_.remove_seal_listener(this);
}

void Selector::reserve_selection(Selection& selection) const {
  const uint32_t pairs = max_batch_ * cache_.geometry().n_kv_heads;
  // The pairs of one call hold distinct slots, so the pool's capacity bounds their pages too.
  selection.reserve(pairs,
                    std::min<uint64_t>(uint64_t{pairs} * max_pages_, cache_.pool().capacity()),
                    selects_rows());
}

std::unique_ptr<Selector> Selector::create(const Policy& policy, KvCache& cache, uint32_t max_batch,
                                           uint64_t max_pages, ThreadPool& pool,
                                           const simd::Kernels& kernels) {
  policy.validate();
  // Compressed sequences live on only in the selector that compressed them.
  require(!cache.has_released_pages(),
          "the cache holds sequences whose pages S4R compressed; "
          "free them before setting a new selector");
  std::unique_ptr<Selector> selector =
      selector_info(policy.kind).make(policy, cache, max_batch, max_pages, pool, kernels);
  cache.add_seal_listener(selector.get());
  selector->summarise_existing();
  return selector;
}

}  // namespace kvsift::select
