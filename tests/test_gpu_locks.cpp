// LOCKS selection on the GPU (gpu/locks_scorer.hpp) against the CPU's: the device's per-head page
// scores against simd's locks_score and the open page's exact log-sum-exp, and the LOCKS selector
// with policy.device against the CPU selector on one cache: the same page counts, the same
// pages but at near-ties of the combined score, close scores and kept estimates, over contexts of
// 1K..100K tokens, G = 1 and 4, d = 64 and 128, f16 and bf16, every GQA combine and several
// budgets, then over decode steps that seal new pages. The pair plan against the CPU selector's
// counts and the refusals that need no device run everywhere; the rest skips without a CUDA build
// or device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/host_memory.hpp"
#include "gpu/locks_scorer.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/core/error.hpp"
#include "lib/select/locks_summary.hpp"
#include "lib/select/page_selector.hpp"
#include "lib/select/selector.hpp"
#include "simd/half.hpp"
#include "simd/isa.hpp"
#include "simd/kernels.hpp"
#include "tests/gpu_skip.hpp"
#include "tests/test_util.hpp"

namespace kvsift {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Keys with the structure real ones have (as bench/key_maker.hpp, for any head_dim): each page of
// each head a rank-4 mixture of 32 topic directions plus noise, and two outlier channels.
class Keys {
 public:
  Keys(uint32_t heads, uint32_t d, uint64_t seed)
      : heads_(heads), d_(d), rng_(seed), picks_(std::size_t{heads} * 4) {
    topics_.resize(std::size_t{heads} * kTopics * d);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& x : topics_) x = normal(rng_);
  }
  // [n, heads, d] keys of positions [first, first + n), and V (noise).
  void make(uint64_t first, uint32_t n, std::vector<float>& k, std::vector<float>& v) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<uint32_t> topic(0, kTopics - 1);
    k.assign(std::size_t{n} * heads_ * d_, 0.0f);
    v.resize(k.size());
    for (float& x : v) x = normal(rng_);
    for (uint32_t i = 0; i < n; ++i)
      for (uint32_t h = 0; h < heads_; ++h) {
        uint32_t* picks = picks_.data() + std::size_t{h} * 4;
        if ((first + i) % 16 == 0 || i == 0)
          for (uint32_t m = 0; m < 4; ++m) picks[m] = topic(rng_);
        float* row = k.data() + (std::size_t{i} * heads_ + h) * d_;
        for (uint32_t m = 0; m < 4; ++m) {
          const uint32_t p = picks[m];
          const float w = normal(rng_);
          const float* t = topics_.data() + (std::size_t{h} * kTopics + p) * d_;
          for (uint32_t c = 0; c < d_; ++c) row[c] += w * t[c];
        }
        for (uint32_t c = 0; c < d_; ++c) row[c] += 0.3f * normal(rng_);
        row[3] += 4.0f;
        row[d_ / 2 + 5] -= 3.0f;
      }
  }
  const float* topic(uint32_t h, uint32_t p) const {
    return topics_.data() + (std::size_t{h} * kTopics + p) * d_;
  }
  static constexpr uint32_t kTopics = 32;

 private:
  uint32_t heads_, d_;
  std::mt19937_64 rng_;
  std::vector<float> topics_;
  std::vector<uint32_t> picks_;  // [heads, 4] the topics of each head's current page
};

// Queries [n_seqs, H, G, d]: each head a scaled sum of two of its KV head's topics plus noise, so
// that a few pages dominate (and the rest form a long tail with near-ties).
std::vector<float> make_queries(const Keys& keys, uint32_t n_seqs, uint32_t H, uint32_t G,
                                uint32_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<uint32_t> topic(0, Keys::kTopics - 1);
  std::vector<float> q(std::size_t{n_seqs} * H * G * d);
  for (uint32_t s = 0; s < n_seqs; ++s)
    for (uint32_t h = 0; h < H; ++h)
      for (uint32_t g = 0; g < G; ++g) {
        float* row = q.data() + ((std::size_t{s} * H + h) * G + g) * d;
        const float* a = keys.topic(h, topic(rng));
        const float* b = keys.topic(h, topic(rng));
        for (uint32_t c = 0; c < d; ++c) row[c] = 0.6f * a[c] + 0.4f * b[c] + 0.5f * normal(rng);
      }
  return q;
}

struct Config {
  uint32_t group, head_dim;
  simd::Dtype dtype;
  std::vector<uint32_t> contexts;
  uint32_t page_tokens = 16;
};

