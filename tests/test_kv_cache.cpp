#include <gtest/gtest.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "lib/cache/kv_cache.hpp"
#include "lib/core/error.hpp"
#include "simd/half.hpp"
#include "test_util.hpp"

using namespace kvsift;

namespace {

CacheGeometry small_geometry() {
  CacheGeometry g;
  g.n_layers = 2;
  g.n_kv_heads = 3;
  g.group_size = 2;
  g.head_dim = 64;
  g.page_tokens = 16;
  return g;
}

// A cache that rotates the keys it is given, at the theta the tests' rope_reference calls use.
CacheOptions pre_rope_options() {
  CacheOptions o;
  o.key_form = KeyForm::pre_rope;
  o.rope_theta = 50000.0f;
  return o;
}

struct Recorder : SealListener {
  std::vector<std::tuple<int32_t, uint32_t, uint32_t, uint32_t>> sealed;
  std::vector<float> first_k;  // K of each sealed page's first token, element 0
  std::vector<int32_t> freed;
  void on_page_sealed(const SealedPage& p) noexcept override {
    sealed.emplace_back(p.seq_id, p.layer, p.kv_head, p.page);
    first_k.push_back(simd::f16_to_f32(small_geometry().layout().key(p.slot)[0]));
  }
  void on_sequence_freed(int32_t seq_id) noexcept override { freed.push_back(seq_id); }
};

}  // namespace

TEST(KvCache, stored_tokens_read_back_as_the_rounded_inputs) {
  const CacheGeometry g = small_geometry();
  KvCache cache(g, CacheOptions{}, test::kernels());
  const int32_t seq = cache.create_sequence();
  const uint32_t n = 37, H = g.n_kv_heads, d = g.head_dim;
  const auto k = test::random_floats(n * H * d, 1), v = test::random_floats(n * H * d, 2);
  cache.append(seq, 1, 20, k.data(), v.data());  // a prefill chunk, then single decode steps
  for (uint32_t t = 20; t < n; ++t)
    cache.append(seq, 1, 1, k.data() + t * H * d, v.data() + t * H * d);
  EXPECT_EQ(cache.length(seq, 1), n);
  EXPECT_EQ(cache.length(seq, 0), 0u);
  std::vector<float> k_out(n * d), v_out(n * d);
  for (uint32_t h = 0; h < H; ++h) {
    cache.read_tokens(seq, 1, h, 0, n, k_out.data(), v_out.data());
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t c = 0; c < d; ++c) {
        const std::size_t in = (std::size_t{t} * H + h) * d + c;
        ASSERT_EQ(k_out[t * d + c], simd::f16_to_f32(simd::f32_to_f16(k[in])));
        ASSERT_EQ(v_out[t * d + c], simd::f16_to_f32(simd::f32_to_f16(v[in])));
      }
  }
}

// RoPE in float64 on adjacent pairs, the reference for the cache's float32 table.
void rope_reference(float* x, uint32_t n_heads, uint32_t d, uint64_t pos, double theta) {
  for (uint32_t h = 0; h < n_heads; ++h)
    for (uint32_t i = 0; i < d / 2; ++i) {
      const double angle = static_cast<double>(pos) * std::pow(theta, -2.0 * i / d);
      float* p = x + std::size_t{h} * d + 2 * i;
      const double a = p[0], b = p[1];
      p[0] = static_cast<float>(a * std::cos(angle) - b * std::sin(angle));
      p[1] = static_cast<float>(a * std::sin(angle) + b * std::cos(angle));
    }
}

