// The public C API (include/kvsift/kvsift.h) tested as its contract: every documented status for
// every bad input, with kvsift_last_error() naming the argument, plus the behaviour a host relies
// on (all-or-nothing appends, page accounting, attention results and statistics, process-wide
// settings, per-thread errors).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kvsift/kvsift.h"
#include "kvsift/kvsift.hpp"

extern "C" int kvsift_c_smoke(void);

// gtest prints statuses by name.
static void PrintTo(kvsift_status status, std::ostream* os) {
  *os << kvsift_status_string(status) << " (" << static_cast<int>(status) << ")";
}

namespace {

// The owner of the caches the tests call the C functions on (through get()); the tests of
// kvsift_cache_create itself call it directly (expect_create_fails).
using Cache = kvsift::cache;

// Small geometry: 2 layers, 2 KV heads, GQA group 2, d = 64, 16-token pages (4 KiB each).
constexpr uint32_t kLayers = 2;
constexpr uint32_t kKvHeads = 2;
constexpr uint32_t kGroup = 2;
constexpr uint32_t kHeadDim = 64;
constexpr uint32_t kPageTokens = 16;
constexpr uint32_t kMaxBatch = 4;

kvsift_cache_params small_params() {
  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  params.n_layers = kLayers;
  params.n_kv_heads = kKvHeads;
  params.group_size = kGroup;
  params.head_dim = kHeadDim;
  params.page_tokens = kPageTokens;
  params.max_pages = 64;
  params.max_batch = kMaxBatch;
  params.n_threads = 2;
  return params;
}

Cache make_cache(const kvsift_cache_params& params = small_params()) {
  return Cache(params);
}

int32_t make_sequence(kvsift_cache* cache) {
  int32_t id = -1;
  EXPECT_EQ(kvsift_sequence_create(cache, &id), KVSIFT_STATUS_OK) << kvsift_last_error();
  return id;
}

std::vector<float> random_floats(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> values(n);
  for (float& x : values) x = dist(rng);
  return values;
}

// K and V for n tokens of one layer: [n, n_kv_heads, head_dim] each.
struct Tokens {
  std::vector<float> k, v;
  Tokens(uint32_t n, uint32_t seed, uint32_t kv_heads = kKvHeads, uint32_t head_dim = kHeadDim)
      : k(random_floats(std::size_t{n} * kv_heads * head_dim, seed)),
        v(random_floats(std::size_t{n} * kv_heads * head_dim, seed + 1)) {}
};

void append(kvsift_cache* cache, int32_t seq, uint32_t layer, uint32_t n, uint32_t seed) {
  const Tokens t(n, seed);
  ASSERT_EQ(kvsift_append(cache, seq, layer, n, t.k.data(), t.v.data()), KVSIFT_STATUS_OK)
      << kvsift_last_error();
}

uint64_t length_of(const kvsift_cache* cache, int32_t seq, uint32_t layer) {
  uint64_t n = ~uint64_t{0};
  EXPECT_EQ(kvsift_sequence_length(cache, seq, layer, &n), KVSIFT_STATUS_OK) << kvsift_last_error();
  return n;
}

kvsift_cache_stats stats_of(const kvsift_cache* cache) {
  kvsift_cache_stats stats{};
  EXPECT_EQ(kvsift_cache_get_stats(cache, &stats), KVSIFT_STATUS_OK) << kvsift_last_error();
  return stats;
}

// Replaces this thread's last error with a known message, so that a check of the message after a
// failing call sees that call's message and not an older one.
void poison_last_error() {
  ASSERT_EQ(kvsift_set_max_isa(static_cast<kvsift_isa>(77)), KVSIFT_STATUS_INVALID_ARGUMENT);
}

testing::AssertionResult last_error_names(const char* what) {
  const char* message = kvsift_last_error();
  if (message != nullptr && std::strstr(message, what) != nullptr)
    return testing::AssertionSuccess();
  return testing::AssertionFailure()
         << "kvsift_last_error() is \"" << (message ? message : "(NULL)")
         << "\", which does not name \"" << what << "\"";
}

// The call fails with exactly `status` and its message contains `what`.
#define EXPECT_FAILS(call, status, what)                \
  do {                                                  \
    poison_last_error();                                \
    EXPECT_EQ((call), (status)) << kvsift_last_error(); \
    EXPECT_TRUE(last_error_names(what));                \
  } while (0)

// kvsift_cache_create fails with `status`, names `what`, and leaves *out NULL.
void expect_create_fails(const kvsift_cache_params& params, kvsift_status status,
                         const char* what) {
  int not_a_cache = 0;
  auto* cache = reinterpret_cast<kvsift_cache*>(&not_a_cache);
  EXPECT_FAILS(kvsift_cache_create(&params, &cache), status, what);
  EXPECT_EQ(cache, nullptr);
  if (cache != reinterpret_cast<kvsift_cache*>(&not_a_cache)) kvsift_cache_free(cache);
}

// Stores an integer into a C enum field the way a C caller can; a static_cast to an enum without a
// fixed underlying type would itself be undefined for values outside the enumerators' range.
template <class Enum>
void store_raw(Enum* field, int value) {
  static_assert(sizeof(Enum) == sizeof(int));
  std::memcpy(field, &value, sizeof(int));
}

// Restores the process ISA cap (AUTO, or KVSIFT_MAX_ISA's value) when a test that changed it ends.
struct IsaCapRestorer {
  ~IsaCapRestorer() {
    kvsift_isa cap = KVSIFT_ISA_AUTO;
    if (const char* env = std::getenv("KVSIFT_MAX_ISA")) {
      for (kvsift_isa isa :
           {KVSIFT_ISA_SCALAR, KVSIFT_ISA_AVX2, KVSIFT_ISA_AVX512, KVSIFT_ISA_AVX512_VNNI})
        if (std::strcmp(env, kvsift_isa_name(isa)) == 0) cap = isa;
    }
    EXPECT_EQ(kvsift_set_max_isa(cap), KVSIFT_STATUS_OK);
  }
};

// Dense reference in double over the stored (rounded) K/V of the given logical pages of each
// (sequence, KV head); pages == nullptr means all. out: [n_seqs, n_kv_heads * group, head_dim].
std::vector<float> reference_attend(const kvsift_cache* cache, uint32_t layer,
                                    const std::vector<int32_t>& seqs, const std::vector<float>& q,
                                    const std::vector<std::vector<uint32_t>>* pages) {
  const uint32_t H = kKvHeads, G = kGroup, d = kHeadDim, B = kPageTokens;
  std::vector<float> out(seqs.size() * H * G * d, 0.0f);
  for (std::size_t s = 0; s < seqs.size(); ++s) {
    const uint64_t n = length_of(cache, seqs[s], layer);
    std::vector<float> k(n * d), v(n * d);
    for (uint32_t h = 0; h < H; ++h) {
      EXPECT_EQ(kvsift_read_tokens(cache, seqs[s], layer, h, 0, n, k.data(), v.data()),
                KVSIFT_STATUS_OK);
      std::vector<uint64_t> tokens;
      if (pages == nullptr) {
        for (uint64_t t = 0; t < n; ++t) tokens.push_back(t);
      } else {
        for (uint32_t p : (*pages)[s * H + h])
          for (uint64_t t = uint64_t{p} * B; t < std::min<uint64_t>(n, uint64_t{p + 1} * B); ++t)
            tokens.push_back(t);
      }
      if (tokens.empty()) continue;
      for (uint32_t g = 0; g < G; ++g) {
        const std::size_t row = (s * H + h) * G + g;
        const float* qh = q.data() + row * d;
        std::vector<double> logits;
        double max_logit = -INFINITY;
        for (uint64_t t : tokens) {
          double dot = 0;
          for (uint32_t c = 0; c < d; ++c) dot += double{qh[c]} * k[t * d + c];
          logits.push_back(dot / std::sqrt(double{d}));
          max_logit = std::max(max_logit, logits.back());
        }
        std::vector<double> acc(d, 0.0);
        double sum = 0;
        for (std::size_t i = 0; i < tokens.size(); ++i) {
          const double w = std::exp(logits[i] - max_logit);
          sum += w;
          for (uint32_t c = 0; c < d; ++c) acc[c] += w * v[tokens[i] * d + c];
        }
        for (uint32_t c = 0; c < d; ++c) out[row * d + c] = static_cast<float>(acc[c] / sum);
      }
    }
  }
  return out;
}

void expect_near_all(const std::vector<float>& got, const std::vector<float>& want, float tol) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], tol) << "at element " << i;
}

std::size_t q_elems(std::size_t n_seqs) {
  return n_seqs * kKvHeads * kGroup * kHeadDim;
}

// A cache with two sequences in layer 0 (37 and 16 tokens) and a third, empty one, for the
// attention tests.
struct AttendFixture {
  Cache cache = make_cache();
  int32_t a = make_sequence(cache.get());
  int32_t b = make_sequence(cache.get());
  int32_t empty = make_sequence(cache.get());
  std::vector<float> q = random_floats(q_elems(2), 99);
  std::vector<float> out = std::vector<float>(q_elems(2), NAN);
  AttendFixture() {
    append(cache.get(), a, 0, 37, 10);
    append(cache.get(), b, 0, 16, 20);
  }
  std::vector<int32_t> ids() const { return {a, b}; }
};