std::string describe(const Config& c) {
  return "G=" + std::to_string(c.group) + " d=" + std::to_string(c.head_dim) +
         (c.page_tokens != 16 ? " B=" + std::to_string(c.page_tokens) : std::string()) +
         (c.dtype == simd::Dtype::bf16 ? " bf16"
          : c.dtype == simd::Dtype::q8 ? " q8"
                                       : " f16");
}

// A cache of H = 2 KV heads holding one sequence per context, one layer.
struct Fixture {
  CacheGeometry g;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<Keys> keys;
  std::vector<int32_t> seqs;
  std::vector<uint64_t> lengths;
  uint64_t max_pages = 0;

  Fixture(const Config& c, uint32_t extra_tokens, uint64_t seed) {
    g.n_layers = 1;
    g.n_kv_heads = 2;
    g.group_size = c.group;
    g.head_dim = c.head_dim;
    g.page_tokens = c.page_tokens;
    g.dtype = c.dtype;
    uint64_t pages = 0;
    for (uint32_t n : c.contexts) {
      pages += g.pages_for(n + extra_tokens) * g.n_kv_heads;
      max_pages = std::max(max_pages, g.pages_for(n + extra_tokens));
    }
    CacheOptions options;
    options.max_pages = pages + 16;
    cache = std::make_unique<KvCache>(g, options, test::kernels());
    keys = std::make_unique<Keys>(g.n_kv_heads, g.head_dim, seed);
    std::vector<float> k, v;
    for (uint32_t n : c.contexts) {
      const int32_t seq = cache->create_sequence();
      for (uint32_t at = 0; at < n;) {  // in pieces, as a chunked prefill
        const uint32_t m = std::min<uint32_t>(n - at, 8192);
        keys->make(at, m, k, v);
        cache->append(seq, 0, m, k.data(), v.data());
        at += m;
      }
      seqs.push_back(seq);
      lengths.push_back(n);
    }
  }

  // Frees sequence i and puts a new one of `tokens` fresh keys in its place, on its freed slots.
  void replace_sequence(std::size_t i, uint32_t tokens) {
    cache->free_sequence(seqs[i]);
    const int32_t seq = cache->create_sequence();
    std::vector<float> k, v;
    keys->make(0, tokens, k, v);
    cache->append(seq, 0, tokens, k.data(), v.data());
    seqs[i] = seq, lengths[i] = tokens;
  }

  void append_token() {
    std::vector<float> k, v;
    for (std::size_t i = 0; i < seqs.size(); ++i) {
      keys->make(lengths[i], 1, k, v);
      cache->append(seqs[i], 0, 1, k.data(), v.data());
      ++lengths[i];
    }
  }
};

// The chosen pages of pair i: ids and scores.
struct Chosen {
  std::vector<uint32_t> ids;
  std::vector<float> scores;
};
Chosen chosen(const select::Selection& s, uint32_t pair) {
  Chosen c;
  c.ids.assign(s.page_ids.data() + s.offsets[pair], s.page_ids.data() + s.offsets[pair + 1]);
  c.scores.assign(s.scores.data() + s.offsets[pair], s.scores.data() + s.offsets[pair + 1]);
  return c;
}

// The smallest finite score of a choice: its cut (+inf when no selectable page was chosen).
float cut_of(const Chosen& c) {
  float cut = kInf;
  for (float x : c.scores)
    if (std::isfinite(x)) cut = std::min(cut, x);
  return cut;
}

bool near(float a, float b, float relative, float absolute) {
  return std::fabs(a - b) <= relative * std::max(std::fabs(a), std::fabs(b)) + absolute;
}

struct Agreement {
  uint64_t pairs = 0, pages = 0, differing = 0;
  double worst_kept = 0.0;
};

