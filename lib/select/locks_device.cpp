#include "lib/select/locks_device.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "lib/core/error.hpp"
#include "simd/page_rows.hpp"

namespace kvsift::select {

static_assert(static_cast<int>(gpu::LocksCombine::share_avg) ==
                  static_cast<int>(GqaCombine::share_avg) &&
              static_cast<int>(gpu::LocksCombine::nrm) == static_cast<int>(GqaCombine::nrm) &&
              static_cast<int>(gpu::LocksCombine::max) == static_cast<int>(GqaCombine::max));

LocksDevice::LocksDevice(const Policy& policy, KvCache& cache, uint32_t max_batch,
                         uint64_t max_pages, uint32_t rank, GqaCombine combine, float scale,
                         const simd::Kernels& kernels)
    : cache_(cache), policy_(policy), kernels_(kernels) {
  require(policy.kind != Kind::locks_certified,
          "policy.device: certified LOCKS selection runs on the CPU only");
  require(policy.locks.int8_query, "policy.device: the device scores int8 queries only");
  const CacheGeometry& g = cache.geometry();
  gpu::LocksScorerShape shape;
  shape.head_dim = g.head_dim;
  shape.page_tokens = g.page_tokens;
  shape.rank = rank;
  shape.group = g.group_size;
  // The open pages' keys travel in a 16-bit dtype: a q8 cache's as fp16 (see open_keys()).
  shape.dtype = g.row_dtype();
  shape.combine = static_cast<gpu::LocksCombine>(combine);
  shape.scale = scale;
  const uint64_t slots = cache.pool().capacity();
  shape.slots = static_cast<uint32_t>(slots);
  shape.max_pairs = max_batch * g.n_kv_heads;
  shape.max_pages = std::min<uint64_t>(uint64_t{shape.max_pairs} * max_pages, slots);
  shape.sink_pages = policy.sink_pages;
  shape.window_pages = policy.window_pages;
  // The device keeps every layer's tables of a full batch (a run then sends only the slots of
  // pages sealed since the last), within twice the pool's slots of entries.
  shape.max_pair_pages = max_pages;
  shape.table_copies = static_cast<uint32_t>(std::min<uint64_t>(
      uint64_t{g.n_layers} * shape.max_pairs, 2 * slots / std::max<uint64_t>(max_pages, 1)));
  gpu::check(scorer_.init(policy.device, shape), "the locks device scorer on device ",
             policy.device, ": ");
  upload_slots_.resize(slots);
  upload_marked_.assign(slots, 0);
  pairs_.resize(shape.max_pairs);
  if (g.dtype == simd::Dtype::q8) {
    open_keys_.resize(std::size_t{shape.max_pairs} * g.page_elems());
    open_rows_.resize(g.page_elems());
  }
}

const uint16_t* LocksDevice::open_keys(uint32_t i, uint32_t slot, uint32_t open) noexcept {
  const CacheGeometry& g = cache_.geometry();
  const std::byte* page = cache_.pool().slot(slot);
  if (g.dtype != simd::Dtype::q8) return g.layout().key(page);
  // fp16 holds a dequantized q8 value to within 2^-11 of itself; the open page feeds only the
  // kept-mass estimate.
  uint16_t* out = open_keys_.data() + std::size_t{i} * g.page_elems();
  simd::load_rows(kernels_, g.layout(), page, simd::SlotPart::key, 0, open, open_rows_.data());
  kernels_.encode(open_rows_.data(), out, std::size_t{open} * g.head_dim, g.row_dtype());
  return out;
}

void LocksDevice::summaries_built(const uint32_t* slots, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) {
    if (upload_marked_[slots[i]]) continue;
    upload_marked_[slots[i]] = 1;
    upload_slots_[n_upload_++] = slots[i];  // room for every slot: each is listed once
  }
}

void LocksDevice::reserve_names(const SelectCall& call) {
  for (uint32_t i = 0; i < call.n_seqs; ++i)
    if (call.seq_ids[i] >= 0 && static_cast<std::size_t>(call.seq_ids[i]) >= table_names_.size())
      table_names_.resize(static_cast<std::size_t>(call.seq_ids[i]) + 1, 0);
}

bool LocksDevice::upload_pending(const std::byte* records) noexcept {
  if (n_upload_ == 0) return true;
  if (!scorer_.upload(records, upload_slots_.data(), n_upload_).ok) return false;
  for (std::size_t i = 0; i < n_upload_; ++i) upload_marked_[upload_slots_[i]] = 0;
  n_upload_ = 0;
  return true;
}

uint64_t LocksDevice::table_name(int32_t seq) noexcept {
  const auto at = static_cast<std::size_t>(seq);
  if (at >= table_names_.size()) return 0;
  if (table_names_[at] == 0) {
    const CacheGeometry& g = cache_.geometry();
    table_names_[at] = next_table_name_;
    next_table_name_ += uint64_t{g.n_layers} * g.n_kv_heads;
  }
  return table_names_[at];
}

void LocksDevice::rename_tables(int32_t seq) noexcept {
  if (static_cast<std::size_t>(seq) < table_names_.size()) table_names_[seq] = 0;
}

bool LocksDevice::select(const SelectCall& call, const std::byte* records,
                         std::size_t summary_bytes, Selection& out) noexcept {
  if (!upload_pending(records)) {
    ++fallbacks_;
    return false;
  }
  const CacheGeometry& g = cache_.geometry();
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
        open == 0 ? nullptr : open_keys(i, pair.table[sealed], static_cast<uint32_t>(open));
    // What the CPU path reports: the summaries and the open page's keys of the scored pairs.
    if (!gpu::locks_pair_plan(scorer_.shape(), pair.tokens, pair.budget_tokens).whole)
      bytes += sealed * summary_bytes + open * g.layout().key_bytes();
  }
  if (!scorer_.validate(pairs_.data(), n_pairs).ok || !scorer_.run(pairs_.data(), n_pairs).ok) {
    ++fallbacks_;
    return false;
  }
  const uint32_t* offsets = scorer_.offsets();
  const uint32_t total = offsets[n_pairs];
  out.n_pairs = n_pairs;
  std::copy_n(offsets, n_pairs + 1, out.offsets.data());
  std::copy_n(scorer_.page_ids(), total, out.page_ids.data());
  std::copy_n(scorer_.scores(), total, out.scores.data());
  std::copy_n(scorer_.kept_estimate(), n_pairs, out.kept_estimate.data());
  std::fill_n(out.dropped_bound.data(), n_pairs, std::numeric_limits<float>::quiet_NaN());
  out.index_bytes_read = bytes;
  return true;
}

}  // namespace kvsift::select
