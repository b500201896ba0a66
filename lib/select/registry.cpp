#include "lib/select/registry.hpp"

#include <string>

#include "lib/select/selector.hpp"

namespace kvsift::select {

// Each method's file defines its factory.
#define KVSIFT_SELECTOR_FACTORY(kind, c_name, level, description)                   \
  std::unique_ptr<Selector> make_##kind##_selector(                                 \
      const Policy& policy, KvCache& cache, uint32_t max_batch, uint64_t max_pages, \
      ThreadPool& pool, const simd::Kernels& kernels);
KVSIFT_SELECTORS(KVSIFT_SELECTOR_FACTORY)
#undef KVSIFT_SELECTOR_FACTORY

namespace {

constexpr SelectorInfo kSelectors[] = {
#define KVSIFT_SELECTOR_INFO(kind, c_name, level, description) \
  {Kind::kind, #kind, Level::level, &make_##kind##_selector, description},
    KVSIFT_SELECTORS(KVSIFT_SELECTOR_INFO)
#undef KVSIFT_SELECTOR_INFO
};

constexpr bool in_kind_order() {
  for (std::size_t i = 0; i < std::size(kSelectors); ++i)
    if (static_cast<std::size_t>(kSelectors[i].kind) != i) return false;
  return true;
}
static_assert(std::size(kSelectors) == static_cast<std::size_t>(Kind::count),
              "the table covers every Kind");
static_assert(in_kind_order(), "selector_info indexes the table by Kind");

}  // namespace

std::span<const SelectorInfo> selectors() noexcept {
  return kSelectors;
}

const SelectorInfo& selector_info(Kind kind) noexcept {
  return kSelectors[static_cast<std::size_t>(kind)];
}

const SelectorInfo* find_selector(std::string_view name) noexcept {
  for (const SelectorInfo& info : kSelectors)
    if (info.name == name) return &info;
  return nullptr;
}

std::string_view selector_names() {
  static const std::string names = [] {
    std::string s;
    for (const SelectorInfo& info : kSelectors)
      s += (s.empty() ? "" : ", ") + std::string(info.name);
    return s;
  }();
  return names;
}

std::string_view kind_name(Kind kind) noexcept {
  return known(kind) ? selector_info(kind).name : "?";
}

}  // namespace kvsift::select
