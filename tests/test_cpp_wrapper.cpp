// The C++ wrapper (include/kvsift/kvsift.hpp) against the C API it wraps and against the float64
// reference attention (tests/reference_attention.hpp): each wrapper class gives what the C calls
// give on a twin handle fed the same fixed-seed inputs, failures carry the C call's status and
// message, spans of the wrong size are refused before any C call, and moved-from handles are
// empty (the ASan build checks that nothing is freed twice or leaked).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvsift/kvsift.h"
#include "kvsift/kvsift.hpp"
#include "tests/model_handle.hpp"
#include "tests/reference_attention.hpp"
#include "tests/test_util.hpp"

// tests/cpp_header.cpp: a translation unit that includes kvsift.hpp alone.
int kvsift_cpp_header_compiled_version();

namespace {

using kvsift::test::random_floats;
using kvsift::test::relative_error;

// test::attend_tolerance for a cache's ISA and dtype (the C enums share the values of
// simd/isa.hpp's Level and simd/page_layout.hpp's Dtype).
double attend_tolerance(const kvsift::cache& cache, kvsift_dtype dtype) {
  return kvsift::test::attend_tolerance(static_cast<kvsift::simd::Level>(cache.isa()),
                                        static_cast<kvsift::simd::Dtype>(dtype));
}

static_assert(!std::is_copy_constructible_v<kvsift::cache>);
static_assert(!std::is_copy_assignable_v<kvsift::cache>);
static_assert(std::is_nothrow_move_constructible_v<kvsift::cache>);
static_assert(std::is_nothrow_move_assignable_v<kvsift::cache>);
static_assert(!std::is_copy_constructible_v<kvsift::model_runner>);
static_assert(std::is_nothrow_move_constructible_v<kvsift::model_runner>);
static_assert(std::is_nothrow_move_assignable_v<kvsift::model_runner>);
static_assert(!std::is_copy_constructible_v<kvsift::sampler>);
static_assert(std::is_nothrow_move_constructible_v<kvsift::sampler>);
static_assert(std::is_nothrow_move_assignable_v<kvsift::sampler>);

// Replaces this thread's last error with a known message: a check afterwards that the message is
// still this one proves no C call failed in between.
std::string poison_last_error() {
  EXPECT_EQ(kvsift_set_max_isa(static_cast<kvsift_isa>(77)), KVSIFT_STATUS_INVALID_ARGUMENT);
  return kvsift_last_error();
}

// f() throws kvsift::error with `status` and exactly `message`.
template <class F>
void expect_error(F&& f, kvsift_status status, const std::string& message) {
  try {
    f();
    ADD_FAILURE() << "no kvsift::error thrown; expected \"" << message << "\"";
  } catch (const kvsift::error& e) {
    EXPECT_EQ(e.status(), status) << e.what();
    EXPECT_EQ(std::string(e.what()), message);
  }
}

// The C call fails; the wrapper call, given the same arguments, throws its status and message.
template <class CCall, class WrapperCall>
void expect_same_failure(CCall&& c_call, WrapperCall&& wrapper_call) {
  const kvsift_status status = c_call();
  ASSERT_NE(status, KVSIFT_STATUS_OK);
  const std::string message = kvsift_last_error();
  ASSERT_FALSE(message.empty());
  expect_error(wrapper_call, status, message);
}

// The wrapper refuses a span before calling C: kvsift::error INVALID_ARGUMENT whose message names
// `argument`, and this thread's last C error is untouched.
template <class F>
void expect_refused(F&& f, const std::string& argument) {
  const std::string poison = poison_last_error();
  try {
    f();
    ADD_FAILURE() << "no kvsift::error thrown for " << argument;
  } catch (const kvsift::error& e) {
    EXPECT_EQ(e.status(), KVSIFT_STATUS_INVALID_ARGUMENT);
    EXPECT_EQ(std::string_view(e.what()).rfind("kvsift.hpp: " + argument + " has ", 0), 0u)
        << e.what();
  }
  EXPECT_EQ(std::string(kvsift_last_error()), poison) << "a C call failed after all";
}

// ---- Version and process-wide calls ------------------------------------------------------------

TEST(CppWrapper, compiled_and_linked_versions_match_the_c_api) {
  EXPECT_EQ(kvsift::compiled_version, KVSIFT_VERSION);
  EXPECT_EQ(kvsift_cpp_header_compiled_version(), KVSIFT_VERSION);
  EXPECT_EQ(kvsift::linked_version(), kvsift_version());
  EXPECT_EQ(kvsift::linked_version(), kvsift::compiled_version);  // built in one tree
  EXPECT_EQ(kvsift::linked_version_string(), std::string_view(kvsift_version_string()));
  EXPECT_EQ(kvsift::linked_version_string(), std::to_string(KVSIFT_VERSION_MAJOR) + "." +
                                                 std::to_string(KVSIFT_VERSION_MINOR) + "." +
                                                 std::to_string(KVSIFT_VERSION_PATCH));
}

TEST(CppWrapper, names_and_settings_mirror_the_c_api) {
  EXPECT_EQ(kvsift::status_string(KVSIFT_STATUS_NOT_FOUND),
            std::string_view(kvsift_status_string(KVSIFT_STATUS_NOT_FOUND)));
  EXPECT_EQ(kvsift::isa_supported(), kvsift_isa_supported());
  EXPECT_EQ(kvsift::isa_name(kvsift::isa_supported()),
            std::string_view(kvsift_isa_name(kvsift_isa_supported())));
  for (int s = 0; s < KVSIFT_SELECTOR_COUNT; ++s) {
    const auto selector = static_cast<kvsift_selector>(s);
    EXPECT_EQ(kvsift::selector_name(selector), std::string_view(kvsift_selector_name(selector)));
    EXPECT_EQ(kvsift::selector_from_name(kvsift_selector_name(selector)), selector);
  }
  kvsift_selector_policy c_policy;
  kvsift_selector_policy_init(&c_policy);
  const kvsift_selector_policy policy = kvsift::default_selector_policy();
  EXPECT_EQ(policy.selector, c_policy.selector);
  EXPECT_EQ(policy.budget, c_policy.budget);
  EXPECT_EQ(policy.combine, c_policy.combine);
  EXPECT_EQ(policy.s4r.window, c_policy.s4r.window);

  kvsift_selector unused;
  expect_same_failure([&] { return kvsift_selector_from_name("louvre", &unused); },
                      [] { kvsift::selector_from_name("louvre"); });
  expect_same_failure([] { return kvsift_set_max_isa(static_cast<kvsift_isa>(77)); },
                      [] { kvsift::set_max_isa(static_cast<kvsift_isa>(77)); });
  int n_devices = -1;
  const kvsift_status gpu = kvsift_gpu_device_count(&n_devices);
  uint64_t used = 0, total = 0;
  if (gpu == KVSIFT_STATUS_OK) {
    EXPECT_EQ(kvsift::gpu_device_count(), n_devices);
    const kvsift::GpuMemory memory = kvsift::gpu_memory_info(0);
    EXPECT_GT(memory.used_bytes, 0u);
    EXPECT_LE(memory.used_bytes, memory.total_bytes);
  } else {
    expect_same_failure([&] { return kvsift_gpu_device_count(&n_devices); },
                        [] { kvsift::gpu_device_count(); });
    expect_same_failure([&] { return kvsift_gpu_memory_info(0, &used, &total); },
                        [] { kvsift::gpu_memory_info(0); });
  }
}

// ---- The cache against the C API and the float64 reference
// ----------------------------------------

struct Geometry {
  kvsift_dtype dtype;
  uint32_t group_size;
  uint32_t page_tokens;
};

std::string geometry_text(const Geometry& g) {
  const char* dtype = g.dtype == KVSIFT_DTYPE_F16    ? "f16"
                      : g.dtype == KVSIFT_DTYPE_BF16 ? "bf16"
                                                     : "q8";
  return std::string("dtype_") + dtype + "_group_" + std::to_string(g.group_size) + "_page_" +
         std::to_string(g.page_tokens);
}

// The test names, and gtest's print of the parameter (which ctest shows beside them).
std::string geometry_name(const testing::TestParamInfo<Geometry>& info) {
  return geometry_text(info.param);
}
void PrintTo(const Geometry& g, std::ostream* os) {
  *os << geometry_text(g);
}

constexpr uint32_t kLayers = 2, kKvHeads = 2, kHeadDim = 64;

class CppWrapperCache : public testing::TestWithParam<Geometry> {
 protected:
  kvsift_cache_params params() const {
    kvsift_cache_params p = kvsift::cache::default_params();
    p.n_layers = kLayers;
    p.n_kv_heads = kKvHeads;
    p.group_size = GetParam().group_size;
    p.head_dim = kHeadDim;
    p.page_tokens = GetParam().page_tokens;
    p.dtype = GetParam().dtype;
    p.max_pages = 256;
    p.max_batch = 4;
    p.n_threads = 2;
    return p;
  }

