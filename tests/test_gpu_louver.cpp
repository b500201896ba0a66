// Louver's filter pass on the GPU (gpu/louver_filter.hpp) against the CPU's: the device's
// candidates equal the CPU filter's and contain the answer, on structured keys
// (bench/key_maker.hpp) over several subspace counts and both CPU arithmetics; and the Louver
// selector with the device filter chooses exactly the CPU mode's tokens over decode steps with
// buffer flushes and a freed sequence. The CPU half of the split query (begin_query / filter_mask /
// finish_query) and the refusals that need no device run everywhere; the rest skips without a CUDA
// build or device.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <memory>
#include <string>
#include <vector>

#include "bench/key_maker.hpp"
#include "gpu/host_memory.hpp"
#include "gpu/louver_filter.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/core/error.hpp"
#include "lib/select/louver_index.hpp"
#include "lib/select/louver_selector.hpp"
#include "lib/select/selector.hpp"
#include "simd/isa.hpp"
#include "tests/gpu_skip.hpp"
#include "tests/test_util.hpp"

namespace kvsift {
namespace {

constexpr uint32_t kDim = 128;

// Keys of KV head h of a KeyMaker layer with `heads` KV heads: [n, kDim].
std::vector<float> head_keys(uint32_t heads, uint32_t h, uint64_t first, uint32_t n,
                             uint64_t seed) {
  bench::KeyMaker maker(bench::Shape{"test", heads, 1, kDim}, seed);
  std::vector<float> k, v, out(std::size_t{n} * kDim);
  maker.make(first, n, k, v);
  for (uint32_t i = 0; i < n; ++i)
    std::copy_n(k.data() + (std::size_t{i} * heads + h) * kDim, kDim, out.data() + i * kDim);
  return out;
}

// G query heads, each a small multiple of a few keys (the needles) plus noise.
std::vector<float> needle_queries(const std::vector<float>& keys, uint32_t group, uint64_t seed) {
  bench::Random random(seed);
  const uint64_t n = keys.size() / kDim;
  std::vector<float> q(std::size_t{group} * kDim, 0.0f);
  for (uint32_t g = 0; g < group; ++g) {
    float* row = q.data() + std::size_t{g} * kDim;
    for (uint32_t j = 0; j < 4; ++j) {
      const uint64_t needle = uint64_t((random.uniform() + 1.0f) * 0.5f * n) % n;
      for (uint32_t c = 0; c < kDim; ++c) row[c] += 0.1f * keys[needle * kDim + c];
    }
    for (uint32_t c = 0; c < kDim; ++c) row[c] += 0.2f * random.uniform();
  }
  return q;
}

// An index over n keys of head h, then `appended` more through append() (a flush every
// buffer_keys, the rest buffered).
std::unique_ptr<LouverIndex> make_index(uint32_t S, simd::Level isa, uint32_t h, uint32_t n,
                                        uint32_t appended, uint64_t seed) {
  LouverParams params;
  params.head_dim = kDim;
  params.n_subspaces = S;
  params.max_group = 4;
  params.isa = isa;
  const std::vector<float> keys = head_keys(4, h, 0, n + appended, seed);
  auto index = std::make_unique<LouverIndex>(params, keys.data(), n);
  for (uint32_t i = 0; i < appended; ++i) index->append(keys.data() + std::size_t{n + i} * kDim);
  return index;
}

std::vector<LouverQuery> test_queries() {
  std::vector<LouverQuery> queries(4);
  queries[0].fraction = 0.10f;  // sample_fraction, the authors' setting
  queries[1].fraction = 0.01f;  // a tail threshold, where the bounds prune
  queries[1].scan_fallback = false;
  queries[2].tau_mode = LouverTau::token_budget;  // the selector's form
  queries[2].budget_tokens = 64;
  queries[3].tau_mode = LouverTau::target_mass;
  queries[3].scan_fallback = false;
  return queries;
}

std::vector<uint32_t> ids(std::span<const uint32_t> span) {
  return {span.begin(), span.end()};
}

uint32_t mask_words(const LouverIndex& index) {
  return static_cast<uint32_t>((index.indexed() + 31) / 32);
}

// Every indexed key of `answer` is set in `mask`.
bool holds(const std::vector<uint32_t>& mask, const std::vector<uint32_t>& answer,
           uint64_t indexed) {
  for (uint32_t t : answer)
    if (t < indexed && !(mask[t / 32] >> (t % 32) & 1u)) return false;
  return true;
}

// ---- CPU: the split query ------------------------------------------------------------------

// finish_query() returns query()'s tokens from the CPU filter's mask, from every key, and from
// the answer's own keys alone: the exact check decides, whatever superset the filter kept.
TEST(LouverSplitQuery, finish_query_returns_query_s_tokens_for_any_superset_of_the_answer) {
  for (uint32_t S : {1u, 2u, 4u, 8u, 16u}) {
    auto index = make_index(S, simd::Level::avx512, 0, 3000, 300, 11 + S);
    const std::vector<float> keys = head_keys(4, 0, 0, 3300, 11 + S);
    const uint32_t words = mask_words(*index);
    for (uint32_t group : {1u, 4u}) {
      const std::vector<float> q = needle_queries(keys, group, 100 + S * group);
      for (const LouverQuery& query : test_queries()) {
        const LouverResult r = index->query(q.data(), group, query);
        const std::vector<uint32_t> want = ids(r.token_ids);
        std::vector<uint32_t> brute(index->size());
        brute.resize(index->scan(q.data(), group, r.tau.data(), brute.data()));
        ASSERT_EQ(want, brute);
        LouverGateTerms terms[4];
        std::vector<uint32_t> mask(words + 1);
        index->begin_query(q.data(), group, query, terms);
        index->filter_mask(q.data(), group, terms, mask.data());
        ASSERT_TRUE(holds(mask, want, index->indexed())) << "S=" << S << " G=" << group;
        EXPECT_EQ(ids(index->finish_query(q.data(), group, query, mask.data()).token_ids), want)
            << "S=" << S << " G=" << group << " mode=" << int(query.tau_mode);
        std::fill(mask.begin(), mask.end(), ~0u);
        index->begin_query(q.data(), group, query, terms);
        const LouverResult all = index->finish_query(q.data(), group, query, mask.data());
        EXPECT_EQ(ids(all.token_ids), want);
        EXPECT_EQ(all.candidates, index->indexed());
        std::fill(mask.begin(), mask.end(), 0u);
        for (uint32_t t : want)
          if (t < index->indexed()) mask[t / 32] |= 1u << (t % 32);
        index->begin_query(q.data(), group, query, terms);
        EXPECT_EQ(ids(index->finish_query(q.data(), group, query, mask.data()).token_ids), want);
      }
    }
  }
}

TEST(LouverSelectorDevice, refuses_a_device_it_cannot_use_when_created) {
  CacheGeometry g;
  g.n_kv_heads = 2;
  g.group_size = 4;
  g.head_dim = kDim;
  CacheOptions options;
  options.max_pages = 64;
  KvCache cache(g, options, test::kernels());
  select::Policy policy;
  policy.kind = select::Kind::louver;
  policy.budget = 0.1;
  policy.device = -2;
  try {
    select::Selector::create(policy, cache, 1, 64, test::pool(1), test::kernels());
    ADD_FAILURE() << "device -2 accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::invalid_argument) << e.what();
  }
  std::string why;
  policy.device = test::device_usable(&why) ? 4096 : 0;
  try {
    select::Selector::create(policy, cache, 1, 64, test::pool(1), test::kernels());
    ADD_FAILURE() << "device " << policy.device << " accepted";
  } catch (const Error& e) {
    if (policy.device == 0) {
      EXPECT_EQ(e.status(), Status::unsupported) << e.what();
    }
    EXPECT_NE(std::string(e.what()).find("louver device filter"), std::string::npos) << e.what();
  }
}

TEST(LouverFilter, refuses_bad_shapes_before_touching_the_device) {
  if (const gpu::Result r = gpu::backend_status(); !r.ok)
    GTEST_SKIP() << "every call is unsupported without the CUDA backend: " << r.message;
  const auto refused = [](gpu::LouverFilterShape shape, int device = 0) {
    gpu::LouverFilter filter;
    const gpu::Result r = filter.init(device, shape);
    return !r.ok && !r.unsupported;
  };
  gpu::LouverFilterShape shape;
  for (uint32_t d : {0u, 24u, 272u}) {
    shape.head_dim = d;
    EXPECT_TRUE(refused(shape)) << "head_dim=" << d;
  }
  shape = {};
  for (uint32_t group : {0u, 17u}) {
    shape.max_group = group;
    EXPECT_TRUE(refused(shape)) << "max_group=" << group;
  }
  shape = {};
  shape.max_items = 0;
  EXPECT_TRUE(refused(shape));
  EXPECT_TRUE(refused(gpu::LouverFilterShape{}, -1));
  gpu::LouverFilter filter;  // never initialised
  const gpu::LouverIndexView view;
  EXPECT_FALSE(filter.sync(0, view).ok);
  const gpu::LouverFilterItem item;
  EXPECT_FALSE(filter.validate(&item, 1).ok);
}

// ---- GPU -----------------------------------------------------------------------------------

struct Round {
  std::vector<std::vector<float>> q;  // per index [group, kDim]
  std::vector<std::vector<float>> q_norm, t;
  std::vector<gpu::LouverFilterItem> items;
};

// One batch over the indexes (slot i = index i): begin_query on each, the device run, then per
// index the masks compared with the CPU filter's and finish_query against query().
void expect_device_matches(std::vector<std::unique_ptr<LouverIndex>>& indexes,
                           gpu::LouverFilter& filter, const std::vector<std::vector<float>>& keys,
                           uint32_t group, const LouverQuery& query, uint64_t seed,
                           const std::string& what) {
  const uint32_t n = static_cast<uint32_t>(indexes.size());
  Round round;
  round.q.resize(n), round.q_norm.resize(n), round.t.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    round.q[i] = needle_queries(keys[i], group, seed + i);
    LouverGateTerms terms[4];
    indexes[i]->begin_query(round.q[i].data(), group, query, terms);
    round.q_norm[i].resize(std::size_t{group} * simd::kLouverMaxSubspaces);
    round.t[i].resize(group);
    for (uint32_t g = 0; g < group; ++g) {
      std::copy_n(terms[g].q_norm, simd::kLouverMaxSubspaces,
                  round.q_norm[i].data() + std::size_t{g} * simd::kLouverMaxSubspaces);
      round.t[i][g] = terms[g].t;
    }
    round.items.push_back(gpu::LouverFilterItem{i, group, round.q[i].data(), round.q_norm[i].data(),
                                                round.t[i].data()});
  }
  ASSERT_TRUE(filter.validate(round.items.data(), n).ok) << what;
  const gpu::Result r = filter.run(round.items.data(), n);
  ASSERT_TRUE(r.ok) << what << ": " << r.message;
  for (uint32_t i = 0; i < n; ++i) {
    LouverIndex& index = *indexes[i];
    ASSERT_EQ(filter.mask_keys(i), index.indexed()) << what;
    const uint32_t words = mask_words(index);
    const std::vector<uint32_t> device(filter.mask(i), filter.mask(i) + words);
    // The CPU filter with the same terms (begin_query again: filter_mask does not change tau).
    LouverGateTerms terms[4];
    index.begin_query(round.q[i].data(), group, query, terms);
    std::vector<uint32_t> cpu(words);
    index.filter_mask(round.q[i].data(), group, terms, cpu.data());
    uint64_t differ = 0, device_kept = 0, cpu_kept = 0;
    for (uint32_t w = 0; w < words; ++w) {
      differ += std::popcount(device[w] ^ cpu[w]);
      device_kept += std::popcount(device[w]), cpu_kept += std::popcount(cpu[w]);
    }
    EXPECT_EQ(differ, 0u) << what << " index " << i << ": the device kept " << device_kept
                          << " keys, the CPU " << cpu_kept << " of " << index.indexed();
    if (index.indexed() % 32 != 0) {
      EXPECT_EQ(device[words - 1] >> (index.indexed() % 32), 0u) << "bits past the keys";
    }
    const LouverResult want = index.query(round.q[i].data(), group, query);
    const std::vector<uint32_t> answer = ids(want.token_ids);
    ASSERT_TRUE(holds(device, answer, index.indexed())) << what << " index " << i;
    index.begin_query(round.q[i].data(), group, query, terms);
    EXPECT_EQ(ids(index.finish_query(round.q[i].data(), group, query, device.data()).token_ids),
              answer)
        << what << " index " << i;
  }
}

TEST(LouverFilter, device_candidates_equal_the_cpu_filters_and_hold_the_answer) {
  KVSIFT_SKIP_WITHOUT_DEVICE();
  std::vector<simd::Level> isas{simd::Level::scalar};
  if (simd::resolve_level(simd::Level::avx512) == simd::Level::avx512)
    isas.push_back(simd::Level::avx512);
  constexpr uint32_t kIndexes = 4, kPrompt = 20000;
  for (simd::Level isa : isas)
    for (uint32_t S : {1u, 2u, 4u, 8u, 16u, 32u}) {
      const std::string what = std::string(simd::level_name(isa)) + " S=" + std::to_string(S);
      std::vector<std::unique_ptr<LouverIndex>> indexes;
      std::vector<std::vector<float>> keys;
      for (uint32_t h = 0; h < kIndexes; ++h) {
        // Different prompt lengths and buffer fills per index: ragged batches.
        const uint32_t n = kPrompt - 1000 * h, appended = 300 + 37 * h;
        indexes.push_back(make_index(S, isa, h, n, appended, 40 + S));
        keys.push_back(head_keys(4, h, 0, n + appended, 40 + S));
      }
      ASSERT_EQ(indexes[0]->kernels().level, isa);
      gpu::LouverFilter filter;
      gpu::LouverFilterShape shape;
      shape.head_dim = kDim;
      shape.max_group = 4;
      shape.max_items = kIndexes;
      gpu::Result r = filter.init(0, shape);
      ASSERT_TRUE(r.ok) << r.message;
      for (uint32_t i = 0; i < kIndexes; ++i) {
        r = filter.sync(i, select::louver_device_view(*indexes[i]));
        ASSERT_TRUE(r.ok) << r.message;
      }
      uint64_t seed = 1000 * S;
      for (uint32_t group : {1u, 4u})
        for (const LouverQuery& query : test_queries())
          expect_device_matches(indexes, filter, keys, group, query, seed++, what);
      // Flushes after the first upload: 600 more keys per index, then only the new clusters
      // and assignments go up.
      for (uint32_t i = 0; i < kIndexes; ++i) {
        const uint64_t size = indexes[i]->size();
        const std::vector<float> more = head_keys(4, i, size, 600, 77 + S);
        for (uint32_t j = 0; j < 600; ++j) indexes[i]->append(more.data() + std::size_t{j} * kDim);
        keys[i].insert(keys[i].end(), more.begin(), more.end());
        r = filter.sync(i, select::louver_device_view(*indexes[i]));
        ASSERT_TRUE(r.ok) << r.message;
      }
      for (const LouverQuery& query : test_queries())
        expect_device_matches(indexes, filter, keys, 4, query, seed++, what + " after flushes");
      // A released slot takes another index (everything uploaded again).
      filter.release(1);
      indexes[1] = make_index(S, isa, 1, 5000, 10, 99 + S);
      keys[1] = head_keys(4, 1, 0, 5010, 99 + S);
      ASSERT_TRUE(filter.sync(1, select::louver_device_view(*indexes[1])).ok);
      expect_device_matches(indexes, filter, keys, 2, test_queries()[0], seed++,
                            what + " after a release");
      EXPECT_GT(filter.device_bytes(), 0u);
    }
}

TEST(LouverFilter, refuses_bad_views_and_batches) {
  KVSIFT_SKIP_WITHOUT_DEVICE();
  auto index = make_index(4, simd::Level::avx512, 0, 2000, 0, 5);
  gpu::LouverFilter filter;
  gpu::LouverFilterShape shape;
  shape.head_dim = kDim;
  shape.max_group = 4;
  shape.max_items = 2;
  ASSERT_TRUE(filter.init(0, shape).ok);
  const gpu::LouverIndexView good = select::louver_device_view(*index);
  const auto refused = [&](const gpu::LouverIndexView& view, uint32_t slot = 7) {
    const gpu::Result r = filter.sync(slot, view);
    return !r.ok && !r.unsupported;
  };
  gpu::LouverIndexView bad = good;
  bad.head_dim = 64;
  EXPECT_TRUE(refused(bad));
  bad = good;
  bad.n_subspaces = 0;
  EXPECT_TRUE(refused(bad));
  bad = good;
  bad.offset[2] = bad.offset[1];
  EXPECT_TRUE(refused(bad));
  bad = good;
  bad.radii[1] = nullptr;
  EXPECT_TRUE(refused(bad));
  bad = good;
  bad.isa = simd::Level::avx2;
  EXPECT_TRUE(refused(bad));
  std::vector<uint32_t> wild(good.assignments[0], good.assignments[0] + good.n_indexed);
  wild[123] = good.n_clusters;
  bad = good;
  bad.assignments[0] = wild.data();
  EXPECT_TRUE(refused(bad));
  ASSERT_TRUE(filter.sync(0, good).ok);
  bad = good;
  bad.n_clusters -= 16;  // a smaller index in a used slot
  bad.n_indexed -= 64;
  EXPECT_TRUE(refused(bad, 0));
  const auto eight = make_index(8, simd::Level::avx512, 0, 2000, 0, 5);
  EXPECT_TRUE(refused(select::louver_device_view(*eight), 0));  // another geometry, a used slot
  ASSERT_TRUE(filter.sync(1, good).ok);

  std::vector<float> q(4 * kDim, 0.5f), q_norm(4 * simd::kLouverMaxSubspaces, 1.0f), t(4, 0.0f);
  const gpu::LouverFilterItem item{0, 4, q.data(), q_norm.data(), t.data()};
  const auto batch_refused = [&](std::vector<gpu::LouverFilterItem> items) {
    const gpu::Result r = filter.validate(items.data(), static_cast<uint32_t>(items.size()));
    return !r.ok && !r.unsupported;
  };
  EXPECT_TRUE(batch_refused({}));
  EXPECT_TRUE(batch_refused({item, item}));  // one slot twice
  gpu::LouverFilterItem other = item;
  other.slot = 1;
  EXPECT_TRUE(batch_refused({item, other, other}));  // over max_items
  EXPECT_FALSE(batch_refused({item, other}));
  other.slot = 5;  // never synced
  EXPECT_TRUE(batch_refused({item, other}));
  other = item;
  other.group = 0;
  EXPECT_TRUE(batch_refused({other}));
  other.group = 5;
  EXPECT_TRUE(batch_refused({other}));
  other = item;
  other.t = nullptr;
  EXPECT_TRUE(batch_refused({other}));
  filter.release(0);
  EXPECT_TRUE(batch_refused({item}));  // released
}

// ---- The selector in both modes ------------------------------------------------------------

// Two selectors of one policy on one cache, one filtering on the CPU and one on the device: per
// layer and step the same pages and the same token rows for every (sequence, KV head), over 270
// decode steps (the indexes flush their 256-key buffers), two layers, two sequences of different
// lengths, and a sequence freed and replaced midway (its id reused: the device slots are released
// and uploaded afresh).
TEST(LouverSelectorDevice, chooses_the_cpu_modes_tokens_over_decode_steps_with_flushes) {
  KVSIFT_SKIP_WITHOUT_DEVICE();
  CacheGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 2;
  g.group_size = 4;
  g.head_dim = kDim;
  g.page_tokens = 16;
  CacheOptions options;
  options.max_pages = 8192;
  KvCache cache(g, options, test::kernels());
  const uint32_t H = g.n_kv_heads, G = g.group_size, L = g.n_layers;
  const bench::Shape shape{"test", H, G, kDim};
  std::vector<std::unique_ptr<bench::KeyMaker>> makers;
  std::vector<int32_t> seqs;
  std::vector<uint64_t> lengths;
  std::vector<float> k, v;
  const auto add_sequence = [&](uint32_t prompt, uint64_t seed) {
    const int32_t seq = cache.create_sequence();
    auto maker = std::make_unique<bench::KeyMaker>(shape, seed);
    for (uint32_t layer = 0; layer < L; ++layer) {
      maker->make(0, prompt, k, v);
      cache.append(seq, layer, prompt, k.data(), v.data());
    }
    return std::make_pair(seq, std::move(maker));
  };
  for (uint32_t prompt : {2000u, 3100u}) {
    auto [seq, maker] = add_sequence(prompt, 500 + prompt);
    seqs.push_back(seq), makers.push_back(std::move(maker)), lengths.push_back(prompt);
  }
  select::Policy policy;
  policy.kind = select::Kind::louver;
  policy.budget = 0.1;
  const uint64_t max_pages = g.pages_for(3100 + 300);
  auto cpu = select::Selector::create(policy, cache, 2, max_pages, test::pool(2), test::kernels());
  policy.device = 0;
  auto dev = select::Selector::create(policy, cache, 2, max_pages, test::pool(2), test::kernels());
  select::Selection sel_cpu, sel_dev;
  cpu->reserve_selection(sel_cpu);
  dev->reserve_selection(sel_dev);
  uint64_t rows = 0;
  for (uint32_t step = 0; step < 270; ++step) {
    if (step == 100) {  // replace the second sequence; its id comes back
      cache.free_sequence(seqs[1]);
      auto [seq, maker] = add_sequence(1500, 900);
      ASSERT_EQ(seq, seqs[1]);
      makers[1] = std::move(maker), lengths[1] = 1500;
    }
    for (uint32_t i = 0; i < seqs.size(); ++i) {
      for (uint32_t layer = 0; layer < L; ++layer) {
        makers[i]->make(lengths[i], 1, k, v);
        cache.append(seqs[i], layer, 1, k.data(), v.data());
      }
      ++lengths[i];
    }
    for (uint32_t layer = 0; layer < L; ++layer) {
      const auto q = test::random_floats(seqs.size() * H * G * kDim, 7000 + step * L + layer, 1.5f);
      const select::SelectCall call{layer, static_cast<uint32_t>(seqs.size()), seqs.data(),
                                    q.data()};
      cpu->prepare(call, sel_cpu);
      cpu->select(call, sel_cpu);
      dev->prepare(call, sel_dev);
      dev->select(call, sel_dev);
      const std::string where = "step " + std::to_string(step) + " layer " + std::to_string(layer);
      ASSERT_EQ(sel_cpu.n_pairs, sel_dev.n_pairs) << where;
      for (uint32_t pair = 0; pair < sel_cpu.n_pairs; ++pair) {
        ASSERT_EQ(sel_cpu.offsets[pair + 1], sel_dev.offsets[pair + 1]) << where;
        ASSERT_TRUE(std::equal(sel_cpu.page_ids.data() + sel_cpu.offsets[pair],
                               sel_cpu.page_ids.data() + sel_cpu.offsets[pair + 1],
                               sel_dev.page_ids.data() + sel_dev.offsets[pair]))
            << where;
        ASSERT_EQ(sel_cpu.row_counts[pair], sel_dev.row_counts[pair]) << where << " pair " << pair;
        const uint32_t* a =
            sel_cpu.row_tokens.data() + std::size_t{sel_cpu.chunk_offsets[pair]} * g.page_tokens;
        const uint32_t* b =
            sel_dev.row_tokens.data() + std::size_t{sel_dev.chunk_offsets[pair]} * g.page_tokens;
        ASSERT_TRUE(std::equal(a, a + sel_cpu.row_counts[pair], b)) << where << " pair " << pair;
        rows += sel_cpu.row_counts[pair];
      }
    }
  }
  const auto& louver = dynamic_cast<const select::LouverSelector&>(*dev);
  EXPECT_EQ(louver.device_fallbacks(), 0u);
  EXPECT_GT(louver.device_bytes(), 0u);
  EXPECT_GT(rows, 0u);
}

}  // namespace
}  // namespace kvsift
