// kvsift_select: the selection an engine with its own paged kernel gets, checked against what
// kvsift_attend_selected attends to at the same step, for every selector.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kvsift/kvsift.h"
#include "kvsift/kvsift.hpp"
#include "lib/capi/cache_handle.hpp"
#include "tests/test_util.hpp"

namespace {

using kvsift::test::random_floats;

// The owner of the caches the tests call kvsift_select and the others on, through get().
using Cache = kvsift::cache;

constexpr uint32_t kLayers = 2, kKvHeads = 2, kGroup = 2, kHeadDim = 64, kPageTokens = 16;
constexpr uint32_t kPairs = 2 * kKvHeads;  // two sequences per call
constexpr std::size_t kQElems = std::size_t{2} * kKvHeads * kGroup * kHeadDim;

Cache make_cache() {
  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  params.n_layers = kLayers;
  params.n_kv_heads = kKvHeads;
  params.group_size = kGroup;
  params.head_dim = kHeadDim;
  params.page_tokens = kPageTokens;
  params.key_form = KVSIFT_KEYS_PRE_ROPE;  // S4R needs it; the others take either form
  params.max_pages = 1024;
  params.max_batch = 4;
  params.n_threads = 2;
  return Cache(params);
}

// The same tokens into every cache: keys with a few loud tokens so that selections differ from
// the first pages.
void append_all(const std::vector<kvsift_cache*>& caches, const int32_t* seqs, uint32_t n_tokens,
                uint32_t seed) {
  for (uint32_t s = 0; s < 2; ++s)
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      const std::size_t n = std::size_t{n_tokens} * kKvHeads * kHeadDim;
      std::vector<float> k = random_floats(n, seed + 97 * s + 13 * layer);
      const std::vector<float> v = random_floats(n, seed + 97 * s + 13 * layer + 5);
      for (std::size_t t = 7; t < n_tokens; t += 61)
        for (std::size_t c = 0; c < kKvHeads * kHeadDim; ++c) k[t * kKvHeads * kHeadDim + c] *= 4;
      for (kvsift_cache* cache : caches)
        ASSERT_EQ(kvsift_append(cache, seqs[s], layer, n_tokens, k.data(), v.data()),
                  KVSIFT_STATUS_OK)
            << kvsift_last_error();
    }
}

struct Chosen {
  std::vector<uint32_t> page_offsets, page_ids, token_offsets, tokens;
  std::vector<float> kept, bound;
  kvsift_selection_stats stats{};
};

// The two-call pattern: a refused call with no room (which must select nothing), then the call.
Chosen select_twice(kvsift_cache* cache, uint32_t layer, const int32_t* seqs, const float* q,
                    uint64_t expect_pages, uint64_t expect_tokens) {
  Chosen c;
  c.page_offsets.resize(kPairs + 1);
  c.token_offsets.resize(kPairs + 1);
  kvsift_selection s{};
  s.page_offsets = c.page_offsets.data();
  s.token_offsets = c.token_offsets.data();
  size_t n_pages = 0, n_tokens = 0;
  EXPECT_EQ(kvsift_select(cache, layer, 2, seqs, q, &s, &n_pages, &n_tokens, nullptr),
            KVSIFT_STATUS_BUFFER_TOO_SMALL);
  EXPECT_EQ(n_pages, expect_pages);
  EXPECT_EQ(n_tokens, expect_tokens);
  c.page_ids.resize(n_pages);
  c.tokens.resize(n_tokens);
  c.kept.resize(kPairs);
  c.bound.resize(kPairs);
  s.page_ids = c.page_ids.data();
  s.page_capacity = n_pages;
  s.token_positions = c.tokens.data();
  s.token_capacity = n_tokens;
  s.kept_estimate = c.kept.data();
  s.dropped_bound = c.bound.data();
  EXPECT_EQ(kvsift_select(cache, layer, 2, seqs, q, &s, &n_pages, &n_tokens, &c.stats),
            KVSIFT_STATUS_OK)
      << kvsift_last_error();
  c.page_ids.resize(n_pages);
  c.tokens.resize(n_tokens);
  return c;
}

