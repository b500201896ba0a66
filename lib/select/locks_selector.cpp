// LOCKS (docs/methods.md): page-local rank-r summaries, int4 basis, int8 coefficients and
// centroid, built when a page seals; a page scores the log-sum-exp of its reconstructed logits.
// locks_certified also keeps each page's largest key norm, and bounds each page's log-mass by the
// score +- scale |q| (residual + float margin * key norm), scoring with the exact query.
//
// Device mode (policy.device >= 0): lib/select/locks_device.hpp mirrors the records on the device
// and selects there; should it fail, the step runs here on the CPU.
#include <algorithm>
#include <cstring>
#include <memory>

#include "lib/select/locks_device.hpp"
#include "lib/select/locks_summary.hpp"
#include "lib/select/page_selector.hpp"

namespace kvsift::select {

namespace {

class LocksSelector final : public PageSelector {
 public:
  LocksSelector(const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages,
                ThreadPool& pool, const simd::Kernels& kernels)
      : PageSelector(policy, cache, max_batch, max_pages, pool, kernels),
        shape_{cache.geometry().head_dim, cache.geometry().page_tokens, kLocksDefaultRank},
        record_bytes_(locks_record_bytes(shape_)),
        records_(cache.pool().capacity() * record_bytes_, /*huge_pages=*/true),
        key_norms_(certified() ? cache.pool().capacity() : 0, /*huge_pages=*/true) {
    locks_check_shape(shape_);
    if (policy.device >= 0)
      device_ = std::make_unique<LocksDevice>(policy, cache, max_batch, max_pages, shape_.rank,
                                              combine_mode(), scale_, kernels);
  }

  std::size_t summary_bytes_per_page() const noexcept override {
    // The paper's bytes; certified selection adds the residual bound and the key norm.
    return locks_paper_bytes(shape_) + (certified() ? 2 * sizeof(float) : 0);
  }

  uint64_t device_fallbacks() const noexcept override { return device_ ? device_->fallbacks() : 0; }
  uint64_t device_bytes() const noexcept override { return device_ ? device_->device_bytes() : 0; }

  void prepare(const SelectCall& call, Selection&) override {
    if (!device_) return;
    device_->reserve_names(call);
    // A failed upload stays pending: select() tries again, and falls back to the CPU.
    build_summaries();
    device_->upload_pending(records_.data());
  }

  void select(const SelectCall& call, Selection& out) noexcept override {
    if (device_) {
      build_summaries();
      if (device_->select(call, records_.data(), summary_bytes_per_page(), out)) return;
    }
    PageSelector::select(call, out);
  }

  void on_sequence_freed(int32_t seq_id) noexcept override {
    PageSelector::on_sequence_freed(seq_id);
    if (device_) device_->rename_tables(seq_id);
  }
  void on_pages_released(int32_t seq_id, uint32_t, uint64_t, uint64_t) noexcept override {
    if (device_) device_->rename_tables(seq_id);
  }

 protected:
  bool summarises() const noexcept override { return true; }
  bool certified() const noexcept override { return policy_.kind == Kind::locks_certified; }

  void summaries_built(const uint32_t* slots, std::size_t n) noexcept override {
    if (device_) device_->summaries_built(slots, n);
  }

  void summarise(uint32_t slot, const float* keys) noexcept override {
    locks_build(shape_, keys, records_.data() + std::size_t{slot} * record_bytes_);
    if (!certified()) return;
    const uint32_t B = shape_.page_tokens, d = shape_.head_dim;
    float most = 0.0f;
    for (uint32_t t = 0; t < B; ++t) most = std::max(most, l2_norm(keys + std::size_t{t} * d, d));
    key_norms_[slot] = most;
  }

  uint64_t score(const PairView& pair, Scratch& s) const noexcept override {
    const CacheGeometry& g = geometry();
    const uint32_t G = g.group_size, d = g.head_dim;
    const auto sealed = static_cast<uint32_t>(pair.tokens / g.page_tokens);
    simd::LocksScoreJob job;
    job.q = pair.q;
    job.group = G;
    job.head_dim = d;
    job.page_tokens = shape_.page_tokens;
    job.rank = shape_.rank;
    job.int8_query = policy_.locks.int8_query && !certified();  // a bound needs the exact query
    job.scale = scale_;
    job.records = records_.data();
    job.record_bytes = record_bytes_;
    job.slots = pair.table;
    job.count = sealed;
    job.lse = s.slack.data();  // [G, sealed], spread into s.head's rows below
    kernels_.locks_score(job);
    for (uint32_t h = G; h-- > 0;)  // backwards: row h moves to h * max_pages_ >= h * sealed
      std::memmove(s.head.data() + h * max_pages_, s.slack.data() + std::size_t{h} * sealed,
                   sealed * sizeof(float));
    if (certified()) {
      for (uint32_t h = 0; h < G; ++h) {
        const float q_norm = l2_norm(pair.q + std::size_t{h} * d, d);
        for (uint32_t p = 0; p < sealed; ++p) {
          const uint32_t slot = pair.table[p];
          const float residual =
              locks_residual_bound(shape_, records_.data() + std::size_t{slot} * record_bytes_);
          s.slack[h * max_pages_ + p] =
              scale_ * q_norm * (residual + kFloatMargin * key_norms_[slot]);
        }
      }
    }
    return uint64_t{sealed} * summary_bytes_per_page();
  }

 private:
  LocksShape shape_;
  std::size_t record_bytes_;
  LazyArray<std::byte> records_;         // [pool slots, record_bytes_]
  LazyArray<float> key_norms_;           // [pool slots] certified: the page's largest key norm
  std::unique_ptr<LocksDevice> device_;  // device mode only
};

}  // namespace

std::unique_ptr<Selector> make_locks_selector(const Policy& policy, KvCache& cache,
                                              uint32_t max_batch, uint64_t max_pages,
                                              ThreadPool& pool, const simd::Kernels& kernels) {
  return std::make_unique<LocksSelector>(policy, cache, max_batch, max_pages, pool, kernels);
}

std::unique_ptr<Selector> make_locks_certified_selector(const Policy& policy, KvCache& cache,
                                                        uint32_t max_batch, uint64_t max_pages,
                                                        ThreadPool& pool,
                                                        const simd::Kernels& kernels) {
  return std::make_unique<LocksSelector>(policy, cache, max_batch, max_pages, pool, kernels);
}

}  // namespace kvsift::select