// The device selection against the CPU's, pair by pair: equal counts and mandatory pages; a page
// chosen by one side only must score (on the side that chose it) within a near-tie of the other
// side's cut, and there are few such pages; scores of pages both chose agree; estimates agree.
void expect_agreement(const select::Selection& cpu, const select::Selection& dev,
                      select::GqaCombine combine, const std::string& where, Agreement& stats) {
  ASSERT_EQ(cpu.n_pairs, dev.n_pairs) << where;
  // Combined scores: masses relative to the best page for share_avg and nrm, log-masses for max.
  const float rel = 1e-4f, abs = combine == select::GqaCombine::max ? 1e-5f : 1e-30f;
  for (uint32_t pair = 0; pair < cpu.n_pairs; ++pair) {
    const std::string at = where + " pair " + std::to_string(pair);
    const Chosen a = chosen(cpu, pair), b = chosen(dev, pair);
    ASSERT_EQ(a.ids.size(), b.ids.size()) << at;
    const float cut_a = cut_of(a), cut_b = cut_of(b);
    std::vector<uint32_t> only;
    std::size_t i = 0, j = 0;
    while (i < a.ids.size() || j < b.ids.size()) {
      if (j == b.ids.size() || (i < a.ids.size() && a.ids[i] < b.ids[j])) {
        EXPECT_TRUE(std::isfinite(a.scores[i])) << at << ": mandatory page " << a.ids[i];
        EXPECT_TRUE(near(a.scores[i], cut_b, rel, abs) && near(a.scores[i], cut_a, rel, abs))
            << at << ": page " << a.ids[i] << " (CPU only) scores " << a.scores[i] << ", cuts "
            << cut_a << " (CPU) " << cut_b << " (device)";
        only.push_back(a.ids[i++]);
      } else if (i == a.ids.size() || b.ids[j] < a.ids[i]) {
        EXPECT_TRUE(std::isfinite(b.scores[j])) << at << ": mandatory page " << b.ids[j];
        EXPECT_TRUE(near(b.scores[j], cut_a, rel, abs) && near(b.scores[j], cut_b, rel, abs))
            << at << ": page " << b.ids[j] << " (device only) scores " << b.scores[j] << ", cuts "
            << cut_a << " (CPU) " << cut_b << " (device)";
        only.push_back(b.ids[j++]);
      } else {
        if (std::isinf(a.scores[i]) || std::isinf(b.scores[j]))
          EXPECT_EQ(a.scores[i], b.scores[j]) << at << " page " << a.ids[i];
        else
          EXPECT_TRUE(near(a.scores[i], b.scores[j], rel, abs))
              << at << " page " << a.ids[i] << ": " << a.scores[i] << " vs " << b.scores[j];
        ++i, ++j;
      }
    }
    EXPECT_LE(only.size(), 4 + a.ids.size() / 50) << at << ": too many pages differ";
    const float ka = cpu.kept_estimate[pair], kb = dev.kept_estimate[pair];
    EXPECT_NEAR(ka, kb, 1e-3f) << at;
    EXPECT_TRUE(std::isnan(dev.dropped_bound[pair])) << at;
    stats.pairs += 1;
    stats.pages += a.ids.size();
    stats.differing += only.size();
    stats.worst_kept = std::max(stats.worst_kept, double(std::fabs(ka - kb)));
  }
  EXPECT_EQ(cpu.index_bytes_read, dev.index_bytes_read) << where;
}

const std::vector<Config>& configs() {
  static const std::vector<Config> all = {
      {1, 128, simd::Dtype::bf16, {1000, 5003, 30000, 100000}},
      {4, 128, simd::Dtype::bf16, {1000, 5003, 30000, 100000}},
      {4, 128, simd::Dtype::f16, {1024, 7000, 20011}},
      {1, 64, simd::Dtype::f16, {999, 4096, 20000}},
      {4, 64, simd::Dtype::bf16, {1000, 6000, 20000}},
  };
  return all;
}

// The selectors' configurations: configs() and a q8 cache, whose records both sides build from
// the dequantized keys and whose open pages the device reads in fp16 (lib/select/locks_device.hpp).
const std::vector<Config>& selector_configs() {
  static const std::vector<Config> all = [] {
    std::vector<Config> c = configs();
    c.push_back({4, 128, simd::Dtype::q8, {1000, 7001, 20000}});
    return c;
  }();
  return all;
}

// ---- Everywhere: the plan and the refusals -------------------------------------------------

