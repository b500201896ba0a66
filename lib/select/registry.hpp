// The one table of selectors, which everything reads: the C++ kinds, names and levels, the
// factories Selector::create calls, the C API's name lookup and enum range (lib/capi), and the
// apps' help strings (through kvsift_selector_name).
//
// Adding a selector: a file that defines make_<kind>_selector (the Factory below), one line in
// KVSIFT_SELECTORS, and its kvsift_selector value at the same position (include/kvsift/kvsift.h;
// lib/capi's static_asserts hold the two lists to each other).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

namespace kvsift {
class KvCache;
class ThreadPool;
namespace simd {
struct Kernels;
}  // namespace simd
}  // namespace kvsift

namespace kvsift::select {

// X(kind, C_NAME, level, description), in the C enum's order. kind: the name (kvsift_selector_name,
// the apps' --selector); C_NAME: its kvsift_selector is KVSIFT_SELECTOR_<C_NAME> (lib/capi checks
// the two agree); level: page (chooses pages only) or token (also single token rows).
#define KVSIFT_SELECTORS(X)                                                                        \
  X(dense, DENSE, page, "every stored token: exact attention")                                     \
  X(oracle, ORACLE, page, "exact page log-sum-exp from every key: the ceiling of top-b")           \
  X(quest, QUEST, page, "per-page channel min/max, q.k upper bound, top-b")                        \
  X(locks, LOCKS, page, "page-local rank-8 summaries, estimated page mass, top-b")                 \
  X(locks_certified, LOCKS_CERTIFIED, page, "LOCKS grown until the proven dropped mass < epsilon") \
  X(s4r, S4R, token, "the prompt compressed to low rank, its most relevant tokens reconstructed")  \
  X(louver, LOUVER, token, "exact range search: every token with q.k >= tau, tau from the budget") \
  /* a new selector: one line above this one */

enum class Kind : uint8_t {
#define KVSIFT_SELECTOR_KIND(kind, c_name, level, description) kind,
  KVSIFT_SELECTORS(KVSIFT_SELECTOR_KIND)
#undef KVSIFT_SELECTOR_KIND
      count  // not a selector: how many there are
};

enum class Level : uint8_t { page, token };

class Selector;
struct Policy;

// Makes the method's selector; Selector::create validates the policy first and registers it with
// the cache afterwards. Throws Error.
using Factory = std::unique_ptr<Selector> (*)(const Policy& policy, KvCache& cache,
                                              uint32_t max_batch, uint64_t max_pages,
                                              ThreadPool& pool, const simd::Kernels& kernels);

struct SelectorInfo {
  Kind kind;
  std::string_view name;  // a string literal: NUL-terminated
  Level level;
  Factory make;
  std::string_view description;
};

// Every selector, in Kind order.
std::span<const SelectorInfo> selectors() noexcept;
// Whether `kind` is one of them (a Kind may come from a cast of an unchecked integer).
inline bool known(Kind kind) noexcept {
  return static_cast<std::size_t>(kind) < static_cast<std::size_t>(Kind::count);
}
// Requires known(kind).
const SelectorInfo& selector_info(Kind kind) noexcept;
// The selector named `name`, or nullptr.
const SelectorInfo* find_selector(std::string_view name) noexcept;
// The kind's name; "?" for an unknown one.
std::string_view kind_name(Kind kind) noexcept;
// The names, ", "-separated ("dense, oracle, ..."), for messages.
std::string_view selector_names();

}  // namespace kvsift::select