  // float64 attention of every query head of sequence seqs[s] over the tokens `positions` of
  // each KV head, read back through the wrapper (the stored, rounded values).
  std::vector<double> reference(const kvsift::cache& cache, uint32_t layer,
                                const std::vector<int32_t>& seqs, const std::vector<float>& q,
                                const std::vector<std::vector<uint64_t>>& positions) const {
    const uint32_t group = GetParam().group_size;
    std::vector<double> out(q.size());
    for (std::size_t s = 0; s < seqs.size(); ++s)
      for (uint32_t h = 0; h < kKvHeads; ++h) {
        const std::vector<uint64_t>& pos = positions[s * kKvHeads + h];
        std::vector<float> k(pos.size() * kHeadDim), v(pos.size() * kHeadDim);
        for (std::size_t i = 0; i < pos.size(); ++i)
          cache.read_tokens(seqs[s], layer, h, pos[i], 1,
                            std::span(k).subspan(i * kHeadDim, kHeadDim),
                            std::span(v).subspan(i * kHeadDim, kHeadDim));
        const std::size_t at = (s * kKvHeads + h) * group * kHeadDim;
        kvsift::reference_attention(q.data() + at, k.data(), v.data(), pos.size(), group, kHeadDim,
                                    out.data() + at);
      }
    return out;
  }
};

TEST_P(CppWrapperCache, attend_matches_the_c_api_and_the_reference) {
  const kvsift_cache_params p = params();
  kvsift::cache wrapped(p);
  kvsift::cache twin(p);  // driven by C calls only, through get()
  EXPECT_EQ(wrapped.params().group_size, p.group_size);
  EXPECT_EQ(wrapped.isa(), kvsift_cache_isa(twin.get()));

  const std::vector<uint32_t> lengths = {37, 2 * p.page_tokens + 5};
  std::vector<int32_t> seqs, twin_seqs;
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    seqs.push_back(wrapped.create_sequence());
    int32_t id = -1;
    ASSERT_EQ(kvsift_sequence_create(twin.get(), &id), KVSIFT_STATUS_OK);
    twin_seqs.push_back(id);
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      const uint32_t seed = 100 + 10 * static_cast<uint32_t>(s) + layer;
      const std::vector<float> k = random_floats(wrapped.token_size(lengths[s]), seed);
      const std::vector<float> v = random_floats(wrapped.token_size(lengths[s]), seed + 5);
      wrapped.append(seqs[s], layer, k, v);
      ASSERT_EQ(kvsift_append(twin.get(), id, layer, lengths[s], k.data(), v.data()),
                KVSIFT_STATUS_OK);
      EXPECT_EQ(wrapped.sequence_length(seqs[s], layer), lengths[s]);
    }
  }

  const uint32_t layer = 1;
  const std::vector<float> q = random_floats(wrapped.query_size(seqs.size()), 7);
  std::vector<float> out(q.size()), twin_out(q.size());
  wrapped.attend(layer, seqs, q, out);
  ASSERT_EQ(kvsift_attend(twin.get(), layer, static_cast<uint32_t>(twin_seqs.size()),
                          twin_seqs.data(), q.data(), twin_out.data(), nullptr),
            KVSIFT_STATUS_OK);
  EXPECT_EQ(out, twin_out);

  std::vector<std::vector<uint64_t>> every_token;
  for (uint32_t n : lengths)
    for (uint32_t h = 0; h < kKvHeads; ++h) {
      every_token.emplace_back(n);
      for (uint32_t t = 0; t < n; ++t) every_token.back()[t] = t;
    }
  const std::vector<double> expected = reference(wrapped, layer, seqs, q, every_token);
  EXPECT_LT(relative_error(out.data(), expected.data(), out.size()),
            attend_tolerance(wrapped, p.dtype));

  // The statistics of the last attention: the same on both.
  const kvsift_cache_stats stats = wrapped.stats();
  kvsift_cache_stats twin_stats{};
  ASSERT_EQ(kvsift_cache_get_stats(twin.get(), &twin_stats), KVSIFT_STATUS_OK);
  EXPECT_EQ(stats.pages_in_use, twin_stats.pages_in_use);
  EXPECT_EQ(stats.last_tokens_read, twin_stats.last_tokens_read);
  EXPECT_EQ(stats.n_sequences, 2u);

  wrapped.free_sequence(seqs[0]);
  EXPECT_EQ(wrapped.stats().n_sequences, 1u);
}

