// Louver index (lib/select/louver_index.hpp): kernels against the scalar reference, structure
// invariants, ball soundness, and the answer against the brute-force scan (docs/methods.md,
// Louver; How each is tested).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "lib/attend/decode_attention.hpp"
#include "lib/core/error.hpp"
#include "lib/model/llama_model.hpp"
#include "lib/select/louver_index.hpp"
#include "lib/select/selector.hpp"
#include "simd/half.hpp"
#include "tests/model_handle.hpp"
#include "tests/reference_attention.hpp"
#include "tests/test_util.hpp"

namespace kvsift {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Keys shaped like post-RoPE keys: a shared offset, a few high-variance channels, the rest small.
std::vector<float> structured_keys(uint64_t n, uint32_t d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> scale(d), offset(d);
  for (uint32_t j = 0; j < d; ++j) {
    scale[j] = j % 9 == 0 ? 4.0f : 0.6f;
    offset[j] = normal(rng) * 1.5f;
  }
  std::vector<float> keys(n * d);
  for (uint64_t i = 0; i < n; ++i)
    for (uint32_t j = 0; j < d; ++j) keys[i * d + j] = offset[j] + scale[j] * normal(rng);
  return keys;
}

std::vector<float> exact_scores(const LouverIndex& index, const float* q) {
  const uint32_t d = index.params().head_dim;
  std::vector<float> s(index.size());
  std::vector<uint32_t> ids(index.size());
  for (uint32_t i = 0; i < ids.size(); ++i) ids[i] = i;
  index.kernels().scores(q, index.keys(), d, ids.data(), static_cast<uint32_t>(ids.size()),
                         s.data());
  return s;
}

// The thresholds tried (docs/methods.md, How each is tested): k-th largest exact score for several
// k, +-inf and a random value between the extremes.
std::vector<float> test_taus(const LouverIndex& index, const float* q, std::mt19937& rng) {
  std::vector<float> s = exact_scores(index, q);
  std::sort(s.begin(), s.end(), std::greater<float>());
  std::vector<float> taus{-kInf, kInf};
  for (uint64_t k : {1, 10, 20, 100, 1000})
    if (k <= s.size()) taus.push_back(s[k - 1]);
  if (!s.empty()) taus.push_back(std::uniform_real_distribution<float>(s.back(), s.front())(rng));
  return taus;
}

struct Tally {
  uint64_t queries = 0, checked = 0, keys = 0;
};

// query() under every search mode against scan(), for one query head and a fixed tau.
void expect_exact(LouverIndex& index, const float* q, float tau, Tally& tally) {
  std::vector<uint32_t> expected(index.size());
  expected.resize(index.scan(q, 1, &tau, expected.data()));
  for (LouverSearch search : {LouverSearch::all_subspace, LouverSearch::threshold_algorithm})
    for (bool summed : {false, true}) {
      LouverQuery query;
      query.search = search;
      query.summed_key_bound = summed;
      // The TA search does not matter under summed_key_bound: that slot tests the fallback.
      query.scan_fallback = summed && search == LouverSearch::threshold_algorithm;
      query.tau_mode = LouverTau::fixed;
      query.tau = &tau;
      const LouverResult r = index.query(q, 1, query);
      ASSERT_EQ(std::vector<uint32_t>(r.token_ids.begin(), r.token_ids.end()), expected)
          << "tau=" << tau << " search=" << int(search) << " summed=" << summed;
      ++tally.queries;
      tally.checked += r.checked;
      tally.keys += index.size();
    }
}

TEST(LouverKernels, avx512_matches_the_scalar_reference) {
  if (!simd::cpu_has(simd::Level::avx512)) GTEST_SKIP() << "no AVX-512";
  const auto& ref = simd::louver_scalar_kernels();
  const auto& vec = simd::louver_kernels_for(simd::Level::avx512);
  for (uint32_t n : {1u, 15u, 16u, 17u, 203u}) {
    for (uint32_t w : {1u, 16u, 21u, 32u}) {
      const uint32_t padded = (n + 15) / 16 * 16;
      const std::vector<float> q = test::random_floats(w, n + w);
      const std::vector<float> c = test::random_floats(std::size_t{padded} * w, n * w + 1);
      std::vector<uint16_t> centers(c.size());
      for (std::size_t i = 0; i < c.size(); ++i) centers[i] = simd::f32_to_f16(c[i]);
      std::vector<float> radius = test::random_floats(padded, n + 7);
      for (float& x : radius) x = std::abs(x);
      std::vector<float> ub_ref(padded), ub_vec(padded);
      ref.ball_bounds(q.data(), centers.data(), w, radius.data(), 1.3f, n, ub_ref.data());
      vec.ball_bounds(q.data(), centers.data(), w, radius.data(), 1.3f, n, ub_vec.data());
      for (uint32_t i = 0; i < n; ++i) EXPECT_NEAR(ub_vec[i], ub_ref[i], 1e-4f * (1 + w));
    }
    // The filter is pure comparisons: identical answers.
    std::mt19937 rng(n);
    std::vector<std::vector<uint32_t>> assign(3, std::vector<uint32_t>(n));
    std::vector<std::vector<float>> ub(3, test::random_floats(50, n));
    for (auto& a : assign)
      for (uint32_t& x : a) x = rng() % 50;
    for (auto gate : {simd::LouverGate::all, simd::LouverGate::any, simd::LouverGate::summed}) {
      simd::LouverFilterJob job{};
      job.n_subspaces = 3;
      job.n = n;
      job.gate = gate;
      for (int s = 0; s < 3; ++s)
        job.assign[s] = assign[s].data(), job.ub[s] = ub[s].data(), job.t[s] = 0.1f * s;
      std::vector<uint32_t> a(n), b(n);
      job.out = a.data();
      a.resize(ref.filter(job));
      job.out = b.data();
      b.resize(vec.filter(job));
      EXPECT_EQ(a, b);
    }
  }
  // Scores: same values within float32 rounding; check and scan agree with each other per table.
  for (uint32_t d : {16u, 48u, 64u, 128u, 256u}) {
    const uint32_t n = 37;
    const std::vector<float> q = test::random_floats(2 * d, d);
    const std::vector<float> k = test::random_floats(std::size_t{n} * d, d + 1);
    std::vector<uint16_t> keys(k.size());
    for (std::size_t i = 0; i < k.size(); ++i) keys[i] = simd::f32_to_f16(k[i]);
    std::vector<uint32_t> ids(n);
    for (uint32_t i = 0; i < n; ++i) ids[i] = (i * 7) % n;
    std::vector<float> s_ref(n), s_vec(n);
    ref.scores(q.data(), keys.data(), d, ids.data(), n, s_ref.data());
    vec.scores(q.data(), keys.data(), d, ids.data(), n, s_vec.data());
    for (uint32_t i = 0; i < n; ++i) EXPECT_NEAR(s_vec[i], s_ref[i], 1e-4f * d);
    const float tau[2] = {0.0f, 3.0f};
    for (const auto* table : {&ref, &vec}) {
      std::vector<uint32_t> a(n), b(n);
      a.resize(table->scan(q.data(), 2, tau, keys.data(), d, 0, n, a.data()));
      std::vector<uint32_t> all(n);
      for (uint32_t i = 0; i < n; ++i) all[i] = i;
      b.resize(table->check(q.data(), 2, tau, keys.data(), d, all.data(), n, b.data()));
      EXPECT_EQ(a, b);
    }
  }
}

TEST(LouverIndex, subspaces_are_contiguous_and_clusters_are_balanced_balls) {
  for (uint32_t d : {64u, 128u}) {
    for (LouverSplit split : {LouverSplit::pca, LouverSplit::max_variance_axis}) {
      const uint64_t n = 1001;  // not a multiple of r: one short cluster
      const std::vector<float> keys = structured_keys(n, d, d);
      LouverParams params;
      params.head_dim = d;
      params.split = split;
      params.n_subspaces = d == 64 ? 3 : 0;  // 3 does not divide 64: widths 22, 21, 21
      LouverIndex index(params, keys.data(), n);
      const uint32_t S = index.n_subspaces();
      EXPECT_EQ(S, d == 64 ? 3u : 4u);
      EXPECT_EQ(index.n_clusters(), (n + 3) / 4);
      uint32_t total = 0;
      for (uint32_t s = 0; s < S; ++s) {
        EXPECT_EQ(index.subspace_offset(s), total);
        EXPECT_LE(index.subspace_width(s) - index.subspace_width(S - 1), 1u);
        total += index.subspace_width(s);
        std::vector<std::vector<uint32_t>> members(index.n_clusters());
        for (uint64_t i = 0; i < n; ++i) {
          ASSERT_LT(index.assignment(s, i), index.n_clusters());
          members[index.assignment(s, i)].push_back(static_cast<uint32_t>(i));
        }
        uint32_t short_clusters = 0;
        std::vector<float> c(index.subspace_width(s));
        for (uint32_t cl = 0; cl < index.n_clusters(); ++cl) {
          short_clusters += members[cl].size() != 4;
          ASSERT_GE(members[cl].size(), 1u);
          index.center(s, cl, c.data());
          double worst = 0.0;
          for (uint32_t j = 0; j < c.size(); ++j) {
            double mean = 0.0;
            for (uint32_t i : members[cl])
              mean +=
                  simd::f16_to_f32(index.keys()[std::size_t{i} * d + index.subspace_offset(s) + j]);
            mean /= members[cl].size();
            EXPECT_NEAR(c[j], mean, 1e-3 * (1 + std::abs(mean)));  // fp16 rounding of the mean
          }
          for (uint32_t i : members[cl]) {
            double dist = 0.0;
            for (uint32_t j = 0; j < c.size(); ++j) {
              const double e =
                  double(simd::f16_to_f32(
                      index.keys()[std::size_t{i} * d + index.subspace_offset(s) + j])) -
                  c[j];
              dist += e * e;
            }
            worst = std::max(worst, std::sqrt(dist));
          }
          EXPECT_GE(double(index.radius(s, cl)), worst);
          EXPECT_LE(double(index.radius(s, cl)), worst * (1 + 1e-6) + 1e-30);
        }
        EXPECT_EQ(short_clusters, 1u);
      }
      EXPECT_EQ(total, d);
    }
  }
}

TEST(LouverIndex, ball_bound_holds_for_every_member_and_query) {
  const uint32_t d = 128;
  const uint64_t n = 600;
  const std::vector<float> keys = structured_keys(n, d, 3);
  LouverIndex index(LouverParams{}, keys.data(), n);
  uint64_t checks = 0;
  for (uint32_t t = 0; t < 50; ++t) {
    const std::vector<float> q = test::random_floats(d, 100 + t, t % 2 ? 0.1f : 3.0f);
    for (uint32_t s = 0; s < index.n_subspaces(); ++s) {
      const uint32_t o = index.subspace_offset(s), w = index.subspace_width(s);
      double qn = 0.0;
      for (uint32_t j = 0; j < w; ++j) qn += double(q[o + j]) * q[o + j];
      qn = std::sqrt(qn);
      std::vector<float> c(w);
      for (uint64_t i = 0; i < n; ++i) {
        const uint32_t cl = index.assignment(s, i);
        index.center(s, cl, c.data());
        double qk = 0.0, qc = 0.0;
        for (uint32_t j = 0; j < w; ++j) {
          qk += double(q[o + j]) * simd::f16_to_f32(index.keys()[i * d + o + j]);
          qc += double(q[o + j]) * c[j];
        }
        ASSERT_LE(qk, qc + qn * index.radius(s, cl));
        ++checks;
      }
    }
  }
  EXPECT_EQ(checks, 50u * 4 * n);
}

TEST(LouverIndex, returns_exactly_the_brute_force_set_on_random_keys) {
  Tally tally;
  for (simd::Level isa : test::supported_isas()) {
    // One run per Louver table: avx2 runs the scalar one, avx512_vnni the AVX-512 one.
    if (isa == simd::Level::avx2 || isa == simd::Level::avx512_vnni) continue;
    for (uint32_t d : {64u, 128u}) {
      for (bool isotropic : {false, true}) {
        const uint64_t n = 1000;
        const std::vector<float> keys =
            isotropic ? test::random_floats(n * d, d + 5) : structured_keys(n, d, d + 9);
        LouverParams params;
        params.head_dim = d;
        params.isa = isa;
        LouverIndex index(params, keys.data(), n);
        EXPECT_EQ(index.kernels().level, isa);
        std::mt19937 rng(d);
        for (uint32_t t = 0; t < 100; ++t) {
          const std::vector<float> q = test::random_floats(d, 1000 * d + t, 0.3f);
          for (float tau : test_taus(index, q.data(), rng))
            expect_exact(index, q.data(), tau, tally);
        }
      }
    }
  }
  EXPECT_GE(tally.queries, 10000u);
  RecordProperty("queries", std::to_string(tally.queries));
  std::printf("random keys: %llu queries, checked %.3f of the keys\n",
              (unsigned long long)tally.queries, double(tally.checked) / double(tally.keys));
}

TEST(LouverIndex, appended_keys_are_buffered_then_clustered_and_the_answer_stays_exact) {
  const uint32_t d = 128;
  const std::vector<float> keys = structured_keys(1500, d, 77);
  LouverIndex index(LouverParams{}, keys.data(), 500);
  EXPECT_EQ(index.n_clusters(), 125u);
  Tally tally;
  std::mt19937 rng(5);
  for (uint64_t i = 500; i < 1500; ++i) {
    const uint32_t before = index.n_clusters();
    index.append(keys.data() + i * d);
    if ((i + 1 - 500) % 256 == 0) {
      EXPECT_EQ(index.n_clusters(), before + 64);
      EXPECT_EQ(index.buffered(), 0u);
    } else {
      EXPECT_EQ(index.n_clusters(), before);
    }
    EXPECT_EQ(index.size(), i + 1);
    if (i % 7 == 0) {
      const std::vector<float> q = test::random_floats(d, uint32_t(i), 0.3f);
      for (float tau : test_taus(index, q.data(), rng)) expect_exact(index, q.data(), tau, tally);
      // The newest key is always checked: with tau at its own score it must come back.
      const float own = exact_scores(index, q.data())[i];
      LouverQuery query;
      query.tau_mode = LouverTau::fixed;
      query.tau = &own;
      const LouverResult r = index.query(q.data(), 1, query);
      ASSERT_FALSE(r.token_ids.empty());
      EXPECT_TRUE(std::binary_search(r.token_ids.begin(), r.token_ids.end(), uint32_t(i)));
    }
  }
  // The structure invariants after the flushes: every key in one cluster per subspace.
  for (uint32_t s = 0; s < index.n_subspaces(); ++s)
    for (uint64_t i = 0; i < index.indexed(); ++i)
      ASSERT_LT(index.assignment(s, i), index.n_clusters());
  EXPECT_GE(tally.queries, 2000u);
}

TEST(LouverIndex, gqa_group_union_and_shared_tau_equal_the_brute_force_sets) {
  const uint32_t d = 64, G = 3;
  const uint64_t n = 1200;
  const std::vector<float> keys = structured_keys(n, d, 11);
  LouverParams params;
  params.head_dim = d;
  LouverIndex index(params, keys.data(), n);
  double size_union = 0, size_shared = 0;
  for (uint32_t t = 0; t < 40; ++t) {
    const std::vector<float> q = test::random_floats(G * d, 300 + t, 0.3f);
    for (LouverGroupMode mode : {LouverGroupMode::union_of_heads, LouverGroupMode::shared_tau}) {
      for (LouverTau tau_mode :
           {LouverTau::sample_fraction, LouverTau::token_budget, LouverTau::target_mass}) {
        LouverQuery query;
        query.group_mode = mode;
        query.tau_mode = tau_mode;
        query.budget_tokens = 100;
        index.validate(G, query);
        const LouverResult r = index.query(q.data(), G, query);
        const std::vector<uint32_t> got(r.token_ids.begin(), r.token_ids.end());
        const std::vector<float> taus(r.tau.begin(), r.tau.end());
        if (mode == LouverGroupMode::shared_tau) {
          EXPECT_EQ(taus[0], taus[2]);
        }
        std::vector<uint32_t> expected(n);
        expected.resize(index.scan(q.data(), G, taus.data(), expected.data()));
        ASSERT_EQ(got, expected);
        if (tau_mode == LouverTau::sample_fraction)
          (mode == LouverGroupMode::union_of_heads ? size_union : size_shared) += got.size();
      }
    }
  }
  std::printf("GQA G=3 f=0.1: union %.1f keys, shared tau %.1f keys per query\n", size_union / 40,
              size_shared / 40);
}

TEST(LouverIndex, oracle_modes_track_their_targets) {
  const uint32_t d = 128;
  const uint64_t n = 20000;
  const std::vector<float> keys = structured_keys(n, d, 21);
  LouverIndex index(LouverParams{}, keys.data(), n);
  double fraction = 0, budget = 0, mass = 0;
  const int trials = 20;
  for (int t = 0; t < trials; ++t) {
    const std::vector<float> q = test::random_floats(d, 900 + t, 0.3f);
    LouverQuery query;
    fraction += double(index.query(q.data(), 1, query).token_ids.size()) / n;
    query.tau_mode = LouverTau::token_budget;
    query.budget_tokens = 500;
    budget += double(index.query(q.data(), 1, query).token_ids.size());
    query.tau_mode = LouverTau::target_mass;
    query.target_mass = 0.8f;
    const LouverResult r = index.query(q.data(), 1, query);
    const std::vector<float> s = exact_scores(index, q.data());
    const float top = *std::max_element(s.begin(), s.end());
    double kept = 0, total = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const double e = std::exp((s[i] - top) / std::sqrt(double(d)));
      total += e;
      kept += s[i] >= r.tau[0] ? e : 0;
    }
    mass += kept / total;
  }
  fraction /= trials, budget /= trials, mass /= trials;
  EXPECT_GT(fraction, 0.1 / 1.5);
  EXPECT_LT(fraction, 0.1 * 1.5);
  EXPECT_GT(budget, 500 / 1.5);
  EXPECT_LT(budget, 500 * 1.5);
  EXPECT_GT(mass, 0.7);
  EXPECT_LT(mass, 0.9);
}