// locks_pair_plan's count and whole-pair rule match the CPU selector's choice for contexts around
// the edges (a page, a page and one token, sink + window, budgets of none, some, everything).
TEST(LocksPairPlan, matches_the_cpu_selector_s_counts) {
  for (double budget : {0.02, 0.1, 0.5, 1.0, 48.0, 4000.0}) {
    Config c{4, 64, simd::Dtype::f16, {1, 15, 16, 17, 31, 32, 33, 48, 100, 1000, 4099}};
    Fixture f(c, 0, 3);
    select::Policy policy;
    policy.kind = select::Kind::locks;
    policy.budget = budget;
    auto cpu = select::Selector::create(policy, *f.cache, f.seqs.size(), f.max_pages, test::pool(1),
                                        test::kernels());
    select::Selection sel;
    cpu->reserve_selection(sel);
    const auto q = make_queries(*f.keys, f.seqs.size(), 2, 4, 64, 9);
    const select::SelectCall call{0, static_cast<uint32_t>(f.seqs.size()), f.seqs.data(), q.data()};
    cpu->prepare(call, sel);
    cpu->select(call, sel);
    gpu::LocksScorerShape shape;
    shape.head_dim = 64;
    shape.page_tokens = 16;
    for (uint32_t pair = 0; pair < sel.n_pairs; ++pair) {
      const uint64_t tokens = f.lengths[pair / 2];
      const gpu::LocksPairPlan plan =
          gpu::locks_pair_plan(shape, tokens, policy.budget_tokens(tokens));
      const Chosen ch = chosen(sel, pair);
      const std::string at =
          "budget " + std::to_string(budget) + " tokens " + std::to_string(tokens);
      EXPECT_EQ(plan.count, ch.ids.size()) << at;
      EXPECT_EQ(plan.n_pages, f.g.pages_for(tokens)) << at;
      const bool all_inf =
          std::all_of(ch.scores.begin(), ch.scores.end(), [](float x) { return std::isinf(x); });
      EXPECT_EQ(plan.whole, all_inf && sel.kept_estimate[pair] == 1.0f) << at;
      uint32_t mandatory = 0;
      for (float x : ch.scores) mandatory += std::isinf(x);
      if (!plan.whole) {
        EXPECT_EQ(mandatory, plan.n_pages - (plan.sel_last - plan.sink)) << at;
      }
    }
  }
}

TEST(LocksSelectorDevice, refuses_bad_policies_and_a_missing_device_at_creation) {
  CacheGeometry g;
  g.n_kv_heads = 2;
  g.group_size = 4;
  CacheOptions options;
  options.max_pages = 64;
  KvCache cache(g, options, test::kernels());
  select::Policy policy;
  policy.kind = select::Kind::locks;
  policy.budget = 0.1;
  policy.device = -2;
  test::expect_error(
      [&] { select::Selector::create(policy, cache, 1, 64, test::pool(1), test::kernels()); },
      Status::invalid_argument, "policy.device");
  policy.device = 0;
  policy.kind = select::Kind::locks_certified;
  test::expect_error(
      [&] { select::Selector::create(policy, cache, 1, 64, test::pool(1), test::kernels()); },
      Status::invalid_argument, "certified");
  policy.kind = select::Kind::locks;
  policy.locks.int8_query = false;
  test::expect_error(
      [&] { select::Selector::create(policy, cache, 1, 64, test::pool(1), test::kernels()); },
      Status::invalid_argument, "int8");
  policy.locks.int8_query = true;
  std::string why;
  const bool usable = test::device_usable(&why);
  policy.device = usable ? 4096 : 0;
  try {
    select::Selector::create(policy, cache, 1, 64, test::pool(1), test::kernels());
    ADD_FAILURE() << "device " << policy.device << " accepted";
  } catch (const Error& e) {
    if (!usable) {
      EXPECT_EQ(e.status(), Status::unsupported) << e.what();
    }
    EXPECT_NE(std::string(e.what()).find("locks device scorer"), std::string::npos) << e.what();
  }
  // Other kinds ignore the field; the CPU path takes no device.
  policy.device = -1;
  EXPECT_NO_THROW(select::Selector::create(policy, cache, 1, 64, test::pool(1), test::kernels()));
  policy.device = 0;
  policy.kind = select::Kind::quest;
  EXPECT_NO_THROW(select::Selector::create(policy, cache, 1, 64, test::pool(1), test::kernels()));
}

