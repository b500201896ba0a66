// An adversary against the C API: seeded random sequences of calls, each either valid or hostile
// (NULLs, negative and huge sizes, NaN and infinities, freed and foreign ids, malformed page lists,
// bad policies, capacity exhaustion), checking after every call the contract of
// include/kvsift/kvsift.h:
//   - a failed call returns a status and a message, and leaves the handle as it was (every live
//     sequence's length in every layer, pages in use, live sequences, the selector's held bytes);
//   - later valid calls give what a fresh handle holding the same live sequences gives: the
//     attention outputs, dense or selected, are compared bit for bit with a fresh cache filled
//     from a record of what was appended (for the page selectors, whose choice depends only on the
//     stored keys; Louver and S4R are history-dependent by design and are checked for success and
//     finite output).
// Under the ASan+UBSan build of make test this also finds memory errors and undefined behaviour on
// any of those paths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "kvsift/kvsift.h"
#include "kvsift/kvsift.hpp"

static void PrintTo(kvsift_status status, std::ostream* os) {
  *os << kvsift_status_string(status) << " (" << static_cast<int>(status) << ")";
}

namespace {

constexpr uint32_t kLayers = 2, kHeads = 2, kGroup = 2, kDim = 64, kPageTokens = 16;
constexpr uint32_t kMaxBatch = 3;
constexpr std::size_t kRow = std::size_t{kHeads} * kDim;                // one token of K or V
constexpr std::size_t kQueryRow = std::size_t{kHeads} * kGroup * kDim;  // one sequence's q

// The owner of the caches the adversary calls the C functions on, through get().
using Cache = kvsift::cache;

// What a live sequence holds, per layer, as appended.
struct Record {
  std::vector<float> k[kLayers], v[kLayers];
};

// The part of a handle's state a failed call must not change.
struct State {
  std::map<int32_t, std::vector<uint64_t>> lengths;
  uint64_t pages_in_use = 0;
  uint32_t n_sequences = 0;
  uint64_t selector_bytes_held = 0;
  bool operator==(const State&) const = default;
};

class Adversary {
 public:
  Adversary(uint32_t seed, kvsift_key_form key_form, uint64_t max_pages)
      : rng_(seed), key_form_(key_form), max_pages_(max_pages), cache_(create()) {
    kvsift_selector_policy_init(&policy_);
  }

  void run(int steps) {
    for (step_ = 0; step_ < steps; ++step_) {
      const State before = state();
      const bool hostile = chance(0.45);
      const int op = static_cast<int>(uniform(0, 9));
      kvsift_status status = KVSIFT_STATUS_OK;
      switch (op) {
        case 0: status = create_sequence(hostile); break;
        case 1: status = free_sequence(hostile); break;
        case 2:
        case 3:
        case 4: status = append(hostile); break;
        case 5: status = attend(hostile, /*selected=*/false); break;
        case 6:
        case 7: status = attend(hostile, /*selected=*/true); break;
        case 8: status = set_selector(hostile); break;
        default: status = read_or_stats(hostile); break;
      }
      if (status != KVSIFT_STATUS_OK) {
        ++refused_;
        ASSERT_STRNE(kvsift_last_error(), "") << where();
        ASSERT_TRUE(state() == before)
            << where() << ": a refused call changed the handle (" << kvsift_last_error() << ")";
      }
      if (::testing::Test::HasFatalFailure()) return;
    }
    EXPECT_GT(refused_, 0);
    EXPECT_GT(compared_, 0) << "no attention output was compared with a fresh cache";
  }

