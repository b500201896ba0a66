#include "lib/select/s4r_selector.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>

#include "lib/core/error.hpp"
#include "simd/page_rows.hpp"

namespace kvsift::select {

namespace {

// Neighbouring tokens a relevance score is max-pooled over (the paper's kappa = 7).
constexpr uint32_t kPoolKernel = 7;
// Sampled rows per row of the compressed span: the paper's T' = eta T, eta = 1 / compression.
// A prompt whose compressible span is shorter than this many query windows stays exact: its
// bases would come from too few rows to be worth the error.
constexpr uint64_t kMinWindowsToCompress = 4;
// The share of the sample taken as one block of the most recent tokens (the paper's 7:3).
constexpr double kRecentShare = 0.7;

// LatentUnit::basis_id: one counter for every selector of the process, so that an id names one
// fit even across selectors of one cache (DecodeEngine::set_selector replaces them).
std::atomic<uint64_t> next_basis_id{1};

}  // namespace

S4rSelector::S4rSelector(const Policy& policy, KvCache& cache, uint32_t max_batch,
                         uint64_t max_pages, ThreadPool& pool, const simd::Kernels& kernels)
    : Selector(policy, cache, max_batch, max_pages, pool, kernels) {
  require(cache.key_form() == KeyForm::pre_rope,
          "the s4r selector compresses keys before RoPE: it needs a cache that takes pre-RoPE "
          "keys (key form pre_rope)");
  const CacheGeometry& g = cache.geometry();
  const std::size_t dim = std::size_t{heads_per_unit()} * g.head_dim;
  query_rows_.resize(std::size_t{g.group_size} * dim);
  s4r::Basis widest;  // the workspace for the largest basis a unit can have: rank <= dim
  widest.dim = widest.rank = dim;
  reconstruct_ws_.resize(s4r::reconstruct_workspace_floats(widest));
}

void S4rSelector::grow_workspaces(uint64_t n_tokens, uint64_t max_rows) {
  const CacheGeometry& g = cache_.geometry();
  const std::size_t dim = std::size_t{heads_per_unit()} * g.head_dim;
  auto grow = [](auto& v, uint64_t n) {
    if (v.size() < n) v.resize(static_cast<std::size_t>(n));
  };
  try {
    grow(relevance_ws_,
         s4r::relevance_workspace_floats(policy_.s4r.window, g.group_size, n_tokens));
    grow(relevance_, n_tokens);
    grow(top_ws_, n_tokens);
    grow(chosen_, n_tokens);
    grow(rows_, max_rows * dim);
  } catch (const std::bad_alloc&) {
    fail(Status::out_of_memory, "s4r workspaces for ", n_tokens, " compressed tokens");
  }
}

uint32_t S4rSelector::heads_per_unit() const noexcept {
  return policy_.s4r.per_head_bases ? 1 : cache_.geometry().n_kv_heads;
}

void S4rSelector::on_sequence_freed(int32_t seq_id) noexcept {
  if (static_cast<std::size_t>(seq_id) < states_.size())
    states_[static_cast<std::size_t>(seq_id)].clear();
}

S4rSelector::Compressed S4rSelector::compressed(int32_t seq_id, uint32_t layer) const noexcept {
  if (seq_id < 0 || static_cast<std::size_t>(seq_id) >= states_.size()) return {};
  const auto& layers = states_[static_cast<std::size_t>(seq_id)];
  if (layer >= layers.size() || layers[layer].state != State::compressed) return {};
  const LayerState& st = layers[layer];
  return {st.first, st.end, st.units.front().keys.rank};
}

uint64_t S4rSelector::held_bytes() const noexcept {
  uint64_t bytes = 0;
  for (const auto& layers : states_)
    for (const LayerState& st : layers)
      for (const Unit& u : st.units)
        bytes +=
            (u.keys.columns.size() + u.values.columns.size() + u.queries.size()) * sizeof(float) +
            (u.key_coeffs.size() + u.value_coeffs.size()) * sizeof(uint16_t);
  return bytes;
}

void S4rSelector::prepare(const SelectCall& call, Selection& out) {
  const CacheGeometry& g = cache_.geometry();
  const uint32_t n_layers = g.n_layers;
  uint64_t chunks = 0;
  for (uint32_t i = 0; i < call.n_seqs; ++i) {
    const auto seq = static_cast<std::size_t>(call.seq_ids[i]);
    if (states_.size() <= seq) states_.resize(seq + 1);
    if (states_[seq].empty()) states_[seq].resize(n_layers);
    LayerState& st = states_[seq][call.layer];
    if (st.state == State::fresh) {
      const auto start = std::chrono::steady_clock::now();
      compress(call.seq_ids[i], call.layer, st);
      compress_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    if (st.state != State::compressed) continue;
    // select_unit reconstructs at most max(W, budget) of the n compressed tokens.
    const uint64_t n = st.end - st.first;
    const uint64_t length = cache_.length(call.seq_ids[i], call.layer);
    const uint64_t rows =
        std::min(n, std::max<uint64_t>(policy_.s4r.window, policy_.budget_tokens(length)));
    grow_workspaces(n, rows);
    chunks += uint64_t{g.n_kv_heads} * g.pages_for(rows);
  }
  out.reserve_rows(chunks, g.page_tokens, g.slot_bytes());
}

void S4rSelector::compress(int32_t seq_id, uint32_t layer, LayerState& st) {
  const CacheGeometry& g = cache_.geometry();
  const uint32_t B = g.page_tokens, d = g.head_dim, G = g.group_size;
  const uint32_t W = policy_.s4r.window, hpu = heads_per_unit();
  const uint64_t length = cache_.length(seq_id, layer);
  const uint64_t first = uint64_t{policy_.page_plan(B, length).sink} * B, end = length / B * B;
  if (end <= first || end - first < kMinWindowsToCompress * W) {
    st.state = State::exact;
    return;
  }
  const uint64_t n = end - first;
  const uint32_t dim = hpu * d;
  std::vector<Unit> units(g.n_kv_heads / hpu);
  try {
    std::vector<float> rows(static_cast<std::size_t>(n) * dim),
        head(static_cast<std::size_t>(n) * d);
    // Compression 1 keeps full rank: nothing is saved, and attention over everything reconstructed
    // equals dense attention (the check of this whole path).
    const uint32_t rank =
        policy_.s4r.compression == 1.0
            ? dim
            : s4r::solve_rank(dim, n, static_cast<uint32_t>(first), G, W, policy_.s4r.compression);
    const uint64_t n_sample = std::max<uint64_t>(
        rank, static_cast<uint64_t>(std::floor(static_cast<double>(n) / policy_.s4r.compression)));
    const std::vector<uint32_t> sample = s4r::hybrid_sample(0, n, n_sample, kRecentShare);
    for (uint32_t u = 0; u < units.size(); ++u) {
      Unit& unit = units[u];
      for (const bool keys : {true, false}) {
        // The unit's heads side by side: row t is token first + t, D' = hpu * d wide.
        for (uint32_t h = 0; h < hpu; ++h) {
          cache_.read_tokens(seq_id, layer, u * hpu + h, first, n, keys ? head.data() : nullptr,
                             keys ? nullptr : head.data(), KeyForm::pre_rope);
          for (uint64_t t = 0; t < n; ++t)
            std::copy_n(head.data() + t * d, d, rows.data() + t * dim + std::size_t{h} * d);
        }
        s4r::Basis& basis = keys ? unit.keys : unit.values;
        std::vector<uint16_t>& coeffs = keys ? unit.key_coeffs : unit.value_coeffs;
        basis =
            s4r::fit_basis(rows.data(), n, dim, dim, sample.data(), sample.size(), rank, &pool_);
        basis.singular_values = {};  // diagnostics of the fit; decode needs only the columns
        coeffs.resize(static_cast<std::size_t>(n) * rank);
        s4r::project(rows.data(), n, dim, basis, coeffs.data(), g.row_dtype(), kernels_, &pool_);
      }
      unit.queries.assign(std::size_t{W} * G * rank, 0.0f);
      unit.basis_id = next_basis_id.fetch_add(1, std::memory_order_relaxed);
    }
  } catch (const std::bad_alloc&) {
    fail(Status::out_of_memory, "s4r compression of ", n, " tokens of sequence ", seq_id, " layer ",
         layer);
  }
  cache_.release_pages(seq_id, layer, first / B, end / B);
  st.units = std::move(units);
  st.first = first;
  st.end = end;
  st.state = State::compressed;
}

uint64_t S4rSelector::select_unit(const SelectCall& call, uint32_t seq_index, uint32_t unit_index,
                                  LayerState& st, Selection& out, uint64_t exact_tokens,
                                  float& kept) noexcept {
  const CacheGeometry& g = cache_.geometry();
  const uint32_t H = g.n_kv_heads, G = g.group_size, d = g.head_dim, B = g.page_tokens;
  const uint32_t W = policy_.s4r.window, hpu = heads_per_unit(), dim = hpu * d;
  const simd::Kernels& kernels = kernels_;
  Unit& unit = st.units[unit_index];
  const uint32_t rank = unit.keys.rank;
  const int32_t seq = call.seq_ids[seq_index];
  const uint64_t length = cache_.length_unchecked(seq, call.layer);
  const uint32_t h0 = unit_index * hpu;

  // This step's query, rotated back to before RoPE at its position (the last token's), as G
  // vectors of D' (query head g of each KV head of the unit), projected on B_K into the window.
  const float* q = call.q + std::size_t{seq_index} * H * G * d;
  for (uint32_t gi = 0; gi < G; ++gi) {
    float* row = query_rows_.data() + std::size_t{gi} * dim;
    for (uint32_t h = 0; h < hpu; ++h)
      std::copy_n(q + (std::size_t{h0 + h} * G + gi) * d, d, row + std::size_t{h} * d);
    cache_.rope().unrotate(row, hpu, length - 1);
  }
  const std::size_t step = std::size_t{G} * rank;
  if (unit.n_queries == W)
    std::memmove(unit.queries.data(), unit.queries.data() + step,
                 (unit.queries.size() - step) * sizeof(float));
  else
    ++unit.n_queries;
  s4r::project_to_float(query_rows_.data(), G, dim, unit.keys,
                        unit.queries.data() + (unit.n_queries - 1) * step);

  // m tokens: the last min(W, n) always, the best of the rest by pooled latent relevance.
  const uint64_t n = st.end - st.first;
  const uint64_t budget = policy_.budget_tokens(length);
  const uint64_t recent = std::min<uint64_t>(W, n);
  const uint64_t m =
      std::min(n, std::max(recent, budget > exact_tokens ? budget - exact_tokens : 0));
  s4r::relevance(unit.queries.data(), unit.n_queries, G, rank, unit.key_coeffs.data(),
                 g.row_dtype(), n, kPoolKernel, s4r::Pooling::max, s4r::GroupAggregation::mean,
                 kernels, relevance_ws_.data(), relevance_.data(), false, &pool_);
  const auto top = static_cast<uint32_t>(m - recent);
  s4r::top_k(relevance_.data(), n - recent, top, top_ws_.data(), chosen_.data());
  for (uint64_t r = 0; r < recent; ++r) chosen_[top + r] = static_cast<uint32_t>(n - recent + r);
  double total = 0.0, taken = 0.0;
  for (uint64_t t = 0; t < n; ++t) total += relevance_[t];
  for (uint64_t r = 0; r < m; ++r) taken += relevance_[chosen_[r]];
  kept = total > 0.0 ? static_cast<float>(taken / total) : 1.0f;

  const auto rows = static_cast<uint32_t>(m);
  for (uint32_t h = 0; h < hpu; ++h) {
    const uint32_t pair = seq_index * H + h0 + h;
    out.set_rows(pair, rows, B);
    uint32_t* tokens = out.row_tokens.data() + std::size_t{out.chunk_offsets[pair]} * B;
    for (uint32_t r = 0; r < rows; ++r) tokens[r] = static_cast<uint32_t>(st.first + chosen_[r]);
  }
  if (call.latent_rows) {
    LatentUnit& latent = out.latent_units[std::size_t{seq_index} * (H / hpu) + unit_index];
    latent.basis_id = unit.basis_id;
    latent.rank = rank;
    latent.key_basis = unit.keys.columns.data();
    latent.value_basis = unit.values.columns.data();
    latent.key_coeffs = unit.key_coeffs.data();
    latent.value_coeffs = unit.value_coeffs.data();
    latent.first = st.first;
    latent.n_tokens = n;
    latent.positions =
        out.row_tokens.data() + std::size_t{out.chunk_offsets[seq_index * H + h0]} * B;
  } else {
    write_rows(seq_index, unit_index, st, out);
  }
  return (n * rank + 2 * m * rank) * sizeof(uint16_t);
}

void S4rSelector::write_rows(uint32_t seq_index, uint32_t unit_index, const LayerState& st,
                             Selection& out) noexcept {
  const CacheGeometry& g = cache_.geometry();
  const uint32_t H = g.n_kv_heads, d = g.head_dim, B = g.page_tokens;
  const uint32_t hpu = heads_per_unit(), dim = hpu * d, h0 = unit_index * hpu;
  const simd::Kernels& kernels = kernels_;
  const Unit& unit = st.units[unit_index];
  // The rows select_unit chose, from the positions it wrote for the unit's first KV head.
  const uint32_t first_pair = seq_index * H + h0;
  const uint32_t rows = out.row_counts[first_pair];
  const uint32_t* tokens = out.row_tokens.data() + std::size_t{out.chunk_offsets[first_pair]} * B;
  for (uint32_t r = 0; r < rows; ++r) chosen_[r] = static_cast<uint32_t>(tokens[r] - st.first);

  // Reconstruct K (then RoPE at each token's position) and V of the chosen tokens into the row
  // chunks of each KV head of the unit.
  const simd::PageLayout layout = g.layout();
  for (const bool keys : {true, false}) {
    const s4r::Basis& basis = keys ? unit.keys : unit.values;
    s4r::reconstruct(keys ? unit.key_coeffs.data() : unit.value_coeffs.data(), g.row_dtype(), basis,
                     chosen_.data(), rows, rows_.data(), kernels, reconstruct_ws_.data(), &pool_);
    for (uint32_t r = 0; r < rows; ++r) {
      float* row = rows_.data() + std::size_t{r} * dim;
      if (keys) cache_.rope().rotate(row, hpu, st.first + chosen_[r]);
      for (uint32_t h = 0; h < hpu; ++h) {
        const uint32_t pair = seq_index * H + h0 + h;
        std::byte* chunk =
            layout.slot(out.row_chunks.data(), std::size_t{out.chunk_offsets[pair]} + r / B);
        simd::store_rows(kernels, layout, chunk, keys ? simd::SlotPart::key : simd::SlotPart::value,
                         r % B, 1, row + std::size_t{h} * d, d);
      }
    }
  }
}

void S4rSelector::reconstruct_rows(const SelectCall& call, Selection& out) noexcept {
  if (!out.latent) return;
  const uint32_t H = cache_.geometry().n_kv_heads, hpu = heads_per_unit();
  for (uint32_t i = 0; i < call.n_seqs; ++i) {
    const auto s = static_cast<std::size_t>(call.seq_ids[i]);
    if (s >= states_.size() || states_[s].empty()) continue;
    const LayerState& st = states_[s][call.layer];
    if (st.state != State::compressed) continue;
    for (uint32_t u = 0; u < H / hpu; ++u) write_rows(i, u, st, out);
  }
}

void S4rSelector::select(const SelectCall& call, Selection& out) noexcept {
  const CacheGeometry& g = cache_.geometry();
  const uint32_t H = g.n_kv_heads, B = g.page_tokens, hpu = heads_per_unit();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  out.begin_pairs(call.n_seqs * H);
  out.latent = call.latent_rows;
  out.heads_per_unit = hpu;
  for (uint32_t i = 0; i < call.n_seqs; ++i) {
    const int32_t seq = call.seq_ids[i];
    const uint64_t length = cache_.length_unchecked(seq, call.layer);
    const uint64_t n_pages = g.pages_for(length);
    const auto s = static_cast<std::size_t>(seq);
    LayerState* st = s < states_.size() && !states_[s].empty() ? &states_[s][call.layer] : nullptr;
    const bool compressed = st != nullptr && st->state == State::compressed;
    // Exact pages: the sinks and everything from the end of the compressed span on; all of them
    // while the sequence is not compressed.
    const uint64_t gap_first = compressed ? st->first / B : n_pages;
    const uint64_t gap_end = compressed ? st->end / B : n_pages;
    for (uint32_t h = 0; h < H; ++h) out.list_pages_outside(i * H + h, n_pages, gap_first, gap_end);
    if (!compressed) {
      for (uint32_t h = 0; h < H; ++h) {
        const uint32_t pair = i * H + h;
        out.set_rows(pair, 0, B);
        out.kept_estimate[pair] = 1.0f;
        out.dropped_bound[pair] = 0.0f;
      }
      continue;
    }
    const uint64_t exact_tokens = st->first + (length - st->end);
    for (uint32_t u = 0; u < H / hpu; ++u) {
      float kept = 1.0f;
      out.index_bytes_read += select_unit(call, i, u, *st, out, exact_tokens, kept);
      for (uint32_t h = 0; h < hpu; ++h) {
        out.kept_estimate[i * H + u * hpu + h] = kept;
        out.dropped_bound[i * H + u * hpu + h] = nan;
      }
    }
  }
}

std::unique_ptr<Selector> make_s4r_selector(const Policy& policy, KvCache& cache,
                                            uint32_t max_batch, uint64_t max_pages,
                                            ThreadPool& pool, const simd::Kernels& kernels) {
  return std::make_unique<S4rSelector>(policy, cache, max_batch, max_pages, pool, kernels);
}

}  // namespace kvsift::select
