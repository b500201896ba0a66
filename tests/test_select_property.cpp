// A property of every page selector: after any sequence of create, append, free, fork and select
// calls on a cache, a selection equals the one a fresh cache holding only the same live sequences
// makes (so no summary outlives the content it summarises, and slot reuse is invisible), and a
// certified bound on the dropped share of softmax mass is never below the true share computed in
// float64 from the stored keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "lib/cache/kv_cache.hpp"
#include "lib/core/error.hpp"
#include "lib/select/selector.hpp"
#include "tests/test_util.hpp"

namespace kvsift {
namespace {

using select::Kind;
using select::Policy;
using select::Selection;
using select::Selector;

constexpr uint32_t kLayers = 2, kHeads = 2, kGroup = 2, kDim = 64, kPageTokens = 16;
constexpr uint32_t kMaxBatch = 3;
constexpr uint64_t kSlots = 48;  // small, so that freed slots are reused often

CacheGeometry geometry() {
  CacheGeometry g;
  g.n_layers = kLayers;
  g.n_kv_heads = kHeads;
  g.group_size = kGroup;
  g.head_dim = kDim;
  g.page_tokens = kPageTokens;
  return g;
}

// What the live sequences hold, kept beside the cache so a fresh one can be filled alike.
struct Shadow {
  // [layer] -> appended K and V rows, [tokens, kHeads, kDim]
  std::vector<std::vector<float>> k{kLayers}, v{kLayers};
};

struct World {
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<Selector> selector;
  std::map<int32_t, Shadow> live;
};

std::unique_ptr<KvCache> new_cache() {
  CacheOptions options;
  options.max_pages = kSlots;
  return std::make_unique<KvCache>(geometry(), options, test::kernels());
}

std::unique_ptr<Selector> new_selector(const Policy& policy, KvCache& cache) {
  return Selector::create(policy, cache, kMaxBatch, kSlots, test::pool(2), test::kernels());
}

// Keys with page structure (a per-page gain along one direction), so that pages differ in mass and
// a selector has something to choose.
void random_tokens(std::mt19937& rng, uint32_t n, std::vector<float>& k, std::vector<float>& v) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> gain(-2.0f, 3.0f);
  k.resize(std::size_t{n} * kHeads * kDim);
  v.resize(k.size());
  const float g = gain(rng);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = normal(rng) + (i % kDim < 8 ? g : 0.0f);
    v[i] = normal(rng);
  }
}

Selection run(Selector& selector, uint32_t layer, const std::vector<int32_t>& ids,
              const std::vector<float>& q) {
  Selection sel;
  selector.reserve_selection(sel);
  const select::SelectCall call{layer, static_cast<uint32_t>(ids.size()), ids.data(), q.data()};
  selector.prepare(call, sel);
  selector.select(call, sel);
  return sel;
}

std::vector<uint32_t> pages_of(const Selection& sel, uint32_t pair) {
  return {sel.page_ids.begin() + sel.offsets[pair], sel.page_ids.begin() + sel.offsets[pair + 1]};
}

// The largest over the group's query heads of the true share of softmax mass outside the chosen
// pages, in float64 over the stored (rounded) keys.
double true_dropped_share(const KvCache& cache, int32_t seq, uint32_t layer, uint32_t h,
                          const float* q_group, const std::vector<uint32_t>& chosen) {
  const uint64_t n = cache.length(seq, layer);
  std::vector<float> keys(n * kDim);
  cache.read_tokens(seq, layer, h, 0, n, keys.data(), nullptr);
  std::vector<char> kept(n, 0);
  for (uint32_t p : chosen)
    for (uint64_t t = uint64_t{p} * kPageTokens; t < std::min<uint64_t>(n, (p + 1) * kPageTokens);
         ++t)
      kept[t] = 1;
  double worst = 0.0;
  for (uint32_t g = 0; g < kGroup; ++g) {
    const float* q = q_group + std::size_t{g} * kDim;
    std::vector<double> logits(n);
    double top = -INFINITY;
    for (uint64_t t = 0; t < n; ++t) {
      double dot = 0.0;
      for (uint32_t c = 0; c < kDim; ++c) dot += double{q[c]} * keys[t * kDim + c];
      logits[t] = dot / std::sqrt(double{kDim});
      top = std::max(top, logits[t]);
    }
    double all = 0.0, dropped = 0.0;
    for (uint64_t t = 0; t < n; ++t) {
      const double e = std::exp(logits[t] - top);
      all += e;
      if (!kept[t]) dropped += e;
    }
    worst = std::max(worst, dropped / all);
  }
  return worst;
}