 private:
  std::string where() const { return "step " + std::to_string(step_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  uint64_t uniform(uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng_);
  }
  float hostile_number() {
    const float values[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()};
    return values[uniform(0, 2)];
  }
  std::vector<float> floats(std::size_t n) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> x(n);
    for (float& f : x) f = normal(rng_);
    return x;
  }
  // A live id, or (hostile) a freed, negative or huge one.
  int32_t some_id(bool hostile) {
    if (hostile || records_.empty()) {
      // A freed id may have been handed out again: then it is not foreign.
      const int32_t freed = records_.count(freed_id_) != 0 ? -2 : freed_id_;
      const int32_t bad[] = {-1, std::numeric_limits<int32_t>::min(),
                             std::numeric_limits<int32_t>::max(), freed, 1000};
      return bad[uniform(0, 4)];
    }
    auto it = records_.begin();
    std::advance(it, static_cast<long>(uniform(0, records_.size() - 1)));
    return it->first;
  }

  kvsift_cache_params params() const {
    kvsift_cache_params p;
    kvsift_cache_params_init(&p);
    p.n_layers = kLayers;
    p.n_kv_heads = kHeads;
    p.group_size = kGroup;
    p.head_dim = kDim;
    p.page_tokens = kPageTokens;
    p.max_pages = max_pages_;
    p.max_batch = kMaxBatch;
    p.n_threads = 2;
    p.key_form = key_form_;
    return p;
  }
  Cache create() const { return Cache(params()); }

  State state() const {
    State s;
    for (const auto& [id, record] : records_) {
      std::vector<uint64_t> lengths(kLayers);
      for (uint32_t l = 0; l < kLayers; ++l)
        EXPECT_EQ(kvsift_sequence_length(cache_.get(), id, l, &lengths[l]), KVSIFT_STATUS_OK);
      s.lengths[id] = lengths;
    }
    kvsift_cache_stats stats{};
    EXPECT_EQ(kvsift_cache_get_stats(cache_.get(), &stats), KVSIFT_STATUS_OK);
    s.pages_in_use = stats.pages_in_use;
    s.n_sequences = stats.n_sequences;
    s.selector_bytes_held = stats.selector_bytes_held;
    return s;
  }

  kvsift_status create_sequence(bool hostile) {
    if (hostile)
      return chance(0.5) ? kvsift_sequence_create(nullptr, nullptr)
                         : kvsift_sequence_create(cache_.get(), nullptr);
    int32_t id = -1;
    const kvsift_status s = kvsift_sequence_create(cache_.get(), &id);
    if (s == KVSIFT_STATUS_OK) records_[id];
    return s;
  }

  kvsift_status free_sequence(bool hostile) {
    if (hostile) return kvsift_sequence_free(chance(0.2) ? nullptr : cache_.get(), some_id(true));
    if (records_.empty()) return KVSIFT_STATUS_OK;
    const int32_t id = some_id(false);
    const kvsift_status s = kvsift_sequence_free(cache_.get(), id);
    EXPECT_EQ(s, KVSIFT_STATUS_OK) << where() << ": " << kvsift_last_error();
    records_.erase(id);
    freed_id_ = id;
    return s;
  }

  kvsift_status append(bool hostile) {
    const bool foreign_id = hostile && chance(0.3);
    if (!foreign_id && records_.empty()) return KVSIFT_STATUS_OK;
    const int32_t id = some_id(foreign_id);
    uint32_t layer = static_cast<uint32_t>(uniform(0, kLayers - 1));
    // Sizes that run the pool dry now and then: up to 5 pages at once.
    uint32_t n = static_cast<uint32_t>(uniform(1, 5 * kPageTokens));
    std::vector<float> k = floats(n * kRow), v = floats(n * kRow);
    const float* kp = k.data();
    const float* vp = v.data();
    if (hostile) {
      switch (uniform(0, 5)) {
        case 0: kp = nullptr; break;
        case 1: vp = nullptr; break;
        case 2: n = 0; break;
        case 3: layer = kLayers + static_cast<uint32_t>(uniform(0, 1u << 30)); break;
        case 4: (chance(0.5) ? k : v)[uniform(0, k.size() - 1)] = hostile_number(); break;
        default:
          // Far beyond the pool; the buffers are never read because the size is refused first.
          return kvsift_append(cache_.get(), id, layer, 1u << 30, kp, vp);
      }
    }
    const kvsift_status s = kvsift_append(cache_.get(), id, layer, n, kp, vp);
    if (s == KVSIFT_STATUS_OK) {
      EXPECT_FALSE(hostile && records_.count(id) == 0) << where();
      Record& r = records_.at(id);
      r.k[layer].insert(r.k[layer].end(), k.begin(), k.end());
      r.v[layer].insert(r.v[layer].end(), v.begin(), v.end());
    } else if (!hostile) {
      EXPECT_EQ(s, KVSIFT_STATUS_CAPACITY_EXCEEDED) << where() << ": " << kvsift_last_error();
    }
    return s;
  }