TEST_P(CppWrapperCache, attend_over_a_page_list_matches_the_c_api_and_the_reference) {
  const kvsift_cache_params p = params();
  kvsift::cache cache(p);
  const std::vector<int32_t> seqs = {cache.create_sequence()};
  const uint32_t n = 4 * p.page_tokens + 3;  // four full pages and an open one
  const std::vector<float> k = random_floats(cache.token_size(n), 21);
  const std::vector<float> v = random_floats(cache.token_size(n), 22);
  cache.append(seqs[0], 0, k, v);

  // Head 0 attends pages 0, 2 and the open page 4; head 1 attends page 3 alone.
  const std::vector<uint32_t> offsets = {0, 3, 4};
  const std::vector<uint32_t> ids = {0, 2, 4, 3};
  const std::vector<float> q = random_floats(cache.query_size(1), 23);
  std::vector<float> out(q.size()), c_out(q.size());
  cache.attend(0, seqs, q, out, offsets, ids);
  const kvsift_page_list pages{offsets.data(), ids.data()};
  ASSERT_EQ(kvsift_attend(cache.get(), 0, 1, seqs.data(), q.data(), c_out.data(), &pages),
            KVSIFT_STATUS_OK);
  EXPECT_EQ(out, c_out);

  std::vector<std::vector<uint64_t>> positions(kKvHeads);
  for (uint32_t h = 0; h < kKvHeads; ++h)
    for (uint32_t i = offsets[h]; i < offsets[h + 1]; ++i)
      for (uint64_t t = uint64_t{ids[i]} * p.page_tokens;
           t < std::min<uint64_t>(n, uint64_t{ids[i] + 1} * p.page_tokens); ++t)
        positions[h].push_back(t);
  const std::vector<double> expected = reference(cache, 0, seqs, q, positions);
  EXPECT_LT(relative_error(out.data(), expected.data(), out.size()),
            attend_tolerance(cache, p.dtype));
}

