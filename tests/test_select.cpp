// The selector framework and its exact-score selectors (dense, oracle, quest), against float64
// references computed here from the stored keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "lib/core/error.hpp"
#include "lib/model/llama_model.hpp"
#include "lib/select/locks_summary.hpp"
#include "lib/select/selector.hpp"
#include "tests/model_handle.hpp"
#include "tests/test_util.hpp"

namespace kvsift {
namespace {

using select::GqaCombine;
using select::Kind;
using select::Policy;
using select::Selection;
using select::Selector;

std::vector<std::vector<double>> exact_page_lse(const KvCache& cache, int32_t seq, uint32_t layer,
                                                uint32_t h, const float* q);

struct Fixture {
  CacheGeometry geometry;
  std::unique_ptr<KvCache> cache;
  std::vector<int32_t> seq_ids;
  std::vector<float> q;  // [n_seqs, n_query_heads, head_dim]

  // Keys: Gaussian with a per-page offset along a random direction, so pages differ in mass; with
  // `low_rank`, each page's keys are its own rank-4 mixture plus small noise instead (the local
  // low rank LOCKS relies on), and channel 3 an outlier. Stored in `dtype`.
  Fixture(uint32_t H, uint32_t G, uint32_t d, uint32_t B, const std::vector<uint64_t>& lengths,
          uint32_t seed, bool low_rank = false, simd::Dtype dtype = simd::Dtype::f16) {
    geometry.dtype = dtype;
    geometry.n_kv_heads = H;
    geometry.group_size = G;
    geometry.head_dim = d;
    geometry.page_tokens = B;
    cache = std::make_unique<KvCache>(geometry, CacheOptions{}, test::kernels());
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      const int32_t id = cache->create_sequence();
      seq_ids.push_back(id);
      const uint64_t n = lengths[i];
      std::vector<float> k = test::random_floats(n * H * d, seed + 17 * i);
      const std::vector<float> v = test::random_floats(n * H * d, seed + 17 * i + 1);
      const std::vector<float> dir = test::random_floats(d, seed + 17 * i + 2);
      const std::vector<float> page_gain = test::random_floats(n / B + 1, seed + 17 * i + 3, 1.5f);
      if (low_rank) {
        const std::vector<float> basis = test::random_floats((n / B + 1) * H * 4 * d, seed + 5);
        const std::vector<float> mix = test::random_floats(n * H * 4, seed + 6);
        for (uint64_t t = 0; t < n; ++t)
          for (uint32_t h = 0; h < H; ++h)
            for (uint32_t c = 0; c < d; ++c) {
              float x = 0.1f * k[(t * H + h) * d + c];
              for (uint32_t j = 0; j < 4; ++j)
                x += mix[(t * H + h) * 4 + j] * basis[(((t / B) * H + h) * 4 + j) * d + c];
              k[(t * H + h) * d + c] = c == 3 ? 8.0f + x : x;
            }
      }
      for (uint64_t t = 0; t < n; ++t)
        for (uint32_t h = 0; h < H; ++h)
          for (uint32_t c = 0; c < d; ++c) k[(t * H + h) * d + c] += page_gain[t / B] * dir[c];
      cache->append(id, 0, static_cast<uint32_t>(n), k.data(), v.data());
    }
    q = test::random_floats(lengths.size() * H * G * d, seed + 99, 1.5f);
  }

  uint64_t max_pages() const {
    uint64_t most = 1;
    for (int32_t id : seq_ids) most = std::max(most, geometry.pages_for(cache->length(id, 0)));
    return most;
  }

  std::unique_ptr<Selector> selector(const Policy& policy) {
    return Selector::create(policy, *cache, static_cast<uint32_t>(seq_ids.size()), max_pages(),
                            test::pool(2), test::kernels());
  }

  Selection run(Selector& selector) {
    Selection out;
    selector.reserve_selection(out);
    selector.select(
        select::SelectCall{0, static_cast<uint32_t>(seq_ids.size()), seq_ids.data(), q.data()},
        out);
    return out;
  }