TEST(LocksScorer, is_unsupported_without_a_device_and_refuses_bad_shapes_with_one) {
  gpu::LocksScorerShape shape;
  shape.scale = 0.125f;
  shape.slots = 64;
  shape.max_pages = 64;
  std::string why;
  if (!test::device_usable(&why)) {
    gpu::LocksScorer scorer;
    const gpu::Result r = scorer.init(0, shape);
    EXPECT_FALSE(r.ok);
    EXPECT_TRUE(r.unsupported) << r.message;
    return;
  }
  const auto refused = [](gpu::LocksScorerShape s) {
    gpu::LocksScorer scorer;
    const gpu::Result r = scorer.init(0, s);
    return !r.ok && !r.unsupported;
  };
  EXPECT_FALSE(refused(shape));
  for (uint32_t d : {0u, 96u, 512u}) {
    gpu::LocksScorerShape s = shape;
    s.head_dim = d;
    EXPECT_TRUE(refused(s)) << "head_dim=" << d;
  }
  for (uint32_t r : {4u, 16u}) {
    gpu::LocksScorerShape s = shape;
    s.rank = r;
    EXPECT_TRUE(refused(s)) << "rank=" << r;
  }
  for (uint32_t group : {0u, 65u}) {
    gpu::LocksScorerShape s = shape;
    s.group = group;
    EXPECT_TRUE(refused(s)) << "group=" << group;
  }
  gpu::LocksScorerShape s = shape;
  s.scale = 0.0f;
  EXPECT_TRUE(refused(s));
  s = shape;
  s.max_pairs = 0;
  EXPECT_TRUE(refused(s));
  // A batch validate() refuses, and an upload of a slot out of range.
  gpu::LocksScorer scorer;
  ASSERT_TRUE(scorer.init(0, shape).ok);
  std::vector<float> q(128, 1.0f);
  std::vector<uint32_t> table(64, 0);
  std::vector<uint16_t> keys(16 * 128, 0);
  gpu::LocksPair pair{q.data(), table.data(), nullptr, 32, 8};
  EXPECT_TRUE(scorer.validate(&pair, 1).ok);
  EXPECT_FALSE(scorer.validate(&pair, 0).ok);
  EXPECT_FALSE(scorer.validate(&pair, 2).ok);  // over max_pairs
  pair.tokens = 33;                            // an open page without keys
  EXPECT_FALSE(scorer.validate(&pair, 1).ok);
  pair.open_keys = keys.data();
  EXPECT_TRUE(scorer.validate(&pair, 1).ok);
  pair.tokens = 16 * 65;  // more pages than max_pages = 1
  EXPECT_FALSE(scorer.validate(&pair, 1).ok);
  std::vector<std::byte> record(64 * 832);
  const uint32_t bad = 64;
  EXPECT_FALSE(scorer.upload(record.data(), &bad, 1).ok);
}

// ---- On the device -------------------------------------------------------------------------

// Builds the records of pages [first_page, sealed) of every (sequence, KV head) into records
// (slot-indexed) and lists their slots.
void build_records(const Fixture& f, const Config& c, uint64_t first_page,
                   std::vector<std::byte>& records, std::vector<uint32_t>& listed) {
  const select::LocksShape lshape{c.head_dim, f.g.page_tokens, select::kLocksDefaultRank};
  const std::size_t rb = select::locks_record_bytes(lshape);
  records.resize(f.cache->pool().capacity() * rb);
  for (int32_t seq : f.seqs)
    for (uint32_t h = 0; h < f.g.n_kv_heads; ++h) {
      const uint32_t* table = f.cache->page_table(seq, 0, h);
      for (uint64_t p = first_page; p < f.cache->length(seq, 0) / f.g.page_tokens; ++p) {
        select::locks_build(lshape,
                            reinterpret_cast<const uint16_t*>(f.cache->pool().slot(table[p])),
                            c.dtype, records.data() + std::size_t{table[p]} * rb);
        listed.push_back(table[p]);
      }
    }
}

gpu::LocksScorerShape scorer_shape(const Fixture& f, const Config& c, uint32_t pairs) {
  gpu::LocksScorerShape shape;
  shape.head_dim = c.head_dim;
  shape.page_tokens = f.g.page_tokens;
  shape.group = c.group;
  shape.dtype = c.dtype;
  shape.scale = 1.0f / std::sqrt(float(c.head_dim));
  shape.slots = static_cast<uint32_t>(f.cache->pool().capacity());
  shape.max_pairs = pairs;
  shape.max_pages = shape.slots;
  return shape;
}

// The pair of sequence i / H, KV head i % H, with the fixture's queries.
gpu::LocksPair pair_of(const Fixture& f, const std::vector<float>& q, uint32_t group, uint32_t d,
                       uint32_t i) {
  const uint32_t H = f.g.n_kv_heads, B = f.g.page_tokens;
  gpu::LocksPair p;
  p.q = q.data() + std::size_t{i} * group * d;
  p.table = f.cache->page_table(f.seqs[i / H], 0, i % H);
  p.tokens = f.lengths[i / H];
  p.budget_tokens = p.tokens / 50;
  if (p.tokens % B)
    p.open_keys = reinterpret_cast<const uint16_t*>(f.cache->pool().slot(p.table[p.tokens / B]));
  return p;
}