// float64 softmax attention of one pair's query heads over the given token positions, read back
// from `cache`.
void reference_pair(kvsift_cache* cache, int32_t seq, uint32_t layer, uint32_t head,
                    const std::vector<uint64_t>& positions, const float* q, double* out) {
  std::vector<float> k(kHeadDim), v(kHeadDim);
  for (uint32_t g = 0; g < kGroup; ++g) {
    const float* qh = q + std::size_t{g} * kHeadDim;
    std::vector<double> logits;
    for (uint64_t t : positions) {
      ASSERT_EQ(kvsift_read_tokens(cache, seq, layer, head, t, 1, k.data(), nullptr),
                KVSIFT_STATUS_OK);
      double dot = 0.0;
      for (uint32_t c = 0; c < kHeadDim; ++c) dot += double{qh[c]} * k[c];
      logits.push_back(dot / std::sqrt(double{kHeadDim}));
    }
    const double top = *std::max_element(logits.begin(), logits.end());
    double sum = 0.0;
    double* o = out + std::size_t{g} * kHeadDim;
    std::fill(o, o + kHeadDim, 0.0);
    for (std::size_t i = 0; i < positions.size(); ++i) {
      ASSERT_EQ(kvsift_read_tokens(cache, seq, layer, head, positions[i], 1, nullptr, v.data()),
                KVSIFT_STATUS_OK);
      const double w = std::exp(logits[i] - top);
      sum += w;
      for (uint32_t c = 0; c < kHeadDim; ++c) o[c] += w * v[c];
    }
    for (uint32_t c = 0; c < kHeadDim; ++c) o[c] /= sum;
  }
}