TEST(KvCache, a_pre_rope_cache_stores_keys_rotated_at_their_positions) {
  const CacheGeometry g = small_geometry();
  KvCache cache(g, pre_rope_options(), test::kernels());
  const int32_t seq = cache.create_sequence();
  const uint32_t n = 41, H = g.n_kv_heads, d = g.head_dim;
  const auto k = test::random_floats(n * H * d, 3), v = test::random_floats(n * H * d, 4);
  cache.append(seq, 0, 25, k.data(), v.data());
  for (uint32_t t = 25; t < n; ++t)
    cache.append(seq, 0, 1, k.data() + t * H * d, v.data() + t * H * d);
  std::vector<float> rotated = k;
  for (uint32_t t = 0; t < n; ++t) rope_reference(rotated.data() + t * H * d, H, d, t, 50000.0);
  std::vector<float> k_out(n * d), k_pre(n * d), v_out(n * d);
  for (uint32_t h = 0; h < H; ++h) {
    cache.read_tokens(seq, 0, h, 0, n, k_out.data(), v_out.data());
    cache.read_tokens(seq, 0, h, 0, n, k_pre.data(), nullptr, KeyForm::pre_rope);
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t c = 0; c < d; ++c) {
        const std::size_t in = (std::size_t{t} * H + h) * d + c;
        // fp16 storage: half an ulp of rounding plus the float table's few ulps.
        ASSERT_NEAR(k_out[t * d + c], rotated[in], 1e-3 * (1.0 + std::fabs(rotated[in])))
            << "t=" << t << " h=" << h << " c=" << c;
        ASSERT_NEAR(k_pre[t * d + c], k[in], 2e-3 * (1.0 + std::fabs(k[in])));
        ASSERT_EQ(v_out[t * d + c], simd::f16_to_f32(simd::f32_to_f16(v[in])));  // V as given
      }
  }
}

// Keys another engine rotated (the model runner's append_kv) go into a pre_rope cache as they
// come, and read back before RoPE like the keys the cache rotated itself.
TEST(KvCache, a_pre_rope_cache_stores_keys_rotated_elsewhere_as_given) {
  const CacheGeometry g = small_geometry();
  KvCache cache(g, pre_rope_options(), test::kernels());
  const int32_t seq = cache.create_sequence();
  const uint32_t n = 35, H = g.n_kv_heads, d = g.head_dim;
  const auto k = test::random_floats(n * H * d, 13), v = test::random_floats(n * H * d, 14);
  std::vector<float> rotated = k;
  for (uint32_t t = 0; t < n; ++t) rope_reference(rotated.data() + t * H * d, H, d, t, 50000.0);
  cache.append(seq, 1, 19, rotated.data(), v.data(), KeyForm::post_rope);
  for (uint32_t t = 19; t < n; ++t)
    cache.append(seq, 1, 1, rotated.data() + t * H * d, v.data() + t * H * d, KeyForm::post_rope);
  std::vector<float> k_out(n * d), k_pre(n * d);
  for (uint32_t h = 0; h < H; ++h) {
    cache.read_tokens(seq, 1, h, 0, n, k_out.data(), nullptr);
    cache.read_tokens(seq, 1, h, 0, n, k_pre.data(), nullptr, KeyForm::pre_rope);
    for (uint32_t t = 0; t < n; ++t)
      for (uint32_t c = 0; c < d; ++c) {
        const std::size_t in = (std::size_t{t} * H + h) * d + c;
        ASSERT_EQ(k_out[t * d + c], simd::f16_to_f32(simd::f32_to_f16(rotated[in])))
            << "t=" << t << " h=" << h << " c=" << c;
        ASSERT_NEAR(k_pre[t * d + c], k[in], 2e-3 * (1.0 + std::fabs(k[in])));
      }
  }
  // A post_rope cache has no RoPE to apply: keys before it are refused, and nothing changes.
  KvCache post(g, CacheOptions{}, test::kernels());
  const int32_t other = post.create_sequence();
  test::expect_error([&] { post.append(other, 0, 1, k.data(), v.data(), KeyForm::pre_rope); },
                     Status::invalid_argument, "keys before RoPE");
  EXPECT_EQ(post.length(other, 0), 0u);
}