TEST(LouverIndex, rejects_bad_parameters_and_non_finite_keys) {
  LouverParams params;
  params.head_dim = 100;
  EXPECT_THROW(LouverIndex(params, nullptr, 0), Error);
  params.head_dim = 64;
  params.buffer_keys = 10;
  EXPECT_THROW(LouverIndex(params, nullptr, 0), Error);
  params.buffer_keys = 256;
  std::vector<float> keys(64, 1.0f);
  keys[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(LouverIndex(params, keys.data(), 1), Error);
  LouverIndex empty(params, nullptr, 0);
  LouverQuery query;
  EXPECT_THROW(empty.validate(0, query), Error);
  const std::vector<float> q(64, 1.0f);
  EXPECT_TRUE(empty.query(q.data(), 1, query).token_ids.empty());
  keys[5] = 1.0f;
  empty.append(keys.data());
  EXPECT_EQ(empty.query(q.data(), 1, query).token_ids.size(), 1u);
}

// Captures the real queries of every layer during decode.
class QueryCapture : public model::DecodeObserver {
 public:
  explicit QueryCapture(uint32_t n_layers) : q(n_layers) {}
  void on_layer(uint32_t layer, std::span<const int32_t>, const float* qs, const select::Selection&,
                const float*) noexcept override {
    q[layer].insert(q[layer].end(), qs, qs + width);
  }
  std::size_t width = 0;
  std::vector<std::vector<float>> q;  // [layer][steps * n_heads * head_dim]
};

TEST(LouverIndex, returns_exactly_the_brute_force_set_on_real_smollm2_keys) {
  if (test::model_path() == nullptr) GTEST_SKIP() << "KVSIFT_MODEL is not set (make test sets it)";
  model::ModelOptions options;
  options.n_ctx = 1024;
  auto m = model::LlamaModel::load(test::model_path(), options);
  std::string text;
  for (int i = 0; i < 30; ++i)
    text += "Section " + std::to_string(i) + ": the river " + std::to_string(i * 7 % 13) +
            " carries salt to the sea while the old lighthouse keeper counts ships. ";
  const std::vector<int32_t> tokens = m->tokenizer().encode(text, false);
  const int32_t seq = m->create_sequence();
  m->prefill(seq, tokens, nullptr, nullptr, nullptr);
  const CacheGeometry& g = m->cache().geometry();
  QueryCapture capture(g.n_layers);
  capture.width = std::size_t{g.n_query_heads()} * g.head_dim;
  m->set_observer(&capture);
  const int32_t seqs[] = {seq};
  const int steps = 4;
  for (int step = 0; step < steps; ++step) {
    const int32_t next[] = {static_cast<int32_t>(
        std::max_element(m->logits(seq).begin(), m->logits(seq).end()) - m->logits(seq).begin())};
    m->decode(seqs, next);
  }
  m->set_observer(nullptr);
  Tally tally;
  std::mt19937 rng(1);
  const uint32_t d = g.head_dim;
  double pruning[4] = {}, gqa_size[2] = {}, gqa_mass[2] = {};
  uint64_t pruning_queries = 0, gqa_steps = 0;
  for (uint32_t layer = 0; layer < g.n_layers; ++layer) {
    for (uint32_t h = 0; h < g.n_kv_heads; ++h) {
      LouverIndex index = LouverIndex::from_cache(m->cache(), seq, layer, h, LouverParams{});
      ASSERT_EQ(index.size(), tokens.size() + steps);
      // The real queries of the group's heads at every step, and the stored keys as queries.
      std::vector<std::vector<float>> queries;
      for (int step = 0; step < steps; ++step)
        for (uint32_t q = 0; q < g.group_size; ++q) {
          const float* p = capture.q[layer].data() + step * capture.width +
                           (std::size_t{h} * g.group_size + q) * d;
          queries.emplace_back(p, p + d);
        }
      for (uint32_t i = 0; i < 32; ++i) {
        std::vector<float> k(d);
        m->cache().read_tokens(seq, layer, h, rng() % index.size(), 1, k.data(), nullptr);
        queries.push_back(k);
      }
      for (const auto& q : queries)
        for (float tau : test_taus(index, q.data(), rng)) expect_exact(index, q.data(), tau, tally);
      // Pruning on the real queries (reported, not asserted): the oracle at f = 0.10, the top-20
      // threshold, and the same with 8 subspaces of 8 coordinates.
      LouverParams narrow;
      narrow.n_subspaces = 8;
      LouverIndex index8 = LouverIndex::from_cache(m->cache(), seq, layer, h, narrow);
      for (uint32_t i = 0; i < steps * g.group_size; ++i) {
        const float* q = queries[i].data();
        std::vector<float> s = exact_scores(index, q);
        std::nth_element(s.begin(), s.begin() + 19, s.end(), std::greater<float>());
        const float top20 = s[19];
        LouverQuery oracle;
        oracle.scan_fallback = false;
        LouverQuery fixed = oracle;
        fixed.tau_mode = LouverTau::fixed;
        fixed.tau = &top20;
        pruning[0] += index.query(q, 1, oracle).checked / double(index.size());
        pruning[1] += index.query(q, 1, fixed).checked / double(index.size());
        pruning[2] += index8.query(q, 1, oracle).checked / double(index.size());
        pruning[3] += index8.query(q, 1, fixed).checked / double(index.size());
        ++pruning_queries;
      }
      // GQA: union of the heads' sets against one shared tau, at f = 0.10: size of the set and
      // the smallest share of a head's softmax mass it keeps.
      for (int step = 0; step < steps; ++step) {
        const float* q =
            capture.q[layer].data() + step * capture.width + std::size_t{h} * g.group_size * d;
        for (int mode = 0; mode < 2; ++mode) {
          LouverQuery query;
          query.group_mode = mode ? LouverGroupMode::shared_tau : LouverGroupMode::union_of_heads;
          const LouverResult r = index.query(q, g.group_size, query);
          std::vector<uint8_t> in(index.size(), 0);
          for (uint32_t id : r.token_ids) in[id] = 1;
          double worst = 1.0;
          for (uint32_t head = 0; head < g.group_size; ++head) {
            const std::vector<float> s = exact_scores(index, q + head * d);
            const float top = *std::max_element(s.begin(), s.end());
            double kept = 0, total = 0;
            for (std::size_t i = 0; i < s.size(); ++i) {
              const double e = std::exp((s[i] - top) / std::sqrt(double(d)));
              total += e;
              kept += in[i] ? e : 0.0;
            }
            worst = std::min(worst, kept / total);
          }
          gqa_size[mode] += r.token_ids.size() / double(index.size());
          gqa_mass[mode] += worst;
        }
        ++gqa_steps;
      }
    }
  }
  EXPECT_GE(tally.queries, 80000u);
  std::printf("SmolLM2 keys (%zu tokens): %llu queries, checked %.3f of the keys\n", tokens.size(),
              (unsigned long long)tally.queries, double(tally.checked) / double(tally.keys));
  std::printf(
      "real queries, share of keys checked: f=0.10 %.3f, top-20 %.3f; S=8: f=0.10 %.3f, "
      "top-20 %.3f\n",
      pruning[0] / pruning_queries, pruning[1] / pruning_queries, pruning[2] / pruning_queries,
      pruning[3] / pruning_queries);
  std::printf("GQA f=0.10: union %.3f of the keys, worst head mass %.3f; shared tau %.3f, %.3f\n",
              gqa_size[0] / gqa_steps, gqa_mass[0] / gqa_steps, gqa_size[1] / gqa_steps,
              gqa_mass[1] / gqa_steps);
}

}  // namespace
}  // namespace kvsift

