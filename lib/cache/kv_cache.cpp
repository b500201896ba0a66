#include "lib/cache/kv_cache.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>

#include "lib/core/error.hpp"
#include "lib/core/finite.hpp"
#include "simd/page_rows.hpp"

namespace kvsift {

namespace {

const CacheGeometry& validated(const CacheGeometry& geometry) {
  geometry.validate();
  return geometry;
}

}  // namespace

KvCache::KvCache(const CacheGeometry& geometry, const CacheOptions& options,
                 const simd::Kernels& kernels)
    : geometry_(validated(geometry)),
      kernels_(&kernels),
      pool_(geometry.slot_bytes(), options.max_pages, options.pinned),
      key_form_(options.key_form) {
  if (key_form_ == KeyForm::pre_rope) rope_.emplace(options.rope_theta, geometry_.head_dim);
}

int32_t KvCache::create_sequence() {
  Sequence fresh;
  fresh.tokens.assign(geometry_.n_layers, 0);
  fresh.tables.resize(std::size_t{geometry_.n_layers} * geometry_.n_kv_heads);
  fresh.released.assign(geometry_.n_layers, {0, 0});
  auto hole = std::find_if(sequences_.begin(), sequences_.end(),
                           [](const std::optional<Sequence>& s) { return !s.has_value(); });
  int32_t id;
  if (hole != sequences_.end()) {
    id = static_cast<int32_t>(hole - sequences_.begin());
    *hole = std::move(fresh);
  } else {
    if (sequences_.size() >= static_cast<std::size_t>(std::numeric_limits<int32_t>::max()))
      fail(Status::capacity_exceeded, "too many sequences");
    id = static_cast<int32_t>(sequences_.size());
    sequences_.emplace_back(std::move(fresh));
  }
  ++n_live_;
  return id;
}

bool KvCache::has_sequence(int32_t seq_id) const noexcept {
  return seq_id >= 0 && static_cast<std::size_t>(seq_id) < sequences_.size() &&
         sequences_[static_cast<std::size_t>(seq_id)].has_value();
}

const KvCache::Sequence& KvCache::sequence(int32_t seq_id) const {
  if (!has_sequence(seq_id)) fail(Status::not_found, "seq_id=", seq_id, " is not a live sequence");
  return *sequences_[static_cast<std::size_t>(seq_id)];
}

void KvCache::check_layer(uint32_t layer) const {
  require(layer < geometry_.n_layers, "layer=", layer,
          " is out of range (n_layers=", geometry_.n_layers, ")");
}

void KvCache::free_sequence(int32_t seq_id) {
  const Sequence& seq = sequence(seq_id);
  for (SealListener* listener : listeners_) listener->on_sequence_freed(seq_id);
  for (const auto& table : seq.tables)
    for (uint32_t slot : table)
      if (slot != kReleasedSlot) pool_.release(slot);
  sequences_[static_cast<std::size_t>(seq_id)].reset();
  --n_live_;
}

uint64_t KvCache::length(int32_t seq_id, uint32_t layer) const {
  const Sequence& seq = sequence(seq_id);
  check_layer(layer);
  return seq.tokens[layer];
}

uint64_t KvCache::length_unchecked(int32_t seq_id, uint32_t layer) const noexcept {
  return sequences_[static_cast<std::size_t>(seq_id)]->tokens[layer];
}

const uint32_t* KvCache::page_table(int32_t seq_id, uint32_t layer,
                                    uint32_t kv_head) const noexcept {
  return sequences_[static_cast<std::size_t>(seq_id)]
      ->tables[std::size_t{layer} * geometry_.n_kv_heads + kv_head]
      .data();
}

void KvCache::append(int32_t seq_id, uint32_t layer, uint32_t n_tokens, const float* k,
                     const float* v, KeyForm k_form) {
  sequence(seq_id);
  check_layer(layer);
  require(n_tokens > 0, "n_tokens must be > 0");
  require(k != nullptr, "k is NULL");
  require(v != nullptr, "v is NULL");
  require(k_form == KeyForm::post_rope || rope_,
          "keys before RoPE need a cache created for them (key form pre_rope)");
  Sequence& seq = *sequences_[static_cast<std::size_t>(seq_id)];
  const uint32_t B = geometry_.page_tokens, H = geometry_.n_kv_heads, d = geometry_.head_dim;
  const uint64_t before = seq.tokens[layer];
  const uint64_t after = before + n_tokens;
  const uint64_t new_pages_per_head = geometry_.pages_for(after) - geometry_.pages_for(before);
  if (geometry_.pages_for(after) > kMaxPages)
    fail(Status::capacity_exceeded, "sequence ", seq_id, " would exceed ", kMaxPages, " pages");

  // Everything that can fail happens before the first change; the sizes first, so that the
  // buffers are read only for an append the pool can take.
  pool_.reserve(new_pages_per_head * H, "append");
  require_finite(k, std::size_t{n_tokens} * H * d, "k");
  require_finite(v, std::size_t{n_tokens} * H * d, "v");
  for (uint32_t h = 0; h < H; ++h)
    seq.tables[std::size_t{layer} * H + h].reserve(geometry_.pages_for(after));
  // Whatever form came in, read_tokens may rotate the stored keys back: the table covers them.
  if (rope_) rope_->reserve(after);
  if (k_form == KeyForm::pre_rope) {
    const std::size_t elems = std::size_t{n_tokens} * H * d;
    try {
      if (rotated_.size() < elems) rotated_.resize(elems);
    } catch (const std::bad_alloc&) {
      fail(Status::out_of_memory, "append: rotated keys of ", n_tokens, " tokens");
    }
    std::copy_n(k, elems, rotated_.data());
    for (uint32_t t = 0; t < n_tokens; ++t)
      rope_->rotate(rotated_.data() + std::size_t{t} * H * d, H, before + t);
    k = rotated_.data();
  }

  const simd::PageLayout layout = geometry_.layout();
  for (uint32_t h = 0; h < H; ++h) {
    auto& table = seq.tables[std::size_t{layer} * H + h];
    for (uint64_t i = 0; i < new_pages_per_head; ++i) table.push_back(pool_.acquire());
    for (uint64_t pos = before; pos < after; ++pos) {
      const std::size_t row = static_cast<std::size_t>(pos - before) * H + h;
      std::byte* slot = pool_.slot(table[pos / B]);
      const auto t = static_cast<uint32_t>(pos % B);
      simd::store_rows(*kernels_, layout, slot, simd::SlotPart::key, t, 1, k + row * d, d);
      simd::store_rows(*kernels_, layout, slot, simd::SlotPart::value, t, 1, v + row * d, d);
    }
  }
  seq.tokens[layer] = after;

  notify_sealed(seq_id, layer, before / B, after / B);
}

void KvCache::notify_sealed(int32_t seq_id, uint32_t layer, uint64_t first_page,
                            uint64_t end_page) const {
  const Sequence& seq = *sequences_[static_cast<std::size_t>(seq_id)];
  const uint32_t H = geometry_.n_kv_heads;
  for (uint64_t page = first_page; page < end_page; ++page) {
    for (uint32_t h = 0; h < H; ++h) {
      const std::byte* slot = pool_.slot(seq.tables[std::size_t{layer} * H + h][page]);
      const SealedPage sealed{seq_id, layer, h, static_cast<uint32_t>(page), slot};
      for (SealListener* listener : listeners_) listener->on_page_sealed(sealed);
    }
  }
}

int32_t KvCache::fork_sequence(int32_t src) {
  uint64_t pages = 0;
  for (const auto& table : sequence(src).tables) pages += table.size();
  for (const auto& [first, end] : sequence(src).released)
    if (end > first)
      fail(Status::unsupported, "sequence ", src,
           " has released (compressed) pages: fork it before it is compressed");
  pool_.reserve(pages, "fork_sequence");
  const int32_t id = create_sequence();  // may move sequences_: look src up again below
  const Sequence& from = *sequences_[static_cast<std::size_t>(src)];
  Sequence& to = *sequences_[static_cast<std::size_t>(id)];
  to.tokens = from.tokens;
  for (std::size_t t = 0; t < from.tables.size(); ++t) {
    to.tables[t].reserve(from.tables[t].capacity());
    for (uint32_t slot : from.tables[t]) {
      const uint32_t copy = pool_.acquire();
      std::memcpy(pool_.slot(copy), pool_.slot(slot), geometry_.slot_bytes());
      to.tables[t].push_back(copy);
    }
  }
  for (uint32_t layer = 0; layer < geometry_.n_layers; ++layer)
    notify_sealed(id, layer, 0, to.tokens[layer] / geometry_.page_tokens);
  return id;
}

void KvCache::read_tokens(int32_t seq_id, uint32_t layer, uint32_t kv_head, uint64_t first,
                          uint64_t n, float* k_out, float* v_out, KeyForm form) const {
  const Sequence& seq = sequence(seq_id);
  check_layer(layer);
  require(kv_head < geometry_.n_kv_heads, "kv_head=", kv_head,
          " is out of range (n_kv_heads=", geometry_.n_kv_heads, ")");
  const uint64_t stored = seq.tokens[layer];
  require(first <= stored && n <= stored - first, "first=", first, ", n_tokens=", n,
          ": the range is beyond the ", stored, " tokens stored");
  const auto [released_first, released_end] = seq.released[layer];
  require(n == 0 || first + n <= released_first * geometry_.page_tokens ||
              first >= released_end * geometry_.page_tokens,
          "tokens [", first, ", ", first + n, ") overlap the released pages [", released_first,
          ", ", released_end, ") of sequence ", seq_id, " layer ", layer);
  require(form == KeyForm::post_rope || rope_,
          "pre-RoPE keys can be read back only from a cache that takes pre-RoPE keys");
  const uint32_t B = geometry_.page_tokens, d = geometry_.head_dim;
  const auto& table = seq.tables[std::size_t{layer} * geometry_.n_kv_heads + kv_head];
  const simd::PageLayout layout = geometry_.layout();
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t pos = first + i;
    const std::byte* slot = pool_.slot(table[pos / B]);
    const auto t = static_cast<uint32_t>(pos % B);
    if (k_out) {
      simd::load_rows(*kernels_, layout, slot, simd::SlotPart::key, t, 1, k_out + i * d);
      if (form == KeyForm::pre_rope) rope_->unrotate(k_out + i * d, 1, pos);
    }
    if (v_out) simd::load_rows(*kernels_, layout, slot, simd::SlotPart::value, t, 1, v_out + i * d);
  }
}