// Runs the pairs and checks every device page score against simd's locks_score over the
// cache's table (sealed pages) and the exact log-sum-exp (the open page); the worst relative
// difference into *worst.
void expect_cpu_head_scores(const Fixture& f, const Config& c, gpu::LocksScorer& scorer,
                            const std::vector<gpu::LocksPair>& pairs,
                            const std::vector<std::byte>& records, const std::string& where,
                            double* worst) {
  const uint32_t G = c.group, d = c.head_dim, B = f.g.page_tokens;
  const auto n_pairs = static_cast<uint32_t>(pairs.size());
  ASSERT_TRUE(scorer.validate(pairs.data(), n_pairs).ok) << where;
  const gpu::Result r = scorer.run(pairs.data(), n_pairs);
  ASSERT_TRUE(r.ok) << where << ": " << r.message;
  const simd::Kernels& kernels = test::kernels();  // the cache's
  for (uint32_t i = 0; i < n_pairs; ++i) {
    const gpu::LocksPair& p = pairs[i];
    const uint32_t n_pages = static_cast<uint32_t>(f.g.pages_for(p.tokens));
    const uint32_t sealed = static_cast<uint32_t>(p.tokens / B);
    std::vector<float> dev(std::size_t{G} * n_pages), cpu(std::size_t{G} * sealed);
    if (gpu::locks_pair_plan(scorer.shape(), p.tokens, p.budget_tokens).whole) continue;
    const gpu::Result hr = scorer.head_scores(i, dev.data());
    ASSERT_TRUE(hr.ok) << hr.message;
    simd::LocksScoreJob job{};
    job.q = p.q;
    job.group = G;
    job.head_dim = d;
    job.page_tokens = B;
    job.rank = select::kLocksDefaultRank;
    job.int8_query = true;
    job.scale = scorer.shape().scale;
    job.records = records.data();
    job.record_bytes = select::locks_record_bytes({d, B, select::kLocksDefaultRank});
    job.slots = p.table;
    job.count = sealed;
    job.lse = cpu.data();
    kernels.locks_score(job);
    for (uint32_t g = 0; g < G; ++g) {
      for (uint32_t page = 0; page < sealed; ++page) {
        const float a = cpu[std::size_t{g} * sealed + page];
        const float b = dev[std::size_t{g} * n_pages + page];
        *worst = std::max(*worst, double(std::fabs(a - b)) / (1.0 + std::fabs(a)));
        ASSERT_TRUE(near(a, b, 2e-5f, 2e-5f)) << where << " pair " << i << " head " << g << " page "
                                              << page << ": " << a << " vs " << b;
      }
      if (sealed < n_pages) {  // the open page, exactly
        const uint32_t n = static_cast<uint32_t>(p.tokens % B);
        std::vector<float> key(d);
        float logits[64], top = -kInf;
        for (uint32_t t = 0; t < n; ++t) {
          kernels.decode(p.open_keys + std::size_t{t} * d, key.data(), d, c.dtype);
          float dot = 0.0f;
          for (uint32_t ch = 0; ch < d; ++ch) dot += p.q[g * d + ch] * key[ch];
          logits[t] = dot * scorer.shape().scale;
          top = std::max(top, logits[t]);
        }
        float sum = 0.0f;
        for (uint32_t t = 0; t < n; ++t) sum += std::exp(logits[t] - top);
        EXPECT_TRUE(near(top + std::log(sum), dev[std::size_t{g} * n_pages + sealed], 1e-5f, 1e-5f))
            << where << " pair " << i << " open page";
      }
    }
  }
}

// The device's per-head scores of every sealed page of configuration c against the CPU kernel the
// selector uses (the cache's table), and the open page's against its exact log-sum-exp.
void expect_head_scores_match(const Config& c) {
  Fixture f(c, 0, 17);
  const uint32_t H = f.g.n_kv_heads;
  std::vector<std::byte> records;
  std::vector<uint32_t> listed;
  build_records(f, c, 0, records, listed);
  const gpu::LocksScorerShape shape = scorer_shape(f, c, static_cast<uint32_t>(f.seqs.size()) * H);
  gpu::LocksScorer scorer;
  const gpu::Result init = scorer.init(0, shape);
  ASSERT_TRUE(init.ok) << describe(c) << ": " << init.message;
  const gpu::Result up = scorer.upload(records.data(), listed.data(), listed.size());
  ASSERT_TRUE(up.ok) << up.message;
  const auto q = make_queries(*f.keys, f.seqs.size(), H, c.group, c.head_dim, 23);
  std::vector<gpu::LocksPair> pairs;
  for (uint32_t i = 0; i < shape.max_pairs; ++i)
    pairs.push_back(pair_of(f, q, c.group, c.head_dim, i));
  double worst = 0.0;
  expect_cpu_head_scores(f, c, scorer, pairs, records, describe(c), &worst);
  if (::testing::Test::HasFatalFailure()) return;
  std::printf("[ LOCKS ] %s: worst |cpu - device| / (1 + |cpu|) of the page scores %.3g\n",
              describe(c).c_str(), worst);
}