  std::vector<std::vector<double>> page_lse(std::size_t s, uint32_t h) const {
    return exact_page_lse(
        *cache, seq_ids[s], 0, h,
        q.data() + (s * geometry.n_kv_heads + h) * geometry.group_size * geometry.head_dim);
  }
};

// Exact float64 page log-sum-exp of each query head of one (sequence, layer, KV head):
// [G][n_pages]. q: [G, head_dim].
std::vector<std::vector<double>> exact_page_lse(const KvCache& cache, int32_t seq, uint32_t layer,
                                                uint32_t h, const float* q) {
  const CacheGeometry& geometry = cache.geometry();
  const uint32_t G = geometry.group_size, d = geometry.head_dim, B = geometry.page_tokens;
  const uint64_t n = cache.length(seq, layer);
  std::vector<float> k(n * d);
  cache.read_tokens(seq, layer, h, 0, n, k.data(), nullptr);
  std::vector<std::vector<double>> out(G, std::vector<double>(geometry.pages_for(n)));
  {
    for (uint32_t g = 0; g < G; ++g) {
      const float* qg = q + std::size_t{g} * d;
      for (uint64_t p = 0; p < out[g].size(); ++p) {
        std::vector<double> logits;
        for (uint64_t t = p * B; t < std::min<uint64_t>(n, (p + 1) * B); ++t) {
          double dot = 0.0;
          for (uint32_t c = 0; c < d; ++c) dot += double{qg[c]} * k[t * d + c];
          logits.push_back(dot / std::sqrt(double(d)));
        }
        const double top = *std::max_element(logits.begin(), logits.end());
        double sum = 0.0;
        for (double x : logits) sum += std::exp(x - top);
        out[g][p] = top + std::log(sum);
      }
    }
  }
  return out;
}

// The largest over the G heads of the exact share of softmax mass outside `pages`.
double true_dropped_share(const std::vector<std::vector<double>>& lse,
                          const std::vector<uint32_t>& pages) {
  double worst = 0.0;
  for (const std::vector<double>& head : lse) {
    const double top = *std::max_element(head.begin(), head.end());
    double all = 0.0, dropped = 0.0;
    for (std::size_t p = 0; p < head.size(); ++p) {
      const double m = std::exp(head[p] - top);
      all += m;
      if (!std::binary_search(pages.begin(), pages.end(), static_cast<uint32_t>(p))) dropped += m;
    }
    worst = std::max(worst, dropped / all);
  }
  return worst;
}

std::vector<uint32_t> pages_of(const Selection& sel, uint32_t pair) {
  return {sel.page_ids.begin() + sel.offsets[pair], sel.page_ids.begin() + sel.offsets[pair + 1]};
}

Policy policy_of(Kind kind, double budget, GqaCombine combine = GqaCombine::share_avg) {
  Policy policy;
  policy.kind = kind;
  policy.budget = budget;
  policy.combine = combine;
  return policy;
}

TEST(Registry, lists_every_kind_once_in_order) {
  const auto all = select::selectors();
  ASSERT_EQ(all.size(), static_cast<std::size_t>(Kind::count));
  for (std::size_t i = 0; i < all.size(); ++i) {
    SCOPED_TRACE(all[i].name);
    EXPECT_EQ(static_cast<std::size_t>(all[i].kind), i);
    EXPECT_EQ(&select::selector_info(all[i].kind), &all[i]);
    EXPECT_EQ(select::find_selector(all[i].name), &all[i]);
    EXPECT_EQ(select::kind_name(all[i].kind), all[i].name);
    EXPECT_NE(select::selector_names().find(all[i].name), std::string_view::npos);
    EXPECT_FALSE(all[i].description.empty());
    EXPECT_NE(all[i].make, nullptr);
  }
  EXPECT_EQ(select::selector_info(Kind::louver).level, select::Level::token);
  EXPECT_EQ(select::selector_info(Kind::s4r).level, select::Level::token);
  EXPECT_EQ(select::selector_info(Kind::locks).level, select::Level::page);
  EXPECT_EQ(select::find_selector("louvre"), nullptr);
  EXPECT_EQ(select::kind_name(Kind::count), "?");
}

TEST(PagePlan, mandatory_pages_and_the_budget_s_pages) {
  // 21 pages, the last partial; 64 tokens = 4 pages, 2 of them the sink and the window.
  select::PagePlan p = select::page_plan(1, 1, 16, 16 * 20 + 3, 64);
  EXPECT_EQ(p.n_pages, 21u);
  EXPECT_EQ(p.sealed, 20u);
  EXPECT_EQ(p.sink, 1u);
  EXPECT_EQ(p.sel_last, 20u);
  EXPECT_EQ(p.mandatory(), 2u);
  EXPECT_EQ(p.take, 2u);
  EXPECT_EQ(p.count, 4u);
  EXPECT_FALSE(p.whole);
  // A window of 0 still holds the open page; a budget below the mandatory pages takes none.
  p = select::page_plan(3, 0, 16, 16 * 20 + 3, 16);
  EXPECT_EQ(p.sel_last, 20u);
  EXPECT_EQ(p.take, 0u);
  EXPECT_EQ(p.count, 4u);
  // Nothing selectable, or a budget of the whole context: every page.
  p = select::page_plan(3, 2, 16, 16 * 4, 16);
  EXPECT_TRUE(p.whole);
  EXPECT_EQ(p.count, 4u);
  p = select::page_plan(1, 1, 16, 16 * 20, 16 * 20);
  EXPECT_TRUE(p.whole);
  p = select::page_plan(1, 1, 16, 0, 0);
  EXPECT_TRUE(p.whole);
  EXPECT_EQ(p.count, 0u);
  // The budget's two forms.
  EXPECT_EQ(select::budget_tokens(0.05, 1000), 50u);
  EXPECT_EQ(select::budget_tokens(1.0, 1000), 1000u);
  EXPECT_EQ(select::budget_tokens(48.0, 1000), 48u);
}

TEST(Select, dense_chooses_every_page_and_reads_no_index) {
  Fixture f(2, 3, 64, 16, {37, 100, 16}, 1);
  auto selector = f.selector(Policy{});
  const Selection sel = f.run(*selector);
  ASSERT_EQ(sel.n_pairs, 6u);
  for (uint32_t pair = 0; pair < 6; ++pair) {
    const uint64_t n_pages = f.geometry.pages_for(f.cache->length(f.seq_ids[pair / 2], 0));
    const std::vector<uint32_t> pages = pages_of(sel, pair);
    ASSERT_EQ(pages.size(), n_pages);
    for (uint32_t p = 0; p < n_pages; ++p) EXPECT_EQ(pages[p], p);
    EXPECT_EQ(sel.kept_estimate[pair], 1.0f);
    EXPECT_EQ(sel.dropped_bound[pair], 0.0f);
  }
  EXPECT_EQ(sel.index_bytes_read, 0u);
}

// The chosen selectable pages outrank every left-out one by the float64 combined score, the
// mandatory pages are there, and the count is what the budget allows.
void expect_oracle_choice(GqaCombine combine, simd::Dtype dtype = simd::Dtype::f16) {
  const uint32_t H = 2, G = 4, d = 64, B = 16;
  Fixture f(H, G, d, B, {1000, 517}, 7, false, dtype);
  const double budget_tokens = 160;  // 10 pages: sink + window + 8 chosen
  auto selector = f.selector(policy_of(Kind::oracle, budget_tokens, combine));
  const Selection sel = f.run(*selector);
  for (uint32_t pair = 0; pair < sel.n_pairs; ++pair) {
    const auto lse = f.page_lse(pair / H, pair % H);
    const std::size_t n_pages = lse[0].size();
    const std::size_t first = 1, last = n_pages - 1;
    std::vector<double> combined(n_pages, 0.0);
    for (uint32_t g = 0; g < G; ++g) {
      double top = -INFINITY, total = 0.0;
      for (std::size_t p = first; p < last; ++p) top = std::max(top, lse[g][p]);
      for (std::size_t p = first; p < last; ++p) total += std::exp(lse[g][p] - top);
      for (std::size_t p = first; p < last; ++p) {
        const double x = lse[g][p] - top;
        if (combine == GqaCombine::max)
          combined[p] = g == 0 ? lse[g][p] : std::max(combined[p], lse[g][p]);
        else if (combine == GqaCombine::nrm)
          combined[p] += std::exp(x);
        else
          combined[p] += std::exp(x) / total / G;
      }
    }
    const std::vector<uint32_t> pages = pages_of(sel, pair);
    ASSERT_EQ(pages.size(), 10u);
    EXPECT_TRUE(std::is_sorted(pages.begin(), pages.end()));
    EXPECT_EQ(pages.front(), 0u);
    EXPECT_EQ(pages.back(), n_pages - 1);
    double worst_chosen = INFINITY, best_left = -INFINITY;
    for (std::size_t p = first; p < last; ++p) {
      if (std::binary_search(pages.begin(), pages.end(), p))
        worst_chosen = std::min(worst_chosen, combined[p]);
      else
        best_left = std::max(best_left, combined[p]);
    }
    EXPECT_GE(worst_chosen, best_left - 1e-5 * std::fabs(best_left)) << "pair " << pair;

    // The estimated share kept is the exact one (averaged over the heads).
    double share = 0.0;
    for (uint32_t g = 0; g < G; ++g) {
      double all = 0.0, kept = 0.0;
      for (std::size_t p = 0; p < n_pages; ++p) {
        all += std::exp(lse[g][p]);
        if (std::binary_search(pages.begin(), pages.end(), p)) kept += std::exp(lse[g][p]);
      }
      share += kept / all / G;
    }
    EXPECT_NEAR(sel.kept_estimate[pair], share, 1e-4);
    EXPECT_TRUE(std::isnan(sel.dropped_bound[pair]));
  }
  // The oracle reads every key once per pair.
  EXPECT_EQ(sel.index_bytes_read, (1000u + 517u) * H * f.geometry.layout().key_bytes());
}

TEST(Select, oracle_keeps_the_best_pages_by_exact_log_mass_share_avg) {
  expect_oracle_choice(GqaCombine::share_avg);
}
TEST(Select, oracle_keeps_the_best_pages_by_exact_log_mass_nrm) {
  expect_oracle_choice(GqaCombine::nrm);
}
TEST(Select, oracle_keeps_the_best_pages_by_exact_log_mass_max) {
  expect_oracle_choice(GqaCombine::max);
}

TEST(Select, oracle_keeps_the_best_pages_of_a_q8_cache) {
  expect_oracle_choice(GqaCombine::share_avg, simd::Dtype::q8);
}

TEST(Select, budget_counts_sinks_and_window_inside) {
  const uint32_t B = 16;
  Fixture f(1, 2, 64, B, {800}, 3);  // 50 pages
  struct Case {
    double budget;
    std::size_t pages;
  };
  // 0.1 of 800 tokens = 80 tokens = 5 pages; 20 tokens < the 2 mandatory pages; >= 800: all.
  for (const Case& c : {Case{0.1, 5}, Case{20, 2}, Case{320, 20}, Case{1.0, 50}, Case{5000, 50}}) {
    auto selector = f.selector(policy_of(Kind::oracle, c.budget));
    const Selection sel = f.run(*selector);
    EXPECT_EQ(pages_of(sel, 0).size(), c.pages) << "budget " << c.budget;
  }
  Policy wide = policy_of(Kind::oracle, 320);
  wide.sink_pages = 3;
  wide.window_pages = 4;
  auto selector = f.selector(wide);
  const std::vector<uint32_t> pages = pages_of(f.run(*selector), 0);
  ASSERT_EQ(pages.size(), 20u);
  for (uint32_t p : {0u, 1u, 2u, 46u, 47u, 48u, 49u})
    EXPECT_TRUE(std::binary_search(pages.begin(), pages.end(), p)) << p;
}

TEST(Select, the_open_page_is_always_attended) {
  Fixture f(1, 1, 64, 16, {16 * 20 + 3}, 5);
  Policy policy = policy_of(Kind::oracle, 64);
  policy.window_pages = 0;
  auto selector = f.selector(policy);
  const std::vector<uint32_t> pages = pages_of(f.run(*selector), 0);
  ASSERT_EQ(pages.size(), 4u);
  EXPECT_EQ(pages.back(), 20u);
}

TEST(Select, equal_scores_choose_the_lower_page_ids) {
  CacheGeometry geometry;
  geometry.n_kv_heads = 1;
  geometry.group_size = 2;
  geometry.head_dim = 64;
  KvCache cache(geometry, CacheOptions{}, test::kernels());
  const int32_t seq = cache.create_sequence();
  const std::vector<float> k(std::size_t{16} * 20 * 64, 0.5f);  // every page the same
  cache.append(seq, 0, 16 * 20, k.data(), k.data());
  const std::vector<float> q = test::random_floats(2 * 64, 1);
  for (Kind kind : {Kind::oracle, Kind::quest, Kind::locks}) {
    auto selector =
        Selector::create(policy_of(kind, 16 * 6), cache, 1, 20, test::pool(2), test::kernels());
    Selection sel;
    selector->reserve_selection(sel);
    selector->select(select::SelectCall{0, 1, &seq, q.data()}, sel);
    EXPECT_EQ(pages_of(sel, 0), (std::vector<uint32_t>{0, 1, 2, 3, 4, 19}))
        << select::kind_name(kind);
  }
}

// For a q8 cache the bounds are fp16 values rounded outward from the dequantized keys (read back
// by read_tokens below), so they bound those keys' logits too.
class QuestBound : public testing::TestWithParam<simd::Dtype> {};

TEST_P(QuestBound, quest_scores_bound_every_logit_of_their_page) {
  const uint32_t H = 2, G = 3, d = 128, B = 16;
  Fixture f(H, G, d, B, {16 * 40}, 11, false, GetParam());
  // One page short of everything, so that every selectable page but one is chosen and scored.
  auto selector = f.selector(policy_of(Kind::quest, 16 * 39, GqaCombine::max));
  const Selection sel = f.run(*selector);
  EXPECT_EQ(selector->summary_bytes_per_page(), 2u * d * 2);
  for (uint32_t pair = 0; pair < sel.n_pairs; ++pair) {
    std::vector<float> k(16 * 40 * d);
    f.cache->read_tokens(f.seq_ids[0], 0, pair, 0, 16 * 40, k.data(), nullptr);
    for (uint32_t i = sel.offsets[pair]; i < sel.offsets[pair + 1]; ++i) {
      const uint32_t p = sel.page_ids[i];
      if (std::isinf(sel.scores[i])) continue;  // mandatory
      double top = -INFINITY;
      for (uint32_t g = 0; g < G; ++g)
        for (uint32_t t = p * B; t < (p + 1) * B; ++t) {
          double dot = 0.0;
          for (uint32_t c = 0; c < d; ++c)
            dot += double{f.q[(pair * G + g) * d + c]} * k[std::size_t{t} * d + c];
          top = std::max(top, dot / std::sqrt(double(d)));
        }
      EXPECT_GE(sel.scores[i], top - 1e-4 * std::fabs(top)) << "page " << p;
    }
    EXPECT_TRUE(std::isnan(sel.kept_estimate[pair]));
  }
  EXPECT_EQ(sel.index_bytes_read, uint64_t{H} * 40 * 2 * d * 2);
}

INSTANTIATE_TEST_SUITE_P(Select, QuestBound,
                         testing::Values(simd::Dtype::f16, simd::Dtype::bf16, simd::Dtype::q8),
                         [](const testing::TestParamInfo<simd::Dtype>& info) {
                           return std::string(info.param == simd::Dtype::f16    ? "f16"
                                              : info.param == simd::Dtype::bf16 ? "bf16"
                                                                                : "q8");
                         });

TEST(Select, a_nan_query_still_gives_a_valid_selection) {
  Fixture f(1, 2, 64, 16, {16 * 30}, 13);
  f.q[5] = std::numeric_limits<float>::quiet_NaN();
  auto selector = f.selector(policy_of(Kind::oracle, 16 * 6));
  const std::vector<uint32_t> pages = pages_of(f.run(*selector), 0);
  EXPECT_EQ(pages.size(), 6u);
  EXPECT_TRUE(std::is_sorted(pages.begin(), pages.end()));
}

TEST(Select, invalid_policies_are_refused_with_the_field_named) {
  auto refuses = [](const Policy& policy, const char* field) {
    try {
      policy.validate();
      ADD_FAILURE() << "accepted: " << field;
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::invalid_argument);
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  refuses(policy_of(Kind::dense, 0.5), "budget");
  refuses(policy_of(Kind::oracle, 0.0), "budget");
  refuses(policy_of(Kind::quest, -1.0), "budget");
  refuses(policy_of(Kind::quest, std::numeric_limits<double>::quiet_NaN()), "budget");
  Policy eps = policy_of(Kind::oracle, 0.1);
  eps.locks.epsilon = 0.0;
  refuses(eps, "epsilon");
  Policy kind = Policy{};
  kind.kind = static_cast<Kind>(77);
  refuses(kind, "kind");
}

// Counts seals so the fork's notifications can be checked.
struct SealCounter : SealListener {
  int sealed = 0;
  void on_page_sealed(const SealedPage&) noexcept override { ++sealed; }
  void on_sequence_freed(int32_t) noexcept override {}
};

TEST(Select, a_forked_sequence_holds_the_same_tokens_in_its_own_pages) {
  Fixture f(2, 1, 64, 16, {16 * 3 + 5}, 17);
  SealCounter counter;
  f.cache->add_seal_listener(&counter);
  const int32_t fork = f.cache->fork_sequence(f.seq_ids[0]);
  EXPECT_EQ(counter.sealed, 3 * 2);
  EXPECT_EQ(f.cache->length(fork, 0), 16u * 3 + 5);
  std::vector<float> a(53 * 64), b(53 * 64);
  for (uint32_t h = 0; h < 2; ++h) {
    f.cache->read_tokens(f.seq_ids[0], 0, h, 0, 53, a.data(), nullptr);
    f.cache->read_tokens(fork, 0, h, 0, 53, b.data(), nullptr);
    EXPECT_EQ(a, b);
    EXPECT_NE(f.cache->page_table(fork, 0, h)[0], f.cache->page_table(f.seq_ids[0], 0, h)[0]);
  }
  // Appending to the fork leaves the source alone.
  const std::vector<float> kv = test::random_floats(2 * 64, 3);
  f.cache->append(fork, 0, 1, kv.data(), kv.data());
  EXPECT_EQ(f.cache->length(f.seq_ids[0], 0), 53u);
  f.cache->remove_seal_listener(&counter);
}

// ---- LOCKS and certified selection ---------------------------------------------------------

// Exact share of the group's mass (averaged over heads) inside the chosen pages.
double kept_share(const std::vector<std::vector<double>>& lse, const std::vector<uint32_t>& pages) {
  double share = 0.0;
  for (const std::vector<double>& head : lse) {
    const double top = *std::max_element(head.begin(), head.end());
    double all = 0.0, kept = 0.0;
    for (std::size_t p = 0; p < head.size(); ++p) {
      all += std::exp(head[p] - top);
      if (std::binary_search(pages.begin(), pages.end(), static_cast<uint32_t>(p)))
        kept += std::exp(head[p] - top);
    }
    share += kept / all;
  }
  return share / static_cast<double>(lse.size());
}

class LocksMass : public testing::TestWithParam<simd::Dtype> {};

// On a q8 cache the records are built from the dequantized keys, and the oracle's masses are
// over those keys too.
TEST_P(LocksMass, locks_keeps_nearly_the_oracle_mass_on_locally_low_rank_keys) {
  const uint32_t H = 2, G = 4, d = 128, B = 16;
  Fixture f(H, G, d, B, {16 * 128}, 21, /*low_rank=*/true, GetParam());
  const double budget = 16 * 16;  // 12.5%
  auto oracle = f.selector(policy_of(Kind::oracle, budget));
  auto locks = f.selector(policy_of(Kind::locks, budget));
  const Selection by_oracle = f.run(*oracle);
  const Selection by_locks = f.run(*locks);
  EXPECT_EQ(locks->summary_bytes_per_page(), 818u);
  EXPECT_EQ(by_locks.index_bytes_read, uint64_t{H} * 128 * 818);
  for (uint32_t pair = 0; pair < H; ++pair) {
    const auto lse = f.page_lse(0, pair);
    const double oracle_share = kept_share(lse, pages_of(by_oracle, pair));
    const double locks_share = kept_share(lse, pages_of(by_locks, pair));
    EXPECT_EQ(pages_of(by_locks, pair).size(), 16u);
    EXPECT_GE(locks_share, oracle_share - 0.02) << "pair " << pair;
    // The estimate is of the same mass.
    EXPECT_NEAR(by_locks.kept_estimate[pair], locks_share, 0.05) << "pair " << pair;
  }
}

INSTANTIATE_TEST_SUITE_P(Select, LocksMass, testing::Values(simd::Dtype::f16, simd::Dtype::q8),
                         [](const testing::TestParamInfo<simd::Dtype>& info) {
                           return std::string(info.param == simd::Dtype::f16 ? "f16" : "q8");
                         });

// Checks the certified bound against the exact dropped share for many queries; returns how many
// (page, head, query) page bounds were exercised.
uint64_t expect_certified_bounds_hold(Fixture& f, double epsilon, double budget, int queries) {
  Policy policy = policy_of(Kind::locks_certified, budget);
  policy.locks.epsilon = epsilon;
  auto selector = f.selector(policy);
  EXPECT_EQ(selector->summary_bytes_per_page(),
            select::locks_paper_bytes({f.geometry.head_dim, f.geometry.page_tokens, 8}) + 8);
  uint64_t checks = 0;
  for (int r = 0; r < queries; ++r) {
    f.q = test::random_floats(f.q.size(), 1000 + r, 0.5f + 0.25f * (r % 8));
    const Selection sel = f.run(*selector);
    for (uint32_t pair = 0; pair < sel.n_pairs; ++pair) {
      const uint32_t H = f.geometry.n_kv_heads;
      const auto lse = f.page_lse(pair / H, pair % H);
      const std::vector<uint32_t> pages = pages_of(sel, pair);
      const double truth = true_dropped_share(lse, pages);
      EXPECT_LE(truth, sel.dropped_bound[pair]) << "query " << r << " pair " << pair;
      const uint64_t allowed = policy.budget_tokens(f.cache->length(f.seq_ids[pair / H], 0)) / 16;
      if (pages.size() < std::max<uint64_t>(allowed, 2)) {
        EXPECT_LT(sel.dropped_bound[pair], epsilon);
      }
      checks += lse.size() * lse[0].size();
    }
  }
  return checks;
}

TEST(Select, certified_bound_is_never_below_the_true_dropped_mass) {
  uint64_t checks = 0;
  {
    Fixture f(2, 4, 128, 16, {16 * 100 + 5, 16 * 40}, 31, /*low_rank=*/true);
    checks += expect_certified_bounds_hold(f, 1e-3, 1.0, 12);
    checks += expect_certified_bounds_hold(f, 1e-2, 0.2, 12);
  }
  {
    Fixture f(3, 3, 64, 16, {16 * 64}, 37);
    checks += expect_certified_bounds_hold(f, 1e-3, 1.0, 12);
    checks += expect_certified_bounds_hold(f, 0.1, 0.1, 12);
  }
  {  // q8: the bound is over the dequantized keys, which the records and the truth both read
    Fixture f(2, 4, 128, 16, {16 * 60 + 9}, 41, /*low_rank=*/true, simd::Dtype::q8);
    checks += expect_certified_bounds_hold(f, 1e-2, 0.2, 6);
  }
  EXPECT_GT(checks, 20000u);
}

// Observes the real model's decode steps: the certified bound of every layer and KV head against
// the exact dropped share over the real keys.
class CertifiedCheck : public model::DecodeObserver {
 public:
  explicit CertifiedCheck(const model::LlamaModel& m) : model_(m) {}
  void on_layer(uint32_t layer, std::span<const int32_t> seq_ids, const float* q,
                const Selection& sel, const float*) noexcept override {
    const CacheGeometry& g = model_.cache().geometry();
    for (uint32_t pair = 0; pair < sel.n_pairs; ++pair) {
      const uint32_t s = pair / g.n_kv_heads, h = pair % g.n_kv_heads;
      const auto lse = exact_page_lse(
          model_.cache(), seq_ids[s], layer, h,
          q + (std::size_t{s} * g.n_query_heads() + std::size_t{h} * g.group_size) * g.head_dim);
      const std::vector<uint32_t> pages(sel.page_ids.begin() + sel.offsets[pair],
                                        sel.page_ids.begin() + sel.offsets[pair + 1]);
      worst_excess =
          std::max(worst_excess, true_dropped_share(lse, pages) - sel.dropped_bound[pair]);
      pages_chosen += pages.size();
      pages_stored += lse[0].size();
      ++pairs;
    }
  }
  double worst_excess = -1.0;  // max of (true dropped - bound): must stay <= 0
  uint64_t pairs = 0, pages_chosen = 0, pages_stored = 0;

 private:
  const model::LlamaModel& model_;
};

TEST(Select, certified_bound_holds_on_real_model_keys) {
  if (test::model_path() == nullptr) GTEST_SKIP() << "KVSIFT_MODEL is not set (make test sets it)";
  model::ModelOptions options;
  options.n_ctx = 1024;
  auto m = model::LlamaModel::load(test::model_path(), options);
  std::string text;
  for (int i = 0; i < 40; ++i)
    text += "Paragraph " + std::to_string(i) + ": the quick brown fox jumps over the lazy dog. ";
  const std::vector<int32_t> tokens = m->tokenizer().encode(text, false);
  const int32_t seq = m->create_sequence();
  m->prefill(seq, tokens, nullptr, nullptr, nullptr);
  // Capped at a quarter of the context: on these keys the rank-8 residual bounds are too loose to
  // certify 1e-3 with fewer pages, so the cap is what stops the growth and the bound is tested
  // with pages left out.
  select::Policy policy = policy_of(Kind::locks_certified, 0.25);
  m->set_selector(policy);
  CertifiedCheck check(*m);
  m->set_observer(&check);
  const int32_t seqs[] = {seq};
  for (int step = 0; step < 3; ++step) {
    const int32_t next[] = {static_cast<int32_t>(
        std::max_element(m->logits(seq).begin(), m->logits(seq).end()) - m->logits(seq).begin())};
    m->decode(seqs, next);
  }
  m->set_observer(nullptr);
  EXPECT_EQ(check.pairs, 3u * m->config().n_layers * m->config().n_kv_heads);
  EXPECT_LE(check.worst_excess, 0.0);
  EXPECT_LE(m->stats().last_step.dropped_bound, 1.0);
  EXPECT_LT(check.pages_chosen, check.pages_stored / 3);
}

}  // namespace
}  // namespace kvsift