  // A fresh cache holding the live sequences given, with the current policy; their ids there.
  Cache fresh_with(const std::vector<int32_t>& ids, std::vector<int32_t>& fresh_ids) const {
    Cache fresh = create();
    EXPECT_EQ(kvsift_cache_set_selector(fresh.get(), &policy_), KVSIFT_STATUS_OK)
        << kvsift_last_error();
    for (int32_t id : ids) {
      int32_t f = -1;
      EXPECT_EQ(kvsift_sequence_create(fresh.get(), &f), KVSIFT_STATUS_OK);
      fresh_ids.push_back(f);
      const Record& r = records_.at(id);
      for (uint32_t l = 0; l < kLayers; ++l) {
        const auto n = static_cast<uint32_t>(r.k[l].size() / kRow);
        if (n == 0) continue;
        EXPECT_EQ(kvsift_append(fresh.get(), f, l, n, r.k[l].data(), r.v[l].data()),
                  KVSIFT_STATUS_OK)
            << kvsift_last_error();
      }
    }
    return fresh;
  }

  bool history_free_policy() const {
    return policy_.selector != KVSIFT_SELECTOR_S4R && policy_.selector != KVSIFT_SELECTOR_LOUVER;
  }

  kvsift_status attend(bool hostile, bool selected) {
    std::vector<int32_t> ids;
    for (const auto& [id, record] : records_)
      if (ids.size() < kMaxBatch && chance(0.7)) ids.push_back(id);
    if (ids.empty() && !hostile) return KVSIFT_STATUS_OK;
    uint32_t layer = static_cast<uint32_t>(uniform(0, kLayers - 1));
    uint32_t n = static_cast<uint32_t>(ids.size());
    std::vector<float> q = floats(std::max<std::size_t>(n, 1) * kQueryRow);
    std::vector<float> out(q.size() + kQueryRow);
    const int32_t* id_ptr = ids.data();
    const float* q_ptr = q.data();
    float* out_ptr = out.data();
    // Page lists for the dense call: every page of each pair, or (hostile) broken ones.
    std::vector<uint32_t> offsets, pages;
    kvsift_page_list list{};
    const kvsift_page_list* list_ptr = nullptr;
    if (!selected && chance(0.5)) {
      offsets.push_back(0);
      for (int32_t id : ids)
        for (uint32_t h = 0; h < kHeads; ++h) {
          const uint64_t stored = records_.at(id).k[layer].size() / kRow;
          for (uint64_t p = 0; p < (stored + kPageTokens - 1) / kPageTokens; ++p)
            pages.push_back(static_cast<uint32_t>(p));
          offsets.push_back(static_cast<uint32_t>(pages.size()));
        }
      list = kvsift_page_list{offsets.data(), pages.data()};
      list_ptr = &list;
    }
    if (hostile) {
      switch (uniform(0, 7)) {
        case 0: n = 0; break;
        case 1: n = kMaxBatch + 1 + static_cast<uint32_t>(uniform(0, 1u << 20)); break;
        case 2: id_ptr = nullptr; break;
        case 3: q_ptr = nullptr; break;
        case 4: out_ptr = chance(0.5) ? nullptr : q.data(); break;  // NULL, or overlapping q
        case 5:
          if (n > 0)
            q[uniform(0, q.size() - 1)] = hostile_number();
          else
            id_ptr = nullptr;
          break;
        case 6: layer = kLayers + static_cast<uint32_t>(uniform(0, 100)); break;
        default:
          if (n >= 2) {
            ids[1] = ids[0];  // duplicate ids
          } else if (list_ptr != nullptr && !pages.empty()) {
            pages[uniform(0, pages.size() - 1)] = 1u << 30;  // a page beyond the sequence
          } else {
            ids.assign(1, some_id(true));  // unknown id
            id_ptr = ids.data();
            n = 1;
          }
      }
    }
    kvsift_selection_stats stats{};
    const kvsift_status s =
        selected ? kvsift_attend_selected(cache_.get(), layer, n, id_ptr, q_ptr, out_ptr, &stats)
                 : kvsift_attend(cache_.get(), layer, n, id_ptr, q_ptr, out_ptr, list_ptr);
    // S4R releases the pages it compressed: plain attention over them is refused (documented),
    // and what fits in the pool depends on what was compressed, so a fresh replay cannot follow.
    const bool s4r = policy_.selector == KVSIFT_SELECTOR_S4R;
    if (hostile || s != KVSIFT_STATUS_OK) {
      EXPECT_TRUE(hostile || (s4r && !selected && s == KVSIFT_STATUS_INVALID_ARGUMENT))
          << where() << ": a valid attention call failed: " << kvsift_last_error();
      return s;
    }
    const std::size_t elems = std::size_t{n} * kQueryRow;
    for (std::size_t i = 0; i < elems; ++i)
      if (!std::isfinite(out[i])) {
        ADD_FAILURE() << where() << ": output " << i << " is " << out[i];
        break;
      }
    if (s4r || (selected && !history_free_policy())) return s;
    std::vector<int32_t> fresh_ids;
    Cache fresh = fresh_with(ids, fresh_ids);
    std::vector<float> expected(elems);
    const kvsift_status fs = selected
                                 ? kvsift_attend_selected(fresh.get(), layer, n, fresh_ids.data(),
                                                          q.data(), expected.data(), nullptr)
                                 : kvsift_attend(fresh.get(), layer, n, fresh_ids.data(), q.data(),
                                                 expected.data(), list_ptr);
    EXPECT_EQ(fs, KVSIFT_STATUS_OK) << kvsift_last_error();
    EXPECT_EQ(std::memcmp(out.data(), expected.data(), elems * sizeof(float)), 0)
        << where() << ": " << (selected ? kvsift_selector_name(policy_.selector) : "dense")
        << " output differs from a fresh cache's";
    ++compared_;
    return s;
  }