TEST(KvCache, pre_rope_keys_read_back_only_from_a_pre_rope_cache) {
  const CacheGeometry g = small_geometry();
  KvCache cache(g, CacheOptions{}, test::kernels());
  const int32_t seq = cache.create_sequence();
  const auto k = test::random_floats(g.n_kv_heads * g.head_dim, 5);
  cache.append(seq, 0, 1, k.data(), k.data());
  std::vector<float> out(g.head_dim);
  test::expect_error(
      [&] { cache.read_tokens(seq, 0, 0, 0, 1, out.data(), nullptr, KeyForm::pre_rope); },
      Status::invalid_argument, "pre-RoPE");
  CacheOptions bad;
  bad.key_form = KeyForm::pre_rope;
  bad.rope_theta = 0.0f;
  test::expect_error([&] { KvCache c(g, bad, test::kernels()); }, Status::invalid_argument,
                     "theta");
}

TEST(KvCache, pages_seal_once_when_they_fill_in_order) {
  const CacheGeometry g = small_geometry();
  KvCache cache(g, CacheOptions{}, test::kernels());
  Recorder recorder;
  cache.add_seal_listener(&recorder);
  const int32_t seq = cache.create_sequence();
  const uint32_t H = g.n_kv_heads, d = g.head_dim;
  const auto k = test::random_floats(50 * H * d, 3), v = test::random_floats(50 * H * d, 4);
  cache.append(seq, 0, 15, k.data(), v.data());
  EXPECT_TRUE(recorder.sealed.empty());  // the open page is never sealed
  cache.append(seq, 0, 1, k.data() + 15 * H * d, v.data() + 15 * H * d);
  ASSERT_EQ(recorder.sealed.size(), H);
  cache.append(seq, 0, 34, k.data() + 16 * H * d, v.data() + 16 * H * d);  // fills pages 1 and 2
  ASSERT_EQ(recorder.sealed.size(), 3 * H);
  for (uint32_t i = 0; i < recorder.sealed.size(); ++i) {
    const uint32_t page = i / H, head = i % H;
    EXPECT_EQ(recorder.sealed[i], std::make_tuple(seq, 0u, head, page));
    const float want =
        simd::f16_to_f32(simd::f32_to_f16(k[(std::size_t{page} * 16 * H + head) * d]));
    EXPECT_EQ(recorder.first_k[i], want);
  }
  cache.free_sequence(seq);
  EXPECT_EQ(recorder.freed, std::vector<int32_t>{seq});
  cache.remove_seal_listener(&recorder);
}

TEST(KvCache, freeing_a_sequence_returns_its_pages_and_its_id) {
  const CacheGeometry g = small_geometry();
  KvCache cache(g, CacheOptions{}, test::kernels());
  const int32_t a = cache.create_sequence(), b = cache.create_sequence();
  const auto k = test::random_floats(33 * g.n_kv_heads * g.head_dim, 5);
  cache.append(a, 0, 33, k.data(), k.data());
  cache.append(b, 1, 1, k.data(), k.data());
  EXPECT_EQ(cache.pool().in_use(), (3u + 1u) * g.n_kv_heads);
  cache.free_sequence(a);
  EXPECT_EQ(cache.pool().in_use(), 1u * g.n_kv_heads);
  EXPECT_FALSE(cache.has_sequence(a));
  EXPECT_EQ(cache.create_sequence(), a);
  EXPECT_EQ(cache.n_sequences(), 2u);
}

TEST(KvCache, an_append_past_capacity_fails_and_changes_nothing) {
  const CacheGeometry g = small_geometry();
  CacheOptions options;
  options.max_pages = 2 * g.n_kv_heads;  // two pages per head
  KvCache cache(g, options, test::kernels());
  const int32_t seq = cache.create_sequence();
  const auto k = test::random_floats(40 * g.n_kv_heads * g.head_dim, 6);
  cache.append(seq, 0, 20, k.data(), k.data());
  try {
    cache.append(seq, 0, 13, k.data(), k.data());  // needs a third page per head
    FAIL() << "append past capacity did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::capacity_exceeded);
  }
  EXPECT_EQ(cache.length(seq, 0), 20u);
  EXPECT_EQ(cache.pool().in_use(), 2u * g.n_kv_heads);
  cache.append(seq, 0, 12, k.data(), k.data());  // exactly fills the second page
  EXPECT_EQ(cache.length(seq, 0), 32u);
}

