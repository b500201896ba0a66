// The paged host KV cache: a page pool, sequences with one page table per (layer, KV head),
// append, seal notifications and accounting. Layout: lib/cache/geometry.hpp.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "lib/cache/geometry.hpp"
#include "lib/cache/page_pool.hpp"
#include "lib/cache/rope.hpp"
#include "simd/kernels.hpp"

namespace kvsift {

// How append() receives keys: rotated by the engine already, or before RoPE, which the cache
// then applies at each token's position (its index in the sequence) with rope_theta.
enum class KeyForm : uint8_t { post_rope, pre_rope };

struct CacheOptions {
  uint64_t max_pages = 65536;
  KeyForm key_form = KeyForm::post_rope;
  float rope_theta = 10000.0f;  // pre_rope only
  bool pinned = false;
};

// A page that just filled up; passed to SealListener while its K/V are final.
struct SealedPage {
  int32_t seq_id;
  uint32_t layer;
  uint32_t kv_head;
  uint32_t page;          // logical page index within the (sequence, layer, KV head)
  const std::byte* slot;  // the page's pool slot (simd/page_layout.hpp; read through
                          // simd/page_rows.hpp)
};

// Told when pages seal (selectors build their per-page data then, off the decode path), when a
// sequence is freed and when pages are released. The last two give pool slots back for later
// appends to reuse, so a copy of those pages elsewhere (the offload path's device cache) goes
// stale; they are called before the slots go back, while the page tables still name them. Called
// synchronously from append / free_sequence / release_pages; must not throw.
class SealListener {
 public:
  virtual ~SealListener() = default;
  virtual void on_page_sealed(const SealedPage& page) noexcept = 0;
  virtual void on_sequence_freed(int32_t seq_id) noexcept = 0;
  // Pages [first_page, end_page) of every KV head of the layer.
  virtual void on_pages_released(int32_t /*seq_id*/, uint32_t /*layer*/, uint64_t /*first_page*/,
                                 uint64_t /*end_page*/) noexcept {}
};

class KvCache {
 public:
  // kernels: the table append and read_tokens convert with, the handle's
  // (lib/core/kernel_runtime.hpp); a static one. Throws Error (invalid_argument / unsupported /
  // out_of_memory).
  KvCache(const CacheGeometry& geometry, const CacheOptions& options, const simd::Kernels& kernels);

  int32_t create_sequence();
  // A new sequence holding a copy of src's pages (listeners see the full ones sealed). All or
  // nothing. Throws not_found, capacity_exceeded, out_of_memory.
  int32_t fork_sequence(int32_t src);
  void free_sequence(int32_t seq_id);  // throws not_found
  bool has_sequence(int32_t seq_id) const noexcept;
  uint32_t n_sequences() const noexcept { return n_live_; }
  // Every live id is below this bound (ids are reused after free_sequence).
  int32_t sequence_id_bound() const noexcept { return static_cast<int32_t>(sequences_.size()); }

  // Tokens stored in one layer of a sequence. Throws not_found / invalid_argument.
  uint64_t length(int32_t seq_id, uint32_t layer) const;

  // k, v: [n_tokens, n_kv_heads, head_dim] float32, k in the cache's key form. Stored keys are
  // always rotated. All or nothing. Throws not_found, invalid_argument, capacity_exceeded,
  // out_of_memory.
  void append(int32_t seq_id, uint32_t layer, uint32_t n_tokens, const float* k, const float* v) {
    append(seq_id, layer, n_tokens, k, v, key_form_);
  }
  // The same with k in the form given: a pre_rope cache also takes keys rotated elsewhere (K/V a
  // caller computed with another engine) and stores them as they are; a post_rope cache refuses
  // pre_rope keys (invalid_argument: it has no RoPE).
  void append(int32_t seq_id, uint32_t layer, uint32_t n_tokens, const float* k, const float* v,
              KeyForm k_form);

  // Stored tokens [first, first + n) of one (sequence, layer, KV head) as float32, [n, head_dim];
  // keys rotated (post_rope) or rotated back (pre_rope: needs a pre_rope cache). k_out or v_out
  // may be null.
  void read_tokens(int32_t seq_id, uint32_t layer, uint32_t kv_head, uint64_t first, uint64_t n,
                   float* k_out, float* v_out, KeyForm form = KeyForm::post_rope) const;

  // Returns the full pages [first_page, end_page) of every KV head of one layer of a sequence to
  // the pool: a compressing selector (S4R) holds their tokens in another form. The sequence keeps
  // its length; the released pages can no longer be read, attended or forked. One range per
  // (sequence, layer), released once. Throws not_found, invalid_argument.
  void release_pages(int32_t seq_id, uint32_t layer, uint64_t first_page, uint64_t end_page);
  // Whether page `page` of one layer of a sequence holds K/V that can be read: stored and not
  // released. Attention and the offload path ask this rather than knowing what a release is.
  // Callers validated seq_id and layer.
  bool page_readable(int32_t seq_id, uint32_t layer, uint64_t page) const noexcept;
  // Whether every stored page of one layer of a sequence can be read (none was released).
  bool all_pages_readable(int32_t seq_id, uint32_t layer) const noexcept;
  // Whether any live sequence has released pages (selectors that read pages refuse such caches).
  bool has_released_pages() const noexcept;

  // The listener must outlive the cache or be removed first.
  void add_seal_listener(SealListener* listener);
  void remove_seal_listener(SealListener* listener) noexcept;

  // Decode-path access; callers validated seq_id and layer. Entries of released pages are not
  // slots.
  const uint32_t* page_table(int32_t seq_id, uint32_t layer, uint32_t kv_head) const noexcept;
  uint64_t length_unchecked(int32_t seq_id, uint32_t layer) const noexcept;

  const CacheGeometry& geometry() const noexcept { return geometry_; }
  const PagePool& pool() const noexcept { return pool_; }
  KeyForm key_form() const noexcept { return key_form_; }
  // The cache's RoPE, covering every stored position; pre_rope caches only.
  const Rope& rope() const noexcept { return *rope_; }

 private:
  struct Sequence {
    std::vector<uint64_t> tokens;               // [n_layers]
    std::vector<std::vector<uint32_t>> tables;  // [n_layers * n_kv_heads] slot ids per page
    std::vector<std::pair<uint64_t, uint64_t>> released;  // [n_layers] page range given back
  };
  static constexpr uint32_t kReleasedSlot = UINT32_MAX;  // a table entry whose page was released
  const Sequence& sequence(int32_t seq_id) const;
  void check_layer(uint32_t layer) const;
  void notify_sealed(int32_t seq_id, uint32_t layer, uint64_t first_page, uint64_t end_page) const;

  CacheGeometry geometry_;
  const simd::Kernels* kernels_;
  PagePool pool_;
  std::vector<std::optional<Sequence>> sequences_;  // index = id; freed ids are reused
  uint32_t n_live_ = 0;
  std::vector<SealListener*> listeners_;
  KeyForm key_form_;
  std::optional<Rope> rope_;
  std::vector<float> rotated_;  // append's rotated keys (pre_rope), grown as needed
};

}  // namespace kvsift