void check_property(const Policy& policy, uint32_t seed, int steps) {
  std::mt19937 rng(seed);
  World w{new_cache(), nullptr, {}};
  w.selector = new_selector(policy, *w.cache);
  int selections = 0, certified_checks = 0;
  for (int step = 0; step < steps; ++step) {
    const int op = std::uniform_int_distribution<int>(0, 9)(rng);
    std::vector<int32_t> ids;
    for (const auto& [id, shadow] : w.live) ids.push_back(id);
    if (op == 0 || ids.empty()) {
      w.live[w.cache->create_sequence()];
    } else if (op == 1 && ids.size() > 1) {
      const int32_t id = ids[rng() % ids.size()];
      w.cache->free_sequence(id);
      w.live.erase(id);
    } else if (op == 2) {
      const int32_t src = ids[rng() % ids.size()];
      try {
        const int32_t id = w.cache->fork_sequence(src);
        w.live[id] = w.live[src];
      } catch (const Error& e) {
        ASSERT_EQ(e.status(), Status::capacity_exceeded) << e.what();
      }
    } else if (op <= 6) {
      // Appends to every layer alike, as a decoder does; a pool that runs dry refuses the layer.
      const int32_t id = ids[rng() % ids.size()];
      const uint32_t n = std::uniform_int_distribution<uint32_t>(1, 40)(rng);
      std::vector<float> k, v;
      random_tokens(rng, n, k, v);
      bool all_appended = true;
      for (uint32_t l = 0; l < kLayers && all_appended; ++l) {
        try {
          w.cache->append(id, l, n, k.data(), v.data());
          Shadow& s = w.live[id];
          s.k[l].insert(s.k[l].end(), k.begin(), k.end());
          s.v[l].insert(s.v[l].end(), v.begin(), v.end());
        } catch (const Error& e) {
          ASSERT_EQ(e.status(), Status::capacity_exceeded) << e.what();
          all_appended = false;
        }
      }
      // Layers must stay even for a fresh replay; free what went uneven.
      if (!all_appended && w.cache->length(id, 0) != w.cache->length(id, kLayers - 1)) {
        w.cache->free_sequence(id);
        w.live.erase(id);
      }
    } else {
      // Select for a batch of distinct live sequences on one layer, and compare with a fresh cache.
      std::shuffle(ids.begin(), ids.end(), rng);
      ids.resize(std::min<std::size_t>(ids.size(), 1 + rng() % kMaxBatch));
      const uint32_t layer = rng() % kLayers;
      const std::vector<float> q =
          test::random_floats(ids.size() * kHeads * kGroup * kDim, seed * 7919 + step, 1.5f);
      const Selection sel = run(*w.selector, layer, ids, q);

      auto fresh = new_cache();
      std::vector<int32_t> fresh_ids;
      for (int32_t id : ids) {
        const int32_t f = fresh->create_sequence();
        fresh_ids.push_back(f);
        const Shadow& s = w.live.at(id);
        for (uint32_t l = 0; l < kLayers; ++l) {
          const auto n = static_cast<uint32_t>(s.k[l].size() / (kHeads * kDim));
          if (n > 0) fresh->append(f, l, n, s.k[l].data(), s.v[l].data());
        }
      }
      auto fresh_selector = new_selector(policy, *fresh);
      const Selection expected = run(*fresh_selector, layer, fresh_ids, q);
      ASSERT_EQ(sel.n_pairs, expected.n_pairs);
      for (uint32_t pair = 0; pair < sel.n_pairs; ++pair) {
        ASSERT_EQ(pages_of(sel, pair), pages_of(expected, pair))
            << "step " << step << ", pair " << pair << " (sequence " << ids[pair / kHeads] << ")";
        const float kept = sel.kept_estimate[pair], kept_fresh = expected.kept_estimate[pair];
        EXPECT_TRUE(kept == kept_fresh || (std::isnan(kept) && std::isnan(kept_fresh)))
            << "step " << step << ": " << kept << " vs " << kept_fresh;
        const float bound = sel.dropped_bound[pair];
        if (!std::isnan(bound)) {
          const uint32_t i = pair / kHeads, h = pair % kHeads;
          const double truth = true_dropped_share(
              *w.cache, ids[i], layer, h, q.data() + (std::size_t{i} * kHeads + h) * kGroup * kDim,
              pages_of(sel, pair));
          // The bound is stored in float32: one rounding of room.
          EXPECT_GE(double{bound} * (1.0 + 1e-6), truth) << "step " << step << ", pair " << pair;
          ++certified_checks;
        }
      }
      ++selections;
    }
  }
  EXPECT_GT(selections, steps / 10);
  if (policy.kind == Kind::locks_certified) {
    EXPECT_GT(certified_checks, 0);
  }
}

Policy policy_of(Kind kind) {
  Policy p;
  p.kind = kind;
  p.budget = kind == Kind::dense ? 0.0 : 48.0;
  return p;
}

TEST(SelectProperty, selections_after_create_append_free_fork_equal_a_fresh_caches) {
  // Every page-level selector of the registry (lib/select/registry.hpp), a new one included.
  for (const select::SelectorInfo& info : select::selectors()) {
    if (info.level != select::Level::page) continue;
    SCOPED_TRACE(std::string(info.name));
    for (uint32_t seed = 1; seed <= 3; ++seed) check_property(policy_of(info.kind), seed, 400);
  }
}

TEST(SelectProperty, certified_bound_holds_at_tight_epsilon_and_under_the_nrm_combine) {
  Policy p = policy_of(Kind::locks_certified);
  p.locks.epsilon = 1e-5;
  p.budget = 160.0;
  check_property(p, 11, 300);
  p.combine = select::GqaCombine::nrm;
  check_property(p, 12, 300);
}

}  // namespace
}  // namespace kvsift