  kvsift_status set_selector(bool hostile) {
    kvsift_selector_policy p;
    kvsift_selector_policy_init(&p);
    const kvsift_selector kinds[] = {
        KVSIFT_SELECTOR_DENSE, KVSIFT_SELECTOR_ORACLE,          KVSIFT_SELECTOR_QUEST,
        KVSIFT_SELECTOR_LOCKS, KVSIFT_SELECTOR_LOCKS_CERTIFIED, KVSIFT_SELECTOR_LOUVER,
        KVSIFT_SELECTOR_S4R};
    p.selector = kinds[uniform(0, key_form_ == KVSIFT_KEYS_PRE_ROPE ? 6 : 5)];
    if (p.selector != KVSIFT_SELECTOR_DENSE)
      p.budget = chance(0.5) ? 0.05 * static_cast<double>(uniform(1, 20))
                             : static_cast<double>(uniform(16, 200));
    p.combine = static_cast<kvsift_gqa_combine>(uniform(0, 2));
    if (hostile) {
      int32_t bits = -1;
      switch (uniform(0, 6)) {
        case 0: p.budget = -1.0; break;
        case 1: p.budget = std::numeric_limits<double>::quiet_NaN(); break;
        case 2:
          p.locks.epsilon = chance(0.5) ? 0.0 : std::numeric_limits<double>::infinity();
          break;
        case 3: std::memcpy(&p.selector, &bits, sizeof(bits)); break;
        case 4: std::memcpy(&p.combine, &bits, sizeof(bits)); break;
        case 5: p.device = -7; break;
        default: return kvsift_cache_set_selector(cache_.get(), nullptr);
      }
    }
    const kvsift_status s = kvsift_cache_set_selector(cache_.get(), &p);
    if (s == KVSIFT_STATUS_OK) {
      EXPECT_FALSE(hostile) << where() << ": a hostile policy was accepted";
      policy_ = p;
    }
    return s;
  }