TEST_P(CppWrapperCache, select_matches_kvsift_select_and_attend_selected) {
  const kvsift_cache_params p = params();
  kvsift_selector_policy policy = kvsift::default_selector_policy();
  policy.selector = KVSIFT_SELECTOR_LOCKS;
  policy.budget = 4.0 * p.page_tokens;
  // `selecting` selects through the wrapper, `twin` through kvsift_select, `attending` attends
  // with attend_selected: the same tokens and the same policy in all three.
  kvsift::cache selecting(p), twin(p), attending(p);
  std::vector<int32_t> seqs;
  for (kvsift::cache* cache : {&selecting, &twin, &attending}) {
    cache->set_selector(policy);
    seqs.clear();
    for (uint32_t s = 0; s < 2; ++s) {
      seqs.push_back(cache->create_sequence());
      const uint32_t n = 9 * p.page_tokens + 5 * s;
      cache->append(seqs[s], 0, random_floats(cache->token_size(n), 31 + s),
                    random_floats(cache->token_size(n), 41 + s));
    }
  }
  const std::vector<float> q = random_floats(selecting.query_size(seqs.size()), 51);

  const kvsift::selection chosen = selecting.select(0, seqs, q);
  const std::size_t pairs = seqs.size() * kKvHeads;
  ASSERT_EQ(chosen.page_offsets.size(), pairs + 1);
  EXPECT_EQ(chosen.page_ids.size(), chosen.page_offsets.back());
  EXPECT_EQ(chosen.token_positions.size(), 0u);  // LOCKS chooses pages only
  EXPECT_EQ(chosen.stats.pairs, pairs);
  EXPECT_EQ(chosen.stats.pages_chosen, chosen.page_ids.size());
  EXPECT_LT(chosen.page_ids.size(), chosen.stats.pages_stored);  // the budget dropped pages

  std::vector<uint32_t> offsets(pairs + 1), ids(chosen.stats.pages_stored),
      token_offsets(pairs + 1);
  std::vector<float> kept(pairs), bound(pairs);
  const kvsift_selection buffers{offsets.data(), ids.data(), ids.size(),  token_offsets.data(),
                                 nullptr,        0,          kept.data(), bound.data()};
  std::size_t n_pages = 0, n_tokens = 0;
  ASSERT_EQ(kvsift_select(twin.get(), 0, 2, seqs.data(), q.data(), &buffers, &n_pages, &n_tokens,
                          nullptr),
            KVSIFT_STATUS_OK)
      << kvsift_last_error();
  ids.resize(n_pages);
  EXPECT_EQ(chosen.page_offsets, offsets);
  EXPECT_EQ(chosen.page_ids, ids);
  EXPECT_EQ(chosen.token_offsets, token_offsets);
  for (std::size_t i = 0; i < pairs; ++i) {
    EXPECT_EQ(chosen.kept_estimate[i], kept[i]) << "pair " << i;
    EXPECT_TRUE(chosen.dropped_bound[i] == bound[i] ||
                (std::isnan(chosen.dropped_bound[i]) && std::isnan(bound[i])))
        << "pair " << i;
  }

  // Attending over the chosen pages gives what attend_selected gives, bit for bit.
  std::vector<float> out(q.size()), selected_out(q.size());
  selecting.attend(0, seqs, q, out, chosen.page_offsets, chosen.page_ids);
  const kvsift_selection_stats stats = attending.attend_selected(0, seqs, q, selected_out);
  EXPECT_EQ(out, selected_out);
  EXPECT_EQ(stats.pages_chosen, chosen.stats.pages_chosen);
  EXPECT_GT(stats.kv_bytes_read, 0u);
}

INSTANTIATE_TEST_SUITE_P(Geometries, CppWrapperCache,
                         testing::Values(Geometry{KVSIFT_DTYPE_F16, 1, 16},
                                         Geometry{KVSIFT_DTYPE_F16, 4, 32},
                                         Geometry{KVSIFT_DTYPE_BF16, 2, 16},
                                         Geometry{KVSIFT_DTYPE_Q8, 4, 16},
                                         Geometry{KVSIFT_DTYPE_Q8, 3, 64}),
                         geometry_name);

// ---- Failures
// -------------------------------------------------------------------------------------