void check_selector(kvsift_selector kind, double budget) {
  // `selected` attends with kvsift_attend_selected, `selecting` selects with kvsift_select, and
  // `plain` (no selector) keeps every token for the reference: the same tokens in all three.
  Cache selected = make_cache(), selecting = make_cache(), plain = make_cache();
  std::vector<kvsift_cache*> all = {selected.get(), selecting.get(), plain.get()};
  int32_t seqs[2];
  for (kvsift_cache* cache : all)
    for (int32_t& seq : seqs) ASSERT_EQ(kvsift_sequence_create(cache, &seq), KVSIFT_STATUS_OK);
  kvsift_selector_policy policy;
  kvsift_selector_policy_init(&policy);
  policy.selector = kind;
  policy.budget = budget;
  policy.s4r.compression = 1.0;  // S4R at full rank: its reconstructions are the tokens, rounded
  ASSERT_EQ(kvsift_cache_set_selector(selected.get(), &policy), KVSIFT_STATUS_OK);
  ASSERT_EQ(kvsift_cache_set_selector(selecting.get(), &policy), KVSIFT_STATUS_OK);
  append_all(all, seqs, 40 * kPageTokens + 5, 11);
  const bool token_level = kind == KVSIFT_SELECTOR_LOUVER || kind == KVSIFT_SELECTOR_S4R;
  for (uint32_t step = 0; step < 3; ++step) {
    if (step > 0) append_all(all, seqs, 1, 1000 + step);
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      const std::vector<float> q = random_floats(kQElems, 77 + 10 * step + layer, 2.0f);
      std::vector<float> out(kQElems), from_list(kQElems, -1.0f);
      kvsift_selection_stats stats{};
      ASSERT_EQ(
          kvsift_attend_selected(selected.get(), layer, 2, seqs, q.data(), out.data(), &stats),
          KVSIFT_STATUS_OK)
          << kvsift_last_error();
      uint64_t length = 0;
      ASSERT_EQ(kvsift_sequence_length(plain.get(), seqs[0], layer, &length), KVSIFT_STATUS_OK);
      const uint64_t pages = (length + kPageTokens - 1) / kPageTokens;
      const Chosen c = select_twice(selecting.get(), layer, seqs, q.data(), kPairs * pages,
                                    token_level ? kPairs * length : 0);
      EXPECT_EQ(c.stats.pairs, stats.pairs);
      EXPECT_EQ(c.stats.pages_chosen, stats.pages_chosen);
      EXPECT_EQ(c.stats.pages_stored, stats.pages_stored);
      EXPECT_EQ(c.stats.index_bytes_read, stats.index_bytes_read);
      EXPECT_EQ(c.stats.kv_bytes_read, 0u);
      EXPECT_TRUE(c.stats.kept_estimate == stats.kept_estimate ||
                  (std::isnan(c.stats.kept_estimate) && std::isnan(stats.kept_estimate)));
      EXPECT_TRUE(c.stats.dropped_bound == stats.dropped_bound ||
                  (std::isnan(c.stats.dropped_bound) && std::isnan(stats.dropped_bound)));
      // What kvsift_attend_selected used, from its handle.
      const kvsift::select::Selection& used = selected.get()->engine.selection();
      ASSERT_EQ(c.page_offsets.back(), c.page_ids.size());
      for (uint32_t pair = 0; pair <= kPairs; ++pair)
        EXPECT_EQ(c.page_offsets[pair], used.offsets[pair]);
      for (std::size_t i = 0; i < c.page_ids.size(); ++i)
        EXPECT_EQ(c.page_ids[i], used.page_ids[i]);
      auto same = [](float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); };
      for (uint32_t pair = 0; pair < kPairs; ++pair) {
        EXPECT_TRUE(same(c.kept[pair], used.kept_estimate[pair])) << "pair " << pair;
        EXPECT_TRUE(same(c.bound[pair], used.dropped_bound[pair])) << "pair " << pair;
      }
      const kvsift_page_list list{c.page_offsets.data(), c.page_ids.data()};
      if (!token_level) {
        EXPECT_TRUE(c.tokens.empty());
        EXPECT_EQ(c.token_offsets.back(), 0u);
        ASSERT_EQ(kvsift_attend(selecting.get(), layer, 2, seqs, q.data(), from_list.data(), &list),
                  KVSIFT_STATUS_OK)
            << kvsift_last_error();
        EXPECT_EQ(std::memcmp(out.data(), from_list.data(), out.size() * sizeof(float)), 0)
            << kvsift_selector_name(kind) << " step " << step << " layer " << layer;
        continue;
      }
      // Token level: the positions are the rows the attention read, and attention recomputed in
      // float64 over the listed pages and positions matches the selected output.
      ASSERT_TRUE(used.has_rows);
      double diff = 0.0, norm = 0.0;
      for (uint32_t pair = 0; pair < kPairs; ++pair) {
        std::vector<uint32_t> rows(
            used.row_tokens.data() + std::size_t{used.chunk_offsets[pair]} * kPageTokens,
            used.row_tokens.data() + std::size_t{used.chunk_offsets[pair]} * kPageTokens +
                used.row_counts[pair]);
        std::sort(rows.begin(), rows.end());
        const std::vector<uint32_t> returned(c.tokens.begin() + c.token_offsets[pair],
                                             c.tokens.begin() + c.token_offsets[pair + 1]);
        EXPECT_EQ(returned, rows) << "pair " << pair;
        std::vector<uint64_t> positions;
        for (uint32_t i = c.page_offsets[pair]; i < c.page_offsets[pair + 1]; ++i)
          for (uint64_t t = uint64_t{c.page_ids[i]} * kPageTokens;
               t < std::min<uint64_t>(length, (uint64_t{c.page_ids[i]} + 1) * kPageTokens); ++t)
            positions.push_back(t);
        for (uint32_t t : returned) {
          EXPECT_TRUE(std::find(positions.begin(), positions.end(), t) == positions.end());
          positions.push_back(t);
        }
        std::vector<double> ref(std::size_t{kGroup} * kHeadDim);
        const std::size_t at = std::size_t{pair} * kGroup * kHeadDim;
        reference_pair(plain.get(), seqs[pair / kKvHeads], layer, pair % kKvHeads, positions,
                       q.data() + at, ref.data());
        for (std::size_t i = 0; i < ref.size(); ++i) {
          diff += (out[at + i] - ref[i]) * (out[at + i] - ref[i]);
          norm += ref[i] * ref[i];
        }
      }
      // Louver gathers the stored rows (float32 arithmetic only); S4R reconstructs them from
      // fp16 coefficients at full rank.
      EXPECT_LT(std::sqrt(diff / norm), kind == KVSIFT_SELECTOR_LOUVER ? 1e-5 : 2e-3)
          << kvsift_selector_name(kind) << " step " << step << " layer " << layer;
      for (uint32_t pair = 0; pair < kPairs; ++pair)
        EXPECT_GT(c.token_offsets[pair + 1] - c.token_offsets[pair], 0u) << "pair " << pair;
    }
  }
}

}  // namespace

TEST(SelectCApi, attention_over_the_returned_pages_equals_attend_selected_for_every_selector) {
  check_selector(KVSIFT_SELECTOR_DENSE, 0.0);
  check_selector(KVSIFT_SELECTOR_ORACLE, 0.2);
  check_selector(KVSIFT_SELECTOR_QUEST, 0.2);
  check_selector(KVSIFT_SELECTOR_LOCKS, 0.2);
  check_selector(KVSIFT_SELECTOR_LOCKS_CERTIFIED, 0.5);
}