bool all_nan(const std::vector<float>& values) {
  for (float x : values)
    if (!std::isnan(x)) return false;
  return true;
}

}  // namespace

// ---- Version, statuses, errors ---------------------------------------------------------------

TEST(CApi, c_translation_unit_smoke_test_passes) {
  EXPECT_EQ(kvsift_c_smoke(), 0);
}

TEST(CApi, version_macro_equals_linked_version) {
  EXPECT_EQ(kvsift_version(), KVSIFT_VERSION);
  EXPECT_EQ(KVSIFT_VERSION,
            KVSIFT_VERSION_MAJOR * 10000 + KVSIFT_VERSION_MINOR * 100 + KVSIFT_VERSION_PATCH);
}

TEST(CApi, version_string_matches_version_macros) {
  const std::string expected = std::to_string(KVSIFT_VERSION_MAJOR) + "." +
                               std::to_string(KVSIFT_VERSION_MINOR) + "." +
                               std::to_string(KVSIFT_VERSION_PATCH);
  ASSERT_NE(kvsift_version_string(), nullptr);
  EXPECT_EQ(std::string(kvsift_version_string()), expected);
}

TEST(CApi, status_string_is_distinct_and_non_empty_for_every_status) {
  const kvsift_status all[] = {KVSIFT_STATUS_OK,
                               KVSIFT_STATUS_INVALID_ARGUMENT,
                               KVSIFT_STATUS_UNSUPPORTED,
                               KVSIFT_STATUS_OUT_OF_MEMORY,
                               KVSIFT_STATUS_CAPACITY_EXCEEDED,
                               KVSIFT_STATUS_NOT_FOUND,
                               KVSIFT_STATUS_IO_ERROR,
                               KVSIFT_STATUS_INVALID_FILE,
                               KVSIFT_STATUS_INTERNAL};
  std::set<std::string> names;
  for (kvsift_status status : all) {
    const char* name = kvsift_status_string(status);
    ASSERT_NE(name, nullptr);
    EXPECT_STRNE(name, "");
    names.insert(name);
  }
  EXPECT_EQ(names.size(), std::size(all));
  // An unknown value still gets a string (9 stays inside the enum's value range in C++).
  const char* unknown = kvsift_status_string(static_cast<kvsift_status>(9));
  ASSERT_NE(unknown, nullptr);
  EXPECT_STRNE(unknown, "");
}

TEST(CApi, last_error_is_empty_on_a_thread_where_nothing_failed) {
  std::string seen = "(not run)";
  std::thread([&] { seen = kvsift_last_error(); }).join();
  EXPECT_EQ(seen, "");
}

TEST(CApi, last_error_is_per_thread) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  EXPECT_FAILS(kvsift_sequence_free(cache.get(), 12345), KVSIFT_STATUS_NOT_FOUND, "seq_id");
  const std::string main_error = kvsift_last_error();

  std::string thread_error;
  std::thread([&] {
    int32_t id;
    EXPECT_EQ(kvsift_sequence_create(nullptr, &id), KVSIFT_STATUS_INVALID_ARGUMENT);
    thread_error = kvsift_last_error();
  }).join();

  EXPECT_NE(thread_error.find("cache"), std::string::npos) << thread_error;
  EXPECT_EQ(std::string(kvsift_last_error()), main_error);
}

// ---- Parameters and cache creation
// ---------------------------------------------------------------

TEST(CApi, params_init_fills_the_documented_defaults) {
  kvsift_cache_params params;
  std::memset(&params, 0xAB, sizeof(params));
  kvsift_cache_params_init(&params);
  EXPECT_EQ(params.n_layers, 1u);
  EXPECT_EQ(params.n_kv_heads, 1u);
  EXPECT_EQ(params.group_size, 1u);
  EXPECT_EQ(params.head_dim, 128u);
  EXPECT_EQ(params.page_tokens, 16u);
  EXPECT_EQ(params.dtype, KVSIFT_DTYPE_F16);
  EXPECT_EQ(params.key_form, KVSIFT_KEYS_POST_ROPE);
  EXPECT_EQ(params.max_pages, 65536u);
  EXPECT_EQ(params.pinned, 0);
  EXPECT_EQ(params.max_batch, 64u);
  EXPECT_EQ(params.n_threads, 0);
  EXPECT_EQ(params.isa, KVSIFT_ISA_AUTO);
  EXPECT_EQ(params.device, -1);
  EXPECT_EQ(params.device_cache_pages, 0u);
}

TEST(CApi, model_params_init_fills_the_documented_defaults) {
  kvsift_model_params params;
  std::memset(&params, 0xAB, sizeof(params));
  kvsift_model_params_init(&params);
  EXPECT_EQ(params.n_ctx, 0u);
  EXPECT_EQ(params.max_seqs, 1u);
  EXPECT_EQ(params.prefill_chunk, 256u);
  EXPECT_EQ(params.weights_f32, 0);
  EXPECT_EQ(params.weights, KVSIFT_WEIGHTS_BF16);
  EXPECT_EQ(params.kv_dtype, KVSIFT_DTYPE_F16);
  EXPECT_EQ(params.device, -1);
}

TEST(CApi, params_init_ignores_null) {
  kvsift_cache_params_init(nullptr);
}

TEST(CApi, create_with_default_params_succeeds) {
  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  Cache cache = make_cache(params);
  ASSERT_NE(cache, nullptr);
  const kvsift_cache_stats stats = stats_of(cache.get());
  EXPECT_EQ(stats.pages_capacity, 65536u);
  EXPECT_EQ(stats.page_bytes, 2u * 16 * 128 * 2);
  EXPECT_GE(stats.bytes_reserved, stats.pages_capacity * stats.page_bytes);
  EXPECT_EQ(stats.pages_in_use, 0u);
  EXPECT_EQ(stats.n_sequences, 0u);
}

TEST(CApi, create_rejects_null_params) {
  int not_a_cache = 0;
  auto* cache = reinterpret_cast<kvsift_cache*>(&not_a_cache);
  EXPECT_FAILS(kvsift_cache_create(nullptr, &cache), KVSIFT_STATUS_INVALID_ARGUMENT, "params");
  EXPECT_EQ(cache, nullptr);
}

TEST(CApi, create_rejects_null_out) {
  const kvsift_cache_params params = small_params();
  EXPECT_FAILS(kvsift_cache_create(&params, nullptr), KVSIFT_STATUS_INVALID_ARGUMENT, "out");
}

TEST(CApi, create_rejects_zero_layers) {
  kvsift_cache_params params = small_params();
  params.n_layers = 0;
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "n_layers");
}

TEST(CApi, create_rejects_zero_kv_heads) {
  kvsift_cache_params params = small_params();
  params.n_kv_heads = 0;
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "n_kv_heads");
}

TEST(CApi, create_rejects_group_size_zero_or_above_64) {
  kvsift_cache_params params = small_params();
  params.group_size = 0;
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "group_size");
  params.group_size = 65;
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "group_size");
}

TEST(CApi, create_reports_head_dim_96_unsupported) {
  kvsift_cache_params params = small_params();
  params.head_dim = 96;
  expect_create_fails(params, KVSIFT_STATUS_UNSUPPORTED, "head_dim");
  params.head_dim = 0;
  expect_create_fails(params, KVSIFT_STATUS_UNSUPPORTED, "head_dim");
}

TEST(CApi, create_reports_page_tokens_8_unsupported) {
  kvsift_cache_params params = small_params();
  params.page_tokens = 8;
  expect_create_fails(params, KVSIFT_STATUS_UNSUPPORTED, "page_tokens");
}

TEST(CApi, create_rejects_unknown_dtype) {
  kvsift_cache_params params = small_params();
  store_raw(&params.dtype, 7);
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "dtype");
}

TEST(CApi, create_rejects_pre_rope_keys_without_a_positive_rope_theta) {
  kvsift_cache_params params = small_params();
  params.key_form = KVSIFT_KEYS_PRE_ROPE;
  params.rope_theta = 0.0f;
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "rope_theta");
  params.rope_theta = 10000.0f;
  make_cache(params);  // accepted
}

TEST(CApi, create_rejects_unknown_key_form) {
  kvsift_cache_params params = small_params();
  store_raw(&params.key_form, 7);
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "key_form");
}

TEST(CApi, create_rejects_zero_max_pages) {
  kvsift_cache_params params = small_params();
  params.max_pages = 0;
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "max_pages");
}

TEST(CApi, create_rejects_zero_max_batch) {
  kvsift_cache_params params = small_params();
  params.max_batch = 0;
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "max_batch");
}

TEST(CApi, create_rejects_negative_thread_count) {
  kvsift_cache_params params = small_params();
  params.n_threads = -1;
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "n_threads");
}

TEST(CApi, create_rejects_unknown_isa) {
  kvsift_cache_params params = small_params();
  params.isa = static_cast<kvsift_isa>(7);
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "isa");
}

