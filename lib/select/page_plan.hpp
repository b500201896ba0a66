// The sink/window/budget page plan of one (sequence, KV head), which every selector follows
// (docs/methods.md) and the device LOCKS scorer repeats (gpu/locks_scorer.hpp). Header-only and
// plain C++, so that gpu/*.cu can include it.
//
// Budget (the papers' meaning): tokens per (layer, KV head) per step, sink and window pages counted
// inside; pages allowed = floor(budget_tokens / page_tokens), never fewer than the mandatory ones.
// Mandatory: the first sink_pages pages and the last max(window_pages, 1) pages, so that the last
// page (the open page, partial or just filled) is always attended.
#pragma once

#include <cmath>
#include <cstdint>

namespace kvsift::select {

// Tokens a budget allows for a context of `tokens` tokens: a fraction of the context when the
// budget is in (0, 1], else a token count.
inline uint64_t budget_tokens(double budget, uint64_t tokens) noexcept {
  return budget <= 1.0 ? static_cast<uint64_t>(std::floor(budget * static_cast<double>(tokens)))
                       : static_cast<uint64_t>(budget);
}

// A pair's pages: [0, sink) and [sel_last, n_pages) are mandatory, [sink, sel_last) selectable and
// `take` of them allowed; `whole`: every page is chosen unscored (nothing selectable, or the budget
// covers the context).
struct PagePlan {
  uint32_t n_pages = 0, sealed = 0;
  uint32_t sink = 0, sel_last = 0, take = 0;
  bool whole = false;
  uint32_t count = 0;  // pages chosen: n_pages when whole, else the mandatory ones + take

  uint32_t mandatory() const noexcept { return sink + (n_pages - sel_last); }
  uint32_t selectable() const noexcept { return sel_last - sink; }
};

inline PagePlan page_plan(uint32_t sink_pages, uint32_t window_pages, uint32_t page_tokens,
                          uint64_t tokens, uint64_t budget_tokens) noexcept {
  PagePlan p;
  const uint32_t B = page_tokens;
  p.n_pages = static_cast<uint32_t>((tokens + B - 1) / B);
  p.sealed = static_cast<uint32_t>(tokens / B);
  p.sink = sink_pages < p.n_pages ? sink_pages : p.n_pages;
  const uint32_t window_wanted = window_pages > 1 ? window_pages : 1;
  const uint32_t window = window_wanted < p.n_pages - p.sink ? window_wanted : p.n_pages - p.sink;
  p.sel_last = p.n_pages - window;
  p.whole = p.sel_last <= p.sink || budget_tokens >= tokens;
  if (p.whole) {
    p.count = p.n_pages;
    return p;
  }
  const uint64_t budget_pages = budget_tokens / B, mandatory = p.mandatory();
  const uint64_t allowed = budget_pages > mandatory ? budget_pages - mandatory : 0;
  p.take = static_cast<uint32_t>(allowed < p.selectable() ? allowed : p.selectable());
  p.count = p.mandatory() + p.take;
  return p;
}

}  // namespace kvsift::select