TEST(SelectCApi, token_level_selectors_return_the_rows_they_attend_to) {
  check_selector(KVSIFT_SELECTOR_LOUVER, 0.2);
  check_selector(KVSIFT_SELECTOR_S4R, 0.2);
}

TEST(SelectCApi, refusals_name_the_argument_and_select_nothing) {
  Cache cache = make_cache();
  int32_t seqs[2];
  for (int32_t& seq : seqs) ASSERT_EQ(kvsift_sequence_create(cache.get(), &seq), KVSIFT_STATUS_OK);
  append_all({cache.get()}, seqs, 100, 3);
  std::vector<float> q = random_floats(kQElems, 5);
  std::vector<uint32_t> offsets(kPairs + 1, 7), ids(1000);
  kvsift_selection s{};
  s.page_offsets = offsets.data();
  s.page_ids = ids.data();
  s.page_capacity = ids.size();
  size_t n_pages = 0, n_tokens = 0;
  auto call = [&](const int32_t* ids_, const float* q_) {
    return kvsift_select(cache.get(), 0, 2, ids_, q_, &s, &n_pages, &n_tokens, nullptr);
  };
  EXPECT_EQ(kvsift_select(nullptr, 0, 2, seqs, q.data(), &s, &n_pages, &n_tokens, nullptr),
            KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(kvsift_select(cache.get(), 0, 2, seqs, q.data(), nullptr, &n_pages, &n_tokens, nullptr),
            KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(
      kvsift_select(cache.get(), kLayers, 2, seqs, q.data(), &s, &n_pages, &n_tokens, nullptr),
      KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(kvsift_select(cache.get(), 0, 0, seqs, q.data(), &s, &n_pages, &n_tokens, nullptr),
            KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(call(seqs, nullptr), KVSIFT_STATUS_INVALID_ARGUMENT);
  const int32_t unknown[2] = {seqs[0], 99};
  EXPECT_EQ(call(unknown, q.data()), KVSIFT_STATUS_NOT_FOUND);
  const int32_t twice[2] = {seqs[0], seqs[0]};
  EXPECT_EQ(call(twice, q.data()), KVSIFT_STATUS_INVALID_ARGUMENT);
  q[3] = std::nanf("");
  EXPECT_EQ(call(seqs, q.data()), KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvsift_last_error()).find("q"), std::string::npos);
  q[3] = 0.5f;
  s.page_offsets = nullptr;
  EXPECT_EQ(call(seqs, q.data()), KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvsift_last_error()).find("page_offsets"), std::string::npos);
  s.page_offsets = offsets.data();
  s.page_ids = nullptr;
  EXPECT_EQ(call(seqs, q.data()), KVSIFT_STATUS_INVALID_ARGUMENT);
  s.page_ids = ids.data();
  s.page_capacity = 3;
  EXPECT_EQ(call(seqs, q.data()), KVSIFT_STATUS_BUFFER_TOO_SMALL);
  EXPECT_EQ(n_pages, std::size_t{kPairs} * 7);               // 100 tokens: 7 pages per pair
  EXPECT_EQ(offsets, std::vector<uint32_t>(kPairs + 1, 7));  // nothing written
  // A token-level selector needs token_offsets.
  kvsift_selector_policy policy;
  kvsift_selector_policy_init(&policy);
  policy.selector = KVSIFT_SELECTOR_LOUVER;
  policy.budget = 0.5;
  ASSERT_EQ(kvsift_cache_set_selector(cache.get(), &policy), KVSIFT_STATUS_OK);
  std::vector<uint32_t> tokens(kPairs * 100);
  s.page_capacity = ids.size();
  s.token_positions = tokens.data();
  s.token_capacity = tokens.size();
  EXPECT_EQ(call(seqs, q.data()), KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kvsift_last_error()).find("token_offsets"), std::string::npos);
  std::vector<uint32_t> token_offsets(kPairs + 1);
  s.token_offsets = token_offsets.data();
  EXPECT_EQ(call(seqs, q.data()), KVSIFT_STATUS_OK) << kvsift_last_error();
  EXPECT_EQ(token_offsets.back(), n_tokens);
}