TEST(LocksScorer, head_scores_match_the_cpu_kernel) {
  KVSIFT_SKIP_WITHOUT_DEVICE();
  for (const Config& c : configs()) {
    expect_head_scores_match(c);
    if (HasFatalFailure()) return;
  }
}

// The score kernel's other paths: heads in two passes (G = 8) and past the group in the last
// pass (G = 6), a second block of heads (G = 12), head_dim 256 (its swizzle), 32-page blocks
// (records of page_tokens 32 and 64), tiles the pages do not fill, and contexts of one page and
// one page and a token.
TEST(LocksScorer, head_scores_match_the_cpu_kernel_for_every_score_kernel_path) {
  KVSIFT_SKIP_WITHOUT_DEVICE();
  static const std::vector<Config> more = {
      {8, 128, simd::Dtype::bf16, {5003, 20000}},    {6, 64, simd::Dtype::bf16, {1000, 4099}},
      {12, 128, simd::Dtype::f16, {3000}},           {2, 256, simd::Dtype::f16, {999, 7000}},
      {4, 256, simd::Dtype::bf16, {16, 17, 4000}},   {4, 128, simd::Dtype::bf16, {1000, 20000}, 32},
      {1, 256, simd::Dtype::bf16, {2000, 9001}, 64}, {3, 64, simd::Dtype::f16, {64, 65, 3001}, 64},
  };
  for (const Config& c : more) {
    expect_head_scores_match(c);
    if (HasFatalFailure()) return;
  }
}

// Named tables: over decode steps that seal pages, the device's copies (fewer than the pairs, so
// that they are reused) give the scores of the cache's tables; so do a table named twice in one
// run, and a freed sequence's reused id whose tables get new names.
TEST(LocksScorer, keeps_named_tables_and_takes_only_their_new_entries) {
  KVSIFT_SKIP_WITHOUT_DEVICE();
  const Config c{4, 128, simd::Dtype::bf16, {3000, 9001, 20000}};
  Fixture f(c, 8100, 41);
  const uint32_t H = f.g.n_kv_heads, n_pairs = static_cast<uint32_t>(f.seqs.size()) * H;
  std::vector<std::byte> records;
  std::vector<uint32_t> listed;
  build_records(f, c, 0, records, listed);
  gpu::LocksScorerShape shape = scorer_shape(f, c, n_pairs + 1);
  shape.table_copies = n_pairs - 2;
  shape.max_pair_pages = f.max_pages;
  gpu::LocksScorer scorer;
  ASSERT_TRUE(scorer.init(0, shape).ok);
  ASSERT_TRUE(scorer.upload(records.data(), listed.data(), listed.size()).ok);
  std::vector<uint64_t> names(f.seqs.size());
  for (std::size_t s = 0; s < names.size(); ++s) names[s] = 1 + s * H;
  double worst = 0.0;
  for (uint32_t step = 0; step < 40; ++step) {
    if (step == 20) {  // free the middle sequence, refill its slots, name its tables anew
      f.replace_sequence(1, 8000);
      names[1] = 1000;
      listed.clear();
      build_records(f, c, 0, records, listed);
      ASSERT_TRUE(scorer.upload(records.data(), listed.data(), listed.size()).ok);
    }
    for (int m = 0; m < 7; ++m) {  // several pages seal between runs
      f.append_token();
      for (std::size_t s = 0; s < f.seqs.size(); ++s)
        if (f.lengths[s] % f.g.page_tokens == 0) {
          listed.clear();
          build_records(f, c, f.lengths[s] / f.g.page_tokens - 1, records, listed);
          ASSERT_TRUE(scorer.upload(records.data(), listed.data(), listed.size()).ok);
        }
    }
    const auto q = make_queries(*f.keys, f.seqs.size(), H, c.group, c.head_dim, 300 + step);
    std::vector<gpu::LocksPair> pairs;
    for (uint32_t j = 0; j < n_pairs; ++j) {  // in a rotating order, so that copies are reused
      const uint32_t i = (j + step) % n_pairs;
      pairs.push_back(pair_of(f, q, c.group, c.head_dim, i));
      pairs.back().table_id = names[i / H] + i % H;
    }
    if (step % 3 == 0) pairs.push_back(pairs[step % n_pairs]);  // a table named twice
    expect_cpu_head_scores(f, c, scorer, pairs, records, "step " + std::to_string(step), &worst);
    if (HasFatalFailure()) return;
  }
  std::printf("[ LOCKS ] named tables: worst |cpu - device| / (1 + |cpu|) %.3g\n", worst);
}

