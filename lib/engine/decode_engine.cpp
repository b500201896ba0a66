#include "lib/engine/decode_engine.hpp"

#include <algorithm>
#include <chrono>
#include <limits>

#include "lib/core/error.hpp"
#include "lib/offload/offload_attention.hpp"

namespace kvsift {

namespace {

using Clock = std::chrono::steady_clock;

double micros(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::micro>(to - from).count();
}

// The offload backend's sizes, from the cache and the engine's options: the one place they are
// computed. A pair lists at most the pages it holds; the device cache defaults to a mirror of the
// whole pool (every page resident), and the token rows Louver gathers and S4R reconstructs get
// as many slots as one layer of the pool holds (a decoder appends every layer alike).
OffloadOptions offload_options(const KvCache& cache, const EngineOptions& options) {
  const CacheGeometry& g = cache.geometry();
  const uint64_t capacity = cache.pool().capacity();
  const uint64_t per_layer = (capacity + g.n_layers - 1) / g.n_layers;
  OffloadOptions o;
  o.device = options.device;
  o.max_batch = options.max_batch;
  o.max_pages_per_pair =
      options.max_pages_per_pair != 0
          ? options.max_pages_per_pair
          : std::max<uint64_t>(1, capacity / (uint64_t{g.n_layers} * g.n_kv_heads));
  o.cache_pages = options.device_cache_pages;
  o.max_row_chunks = options.device_cache_pages != 0 ? options.device_cache_pages
                                                     : std::min<uint64_t>(per_layer, 1u << 30);
  o.step_parts = options.device_step_parts;
  return o;
}

}  // namespace

DecodeEngine::DecodeEngine(KvCache& cache, const simd::Kernels& kernels,
                           const EngineOptions& options)
    : cache_(cache),
      kernels_(kernels),
      cpu_(cache.geometry(), options.max_batch, options.n_threads, kernels),
      selector_max_pages_(options.max_pages_per_pair != 0 ? options.max_pages_per_pair
                                                          : cache.pool().capacity()) {
  require(options.device >= -1, "device=", options.device,
          " is neither -1 (CPU) nor a device index");
  if (options.device >= 0)
    offload_ = OffloadAttention::create(cache, offload_options(cache, options));
  set_selector(select::Policy{});
}

DecodeEngine::~DecodeEngine() = default;

AttentionBackend& DecodeEngine::mutable_backend() noexcept {
  return offload_ ? static_cast<AttentionBackend&>(*offload_) : cpu_;
}

// The one place that decides where S4R's rows are reconstructed: on the device when the backend
// can (OffloadAttention::reconstructs_rows), so that coefficients cross PCIe instead of rows and
// the host does no reconstruction; on the host otherwise. select() keeps values: its caller reads
// the rows (the C API's selection, an engine with its own kernel).
bool DecodeEngine::latent_rows() const noexcept {
  return offload_ && offload_->reconstructs_rows();
}

const AttentionBackend& DecodeEngine::backend() const noexcept {
  return offload_ ? static_cast<const AttentionBackend&>(*offload_) : cpu_;
}

void DecodeEngine::set_selector(const select::Policy& policy) {
  std::unique_ptr<select::Selector> selector = select::Selector::create(
      policy, cache_, cpu_.max_batch(), selector_max_pages_, cpu_.pool(), kernels_);
  select::Selection selection;
  selector->reserve_selection(selection);
  selector_ = std::move(selector);
  selection_ = std::move(selection);
}

void DecodeEngine::attend(const AttendCall& call) {
  last_ = LayerStepStats{};
  run_attention(call);
}

void DecodeEngine::run_attention(const AttendCall& call) {
  AttentionBackend& b = mutable_backend();
  b.validate(cache_, call);
  const Clock::time_point t0 = Clock::now();
  b.attend(cache_, call);
  record_attention(micros(t0, Clock::now()));
}

void DecodeEngine::record_attention(double cpu_us) noexcept {
  last_.attended = backend().last_stats();
  if (!offload_) {
    last_.attend_us = cpu_us;
    return;
  }
  const OffloadStats& o = offload_->last_step();
  last_.transfer_us = o.transfer_us;
  last_.plan_us = o.plan_us;
  last_.attend_us = o.attend_us;
  last_.h2d_bytes = o.bytes_h2d;
  last_.row_h2d_bytes = o.row_bytes_h2d;
  last_.rows_equivalent_bytes = o.rows_equivalent_bytes;
  last_.cache_hits = o.hits;
  last_.cache_misses = o.misses;
}

void DecodeEngine::select_part(const select::SelectCall& call) {
  const Clock::time_point t0 = Clock::now();
  selector_->prepare(call, selection_);
  selector_->select(call, selection_);
  last_.select_us += micros(t0, Clock::now());
  last_.pairs += selection_.n_pairs;
  last_.pages_chosen += selection_.pages_chosen();
  last_.index_bytes_read += selection_.index_bytes_read;
  last_.kept_estimate_sum += selection_.kept_estimate_sum();
  last_.dropped_bound = select::worse_bound(last_.dropped_bound, selection_.worst_dropped_bound());
}

void DecodeEngine::attend_selected(const AttendCall& call, bool whole_batch) {
  // The selector trusts its call (ids, layer, sizes): validated before it runs.
  cpu_.validate_sequences(cache_, call);
  if (offload_ && !whole_batch && selector_->policy().kind == select::Kind::dense) {
    // Every page, in the call's whole-cache form: a list of every page id would be written,
    // checked and translated for each layer, three passes over the context on the CPU between
    // two kernels of the device's step.
    last_ = LayerStepStats{};
    AttendCall every_page = call;
    every_page.pages = nullptr;
    every_page.rows = nullptr;
    run_attention(every_page);
    last_.pairs = uint64_t{call.n_seqs} * cache_.geometry().n_kv_heads;
    last_.pages_chosen = last_.attended.pages_read;
    last_.kept_estimate_sum = static_cast<double>(last_.pairs);  // all of every pair's mass
    return;
  }
  const uint32_t parts =
      offload_ && !whole_batch ? std::min(offload_->options().step_parts, call.n_seqs) : 1;
  if (parts > 1) {
    attend_in_parts(call);
    return;
  }
  last_ = LayerStepStats{};
  select_part(select::SelectCall{call.layer, call.n_seqs, call.seq_ids, call.q, latent_rows()});
  const PageLists lists = selection_.lists();
  const RowChunks rows = selection_.rows();
  const LatentRows latent = selection_.latent_rows();
  AttendCall selected = call;
  selected.pages = &lists;
  selected.rows = selection_.has_rows ? &rows : nullptr;
  selected.latent = selection_.latent ? &latent : nullptr;
  run_attention(selected);
}

void DecodeEngine::select(const AttendCall& call) {
  cpu_.validate_sequences(cache_, call);
  last_ = LayerStepStats{};
  select_part(select::SelectCall{call.layer, call.n_seqs, call.seq_ids, call.q});
}

void DecodeEngine::attend_in_parts(const AttendCall& call) {
  OffloadAttention& device = *offload_;
  const uint32_t parts = std::min(device.options().step_parts, call.n_seqs);
  const std::size_t q_row =
      std::size_t{cache_.geometry().n_query_heads()} * cache_.geometry().head_dim;
  last_ = LayerStepStats{};
  double part_select_us[OffloadAttention::kMaxParts] = {};
  device.begin();
  for (uint32_t p = 0, row0 = 0; p < parts; ++p) {
    const uint32_t rows = call.n_seqs / parts + (p < call.n_seqs % parts ? 1 : 0);
    AttendCall part = call;
    part.n_seqs = rows;
    part.seq_ids = call.seq_ids + row0;
    part.q = call.q + row0 * q_row;
    const double select_before = last_.select_us;
    try {
      select_part(select::SelectCall{call.layer, rows, part.seq_ids, part.q, latent_rows()});
      part_select_us[p] = last_.select_us - select_before;
      const PageLists lists = selection_.lists();
      const RowChunks chunk_rows = selection_.rows();
      const LatentRows latent = selection_.latent_rows();
      part.pages = &lists;
      part.rows = selection_.has_rows ? &chunk_rows : nullptr;
      part.latent = selection_.latent ? &latent : nullptr;
      device.validate(cache_, part);
      device.enqueue(cache_, part, row0);
    } catch (...) {
      // What is already enqueued reads buffers the backend owns: let it finish first.
      device.abort();
      throw;
    }
    row0 += rows;
  }
  device.finish(call);
  record_attention(0.0);
  // Part p - 1's kernel, enqueued last, runs while the CPU selects part p.
  for (uint32_t p = 1; p < parts; ++p)
    last_.overlap_us += std::min(part_select_us[p], device.part_attend_us(p - 1));
}

}  // namespace kvsift