TEST(CApi, create_reports_an_isa_the_cpu_lacks_unsupported) {
  if (kvsift_isa_supported() == KVSIFT_ISA_AVX512_VNNI) GTEST_SKIP() << "this CPU has every ISA";
  kvsift_cache_params params = small_params();
  params.isa = KVSIFT_ISA_AVX512_VNNI;
  expect_create_fails(params, KVSIFT_STATUS_UNSUPPORTED, "isa");
}

// Appends 3 random tokens to a cache of `dtype` and expects KV head 1's K and V read back within
// tolerance(x, absmax) of each value x given, absmax being the largest |x| of x's row.
template <class Tolerance>
void expect_read_back_within(kvsift_dtype dtype, uint32_t seed, Tolerance&& tolerance) {
  kvsift_cache_params params = small_params();
  params.dtype = dtype;
  Cache cache = make_cache(params);
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  const Tokens t(3, seed);
  ASSERT_EQ(kvsift_append(cache.get(), seq, 0, 3, t.k.data(), t.v.data()), KVSIFT_STATUS_OK);
  std::vector<float> k(3 * kHeadDim), v(3 * kHeadDim);
  ASSERT_EQ(kvsift_read_tokens(cache.get(), seq, 0, 1, 0, 3, k.data(), v.data()), KVSIFT_STATUS_OK);
  for (uint32_t i = 0; i < 3; ++i)
    for (const auto& [in, out] : {std::pair{&t.k, &k}, std::pair{&t.v, &v}}) {
      const float* row = in->data() + (i * kKvHeads + 1) * kHeadDim;
      float absmax = 0.0f;
      for (uint32_t c = 0; c < kHeadDim; ++c) absmax = std::max(absmax, std::fabs(row[c]));
      for (uint32_t c = 0; c < kHeadDim; ++c)
        EXPECT_NEAR((*out)[i * kHeadDim + c], row[c], tolerance(row[c], absmax));
    }
}

TEST(CApi, bf16_cache_stores_values_rounded_to_bf16) {
  expect_read_back_within(KVSIFT_DTYPE_BF16, 5,
                          [](float x, float) { return std::abs(x) * 0x1p-8f; });
}

TEST(CApi, q8_cache_stores_each_row_within_half_its_scale) {
  expect_read_back_within(KVSIFT_DTYPE_Q8, 6,
                          [](float, float absmax) { return absmax / 127.0f * (0.5f + 1e-6f); });
}

TEST(CApi, cache_free_accepts_null) {
  kvsift_cache_free(nullptr);
}

// ---- Instruction sets ---------------------------------------------------------------------------

TEST(CApi, isa_supported_is_a_concrete_isa) {
  const kvsift_isa isa = kvsift_isa_supported();
  EXPECT_NE(isa, KVSIFT_ISA_AUTO);
  EXPECT_TRUE(isa == KVSIFT_ISA_SCALAR || isa == KVSIFT_ISA_AVX2 || isa == KVSIFT_ISA_AVX512 ||
              isa == KVSIFT_ISA_AVX512_VNNI);
}

TEST(CApi, isa_name_names_every_isa) {
  EXPECT_STREQ(kvsift_isa_name(KVSIFT_ISA_SCALAR), "scalar");
  EXPECT_STREQ(kvsift_isa_name(KVSIFT_ISA_AVX2), "avx2");
  EXPECT_STREQ(kvsift_isa_name(KVSIFT_ISA_AVX512), "avx512");
  EXPECT_STREQ(kvsift_isa_name(KVSIFT_ISA_AVX512_VNNI), "avx512_vnni");
  EXPECT_STREQ(kvsift_isa_name(KVSIFT_ISA_AUTO), "auto");
  EXPECT_STREQ(kvsift_isa_name(static_cast<kvsift_isa>(7)), "unknown");
}

TEST(CApi, cache_isa_of_null_is_scalar) {
  EXPECT_EQ(kvsift_cache_isa(nullptr), KVSIFT_ISA_SCALAR);
}

TEST(CApi, set_max_isa_scalar_caps_new_caches_only) {
  IsaCapRestorer restore;
  ASSERT_EQ(kvsift_set_max_isa(KVSIFT_ISA_AUTO), KVSIFT_STATUS_OK);
  Cache before = make_cache();
  ASSERT_NE(before, nullptr);
  const kvsift_isa before_isa = kvsift_cache_isa(before.get());
  EXPECT_EQ(before_isa, kvsift_isa_supported());

  ASSERT_EQ(kvsift_set_max_isa(KVSIFT_ISA_SCALAR), KVSIFT_STATUS_OK);
  Cache after = make_cache();
  ASSERT_NE(after, nullptr);
  EXPECT_EQ(kvsift_cache_isa(after.get()), KVSIFT_ISA_SCALAR);
  EXPECT_EQ(kvsift_cache_isa(before.get()), before_isa);

  ASSERT_EQ(kvsift_set_max_isa(KVSIFT_ISA_AUTO), KVSIFT_STATUS_OK);
  Cache uncapped = make_cache();
  ASSERT_NE(uncapped, nullptr);
  EXPECT_EQ(kvsift_cache_isa(uncapped.get()), kvsift_isa_supported());
}

TEST(CApi, set_max_isa_rejects_unknown_value) {
  IsaCapRestorer restore;
  EXPECT_FAILS(kvsift_set_max_isa(static_cast<kvsift_isa>(9)), KVSIFT_STATUS_INVALID_ARGUMENT,
               "max_isa");
}

TEST(CApi, params_isa_scalar_selects_scalar_kernels) {
  kvsift_cache_params params = small_params();
  params.isa = KVSIFT_ISA_SCALAR;
  Cache cache = make_cache(params);
  ASSERT_NE(cache, nullptr);
  EXPECT_EQ(kvsift_cache_isa(cache.get()), KVSIFT_ISA_SCALAR);
}

TEST(CApi, scalar_and_best_isa_caches_attend_alike) {
  kvsift_cache_params params = small_params();
  std::vector<float> outs[2];
  const kvsift_isa isas[2] = {KVSIFT_ISA_SCALAR, KVSIFT_ISA_AUTO};
  const std::vector<float> q = random_floats(q_elems(1), 7);
  for (int i = 0; i < 2; ++i) {
    params.isa = isas[i];
    Cache cache = make_cache(params);
    ASSERT_NE(cache, nullptr);
    const int32_t seq = make_sequence(cache.get());
    append(cache.get(), seq, 1, 53, 3);
    outs[i].assign(q_elems(1), NAN);
    ASSERT_EQ(kvsift_attend(cache.get(), 1, 1, &seq, q.data(), outs[i].data(), nullptr),
              KVSIFT_STATUS_OK)
        << kvsift_last_error();
  }
  expect_near_all(outs[1], outs[0], 1e-5f);
}

// ---- Logging ----------------------------------------------------------------------------------

namespace {

struct LogRecord {
  std::vector<std::pair<kvsift_log_level, std::string>> messages;
};

void record_log(kvsift_log_level level, const char* message, void* user) {
  static_cast<LogRecord*>(user)->messages.emplace_back(level, message);
}

}  // namespace

TEST(CApi, log_callback_receives_messages_until_removed) {
  LogRecord record;
  kvsift_set_log_callback(record_log, &record, KVSIFT_LOG_INFO);
  Cache first = make_cache();
  ASSERT_NE(first, nullptr);
  ASSERT_FALSE(record.messages.empty());
  for (const auto& [level, message] : record.messages) {
    EXPECT_GE(level, KVSIFT_LOG_INFO);
    EXPECT_FALSE(message.empty());
  }

  kvsift_set_log_callback(nullptr, nullptr, KVSIFT_LOG_DEBUG);
  const std::size_t seen = record.messages.size();
  Cache second = make_cache();
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(record.messages.size(), seen);
}

TEST(CApi, log_callback_drops_messages_below_min_level) {
  LogRecord record;
  kvsift_set_log_callback(record_log, &record, KVSIFT_LOG_ERROR);
  Cache cache = make_cache();
  kvsift_set_log_callback(nullptr, nullptr, KVSIFT_LOG_DEBUG);
  ASSERT_NE(cache, nullptr);
  for (const auto& [level, message] : record.messages)
    EXPECT_EQ(level, KVSIFT_LOG_ERROR) << message;
}

// ---- Sequences ----------------------------------------------------------------------------------

TEST(CApi, sequence_create_rejects_null_cache_and_null_seq_id) {
  int32_t id;
  EXPECT_FAILS(kvsift_sequence_create(nullptr, &id), KVSIFT_STATUS_INVALID_ARGUMENT, "cache");
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  EXPECT_FAILS(kvsift_sequence_create(cache.get(), nullptr), KVSIFT_STATUS_INVALID_ARGUMENT,
               "seq_id");
  EXPECT_EQ(stats_of(cache.get()).n_sequences, 0u);
}

TEST(CApi, new_sequences_are_empty_in_every_layer_and_ids_are_reused) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t a = make_sequence(cache.get());
  const int32_t b = make_sequence(cache.get());
  EXPECT_GE(a, 0);
  EXPECT_GE(b, 0);
  EXPECT_NE(a, b);
  for (uint32_t layer = 0; layer < kLayers; ++layer)
    EXPECT_EQ(length_of(cache.get(), a, layer), 0u);
  EXPECT_EQ(stats_of(cache.get()).n_sequences, 2u);

  ASSERT_EQ(kvsift_sequence_free(cache.get(), a), KVSIFT_STATUS_OK);
  EXPECT_EQ(stats_of(cache.get()).n_sequences, 1u);
  EXPECT_EQ(make_sequence(cache.get()), a);
  EXPECT_EQ(stats_of(cache.get()).n_sequences, 2u);
}