// Two selectors of one policy on one cache, CPU and device: agreement (expect_agreement) for each
// configuration, GQA combine and budget, then over decode steps that seal new pages (uploaded in
// prepare()) and a freed sequence whose slots are reused.
TEST(LocksSelectorDevice, chooses_the_cpu_s_pages_but_at_near_ties) {
  KVSIFT_SKIP_WITHOUT_DEVICE();
  for (const Config& c : selector_configs()) {
    Fixture f(c, 40, 29);
    const uint32_t n_seqs = static_cast<uint32_t>(f.seqs.size());
    for (select::GqaCombine combine :
         {select::GqaCombine::share_avg, select::GqaCombine::nrm, select::GqaCombine::max}) {
      for (double budget : {0.02, 0.1, 512.0}) {
        if (c.group == 1 && combine != select::GqaCombine::share_avg) continue;  // all alike
        select::Policy policy;
        policy.kind = select::Kind::locks;
        policy.budget = budget;
        policy.combine = combine;
        auto cpu = select::Selector::create(policy, *f.cache, n_seqs, f.max_pages, test::pool(2),
                                            test::kernels());
        policy.device = 0;
        auto dev = select::Selector::create(policy, *f.cache, n_seqs, f.max_pages, test::pool(2),
                                            test::kernels());
        select::Selection sel_cpu, sel_dev;
        cpu->reserve_selection(sel_cpu);
        dev->reserve_selection(sel_dev);
        Agreement stats;
        const std::string where = describe(c) + " " + std::string(select::combine_name(combine)) +
                                  " budget " + std::to_string(budget);
        for (uint32_t step = 0; step < 3; ++step) {
          const auto q = make_queries(*f.keys, n_seqs, 2, c.group, c.head_dim, 100 + step);
          const select::SelectCall call{0, n_seqs, f.seqs.data(), q.data()};
          cpu->prepare(call, sel_cpu);
          cpu->select(call, sel_cpu);
          dev->prepare(call, sel_dev);
          dev->select(call, sel_dev);
          expect_agreement(sel_cpu, sel_dev, combine, where + " step " + std::to_string(step),
                           stats);
          if (HasFatalFailure()) return;
        }
        const auto& page_dev = dynamic_cast<const select::PageSelector&>(*dev);
        EXPECT_EQ(page_dev.device_fallbacks(), 0u) << where;
        EXPECT_GT(page_dev.device_bytes(), 0u) << where;
        std::printf("[ LOCKS ] %s: %lu pairs, %lu pages, %lu differing, kept within %.2g\n",
                    where.c_str(), (unsigned long)stats.pairs, (unsigned long)stats.pages,
                    (unsigned long)stats.differing, stats.worst_kept);
      }
    }
  }
}

TEST(LocksSelectorDevice, follows_decode_steps_that_seal_pages_and_reuse_slots) {
  KVSIFT_SKIP_WITHOUT_DEVICE();
  Config c{4, 128, simd::Dtype::bf16, {3000, 9001, 20000}};
  Fixture f(c, 80, 31);
  const uint32_t n_seqs = static_cast<uint32_t>(f.seqs.size());
  select::Policy policy;
  policy.kind = select::Kind::locks;
  policy.budget = 0.05;
  auto cpu = select::Selector::create(policy, *f.cache, n_seqs, f.max_pages, test::pool(2),
                                      test::kernels());
  policy.device = 0;
  auto dev = select::Selector::create(policy, *f.cache, n_seqs, f.max_pages, test::pool(2),
                                      test::kernels());
  select::Selection sel_cpu, sel_dev;
  cpu->reserve_selection(sel_cpu);
  dev->reserve_selection(sel_dev);
  Agreement stats;
  for (uint32_t step = 0; step < 60; ++step) {
    if (step == 30) f.replace_sequence(1, 8000);  // the middle one, on its freed slots
    f.append_token();
    const auto q = make_queries(*f.keys, n_seqs, 2, c.group, c.head_dim, 500 + step);
    const select::SelectCall call{0, n_seqs, f.seqs.data(), q.data()};
    cpu->prepare(call, sel_cpu);
    cpu->select(call, sel_cpu);
    dev->prepare(call, sel_dev);
    dev->select(call, sel_dev);
    expect_agreement(sel_cpu, sel_dev, policy.combine, "step " + std::to_string(step), stats);
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(dynamic_cast<const select::PageSelector&>(*dev).device_fallbacks(), 0u);
  std::printf("[ LOCKS ] decode: %lu pairs, %lu pages, %lu differing, kept within %.2g\n",
              (unsigned long)stats.pairs, (unsigned long)stats.pages,
              (unsigned long)stats.differing, stats.worst_kept);
}

}  // namespace
}  // namespace kvsift
