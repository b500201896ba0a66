#include <memory>

#include "lib/select/page_selector.hpp"

namespace kvsift::select {

namespace {

// Every page, every step: exact attention.
class DenseSelector final : public PageSelector {
 public:
  using PageSelector::PageSelector;
  bool selects_everything() const noexcept override { return true; }
  uint64_t score(const PairView&, Scratch&) const noexcept override { return 0; }
};

}  // namespace

std::unique_ptr<Selector> make_dense_selector(const Policy& policy, KvCache& cache,
                                              uint32_t max_batch, uint64_t max_pages,
                                              ThreadPool& pool, const simd::Kernels& kernels) {
  return std::make_unique<DenseSelector>(policy, cache, max_batch, max_pages, pool, kernels);
}

}  // namespace kvsift::select