TEST(CApi, sequence_free_rejects_null_cache) {
  EXPECT_FAILS(kvsift_sequence_free(nullptr, 0), KVSIFT_STATUS_INVALID_ARGUMENT, "cache");
}

TEST(CApi, sequence_free_reports_unknown_ids_not_found) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t freed = make_sequence(cache.get());
  ASSERT_EQ(kvsift_sequence_free(cache.get(), freed), KVSIFT_STATUS_OK);
  for (int32_t id : {freed, int32_t{7}, int32_t{-1}, INT32_MIN})
    EXPECT_FAILS(kvsift_sequence_free(cache.get(), id), KVSIFT_STATUS_NOT_FOUND, "seq_id");
}

TEST(CApi, sequence_length_rejects_bad_arguments) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  uint64_t n;
  EXPECT_FAILS(kvsift_sequence_length(nullptr, seq, 0, &n), KVSIFT_STATUS_INVALID_ARGUMENT,
               "cache");
  EXPECT_FAILS(kvsift_sequence_length(cache.get(), seq, 0, nullptr), KVSIFT_STATUS_INVALID_ARGUMENT,
               "n_tokens");
  EXPECT_FAILS(kvsift_sequence_length(cache.get(), seq, kLayers, &n),
               KVSIFT_STATUS_INVALID_ARGUMENT, "layer");
  EXPECT_FAILS(kvsift_sequence_length(cache.get(), seq + 1, 0, &n), KVSIFT_STATUS_NOT_FOUND,
               "seq_id");
  EXPECT_FAILS(kvsift_sequence_length(cache.get(), -3, 0, &n), KVSIFT_STATUS_NOT_FOUND, "seq_id");
}

// ---- Append and read back -----------------------------------------------------------------------

TEST(CApi, append_rejects_null_cache_and_buffers) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  const Tokens t(2, 1);
  EXPECT_FAILS(kvsift_append(nullptr, seq, 0, 2, t.k.data(), t.v.data()),
               KVSIFT_STATUS_INVALID_ARGUMENT, "cache");
  EXPECT_FAILS(kvsift_append(cache.get(), seq, 0, 2, nullptr, t.v.data()),
               KVSIFT_STATUS_INVALID_ARGUMENT, "k");
  EXPECT_FAILS(kvsift_append(cache.get(), seq, 0, 2, t.k.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "v");
  EXPECT_EQ(length_of(cache.get(), seq, 0), 0u);
  EXPECT_EQ(stats_of(cache.get()).pages_in_use, 0u);
}

TEST(CApi, append_rejects_zero_tokens) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  const Tokens t(1, 1);
  EXPECT_FAILS(kvsift_append(cache.get(), seq, 0, 0, t.k.data(), t.v.data()),
               KVSIFT_STATUS_INVALID_ARGUMENT, "n_tokens");
}

TEST(CApi, append_rejects_layer_out_of_range) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  const Tokens t(1, 1);
  EXPECT_FAILS(kvsift_append(cache.get(), seq, kLayers, 1, t.k.data(), t.v.data()),
               KVSIFT_STATUS_INVALID_ARGUMENT, "layer");
}

TEST(CApi, append_reports_unknown_sequences_not_found) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t freed = make_sequence(cache.get());
  ASSERT_EQ(kvsift_sequence_free(cache.get(), freed), KVSIFT_STATUS_OK);
  const Tokens t(1, 1);
  for (int32_t id : {freed, int32_t{5}, int32_t{-1}})
    EXPECT_FAILS(kvsift_append(cache.get(), id, 0, 1, t.k.data(), t.v.data()),
                 KVSIFT_STATUS_NOT_FOUND, "seq_id");
  EXPECT_EQ(stats_of(cache.get()).pages_in_use, 0u);
}

TEST(CApi, append_grows_only_its_layer_and_read_tokens_returns_fp16_rounded_values) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  const uint32_t n = 21;
  const Tokens t(n, 42);
  ASSERT_EQ(kvsift_append(cache.get(), seq, 1, n, t.k.data(), t.v.data()), KVSIFT_STATUS_OK);
  EXPECT_EQ(length_of(cache.get(), seq, 0), 0u);
  EXPECT_EQ(length_of(cache.get(), seq, 1), n);

  std::vector<float> k(n * kHeadDim), v(n * kHeadDim);
  for (uint32_t h = 0; h < kKvHeads; ++h) {
    ASSERT_EQ(kvsift_read_tokens(cache.get(), seq, 1, h, 0, n, k.data(), v.data()),
              KVSIFT_STATUS_OK)
        << kvsift_last_error();
    for (uint32_t i = 0; i < n; ++i)
      for (uint32_t c = 0; c < kHeadDim; ++c) {
        const std::size_t src = (std::size_t{i} * kKvHeads + h) * kHeadDim + c;
        // Inputs are in [-1, 1]: fp16 keeps 11 significant bits, and subnormals step by 2^-24.
        EXPECT_NEAR(k[i * kHeadDim + c], t.k[src], std::abs(t.k[src]) * 0x1p-11f + 0x1p-24f);
        EXPECT_NEAR(v[i * kHeadDim + c], t.v[src], std::abs(t.v[src]) * 0x1p-11f + 0x1p-24f);
      }
  }
}

TEST(CApi, decode_steps_store_the_same_values_as_one_prefill) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t chunked = make_sequence(cache.get());
  const int32_t stepped = make_sequence(cache.get());
  const uint32_t n = 19, row = kKvHeads * kHeadDim;
  const Tokens t(n, 8);
  ASSERT_EQ(kvsift_append(cache.get(), chunked, 0, n, t.k.data(), t.v.data()), KVSIFT_STATUS_OK);
  for (uint32_t i = 0; i < n; ++i)
    ASSERT_EQ(kvsift_append(cache.get(), stepped, 0, 1, t.k.data() + i * row, t.v.data() + i * row),
              KVSIFT_STATUS_OK);
  std::vector<float> a(n * kHeadDim), b(n * kHeadDim);
  for (uint32_t h = 0; h < kKvHeads; ++h) {
    ASSERT_EQ(kvsift_read_tokens(cache.get(), chunked, 0, h, 0, n, a.data(), nullptr),
              KVSIFT_STATUS_OK);
    ASSERT_EQ(kvsift_read_tokens(cache.get(), stepped, 0, h, 0, n, b.data(), nullptr),
              KVSIFT_STATUS_OK);
    EXPECT_EQ(a, b);
    ASSERT_EQ(kvsift_read_tokens(cache.get(), chunked, 0, h, 0, n, nullptr, a.data()),
              KVSIFT_STATUS_OK);
    ASSERT_EQ(kvsift_read_tokens(cache.get(), stepped, 0, h, 0, n, nullptr, b.data()),
              KVSIFT_STATUS_OK);
    EXPECT_EQ(a, b);
  }
  EXPECT_EQ(stats_of(cache.get()).pages_in_use, 2u * kKvHeads * 2);
}

TEST(CApi, read_tokens_rejects_bad_arguments) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  append(cache.get(), seq, 0, 10, 1);
  std::vector<float> k(20 * kHeadDim), v(20 * kHeadDim);
  EXPECT_FAILS(kvsift_read_tokens(nullptr, seq, 0, 0, 0, 1, k.data(), v.data()),
               KVSIFT_STATUS_INVALID_ARGUMENT, "cache");
  EXPECT_FAILS(kvsift_read_tokens(cache.get(), seq, kLayers, 0, 0, 1, k.data(), v.data()),
               KVSIFT_STATUS_INVALID_ARGUMENT, "layer");
  EXPECT_FAILS(kvsift_read_tokens(cache.get(), seq, 0, kKvHeads, 0, 1, k.data(), v.data()),
               KVSIFT_STATUS_INVALID_ARGUMENT, "kv_head");
  EXPECT_FAILS(kvsift_read_tokens(cache.get(), seq + 1, 0, 0, 0, 1, k.data(), v.data()),
               KVSIFT_STATUS_NOT_FOUND, "seq_id");
  EXPECT_FAILS(kvsift_read_tokens(cache.get(), -1, 0, 0, 0, 1, k.data(), v.data()),
               KVSIFT_STATUS_NOT_FOUND, "seq_id");
}

