#include <algorithm>
#include <memory>

#include "lib/select/page_selector.hpp"

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

  void summarise(uint32_t slot, const uint16_t* k) noexcept override {
    const CacheGeometry& g = geometry();
    const uint32_t B = g.page_tokens, d = g.head_dim;
    float keys[64 * 256];  // page_tokens * head_dim at most
    kernels_.decode(k, keys, std::size_t{B} * d, g.dtype);
    uint16_t* lo = bounds_.data() + std::size_t{slot} * 2 * d;
    uint16_t* hi = lo + d;
    for (uint32_t c = 0; c < d; ++c) {
      uint32_t arg_lo = 0, arg_hi = 0;
      for (uint32_t t = 1; t < B; ++t) {
        if (keys[t * d + c] < keys[arg_lo * d + c]) arg_lo = t;
        if (keys[t * d + c] > keys[arg_hi * d + c]) arg_hi = t;
      }
      lo[c] = k[arg_lo * d + c];
      hi[c] = k[arg_hi * d + c];
    }
  }

  uint64_t score(const PairView& pair, Scratch& s) const noexcept override {
    const CacheGeometry& g = geometry();
    const uint32_t d = g.head_dim, G = g.group_size;
    const auto sealed = static_cast<uint32_t>(pair.tokens / g.page_tokens);
    for (uint32_t p = 0; p < sealed; ++p) {
      kernels_.decode(bounds_.data() + std::size_t{pair.table[p]} * 2 * d, s.keys.data(),
                      2 * std::size_t{d}, g.dtype);
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
  LazyArray<uint16_t> bounds_;  // [pool slots, 2, head_dim]: min then max
};

}  // namespace

std::unique_ptr<Selector> make_quest_selector(const Policy& policy, KvCache& cache,
                                              uint32_t max_batch, uint64_t max_pages,
                                              ThreadPool& pool, const simd::Kernels& kernels) {
  return std::make_unique<QuestSelector>(policy, cache, max_batch, max_pages, pool, kernels);
}

}  // namespace kvsift::select