void KvCache::release_pages(int32_t seq_id, uint32_t layer, uint64_t first_page,
                            uint64_t end_page) {
  sequence(seq_id);
  check_layer(layer);
  Sequence& seq = *sequences_[static_cast<std::size_t>(seq_id)];
  const uint64_t sealed = seq.tokens[layer] / geometry_.page_tokens;
  require(first_page < end_page && end_page <= sealed, "release_pages [", first_page, ", ",
          end_page, ") is not a non-empty range of the ", sealed, " sealed pages");
  require(seq.released[layer].second == seq.released[layer].first, "sequence ", seq_id, " layer ",
          layer, " already released pages");
  for (SealListener* listener : listeners_)
    listener->on_pages_released(seq_id, layer, first_page, end_page);
  const uint32_t H = geometry_.n_kv_heads;
  for (uint32_t h = 0; h < H; ++h) {
    auto& table = seq.tables[std::size_t{layer} * H + h];
    for (uint64_t p = first_page; p < end_page; ++p) {
      pool_.release(table[p]);
      table[p] = kReleasedSlot;
    }
  }
  seq.released[layer] = {first_page, end_page};
}

bool KvCache::page_readable(int32_t seq_id, uint32_t layer, uint64_t page) const noexcept {
  const Sequence& seq = *sequences_[static_cast<std::size_t>(seq_id)];
  const auto [released_first, released_end] = seq.released[layer];
  return page < geometry_.pages_for(seq.tokens[layer]) &&
         (page < released_first || page >= released_end);
}

bool KvCache::all_pages_readable(int32_t seq_id, uint32_t layer) const noexcept {
  const auto [first, end] = sequences_[static_cast<std::size_t>(seq_id)]->released[layer];
  return first == end;
}

bool KvCache::has_released_pages() const noexcept {
  for (const auto& seq : sequences_)
    if (seq)
      for (const auto& [first, end] : seq->released)
        if (end > first) return true;
  return false;
}

void KvCache::add_seal_listener(SealListener* listener) {
  require(listener != nullptr, "listener is NULL");
  listeners_.push_back(listener);
}

void KvCache::remove_seal_listener(SealListener* listener) noexcept {
  std::erase(listeners_, listener);
}

}  // namespace kvsift