TEST(CApi, read_tokens_rejects_ranges_past_the_end) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  append(cache.get(), seq, 0, 10, 1);
  std::vector<float> k(20 * kHeadDim, NAN);
  EXPECT_FAILS(kvsift_read_tokens(cache.get(), seq, 0, 0, 5, 6, k.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "n_tokens");
  EXPECT_FAILS(kvsift_read_tokens(cache.get(), seq, 0, 0, 11, 0, k.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "n_tokens");
  EXPECT_FAILS(kvsift_read_tokens(cache.get(), seq, 0, 0, 1, UINT64_MAX, k.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "n_tokens");
  // Layer 1 holds no tokens.
  EXPECT_FAILS(kvsift_read_tokens(cache.get(), seq, 1, 0, 0, 1, k.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "n_tokens");
  EXPECT_TRUE(all_nan(k));
  // The end of the sequence, and nothing at all, are fine.
  EXPECT_EQ(kvsift_read_tokens(cache.get(), seq, 0, 1, 5, 5, k.data(), nullptr), KVSIFT_STATUS_OK);
  EXPECT_EQ(kvsift_read_tokens(cache.get(), seq, 0, 1, 10, 0, nullptr, nullptr), KVSIFT_STATUS_OK);
  EXPECT_EQ(kvsift_read_tokens(cache.get(), seq, 0, 1, 0, 10, nullptr, nullptr), KVSIFT_STATUS_OK);
}

// ---- Capacity and page accounting ---------------------------------------------------------------

TEST(CApi, append_past_capacity_returns_capacity_exceeded) {
  kvsift_cache_params params = small_params();
  params.max_pages = 4;  // two pages per KV head
  Cache cache = make_cache(params);
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  append(cache.get(), seq, 0, 20, 1);  // 2 pages per head: the pool is full, the 2nd page open
  const kvsift_cache_stats full = stats_of(cache.get());
  ASSERT_EQ(full.pages_in_use, 4u);

  // 13 more tokens need a third page per head.
  const Tokens more(13, 2);
  EXPECT_FAILS(kvsift_append(cache.get(), seq, 0, 13, more.k.data(), more.v.data()),
               KVSIFT_STATUS_CAPACITY_EXCEEDED, "pages");
  // Another layer needs pages of its own.
  EXPECT_FAILS(kvsift_append(cache.get(), seq, 1, 1, more.k.data(), more.v.data()),
               KVSIFT_STATUS_CAPACITY_EXCEEDED, "pages");
  // The open page still takes tokens.
  ASSERT_EQ(kvsift_append(cache.get(), seq, 0, 12, more.k.data(), more.v.data()), KVSIFT_STATUS_OK)
      << kvsift_last_error();
  EXPECT_EQ(length_of(cache.get(), seq, 0), 32u);
  EXPECT_EQ(stats_of(cache.get()).pages_in_use, 4u);
}

TEST(CApi, failed_append_changes_nothing) {
  kvsift_cache_params params = small_params();
  params.max_pages = 6;
  Cache cache = make_cache(params);
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  const int32_t other = make_sequence(cache.get());
  append(cache.get(), seq, 0, 18, 1);  // 4 pages in use
  std::vector<float> k_before(18 * kHeadDim), v_before(18 * kHeadDim);
  ASSERT_EQ(kvsift_read_tokens(cache.get(), seq, 0, 1, 0, 18, k_before.data(), v_before.data()),
            KVSIFT_STATUS_OK);
  const kvsift_cache_stats before = stats_of(cache.get());

  const Tokens big(40, 3);  // 18 + 40 = 58 tokens: 4 pages per head, 4 more than are free
  EXPECT_FAILS(kvsift_append(cache.get(), seq, 0, 40, big.k.data(), big.v.data()),
               KVSIFT_STATUS_CAPACITY_EXCEEDED, "pages");
  EXPECT_FAILS(kvsift_append(cache.get(), other, 0, 40, big.k.data(), big.v.data()),
               KVSIFT_STATUS_CAPACITY_EXCEEDED, "pages");

  EXPECT_EQ(length_of(cache.get(), seq, 0), 18u);
  EXPECT_EQ(length_of(cache.get(), other, 0), 0u);
  const kvsift_cache_stats after = stats_of(cache.get());
  EXPECT_EQ(after.pages_in_use, before.pages_in_use);
  EXPECT_EQ(after.pages_high_water, before.pages_high_water);
  EXPECT_EQ(after.bytes_in_use, before.bytes_in_use);
  EXPECT_EQ(after.n_sequences, before.n_sequences);
  std::vector<float> k_after(18 * kHeadDim), v_after(18 * kHeadDim);
  ASSERT_EQ(kvsift_read_tokens(cache.get(), seq, 0, 1, 0, 18, k_after.data(), v_after.data()),
            KVSIFT_STATUS_OK);
  EXPECT_EQ(k_after, k_before);
  EXPECT_EQ(v_after, v_before);

  // A smaller append that fits still succeeds: 18 + 14 = 32 tokens, all in the 4 pages held.
  ASSERT_EQ(kvsift_append(cache.get(), seq, 0, 14, big.k.data(), big.v.data()), KVSIFT_STATUS_OK)
      << kvsift_last_error();
  EXPECT_EQ(length_of(cache.get(), seq, 0), 32u);
  // And one that needs the last two pages.
  ASSERT_EQ(kvsift_append(cache.get(), other, 0, 16, big.k.data(), big.v.data()), KVSIFT_STATUS_OK)
      << kvsift_last_error();
  EXPECT_EQ(stats_of(cache.get()).pages_in_use, 6u);
}

TEST(CApi, freeing_a_sequence_returns_its_pages_to_the_pool) {
  kvsift_cache_params params = small_params();
  params.max_pages = 8;
  Cache cache = make_cache(params);
  ASSERT_NE(cache, nullptr);
  const int32_t a = make_sequence(cache.get());
  append(cache.get(), a, 0, 33, 1);  // 3 pages per head
  append(cache.get(), a, 1, 1, 2);   // 1 page per head
  EXPECT_EQ(stats_of(cache.get()).pages_in_use, 8u);
  const int32_t b = make_sequence(cache.get());
  const Tokens t(16, 3);
  EXPECT_FAILS(kvsift_append(cache.get(), b, 0, 16, t.k.data(), t.v.data()),
               KVSIFT_STATUS_CAPACITY_EXCEEDED, "pages");

  ASSERT_EQ(kvsift_sequence_free(cache.get(), a), KVSIFT_STATUS_OK);
  kvsift_cache_stats stats = stats_of(cache.get());
  EXPECT_EQ(stats.pages_in_use, 0u);
  EXPECT_EQ(stats.bytes_in_use, 0u);
  EXPECT_EQ(stats.pages_high_water, 8u);
  EXPECT_EQ(stats.n_sequences, 1u);

  append(cache.get(), b, 0, 64, 4);  // 4 pages per head: the whole pool again
  stats = stats_of(cache.get());
  EXPECT_EQ(stats.pages_in_use, 8u);
  EXPECT_EQ(stats.pages_high_water, 8u);
  ASSERT_EQ(kvsift_sequence_free(cache.get(), b), KVSIFT_STATUS_OK);
  EXPECT_EQ(stats_of(cache.get()).pages_in_use, 0u);
}

TEST(CApi, stats_count_pages_per_layer_and_kv_head) {
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  const int32_t seq = make_sequence(cache.get());
  const uint32_t n = 37;
  for (uint32_t layer = 0; layer < kLayers; ++layer) append(cache.get(), seq, layer, n, layer);
  const uint64_t pages = uint64_t{kLayers} * kKvHeads * ((n + kPageTokens - 1) / kPageTokens);
  const kvsift_cache_stats stats = stats_of(cache.get());
  EXPECT_EQ(stats.pages_capacity, 64u);
  EXPECT_EQ(stats.pages_in_use, pages);
  EXPECT_EQ(stats.pages_high_water, pages);
  EXPECT_EQ(stats.page_bytes, 2u * kPageTokens * kHeadDim * 2);
  EXPECT_EQ(stats.bytes_in_use, pages * stats.page_bytes);
  EXPECT_GE(stats.bytes_reserved, stats.pages_capacity * stats.page_bytes);
  EXPECT_EQ(stats.n_sequences, 1u);
  EXPECT_EQ(stats.last_pages_read, 0u);
  EXPECT_EQ(stats.last_tokens_read, 0u);
  EXPECT_EQ(stats.last_bytes_read, 0u);
}

TEST(CApi, get_stats_rejects_null_cache_and_null_stats) {
  kvsift_cache_stats stats;
  EXPECT_FAILS(kvsift_cache_get_stats(nullptr, &stats), KVSIFT_STATUS_INVALID_ARGUMENT, "cache");
  Cache cache = make_cache();
  ASSERT_NE(cache, nullptr);
  EXPECT_FAILS(kvsift_cache_get_stats(cache.get(), nullptr), KVSIFT_STATUS_INVALID_ARGUMENT,
               "stats");
}

// ---- Attention ----------------------------------------------------------------------------------

TEST(CApi, dense_attend_matches_a_reference_over_the_stored_values) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  ASSERT_EQ(kvsift_attend(f.cache.get(), 0, 2, f.ids().data(), f.q.data(), f.out.data(), nullptr),
            KVSIFT_STATUS_OK)
      << kvsift_last_error();
  expect_near_all(f.out, reference_attend(f.cache.get(), 0, f.ids(), f.q, nullptr), 1e-5f);
}

TEST(CApi, dense_attend_stats_count_every_token_of_every_kv_head) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  const std::vector<int32_t> one = {f.a};
  ASSERT_EQ(kvsift_attend(f.cache.get(), 0, 1, one.data(), f.q.data(), f.out.data(), nullptr),
            KVSIFT_STATUS_OK);
  const uint64_t n = 37;
  kvsift_cache_stats stats = stats_of(f.cache.get());
  EXPECT_EQ(stats.last_tokens_read, n * kKvHeads);
  EXPECT_EQ(stats.last_bytes_read, n * kKvHeads * 2 * kHeadDim * 2);
  EXPECT_EQ(stats.last_pages_read, 3u * kKvHeads);

  ASSERT_EQ(kvsift_attend(f.cache.get(), 0, 2, f.ids().data(), f.q.data(), f.out.data(), nullptr),
            KVSIFT_STATUS_OK);
  stats = stats_of(f.cache.get());
  EXPECT_EQ(stats.last_tokens_read, (37u + 16u) * kKvHeads);
  EXPECT_EQ(stats.last_bytes_read, (37u + 16u) * kKvHeads * 2 * kHeadDim * 2);
  EXPECT_EQ(stats.last_pages_read, (3u + 1u) * kKvHeads);
}

TEST(CApi, attend_over_page_lists_matches_a_reference_over_those_pages) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  // Pairs (a, head 0), (a, head 1), (b, head 0), (b, head 1); a has pages 0..2 (2 is open).
  const std::vector<std::vector<uint32_t>> lists = {{0, 2}, {1}, {}, {0}};
  const uint32_t offsets[] = {0, 2, 3, 3, 4};
  const uint32_t page_ids[] = {0, 2, 1, 0};
  const kvsift_page_list pages{offsets, page_ids};
  ASSERT_EQ(kvsift_attend(f.cache.get(), 0, 2, f.ids().data(), f.q.data(), f.out.data(), &pages),
            KVSIFT_STATUS_OK)
      << kvsift_last_error();
  expect_near_all(f.out, reference_attend(f.cache.get(), 0, f.ids(), f.q, &lists), 1e-5f);
  // The pair with no pages gets zeros.
  const std::size_t pair_elems = std::size_t{kGroup} * kHeadDim;
  for (std::size_t i = 2 * pair_elems; i < 3 * pair_elems; ++i) ASSERT_EQ(f.out[i], 0.0f);

  const kvsift_cache_stats stats = stats_of(f.cache.get());
  EXPECT_EQ(stats.last_pages_read, 4u);
  EXPECT_EQ(stats.last_tokens_read, (16u + 5u) + 16u + 0u + 16u);
  EXPECT_EQ(stats.last_bytes_read, stats.last_tokens_read * 2 * kHeadDim * 2);
}

