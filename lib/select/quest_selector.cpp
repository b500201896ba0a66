#include <algorithm>
#include <memory>

#include "lib/select/page_selector.hpp"
#include "simd/half.hpp"

namespace kvsift::select {

namespace {

// Quest: per-page channel-wise min and max of the keys (stored values, so exact in the storage
// dtype); a page's score is the upper bound sum_c max(q_c min_c, q_c max_c) on its logits.
class QuestSelector final : public PageSelector {
 public:
  QuestSelector(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
                ThreadPool& pool, const simd::Kernels& kernels)
      : PageSelector(policy, cache, max_batch, max_pages, pool, kernels),
        bounds_(cache.pool().capacity() * 2 * cache.geometry().head_dim, /*huge_pages=*/true) {}

  std::size_t summary_bytes_per_page() const noexcept override {
    return 2 * std::size_t{geometry().head_dim} * sizeof(uint16_t);
  }

 protected:
  bool summarises() const noexcept override { return true; }
  bool scores_are_log_mass() const noexcept override { return false; }
  // A page bound for the group is the largest of its heads' bounds; averaging or summing
  // exponentiated bounds as if they were masses lost the needle on every generated task
  // (kvsift-eval, 2K and 4K: 0 of 4 at every budget with share_avg).
  GqaCombine combine_mode() const noexcept override { return GqaCombine::max; }

  // The bounds are stored in geometry().row_dtype(): for a 16-bit cache a stored key value
  // itself (exact); for q8 the dequantized value rounded outward to fp16 (widen below), so that
  // they still bound every key of the page.
  void summarise(uint32_t slot, const float* keys) noexcept override {
    const CacheGeometry& g = geometry();
    const uint32_t B = g.page_tokens, d = g.head_dim;
    float bounds[2 * 256];  // min then max, head_dim at most each
    for (uint32_t c = 0; c < d; ++c) {
      float lo = keys[c], hi = keys[c];
      for (uint32_t t = 1; t < B; ++t) {
        lo = std::min(lo, keys[t * d + c]);
        hi = std::max(hi, keys[t * d + c]);
      }
      bounds[c] = lo;
      bounds[d + c] = hi;
    }
    uint16_t* stored = bounds_.data() + std::size_t{slot} * 2 * d;
    kernels_.encode(bounds, stored, 2 * std::size_t{d}, g.row_dtype());
    if (g.dtype == simd::Dtype::q8)
      for (uint32_t i = 0; i < 2 * d; ++i) stored[i] = widen(stored[i], bounds[i], i >= d);
  }

  // fp16 bits h, the nearest fp16 to x, moved one step outward (up for a max, down for a min)
  // when rounding went inward. A step away from zero grows the magnitude bits (to inf past the
  // largest finite value), a step toward zero shrinks them, through zero to the smallest
  // subnormal of the other sign.
  static uint16_t widen(uint16_t h, float x, bool up) noexcept {
    const float back = simd::f16_to_f32(h);
    if (up ? back >= x : back <= x) return h;
    const bool negative = (h & 0x8000u) != 0;
    if (up != negative) return static_cast<uint16_t>(h + 1);
    if ((h & 0x7fffu) == 0) return up ? uint16_t{0x0001} : uint16_t{0x8001};
    return static_cast<uint16_t>(h - 1);
  }

  uint64_t score(const PairView& pair, Scratch& s) const noexcept override {
    const CacheGeometry& g = geometry();
    const uint32_t d = g.head_dim, G = g.group_size;
    const auto sealed = static_cast<uint32_t>(pair.tokens / g.page_tokens);
    for (uint32_t p = 0; p < sealed; ++p) {
      kernels_.decode(bounds_.data() + std::size_t{pair.table[p]} * 2 * d, s.keys.data(),
                      2 * std::size_t{d}, g.row_dtype());
      const float* lo = s.keys.data();
      const float* hi = lo + d;
      for (uint32_t h = 0; h < G; ++h) {
        const float* q = pair.q + std::size_t{h} * d;
        float bound = 0.0f;
        for (uint32_t c = 0; c < d; ++c) bound += std::max(q[c] * lo[c], q[c] * hi[c]);
        s.head[h * max_pages_ + p] = bound * scale_;
      }
    }
    return uint64_t{sealed} * summary_bytes_per_page();
  }

 private:
  LazyArray<uint16_t> bounds_;  // [pool slots, 2, head_dim]: min then max, in row_dtype()
};

}  // namespace

std::unique_ptr<Selector> make_quest_selector(const Policy& policy, KvCache& cache,
                                              uint32_t max_batch, uint64_t max_pages,
                                              ThreadPool& pool, const simd::Kernels& kernels) {
  return std::make_unique<QuestSelector>(policy, cache, max_batch, max_pages, pool, kernels);
}

}  // namespace kvsift::select