kvsift_cache_params small_params() {
  kvsift_cache_params p = kvsift::cache::default_params();
  p.n_layers = kLayers;
  p.n_kv_heads = kKvHeads;
  p.group_size = 2;
  p.head_dim = kHeadDim;
  p.max_pages = 64;
  p.max_batch = 2;
  p.n_threads = 2;
  return p;
}

TEST(CppWrapperErrors, failed_c_calls_throw_their_status_and_message) {
  kvsift_cache_params bad = small_params();
  bad.head_dim = 65;
  kvsift_cache* raw = nullptr;
  expect_same_failure([&] { return kvsift_cache_create(&bad, &raw); },
                      [&] { kvsift::cache cache(bad); });
  EXPECT_EQ(raw, nullptr);

  kvsift::cache cache(small_params());
  const int32_t seq = cache.create_sequence();
  expect_same_failure([&] { return kvsift_sequence_free(cache.get(), 12345); },
                      [&] { cache.free_sequence(12345); });
  uint64_t n = 0;
  expect_same_failure([&] { return kvsift_sequence_length(cache.get(), seq, kLayers, &n); },
                      [&] { cache.sequence_length(seq, kLayers); });
  const std::vector<float> k = random_floats(cache.token_size(3), 1);
  expect_same_failure(
      [&] { return kvsift_append(cache.get(), seq, kLayers, 3, k.data(), k.data()); },
      [&] { cache.append(seq, kLayers, k, k); });
  std::vector<float> row(kHeadDim);
  expect_same_failure(
      [&] { return kvsift_read_tokens(cache.get(), seq, 0, 0, 0, 1, row.data(), nullptr); },
      [&] { cache.read_tokens(seq, 0, 0, 0, 1, row, {}); });
  const std::vector<int32_t> dup = {seq, seq};
  const std::vector<float> q = random_floats(cache.query_size(2), 2);
  std::vector<float> out(q.size());
  expect_same_failure(
      [&] { return kvsift_attend(cache.get(), 0, 2, dup.data(), q.data(), out.data(), nullptr); },
      [&] { cache.attend(0, dup, q, out); });
  kvsift_selector_policy policy = kvsift::default_selector_policy();
  policy.budget = -1.0;
  expect_same_failure([&] { return kvsift_cache_set_selector(cache.get(), &policy); },
                      [&] { cache.set_selector(policy); });

  kvsift_sampler_params sampler_params = kvsift::sampler::default_params();
  sampler_params.top_p = 1.5f;
  kvsift_sampler* raw_sampler = nullptr;
  expect_same_failure([&] { return kvsift_sampler_create(&sampler_params, &raw_sampler); },
                      [&] { kvsift::sampler s(sampler_params); });
  kvsift::sampler greedy(kvsift::sampler::default_params());
  const std::vector<float> masked(4, -INFINITY);
  int32_t token = -1;
  expect_same_failure(
      [&] { return kvsift_sampler_sample(greedy.get(), masked.data(), masked.size(), &token); },
      [&] { greedy.sample(masked); });

  kvsift_model* raw_model = nullptr;
  const kvsift_model_params model_params = kvsift::model_runner::default_params();
  expect_same_failure(
      [&] { return kvsift_model_load("/nonexistent/model.gguf", &model_params, &raw_model); },
      [&] { kvsift::model_runner m("/nonexistent/model.gguf"); });
}

TEST(CppWrapperErrors, spans_of_the_wrong_size_are_refused_before_the_c_call) {
  kvsift::cache cache(small_params());
  const int32_t seq = cache.create_sequence();
  const std::vector<float> three = random_floats(cache.token_size(3), 3);
  cache.append(seq, 0, three, three);

  const std::vector<float> ragged(cache.token_size(2) + 1);
  expect_refused([&] { cache.append(seq, 0, ragged, ragged); }, "k");
  const std::vector<float> two(cache.token_size(2));
  expect_refused([&] { cache.append(seq, 0, two, three); }, "v");
  EXPECT_EQ(cache.sequence_length(seq, 0), 3u);  // nothing appended

  std::vector<float> row(kHeadDim + 1);
  expect_refused([&] { cache.read_tokens(seq, 0, 0, 0, 1, row, {}); }, "k_out");
  expect_refused([&] { cache.read_tokens(seq, 0, 0, 0, 1, {}, row); }, "v_out");

  const std::vector<int32_t> seqs = {seq};
  const std::vector<float> q = random_floats(cache.query_size(1), 4);
  const std::vector<float> short_q(q.begin(), q.end() - 1);
  std::vector<float> out(q.size()), long_out(q.size() + 1);
  expect_refused([&] { cache.attend(0, seqs, short_q, out); }, "q");
  expect_refused([&] { cache.attend(0, seqs, q, long_out); }, "out");
  expect_refused([&] { cache.attend_selected(0, seqs, short_q, out); }, "q");
  expect_refused([&] { cache.select(0, seqs, short_q); }, "q");
  const std::vector<uint32_t> ids = {0};
  const std::vector<uint32_t> too_few_offsets = {0, 1};
  expect_refused([&] { cache.attend(0, seqs, q, out, too_few_offsets, ids); }, "page_offsets");
  // An offset past the end of page_ids would make the C call read past the buffer.
  const std::vector<uint32_t> past_the_ids = {0, 1, 2};
  try {
    cache.attend(0, seqs, q, out, past_the_ids, ids);
    ADD_FAILURE() << "an offset beyond page_ids was accepted";
  } catch (const kvsift::error& e) {
    EXPECT_EQ(e.status(), KVSIFT_STATUS_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(e.what()),
              "kvsift.hpp: page_offsets holds 2, beyond page_ids' 1 elements");
  }
  // The same offsets with enough ids pass the wrapper and attend.
  const std::vector<uint32_t> two_ids = {0, 0};
  cache.attend(0, seqs, q, out, past_the_ids, two_ids);
}