TEST(CApi, page_lists_with_no_pages_accept_null_page_ids_and_give_zeros) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  const uint32_t offsets[] = {0, 0, 0, 0, 0};
  const kvsift_page_list pages{offsets, nullptr};
  ASSERT_EQ(kvsift_attend(f.cache.get(), 0, 2, f.ids().data(), f.q.data(), f.out.data(), &pages),
            KVSIFT_STATUS_OK)
      << kvsift_last_error();
  for (float x : f.out) ASSERT_EQ(x, 0.0f);
  EXPECT_EQ(stats_of(f.cache.get()).last_tokens_read, 0u);
}

TEST(CApi, attend_gives_zeros_for_a_sequence_without_tokens) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  const int32_t ids[] = {f.empty, f.b};
  ASSERT_EQ(kvsift_attend(f.cache.get(), 0, 2, ids, f.q.data(), f.out.data(), nullptr),
            KVSIFT_STATUS_OK);
  const std::size_t seq_elems = q_elems(1);
  for (std::size_t i = 0; i < seq_elems; ++i) ASSERT_EQ(f.out[i], 0.0f);
  for (std::size_t i = seq_elems; i < 2 * seq_elems; ++i) ASSERT_FALSE(std::isnan(f.out[i]));
  // Layer 1 of every sequence is empty.
  ASSERT_EQ(kvsift_attend(f.cache.get(), 1, 2, f.ids().data(), f.q.data(), f.out.data(), nullptr),
            KVSIFT_STATUS_OK);
  for (float x : f.out) ASSERT_EQ(x, 0.0f);
}