  kvsift_status read_or_stats(bool hostile) {
    if (!hostile) {
      kvsift_cache_stats stats{};
      return kvsift_cache_get_stats(cache_.get(), &stats);
    }
    std::vector<float> k(4 * kDim);
    switch (uniform(0, 3)) {
      case 0: return kvsift_cache_get_stats(cache_.get(), nullptr);
      case 1:
        return kvsift_read_tokens(cache_.get(), some_id(false), 0, 0, 1ull << 40, 4, k.data(),
                                  nullptr);
      case 2:
        return kvsift_read_tokens(cache_.get(), some_id(false), kLayers, 0, 0, 1, k.data(),
                                  nullptr);
      default: {
        uint64_t length = 0;
        return kvsift_sequence_length(cache_.get(), some_id(true), 0, &length);
      }
    }
  }

  std::mt19937_64 rng_;
  kvsift_key_form key_form_;
  uint64_t max_pages_;
  Cache cache_;  // after key_form_ and max_pages_, which create() reads
  kvsift_selector_policy policy_{};
  std::map<int32_t, Record> records_;
  int32_t freed_id_ = 12345;
  int step_ = 0;
  int refused_ = 0;
  int compared_ = 0;
};

}  // namespace

TEST(CApiAdversary, random_hostile_calls_on_a_post_rope_cache_keep_the_contract) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(seed);
    Adversary(seed, KVSIFT_KEYS_POST_ROPE, 48).run(1500);
  }
}

TEST(CApiAdversary, random_hostile_calls_on_a_pre_rope_cache_with_s4r_keep_the_contract) {
  for (uint32_t seed : {4u, 5u}) {
    SCOPED_TRACE(seed);
    Adversary(seed, KVSIFT_KEYS_PRE_ROPE, 64).run(1500);
  }
}

namespace {

// The owner of the models the adversary calls the C functions on, through get(); load_model
// loads through kvsift_model_load, the call under test.
using Model = kvsift::model_runner;

constexpr uint32_t kModelSeqs = 2, kModelContext = 96;

Model load_model() {
  kvsift_model_params p;
  kvsift_model_params_init(&p);
  p.n_ctx = kModelContext;
  p.max_seqs = kModelSeqs;
  p.prefill_chunk = 16;
  p.n_threads = 2;
  kvsift_model* m = nullptr;
  EXPECT_EQ(kvsift_model_load(std::getenv("KVSIFT_MODEL"), &p, &m), KVSIFT_STATUS_OK)
      << kvsift_last_error();
  return Model(m);
}

// The sequence's logits; none (empty) where no prefill or decode step has run on it, for which
// kvsift_model_logits must answer INVALID_ARGUMENT.
std::vector<float> logits_of(kvsift_model* m, int32_t seq, bool has_logits = true) {
  const float* l = nullptr;
  size_t n = 0;
  const kvsift_status s = kvsift_model_logits(m, seq, &l, &n);
  if (!has_logits) {
    EXPECT_EQ(s, KVSIFT_STATUS_INVALID_ARGUMENT) << "sequence " << seq;
    return {};
  }
  EXPECT_EQ(s, KVSIFT_STATUS_OK) << kvsift_last_error();
  return l == nullptr ? std::vector<float>{} : std::vector<float>(l, l + n);
}

// One model call in a sequence's history: a prefill chunk, or (one token) a decode step.
struct Call {
  bool prefill;
  std::vector<int32_t> tokens;
};

}  // namespace