// ---- Moves
// ----------------------------------------------------------------------------------------

TEST(CppWrapperMoves, a_moved_from_handle_is_empty_and_the_target_owns_the_handle) {
  kvsift::cache first(small_params());
  kvsift_cache* const raw = first.get();
  ASSERT_NE(raw, nullptr);
  const int32_t seq = first.create_sequence();

  kvsift::cache second(std::move(first));
  EXPECT_EQ(first.get(), nullptr);  // NOLINT(bugprone-use-after-move): the point of the test
  EXPECT_FALSE(first);
  EXPECT_TRUE(first == nullptr);
  EXPECT_EQ(second.get(), raw);
  EXPECT_EQ(second.sequence_length(seq, 0), 0u);

  // Assigning over a live handle frees that one (ASan reports a leak otherwise).
  kvsift::cache third(small_params());
  third = std::move(second);
  EXPECT_EQ(second.get(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(third.get(), raw);
  // Self-assignment keeps the handle.
  kvsift::cache& alias = third;
  third = std::move(alias);
  EXPECT_EQ(third.get(), raw);

  // An empty handle reaches the C call, which refuses the NULL with its own message.
  kvsift_cache_stats unused{};
  expect_same_failure([&] { return kvsift_cache_get_stats(nullptr, &unused); },
                      [&] { (void)first.stats(); });  // NOLINT(bugprone-use-after-move)
  // Moving an empty handle leaves both empty; destroying them frees nothing twice.
  kvsift::cache fourth(std::move(first));  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(fourth.get(), nullptr);
  kvsift::cache fifth;
  EXPECT_FALSE(fifth);
  fifth = std::move(third);  // a default-constructed handle takes one over
  EXPECT_EQ(fifth.get(), raw);
  EXPECT_EQ(third.get(), nullptr);  // NOLINT(bugprone-use-after-move)

  kvsift::sampler s(kvsift::sampler::default_params());
  kvsift_sampler* const raw_sampler = s.get();
  ASSERT_NE(raw_sampler, nullptr);
  kvsift::sampler t(std::move(s));
  EXPECT_EQ(s.get(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(t.get(), raw_sampler);
  kvsift::sampler u;  // default constructed: empty until assigned
  EXPECT_TRUE(u == nullptr);
  u = std::move(t);
  EXPECT_EQ(t.get(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(u.get(), raw_sampler);

  kvsift::model_runner empty;
  EXPECT_TRUE(empty == nullptr);
  kvsift::model_runner adopted_null(nullptr);
  EXPECT_TRUE(adopted_null == nullptr);
  kvsift::model_runner moved(std::move(empty));
  EXPECT_EQ(moved.get(), nullptr);
}

// ---- The sampler
// ----------------------------------------------------------------------------------

TEST(CppWrapperSampler, draws_what_the_c_sampler_draws_from_the_same_seed) {
  const std::vector<float> logits = random_floats(500, 61);
  kvsift::sampler greedy(kvsift::sampler::default_params());
  EXPECT_EQ(greedy.sample(logits), std::max_element(logits.begin(), logits.end()) - logits.begin());

  kvsift_sampler_params p = kvsift::sampler::default_params();
  p.temperature = 0.9f;
  p.top_p = 0.95f;
  p.seed = 1234;
  kvsift::sampler wrapped(p);
  kvsift_sampler* raw_twin = nullptr;
  ASSERT_EQ(kvsift_sampler_create(&p, &raw_twin), KVSIFT_STATUS_OK);
  const kvsift::sampler twin(raw_twin);  // adopted: drawn from by C calls, freed by the wrapper
  std::vector<int32_t> drawn, twin_drawn;
  for (int i = 0; i < 40; ++i) {
    drawn.push_back(wrapped.sample(logits));
    int32_t token = -1;
    ASSERT_EQ(kvsift_sampler_sample(twin.get(), logits.data(), logits.size(), &token),
              KVSIFT_STATUS_OK);
    twin_drawn.push_back(token);
  }
  EXPECT_EQ(drawn, twin_drawn);
  EXPECT_GT(std::set<int32_t>(drawn.begin(), drawn.end()).size(), 1u);  // it did sample
}

// ---- The model runner (needs KVSIFT_MODEL)
// --------------------------------------------------------

class CppWrapperModel : public testing::Test {
 protected:
  void SetUp() override {
    if (kvsift::test::model_path() == nullptr) GTEST_SKIP() << "KVSIFT_MODEL is not set";
  }
  static kvsift_model_params small_params() {
    kvsift_model_params p = kvsift::model_runner::default_params();
    p.n_ctx = 128;
    p.max_seqs = 2;
    p.n_threads = 2;
    return p;
  }
};

TEST_F(CppWrapperModel, runs_what_the_c_api_runs) {
  const kvsift_model_params p = small_params();
  kvsift::model_runner wrapped(kvsift::test::model_path(), p);
  kvsift_model* raw = nullptr;
  ASSERT_EQ(kvsift_model_load(kvsift::test::model_path(), &p, &raw), KVSIFT_STATUS_OK);
  const kvsift::model_runner twin(raw);  // adopted: driven by C calls below, freed by the wrapper
  ASSERT_EQ(twin.get(), raw);

  const kvsift_model_info info = wrapped.info();
  EXPECT_EQ(info.n_ctx, 128u);
  EXPECT_GT(info.n_vocab, 0u);

  // Tokens, text and the chat template, against the C calls.
  const std::string text = "The wrapper tokenizes what the C API tokenizes: <|im_start|> too.";
  for (const bool special : {false, true}) {
    const std::vector<int32_t> ids = wrapped.tokenize(text, special);
    std::vector<int32_t> c_ids(text.size() + 8);
    std::size_t n = 0;
    ASSERT_EQ(kvsift_tokenize(twin.get(), text.data(), text.size(), special ? 1 : 0, c_ids.data(),
                              c_ids.size(), &n),
              KVSIFT_STATUS_OK);
    c_ids.resize(n);
    EXPECT_EQ(ids, c_ids);
    const std::string back = wrapped.detokenize(ids);
    std::string c_back(back.size() + 16, '\0');
    ASSERT_EQ(
        kvsift_detokenize(twin.get(), c_ids.data(), c_ids.size(), c_back.data(), c_back.size(), &n),
        KVSIFT_STATUS_OK);
    c_back.resize(n);
    EXPECT_EQ(back, c_back);
    if (!special) {
      EXPECT_EQ(back, text);
    }
  }
  EXPECT_EQ(wrapped.tokenize("", false), std::vector<int32_t>{});
  const std::string long_turn(600, 'x');
  const std::vector<kvsift_chat_message> chat = {
      {"user", "Hello"}, {"assistant", "Hi."}, {"user", long_turn.c_str()}};
  const std::string rendered = wrapped.chat_template(chat, true);
  std::size_t needed = 0;
  ASSERT_EQ(kvsift_chat_template(twin.get(), chat.data(), chat.size(), 1, nullptr, 0, &needed),
            KVSIFT_STATUS_BUFFER_TOO_SMALL);
  std::string c_rendered(needed, '\0');
  ASSERT_EQ(kvsift_chat_template(twin.get(), chat.data(), chat.size(), 1, c_rendered.data(),
                                 c_rendered.size(), &needed),
            KVSIFT_STATUS_OK);
  EXPECT_EQ(rendered, c_rendered);
  EXPECT_GT(rendered.size(), 600u);  // past the wrapper's first guess: the second call ran
  EXPECT_EQ(wrapped.token_is_end(info.eos), kvsift_token_is_end(twin.get(), info.eos) != 0);

  // Prefill, decode and the logits, bit for bit against the twin.
  const std::vector<int32_t> prompt = wrapped.tokenize("Paged attention reads keys from", false);
  const int32_t seq = wrapped.create_sequence();
  int32_t twin_seq = -1;
  ASSERT_EQ(kvsift_model_sequence_create(twin.get(), &twin_seq), KVSIFT_STATUS_OK);
  std::vector<float> all(prompt.size() * info.n_vocab), twin_all(all.size());
  wrapped.prefill(seq, prompt, all);
  ASSERT_EQ(kvsift_model_prefill(twin.get(), twin_seq, prompt.data(), prompt.size(),
                                 twin_all.data(), nullptr, nullptr),
            KVSIFT_STATUS_OK);
  EXPECT_EQ(all, twin_all);
  const float* c_logits = nullptr;
  std::size_t n_vocab = 0;
  for (int step = 0; step < 3; ++step) {
    const std::span<const float> logits = wrapped.logits(seq);
    ASSERT_EQ(kvsift_model_logits(twin.get(), twin_seq, &c_logits, &n_vocab), KVSIFT_STATUS_OK);
    ASSERT_EQ(logits.size(), n_vocab);
    EXPECT_TRUE(std::equal(logits.begin(), logits.end(), c_logits)) << "step " << step;
    const int32_t next =
        static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    const std::vector<int32_t> one_seq = {seq}, one_token = {next};
    wrapped.decode(one_seq, one_token);
    ASSERT_EQ(kvsift_model_decode(twin.get(), 1, &twin_seq, &next), KVSIFT_STATUS_OK);
  }
  EXPECT_EQ(wrapped.stats().decode_tokens, 3u);

  // A fork continues from the same logits.
  const int32_t fork = wrapped.fork_sequence(seq);
  const std::span<const float> forked = wrapped.logits(fork), original = wrapped.logits(seq);
  EXPECT_TRUE(std::equal(forked.begin(), forked.end(), original.begin()));
  wrapped.free_sequence(fork);

  // Failures and refusals.
  expect_same_failure([&] { return kvsift_model_sequence_free(twin.get(), 4242); },
                      [&] { wrapped.free_sequence(4242); });
  const int32_t outside_vocab = static_cast<int32_t>(info.n_vocab);
  const int32_t other = wrapped.create_sequence();
  int32_t twin_other = -1;
  ASSERT_EQ(kvsift_model_sequence_create(twin.get(), &twin_other), KVSIFT_STATUS_OK);
  ASSERT_EQ(twin_other, other);
  expect_same_failure(
      [&] {
        return kvsift_model_prefill(twin.get(), twin_other, &outside_vocab, 1, nullptr, nullptr,
                                    nullptr);
      },
      [&] { wrapped.prefill(other, std::span(&outside_vocab, 1)); });
  std::vector<float> short_logits(info.n_vocab - 1);
  expect_refused([&] { wrapped.prefill(other, prompt, short_logits); }, "all_logits");
  const std::vector<int32_t> two_seqs = {seq, other}, one_token = {1};
  expect_refused([&] { wrapped.decode(two_seqs, one_token); }, "tokens");
  kvsift_selector_policy policy = kvsift::default_selector_policy();
  policy.selector = KVSIFT_SELECTOR_DENSE;
  policy.budget = 64;
  expect_same_failure([&] { return kvsift_model_set_selector(twin.get(), &policy); },
                      [&] { wrapped.set_selector(policy); });
}

TEST_F(CppWrapperModel, append_kv_stores_what_the_c_call_stores) {
  const kvsift_model_params p = small_params();
  kvsift::model_runner wrapped(kvsift::test::model_path(), p);
  kvsift_model* raw = nullptr;
  ASSERT_EQ(kvsift_model_load(kvsift::test::model_path(), &p, &raw), KVSIFT_STATUS_OK);
  const kvsift::model_runner twin(raw);
  const kvsift_model_info info = wrapped.info();
  const std::size_t per_token = std::size_t{info.n_kv_heads} * info.head_dim;
  const std::vector<float> k = kvsift::test::random_floats(19 * per_token, 3);
  const std::vector<float> v = kvsift::test::random_floats(19 * per_token, 4);
  const int32_t seq = wrapped.create_sequence();
  int32_t twin_seq = -1;
  ASSERT_EQ(kvsift_model_sequence_create(twin.get(), &twin_seq), KVSIFT_STATUS_OK);
  for (uint32_t l = 0; l < info.n_layers; ++l) {
    wrapped.append_kv(seq, l, k, v);
    ASSERT_EQ(kvsift_model_sequence_append_kv(twin.get(), twin_seq, l, 19, k.data(), v.data()),
              KVSIFT_STATUS_OK);
  }
  const float* none = nullptr;
  expect_same_failure([&] { return kvsift_model_logits(twin.get(), twin_seq, &none, nullptr); },
                      [&] { wrapped.logits(seq); });
  const int32_t token = 1;
  wrapped.decode(std::span(&seq, 1), std::span(&token, 1));
  ASSERT_EQ(kvsift_model_decode(twin.get(), 1, &twin_seq, &token), KVSIFT_STATUS_OK);
  const std::span<const float> logits = wrapped.logits(seq);
  const float* c_logits = nullptr;
  ASSERT_EQ(kvsift_model_logits(twin.get(), twin_seq, &c_logits, nullptr), KVSIFT_STATUS_OK);
  EXPECT_TRUE(std::equal(logits.begin(), logits.end(), c_logits));

  const std::span<const float> ragged(k.data(), per_token + 1);
  expect_refused([&] { wrapped.append_kv(seq, 0, ragged, ragged); }, "k");
  expect_refused([&] { wrapped.append_kv(seq, 0, k, std::span(v).first(per_token)); }, "v");
  expect_same_failure(
      [&] {
        return kvsift_model_sequence_append_kv(twin.get(), twin_seq, info.n_layers, 19, k.data(),
                                               v.data());
      },
      [&] { wrapped.append_kv(seq, info.n_layers, k, v); });
}

}  // namespace