namespace kvsift {
namespace {

// The Louver selector through the cache and decode attention: the rows are exactly the tokens an
// independent index over the same keys returns (outside the sink and window pages), attention
// over them and the mandatory pages equals the float64 reference over the same tokens, and the
// index follows the cache as decode appends.
// In every dtype: a q8 cache's tokens are gathered with their scales, and the reference reads the
// same dequantized values back.
class LouverSelectorDtype : public testing::TestWithParam<simd::Dtype> {};

TEST_P(LouverSelectorDtype, attends_exactly_the_range_search_tokens_and_follows_appends) {
  CacheGeometry g;
  g.dtype = GetParam();
  g.n_kv_heads = 2;
  g.group_size = 3;
  g.head_dim = 64;
  g.page_tokens = 16;
  CacheOptions options;
  options.max_pages = 1024;
  KvCache cache(g, options, test::kernels());
  const int32_t seq = cache.create_sequence();
  const uint32_t H = g.n_kv_heads, G = g.group_size, d = g.head_dim, B = g.page_tokens;
  const uint64_t n = 1500;
  std::vector<float> k(n * H * d);
  for (uint32_t h = 0; h < H; ++h) {
    const auto keys = structured_keys(n, d, 200 + h);
    for (uint64_t t = 0; t < n; ++t)
      std::copy_n(keys.data() + t * d, d, k.data() + (t * H + h) * d);
  }
  const auto v = test::random_floats(n * H * d, 210);
  cache.append(seq, 0, static_cast<uint32_t>(n), k.data(), v.data());
  select::Policy policy;
  policy.kind = select::Kind::louver;
  policy.budget = 0.1;
  auto selector = select::Selector::create(policy, cache, 1, g.pages_for(n + 8), test::pool(2),
                                           test::kernels());
  select::Selection sel;
  selector->reserve_selection(sel);
  DecodeAttention attention(g, 1, 2, test::kernels());
  for (uint32_t step = 0; step < 3; ++step) {
    const auto kv = test::random_floats(2 * H * d, 220 + step);
    cache.append(seq, 0, 1, kv.data(), kv.data() + H * d);
    const uint64_t length = n + 1 + step;
    const auto q = test::random_floats(std::size_t{H} * G * d, 230 + step, 1.5f);
    const select::SelectCall call{0, 1, &seq, q.data()};
    selector->prepare(call, sel);
    selector->select(call, sel);
    const PageLists lists = sel.lists();
    const RowChunks rows = sel.rows();
    std::vector<float> out(q.size());
    AttendCall attend{0, 1, &seq, q.data(), out.data(), &lists, &rows};
    attention.validate(cache, attend);
    attention.run(cache, attend);
    const uint64_t n_pages = g.pages_for(length);
    for (uint32_t h = 0; h < H; ++h) {
      // An index built afresh over the stored keys answers the same query with the same tokens.
      LouverParams params;
      params.head_dim = d;
      params.max_group = G;
      LouverIndex fresh = LouverIndex::from_cache(cache, seq, 0, h, params);
      LouverQuery query;
      query.tau_mode = LouverTau::token_budget;
      query.budget_tokens = policy.budget_tokens(length) - (B + (length - (n_pages - 1) * B));
      const LouverResult want = fresh.query(q.data() + std::size_t{h} * G * d, G, query);
      std::vector<uint32_t> expected;
      for (uint32_t t : want.token_ids)
        if (t / B != 0 && t / B != n_pages - 1) expected.push_back(t);
      const uint32_t* got = sel.row_tokens.data() + std::size_t{sel.chunk_offsets[h]} * B;
      ASSERT_EQ(sel.row_counts[h], expected.size()) << "step " << step << " head " << h;
      EXPECT_TRUE(std::equal(expected.begin(), expected.end(), got));
      EXPECT_GT(expected.size(), 0u);
      // Attention over the sink page, the open page and those tokens.
      std::vector<float> k_all(length * d), v_all(length * d), ks, vs;
      cache.read_tokens(seq, 0, h, 0, length, k_all.data(), v_all.data());
      auto take = [&](uint64_t t) {
        ks.insert(ks.end(), k_all.begin() + t * d, k_all.begin() + (t + 1) * d);
        vs.insert(vs.end(), v_all.begin() + t * d, v_all.begin() + (t + 1) * d);
      };
      for (uint64_t t = 0; t < B; ++t) take(t);
      for (uint64_t t = (n_pages - 1) * B; t < length; ++t) take(t);
      for (uint32_t t : expected) take(t);
      std::vector<double> ref(std::size_t{G} * d);
      reference_attention(q.data() + std::size_t{h} * G * d, ks.data(), vs.data(), ks.size() / d, G,
                          d, ref.data());
      EXPECT_LT(test::relative_error(out.data() + std::size_t{h} * G * d, ref.data(), ref.size()),
                test::attend_tolerance(test::kernels().level, g.dtype));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(LouverSelector, LouverSelectorDtype,
                         testing::Values(simd::Dtype::f16, simd::Dtype::q8),
                         [](const testing::TestParamInfo<simd::Dtype>& info) {
                           return std::string(info.param == simd::Dtype::f16 ? "f16" : "q8");
                         });

}  // namespace
}  // namespace kvsift