TEST(CApi, attend_rejects_null_cache_and_buffers) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  const std::vector<int32_t> ids = f.ids();
  EXPECT_FAILS(kvsift_attend(nullptr, 0, 2, ids.data(), f.q.data(), f.out.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "cache");
  EXPECT_FAILS(kvsift_attend(f.cache.get(), 0, 2, nullptr, f.q.data(), f.out.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "seq_ids");
  EXPECT_FAILS(kvsift_attend(f.cache.get(), 0, 2, ids.data(), nullptr, f.out.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "q");
  EXPECT_FAILS(kvsift_attend(f.cache.get(), 0, 2, ids.data(), f.q.data(), nullptr, nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "out");
  EXPECT_TRUE(all_nan(f.out));
}

TEST(CApi, attend_rejects_batch_sizes_outside_1_to_max_batch) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  const int32_t ids[kMaxBatch + 1] = {f.a, f.b, f.empty, 1000, 1001};
  std::vector<float> q = random_floats(q_elems(kMaxBatch + 1), 5);
  std::vector<float> out(q_elems(kMaxBatch + 1), NAN);
  EXPECT_FAILS(kvsift_attend(f.cache.get(), 0, 0, ids, q.data(), out.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "n_seqs");
  EXPECT_FAILS(kvsift_attend(f.cache.get(), 0, kMaxBatch + 1, ids, q.data(), out.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "n_seqs");
  EXPECT_TRUE(all_nan(out));
}

TEST(CApi, attend_rejects_duplicate_sequence_ids) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  const int32_t ids[] = {f.b, f.a, f.b};
  std::vector<float> q = random_floats(q_elems(3), 5);
  std::vector<float> out(q_elems(3), NAN);
  EXPECT_FAILS(kvsift_attend(f.cache.get(), 0, 3, ids, q.data(), out.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "seq_ids");
  EXPECT_TRUE(all_nan(out));
}

TEST(CApi, attend_rejects_layer_out_of_range) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  EXPECT_FAILS(
      kvsift_attend(f.cache.get(), kLayers, 2, f.ids().data(), f.q.data(), f.out.data(), nullptr),
      KVSIFT_STATUS_INVALID_ARGUMENT, "layer");
  EXPECT_TRUE(all_nan(f.out));
}

TEST(CApi, attend_reports_unknown_sequences_not_found) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  const int32_t freed = make_sequence(f.cache.get());
  ASSERT_EQ(kvsift_sequence_free(f.cache.get(), freed), KVSIFT_STATUS_OK);
  for (int32_t unknown : {freed, int32_t{999}, int32_t{-1}}) {
    const int32_t ids[] = {f.a, unknown};
    EXPECT_FAILS(kvsift_attend(f.cache.get(), 0, 2, ids, f.q.data(), f.out.data(), nullptr),
                 KVSIFT_STATUS_NOT_FOUND, "seq_ids");
  }
  EXPECT_TRUE(all_nan(f.out));
}

TEST(CApi, attend_rejects_out_overlapping_q) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  std::vector<float> buffer = random_floats(q_elems(2) + kHeadDim, 5);
  EXPECT_FAILS(kvsift_attend(f.cache.get(), 0, 2, f.ids().data(), buffer.data(),
                             buffer.data() + kHeadDim, nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "overlaps");
  EXPECT_FAILS(
      kvsift_attend(f.cache.get(), 0, 2, f.ids().data(), buffer.data(), buffer.data(), nullptr),
      KVSIFT_STATUS_INVALID_ARGUMENT, "overlaps");
}

TEST(CApi, attend_rejects_malformed_page_lists) {
  AttendFixture f;
  ASSERT_NE(f.cache, nullptr);
  const std::vector<int32_t> ids = f.ids();
  // a (37 tokens) has pages 0..2, b (16 tokens) has page 0.
  const uint32_t good_offsets[] = {0, 1, 2, 3, 4};
  const uint32_t good_ids[] = {0, 1, 0, 0};
  struct Case {
    const char* what;
    std::vector<uint32_t> offsets, page_ids;
    bool null_offsets, null_page_ids;
  };
  const Case cases[] = {
      {"offsets", {}, {0, 1, 0, 0}, true, false},
      {"page_ids", {0, 1, 2, 3, 4}, {}, false, true},
      {"offsets[0]", {1, 1, 2, 3, 4}, {0, 1, 0, 0}, false, false},
      {"offsets", {0, 2, 1, 3, 4}, {0, 1, 0, 0}, false, false},   // decreasing
      {"page_ids", {0, 1, 2, 3, 4}, {3, 1, 0, 0}, false, false},  // a has 3 pages
      {"page_ids", {0, 1, 2, 3, 4}, {0, 1, 0, 1}, false, false},  // b has 1 page
      {"page_ids", {0, 2, 3, 3, 4}, {1, 1, 0, 0}, false, false},  // repeated
      {"page_ids", {0, 2, 3, 3, 4}, {2, 0, 0, 0}, false, false},  // descending
  };
  const kvsift_page_list good{good_offsets, good_ids};
  ASSERT_EQ(kvsift_attend(f.cache.get(), 0, 2, ids.data(), f.q.data(), f.out.data(), &good),
            KVSIFT_STATUS_OK)
      << kvsift_last_error();
  const kvsift_cache_stats good_stats = stats_of(f.cache.get());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const kvsift_page_list pages{c.null_offsets ? nullptr : c.offsets.data(),
                                 c.null_page_ids ? nullptr : c.page_ids.data()};
    std::vector<float> out(f.out.size(), NAN);
    EXPECT_FAILS(kvsift_attend(f.cache.get(), 0, 2, ids.data(), f.q.data(), out.data(), &pages),
                 KVSIFT_STATUS_INVALID_ARGUMENT, c.what);
    EXPECT_TRUE(all_nan(out));
  }
  // A failed call leaves the statistics of the last successful one.
  const kvsift_cache_stats stats = stats_of(f.cache.get());
  EXPECT_EQ(stats.last_tokens_read, good_stats.last_tokens_read);
  EXPECT_EQ(stats.last_pages_read, good_stats.last_pages_read);
}

// ---- GPU ----------------------------------------------------------------------------------------

TEST(CApi, gpu_device_count_rejects_null) {
  EXPECT_FAILS(kvsift_gpu_device_count(nullptr), KVSIFT_STATUS_INVALID_ARGUMENT, "n_devices");
}

TEST(CApi, gpu_device_count_reports_unsupported_without_a_gpu) {
  int n = -1;
  poison_last_error();
  const kvsift_status status = kvsift_gpu_device_count(&n);
  if (status == KVSIFT_STATUS_OK) {
    EXPECT_GT(n, 0);
    GTEST_SKIP() << n << " CUDA device(s) present";
  }
  EXPECT_EQ(status, KVSIFT_STATUS_UNSUPPORTED) << kvsift_last_error();
  EXPECT_EQ(n, 0);
  // The message says why: no CUDA in the build, or no driver/device.
  std::string message = kvsift_last_error();
  for (char& c : message) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  EXPECT_NE(message.find("cuda"), std::string::npos) << kvsift_last_error();
}

TEST(CApi, gpu_memory_info_rejects_null_and_devices_outside_the_count) {
  uint64_t used = 7, total = 7;
  EXPECT_FAILS(kvsift_gpu_memory_info(0, nullptr, &total), KVSIFT_STATUS_INVALID_ARGUMENT,
               "used_bytes");
  EXPECT_FAILS(kvsift_gpu_memory_info(0, &used, nullptr), KVSIFT_STATUS_INVALID_ARGUMENT,
               "total_bytes");
  int n = 0;
  if (kvsift_gpu_device_count(&n) != KVSIFT_STATUS_OK) {
    EXPECT_EQ(kvsift_gpu_memory_info(0, &used, &total), KVSIFT_STATUS_UNSUPPORTED);
    EXPECT_EQ(used, 0u);
    EXPECT_EQ(total, 0u);
    return;
  }
  EXPECT_FAILS(kvsift_gpu_memory_info(-1, &used, &total), KVSIFT_STATUS_INVALID_ARGUMENT,
               "device -1");
  EXPECT_FAILS(kvsift_gpu_memory_info(n, &used, &total), KVSIFT_STATUS_INVALID_ARGUMENT,
               ("device " + std::to_string(n)).c_str());
  ASSERT_EQ(kvsift_gpu_memory_info(n - 1, &used, &total), KVSIFT_STATUS_OK) << kvsift_last_error();
  // This process holds a CUDA context on the device by now, so something is in use.
  EXPECT_GT(used, 0u);
  EXPECT_LE(used, total);
}

TEST(CApi, pinned_cache_is_unsupported_without_a_gpu) {
  int n = 0;
  const bool have_gpu = kvsift_gpu_device_count(&n) == KVSIFT_STATUS_OK;
  kvsift_cache_params params = small_params();
  params.pinned = 1;
  params.max_pages = 4;
  if (have_gpu) {
    Cache cache = make_cache(params);
    ASSERT_NE(cache, nullptr);
    const int32_t seq = make_sequence(cache.get());
    append(cache.get(), seq, 0, 3, 1);
    GTEST_SKIP() << "a GPU is present: pinned caches work";
  }
  expect_create_fails(params, KVSIFT_STATUS_UNSUPPORTED, "pinned");
}

TEST(CApi, offload_cache_is_unsupported_without_a_gpu_and_a_bad_device_is_refused) {
  kvsift_cache_params params = small_params();
  params.max_pages = 4;
  params.device = -2;
  expect_create_fails(params, KVSIFT_STATUS_INVALID_ARGUMENT, "device");
  int n = 0;
  if (kvsift_gpu_device_count(&n) == KVSIFT_STATUS_OK)
    GTEST_SKIP() << "a GPU is present: the offload tests run the device mode";
  params.device = 0;
  kvsift_cache* cache = nullptr;
  EXPECT_EQ(kvsift_cache_create(&params, &cache), KVSIFT_STATUS_UNSUPPORTED) << kvsift_last_error();
  EXPECT_EQ(cache, nullptr);
}

// ---- Selectors through the C API ---------------------------------------------------------------

namespace {

kvsift_selector_policy policy_for(kvsift_selector selector, double budget) {
  kvsift_selector_policy policy;
  kvsift_selector_policy_init(&policy);
  policy.selector = selector;
  policy.budget = budget;
  return policy;
}

}  // namespace

TEST(CApi, selector_policy_init_fills_the_documented_defaults) {
  kvsift_selector_policy policy;
  std::memset(&policy, 0xab, sizeof policy);
  kvsift_selector_policy_init(&policy);
  EXPECT_EQ(policy.selector, KVSIFT_SELECTOR_DENSE);
  EXPECT_EQ(policy.budget, 0.0);
  EXPECT_EQ(policy.sink_pages, 1u);
  EXPECT_EQ(policy.window_pages, 1u);
  EXPECT_EQ(policy.combine, KVSIFT_GQA_NRM);
  EXPECT_EQ(policy.locks.int8_query, 1);
  EXPECT_EQ(policy.locks.epsilon, 1e-3);
  EXPECT_EQ(policy.s4r.compression, 2.5);
  EXPECT_EQ(policy.s4r.window, 32u);
  EXPECT_EQ(policy.s4r.per_head_bases, 0);
  EXPECT_EQ(policy.device, -1);
  kvsift_selector_policy_init(nullptr);
}

TEST(CApi, selector_names_run_from_0_to_the_count_and_back_through_from_name) {
  std::set<std::string> names;
  for (int i = 0; i < KVSIFT_SELECTOR_COUNT; ++i) {
    const auto selector = static_cast<kvsift_selector>(i);
    const std::string name = kvsift_selector_name(selector);
    EXPECT_NE(name, "unknown") << i;
    EXPECT_TRUE(names.insert(name).second) << name << " twice";
    kvsift_selector back = KVSIFT_SELECTOR_MAX_ENUM;
    ASSERT_EQ(kvsift_selector_from_name(name.c_str(), &back), KVSIFT_STATUS_OK) << name;
    EXPECT_EQ(back, selector);
  }
  EXPECT_STREQ(kvsift_selector_name(KVSIFT_SELECTOR_COUNT), "unknown");
  kvsift_selector none = KVSIFT_SELECTOR_DENSE;
  EXPECT_FAILS(kvsift_selector_from_name("recent", &none), KVSIFT_STATUS_NOT_FOUND,
               "locks_certified");  // the message lists the known names
  // The count itself is not a value.
  AttendFixture f;
  kvsift_selector_policy policy = policy_for(KVSIFT_SELECTOR_QUEST, 0.5);
  policy.selector = KVSIFT_SELECTOR_COUNT;
  EXPECT_FAILS(kvsift_cache_set_selector(f.cache.get(), &policy), KVSIFT_STATUS_INVALID_ARGUMENT,
               "policy->selector");
  policy = policy_for(KVSIFT_SELECTOR_QUEST, 0.5);
  policy.combine = KVSIFT_GQA_COUNT;
  EXPECT_FAILS(kvsift_cache_set_selector(f.cache.get(), &policy), KVSIFT_STATUS_INVALID_ARGUMENT,
               "policy->combine");
}

TEST(CApi, selection_on_a_device_is_refused_clearly_without_one) {
  AttendFixture f;
  kvsift_selector_policy policy = policy_for(KVSIFT_SELECTOR_LOCKS, 0.1);
  policy.device = -2;
  EXPECT_FAILS(kvsift_cache_set_selector(f.cache.get(), &policy), KVSIFT_STATUS_INVALID_ARGUMENT,
               "policy.device");
  int n = 0;
  if (kvsift_gpu_device_count(&n) == KVSIFT_STATUS_OK)
    GTEST_SKIP() << "a GPU is present: the device selection tests run it";
  for (kvsift_selector selector : {KVSIFT_SELECTOR_LOCKS, KVSIFT_SELECTOR_LOUVER}) {
    policy = policy_for(selector, 0.1);
    policy.device = 0;
    EXPECT_EQ(kvsift_cache_set_selector(f.cache.get(), &policy), KVSIFT_STATUS_UNSUPPORTED)
        << kvsift_last_error();
  }
}

TEST(CApi, attend_selected_with_the_whole_context_as_budget_equals_dense) {
  AttendFixture f;
  std::vector<float> dense(f.out.size());
  const auto ids = f.ids();
  ASSERT_EQ(kvsift_attend(f.cache.get(), 0, 2, ids.data(), f.q.data(), dense.data(), nullptr),
            KVSIFT_STATUS_OK);
  for (kvsift_selector selector :
       {KVSIFT_SELECTOR_DENSE, KVSIFT_SELECTOR_ORACLE, KVSIFT_SELECTOR_QUEST}) {
    const kvsift_selector_policy policy =
        policy_for(selector, selector == KVSIFT_SELECTOR_DENSE ? 0.0 : 1.0);
    ASSERT_EQ(kvsift_cache_set_selector(f.cache.get(), &policy), KVSIFT_STATUS_OK)
        << kvsift_last_error();
    kvsift_selection_stats stats{};
    ASSERT_EQ(
        kvsift_attend_selected(f.cache.get(), 0, 2, ids.data(), f.q.data(), f.out.data(), &stats),
        KVSIFT_STATUS_OK)
        << kvsift_last_error();
    EXPECT_EQ(f.out, dense) << kvsift_selector_name(selector);
    EXPECT_EQ(stats.pairs, 2u * kKvHeads);
    EXPECT_EQ(stats.pages_chosen, stats.pages_stored);
    EXPECT_EQ(stats.pages_stored, (3u + 1u) * kKvHeads);
    EXPECT_EQ(stats.kept_estimate, 1.0);
    EXPECT_EQ(stats.dropped_bound, 0.0);
  }
}

TEST(CApi, attend_selected_within_a_budget_reads_fewer_kv_bytes) {
  Cache cache = make_cache();
  const int32_t seq = make_sequence(cache.get());
  append(cache.get(), seq, 0, 16 * 20, 5);
  const std::vector<float> q = random_floats(q_elems(1), 6);
  std::vector<float> out(q.size());
  const kvsift_selector_policy policy = policy_for(KVSIFT_SELECTOR_ORACLE, 16 * 5);
  ASSERT_EQ(kvsift_cache_set_selector(cache.get(), &policy), KVSIFT_STATUS_OK);
  kvsift_selection_stats stats{};
  ASSERT_EQ(kvsift_attend_selected(cache.get(), 0, 1, &seq, q.data(), out.data(), &stats),
            KVSIFT_STATUS_OK)
      << kvsift_last_error();
  EXPECT_EQ(stats.pages_chosen, 5u * kKvHeads);
  EXPECT_EQ(stats.pages_stored, 20u * kKvHeads);
  EXPECT_EQ(stats.kv_bytes_read, 5u * kKvHeads * 16 * kHeadDim * 2 * 2);
  EXPECT_EQ(stats.index_bytes_read, 20u * kKvHeads * 16 * kHeadDim * 2);  // the oracle reads K
  EXPECT_GT(stats.kept_estimate, 0.25);
  EXPECT_LE(stats.kept_estimate, 1.0);
  EXPECT_TRUE(std::isnan(stats.dropped_bound));
}

// S4R through the C API: a pre-RoPE cache, compression on the first selected step, and at full
// rank with every token reconstructed the output of a dense pre-RoPE cache; a post-RoPE cache
// and a selector change over compressed sequences are refused.
TEST(CApi, s4r_at_full_rank_attends_like_dense_and_its_refusals_name_the_cause) {
  kvsift_cache_params params = small_params();
  params.key_form = KVSIFT_KEYS_PRE_ROPE;
  params.max_pages = 256;
  Cache s4r = make_cache(params), dense = make_cache(params);
  const int32_t seq = make_sequence(s4r.get()), ref_seq = make_sequence(dense.get());
  append(s4r.get(), seq, 0, 16 * 40 + 3, 7);
  append(dense.get(), ref_seq, 0, 16 * 40 + 3, 7);
  kvsift_selector_policy policy = policy_for(KVSIFT_SELECTOR_S4R, 1.0);
  policy.s4r.compression = 1.0;
  ASSERT_EQ(kvsift_cache_set_selector(s4r.get(), &policy), KVSIFT_STATUS_OK) << kvsift_last_error();
  const std::vector<float> q = random_floats(q_elems(1), 8);
  std::vector<float> out(q.size()), ref(q.size());
  kvsift_selection_stats stats{};
  ASSERT_EQ(kvsift_attend_selected(s4r.get(), 0, 1, &seq, q.data(), out.data(), &stats),
            KVSIFT_STATUS_OK)
      << kvsift_last_error();
  ASSERT_EQ(kvsift_attend(dense.get(), 0, 1, &ref_seq, q.data(), ref.data(), nullptr),
            KVSIFT_STATUS_OK);
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) {
    diff += (out[i] - ref[i]) * (out[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  EXPECT_LT(std::sqrt(diff / norm), 2e-3);
  EXPECT_EQ(stats.pages_chosen, 2u * kKvHeads);  // the sink page and the partial last one
  // Compressed pages are gone: dense attention and a new selector are refused.
  EXPECT_FAILS(kvsift_attend(s4r.get(), 0, 1, &seq, q.data(), out.data(), nullptr),
               KVSIFT_STATUS_INVALID_ARGUMENT, "released");
  EXPECT_FAILS(kvsift_cache_set_selector(s4r.get(), &policy), KVSIFT_STATUS_INVALID_ARGUMENT,
               "free them");
  ASSERT_EQ(kvsift_sequence_free(s4r.get(), seq), KVSIFT_STATUS_OK);
  EXPECT_EQ(kvsift_cache_set_selector(s4r.get(), &policy), KVSIFT_STATUS_OK);
  Cache post = make_cache();
  EXPECT_FAILS(kvsift_cache_set_selector(post.get(), &policy), KVSIFT_STATUS_INVALID_ARGUMENT,
               "pre-RoPE");
}

// Token-level selectors size their row storage per step, for the sequences a call names: on a
// cache with the default capacity (65,536 pages, 64 sequences per call) they are set up at once
// and attend, where sizing for every pair's whole capacity would take terabytes.
TEST(CApi, token_level_selectors_set_up_on_a_full_size_cache) {
  kvsift_cache_params params = small_params();
  params.key_form = KVSIFT_KEYS_PRE_ROPE;
  params.max_pages = 65536;
  params.max_batch = 64;
  for (const kvsift_selector selector : {KVSIFT_SELECTOR_S4R, KVSIFT_SELECTOR_LOUVER}) {
    Cache cache = make_cache(params);
    const int32_t seq = make_sequence(cache.get());
    append(cache.get(), seq, 0, 16 * 30, 9);
    const kvsift_selector_policy policy = policy_for(selector, 0.2);
    ASSERT_EQ(kvsift_cache_set_selector(cache.get(), &policy), KVSIFT_STATUS_OK)
        << kvsift_selector_name(selector) << ": " << kvsift_last_error();
    const std::vector<float> q = random_floats(q_elems(1), 10);
    std::vector<float> out(q.size(), std::nanf(""));
    ASSERT_EQ(kvsift_attend_selected(cache.get(), 0, 1, &seq, q.data(), out.data(), nullptr),
              KVSIFT_STATUS_OK)
        << kvsift_selector_name(selector) << ": " << kvsift_last_error();
    for (float x : out) ASSERT_TRUE(std::isfinite(x)) << kvsift_selector_name(selector);
  }
}

TEST(CApi, set_selector_refuses_bad_policies_naming_the_field) {
  Cache cache = make_cache();
  kvsift_selector_policy policy = policy_for(KVSIFT_SELECTOR_QUEST, 0.0);
  EXPECT_EQ(kvsift_cache_set_selector(cache.get(), &policy), KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_names("budget"));
  policy.budget = 0.1;
  store_raw(&policy.combine, 9);
  EXPECT_EQ(kvsift_cache_set_selector(cache.get(), &policy), KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_names("combine"));
  policy.combine = KVSIFT_GQA_NRM;
  store_raw(&policy.selector, 17);
  EXPECT_EQ(kvsift_cache_set_selector(cache.get(), &policy), KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_names("selector"));
  policy = policy_for(KVSIFT_SELECTOR_LOCKS_CERTIFIED, 0.5);
  policy.locks.epsilon = 1.5;
  EXPECT_EQ(kvsift_cache_set_selector(cache.get(), &policy), KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_TRUE(last_error_names("epsilon"));
  EXPECT_EQ(kvsift_cache_set_selector(nullptr, &policy), KVSIFT_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(kvsift_cache_set_selector(cache.get(), nullptr), KVSIFT_STATUS_INVALID_ARGUMENT);
  const int32_t seq = make_sequence(cache.get());
  const std::vector<float> q = random_floats(q_elems(1), 6);
  std::vector<float> out(q.size());
  const int32_t unknown = 55;
  EXPECT_EQ(kvsift_attend_selected(cache.get(), 0, 1, &unknown, q.data(), out.data(), nullptr),
            KVSIFT_STATUS_NOT_FOUND);
  EXPECT_EQ(kvsift_attend_selected(cache.get(), 0, 1, &seq, nullptr, out.data(), nullptr),
            KVSIFT_STATUS_INVALID_ARGUMENT);
}