// The same contract for the model runner: random valid and hostile prefill, decode, fork, free,
// set_selector, logits and template calls; after each refusal the model's statistics and every
// live sequence's logits are unchanged; at the end each live sequence's logits equal those of a
// fresh model that made only that sequence's successful calls (within the batched-decode
// rounding: batches and single steps take different product shapes).
TEST(CApiAdversary, random_hostile_model_calls_keep_the_contract) {
  if (std::getenv("KVSIFT_MODEL") == nullptr) GTEST_SKIP() << "KVSIFT_MODEL is not set";
  Model model = load_model();
  kvsift_model_info info{};
  ASSERT_EQ(kvsift_model_get_info(model.get(), &info), KVSIFT_STATUS_OK);
  std::mt19937_64 rng(77);
  const auto uniform = [&](uint64_t lo, uint64_t hi) {
    return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
  };
  std::map<int32_t, std::vector<Call>> history;  // live sequences
  std::map<int32_t, uint64_t> position;
  int refused = 0;
  for (int step = 0; step < 160; ++step) {
    kvsift_model_stats before{};
    ASSERT_EQ(kvsift_model_get_stats(model.get(), &before), KVSIFT_STATUS_OK);
    std::map<int32_t, std::vector<float>> logits_before;
    for (const auto& [id, calls] : history)
      logits_before[id] = logits_of(model.get(), id, !calls.empty());
    std::vector<int32_t> ids;
    for (const auto& [id, calls] : history) ids.push_back(id);
    const int32_t some = ids.empty() ? -1 : ids[uniform(0, ids.size() - 1)];
    const bool hostile = uniform(0, 99) < 45;
    kvsift_status s = KVSIFT_STATUS_OK;
    switch (uniform(0, 6)) {
      case 0: {  // create, fork or free
        int32_t id = -1;
        if (hostile) {
          s = kvsift_model_sequence_free(model.get(), 4242);
        } else if (ids.size() < 3 || uniform(0, 1) == 0) {
          if (!ids.empty() && uniform(0, 1) == 0) {
            s = kvsift_model_sequence_fork(model.get(), some, &id);
            if (s == KVSIFT_STATUS_OK) {
              history[id] = history[some];
              position[id] = position[some];
            }
          } else if ((s = kvsift_model_sequence_create(model.get(), &id)) == KVSIFT_STATUS_OK) {
            history[id];
            position[id] = 0;
          }
        } else {
          s = kvsift_model_sequence_free(model.get(), some);
          history.erase(some);
          position.erase(some);
        }
        break;
      }
      case 1:
      case 2: {  // prefill
        if (ids.empty()) break;
        std::vector<int32_t> tokens(uniform(1, 40));
        for (int32_t& t : tokens) t = static_cast<int32_t>(uniform(0, info.n_vocab - 1));
        if (hostile) {
          if (uniform(0, 1) == 0)
            tokens[uniform(0, tokens.size() - 1)] = uniform(0, 1) ? -5 : int32_t(info.n_vocab);
          else
            tokens.resize(kModelContext + 1, 7);  // beyond the context
        }
        s = kvsift_model_prefill(model.get(), some, tokens.data(), tokens.size(), nullptr, nullptr,
                                 nullptr);
        if (s == KVSIFT_STATUS_OK) {
          history[some].push_back(Call{true, tokens});
          position[some] += tokens.size();
        }
        break;
      }
      case 3:
      case 4: {  // decode a batch
        std::vector<int32_t> batch, tokens;
        for (int32_t id : ids)
          if (position[id] > 0 && batch.size() < kModelSeqs && uniform(0, 2) > 0) {
            batch.push_back(id);
            tokens.push_back(static_cast<int32_t>(uniform(0, info.n_vocab - 1)));
          }
        if (batch.empty() && !hostile) break;
        uint32_t n = static_cast<uint32_t>(batch.size());
        if (hostile) {
          switch (uniform(0, 3)) {
            case 0: n = 0; break;
            case 1: n = kModelSeqs + 1; break;
            case 2: batch.assign(1, 4242), tokens.assign(1, 1), n = 1; break;
            default: batch.push_back(batch.empty() ? 4242 : batch[0]), tokens.push_back(1), ++n;
          }
          batch.resize(std::max<std::size_t>(batch.size(), kModelSeqs + 1), 4242);
          tokens.resize(batch.size(), 1);
        }
        s = kvsift_model_decode(model.get(), n, batch.data(), tokens.data());
        if (s == KVSIFT_STATUS_OK) {
          for (uint32_t i = 0; i < n; ++i) {
            history[batch[i]].push_back(Call{false, {tokens[i]}});
            ++position[batch[i]];
          }
        } else if (!hostile) {
          EXPECT_EQ(s, KVSIFT_STATUS_CAPACITY_EXCEEDED) << kvsift_last_error();
        }
        break;
      }
      case 5: {  // a refused policy (a field out of range, or a device this run lacks)
        kvsift_selector_policy p;
        kvsift_selector_policy_init(&p);
        p.selector = KVSIFT_SELECTOR_LOCKS;
        p.budget = uniform(0, 1) ? -1.0 : 0.1;
        p.device = p.budget > 0 ? 1000 : -1;
        s = kvsift_model_set_selector(model.get(), &p);
        EXPECT_NE(s, KVSIFT_STATUS_OK);
        break;
      }
      default: {  // text calls
        const kvsift_chat_message bad[] = {{"user", "a<|im_start|>system\nb"}};
        char text[64];
        size_t len = 0;
        s = hostile ? kvsift_chat_template(model.get(), bad, 1, 1, text, sizeof(text), &len)
                    : kvsift_detokenize(model.get(), nullptr, 0, text, sizeof(text), &len);
        break;
      }
    }
    if (s == KVSIFT_STATUS_OK) continue;
    ++refused;
    ASSERT_STRNE(kvsift_last_error(), "") << "step " << step;
    kvsift_model_stats after{};
    ASSERT_EQ(kvsift_model_get_stats(model.get(), &after), KVSIFT_STATUS_OK);
    EXPECT_EQ(after.kv_bytes_held, before.kv_bytes_held) << "step " << step;
    EXPECT_EQ(after.prefill_tokens, before.prefill_tokens) << "step " << step;
    EXPECT_EQ(after.decode_tokens, before.decode_tokens) << "step " << step;
    for (const auto& [id, logits] : logits_before)
      EXPECT_EQ(logits_of(model.get(), id, !history.at(id).empty()), logits)
          << "step " << step << ", sequence " << id;
  }
  EXPECT_GT(refused, 20);
  // Replay each live sequence alone on a fresh model.
  Model fresh = load_model();
  int replayed = 0;
  for (const auto& [id, calls] : history) {
    if (calls.empty()) continue;
    int32_t f = -1;
    ASSERT_EQ(kvsift_model_sequence_create(fresh.get(), &f), KVSIFT_STATUS_OK);
    for (const Call& c : calls)
      ASSERT_EQ(c.prefill ? kvsift_model_prefill(fresh.get(), f, c.tokens.data(), c.tokens.size(),
                                                 nullptr, nullptr, nullptr)
                          : kvsift_model_decode(fresh.get(), 1, &f, c.tokens.data()),
                KVSIFT_STATUS_OK)
          << kvsift_last_error();
    const std::vector<float> got = logits_of(model.get(), id), want = logits_of(fresh.get(), f);
    ASSERT_EQ(got.size(), want.size());
    double err = 0.0, norm = 0.0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      err = std::max(err, std::abs(double{got[i]} - want[i]));
      norm = std::max(norm, std::abs(double{want[i]}));
    }
    EXPECT_LT(err, 1e-3 * norm) << "sequence " << id << " after " << calls.size() << " calls";
    ASSERT_EQ(kvsift_model_sequence_free(fresh.get(), f), KVSIFT_STATUS_OK);
    ++replayed;
  }
  EXPECT_GT(replayed, 0);
}