TEST(KvCache, bf16_storage_rounds_to_nearest_even) {
  CacheGeometry g = small_geometry();
  g.dtype = simd::Dtype::bf16;
  KvCache cache(g, CacheOptions{}, test::kernels());
  const int32_t seq = cache.create_sequence();
  const auto k = test::random_floats(g.n_kv_heads * g.head_dim, 7);
  cache.append(seq, 0, 1, k.data(), k.data());
  std::vector<float> out(g.head_dim);
  cache.read_tokens(seq, 0, 2, 0, 1, out.data(), nullptr);
  for (uint32_t c = 0; c < g.head_dim; ++c)
    EXPECT_EQ(out[c], simd::bf16_to_f32(simd::f32_to_bf16(k[2 * g.head_dim + c])));
}

TEST(KvCache, q8_storage_keeps_each_row_within_half_its_scale) {
  CacheGeometry g = small_geometry();
  g.dtype = simd::Dtype::q8;
  // Codes and a float32 scale per row: 2 * 16 * 64 + 8 * 16 bytes, 53% of fp16's slot.
  EXPECT_EQ(g.slot_bytes(), 2u * 16 * 64 + 8 * 16);
  EXPECT_EQ(g.slot_bytes() % 64, 0u);
  KvCache cache(g, CacheOptions{}, test::kernels());
  const int32_t seq = cache.create_sequence();
  const uint32_t n = 37, H = g.n_kv_heads, d = g.head_dim;  // a partial last page
  auto k = test::random_floats(n * H * d, 11, 4.0f), v = test::random_floats(n * H * d, 12);
  std::fill_n(v.begin() + (5 * H + 1) * d, d, 0.0f);  // a zero row reads back as zeros
  cache.append(seq, 0, 20, k.data(), v.data());
  for (uint32_t t = 20; t < n; ++t)
    cache.append(seq, 0, 1, k.data() + t * H * d, v.data() + t * H * d);
  std::vector<float> k_out(n * d), v_out(n * d);
  for (uint32_t h = 0; h < H; ++h) {
    cache.read_tokens(seq, 0, h, 0, n, k_out.data(), v_out.data());
    for (uint32_t t = 0; t < n; ++t)
      for (const auto& [in, out] : {std::pair{&k, &k_out}, std::pair{&v, &v_out}}) {
        const float* x = in->data() + (std::size_t{t} * H + h) * d;
        float absmax = 0.0f;
        for (uint32_t c = 0; c < d; ++c) absmax = std::max(absmax, std::fabs(x[c]));
        const float scale = absmax / 127.0f;
        for (uint32_t c = 0; c < d; ++c) {
          const float got = (*out)[t * d + c];
          // The code's rounding, and one float32 rounding of scale * code.
          ASSERT_LE(std::fabs(double(x[c]) - got), 0.5 * scale + 0x1p-24 * std::fabs(got))
              << "h=" << h << " t=" << t << " c=" << c;
          // Exactly scale times an integer in [-127, 127].
          if (scale > 0.0f) {
            const float code = std::nearbyint(got / scale);
            ASSERT_LE(std::fabs(code), 127.0f);
            ASSERT_EQ(got, scale * code);
          } else {
            ASSERT_EQ(got, 0.0f);
          }
        }
      }
  }
}

TEST(CacheGeometry, rejects_shapes_it_cannot_serve) {
  auto status_of = [](CacheGeometry g) {
    try {
      g.validate();
      return Status::ok;
    } catch (const Error& e) {
      return e.status();
    }
  };
  CacheGeometry g = small_geometry();
  EXPECT_EQ(status_of(g), Status::ok);
  g.head_dim = 96;
  EXPECT_EQ(status_of(g), Status::unsupported);
  g = small_geometry();
  g.page_tokens = 8;
  EXPECT_EQ(status_of(g), Status::unsupported);
  g = small_geometry();
  g.n_layers = 0;
  EXPECT_EQ(status_of(g), Status::invalid_argument);
  g = small_geometry();
  g.group_size = 65;
  EXPECT_EQ(status_of(g), Status::invalid_argument);
}
