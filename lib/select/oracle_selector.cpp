#include <memory>

#include "lib/select/page_selector.hpp"

namespace kvsift::select {

namespace {

// Exact page log-sum-exp from every key: the ceiling of any budgeted top-b page selector.
class OracleSelector final : public PageSelector {
 public:
  using PageSelector::PageSelector;
  uint64_t score(const PairView& pair, Scratch& s) const noexcept override {
    uint64_t bytes = 0;
    const auto sealed = static_cast<uint32_t>(pair.tokens / geometry().page_tokens);
    for (uint32_t p = 0; p < sealed; ++p) bytes += exact_page_lse(pair, p, s);
    return bytes;
  }
};

}  // namespace

std::unique_ptr<Selector> make_oracle_selector(const Policy& policy, KvCache& cache,
                                               uint32_t max_batch, uint64_t max_pages,
                                               ThreadPool& pool, const simd::Kernels& kernels) {
  return std::make_unique<OracleSelector>(policy, cache, max_batch, max_pages, pool, kernels);
}

}  // namespace kvsift::select
