// Decode attention through the cache, against the float64 reference, on ragged batches, both
// thread counts, every ISA, dense and page-list forms, and one 64K-token context.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "lib/attend/decode_attention.hpp"
#include "lib/cache/kv_cache.hpp"
#include "test_util.hpp"
#include "tests/reference_attention.hpp"

using namespace kvsift;

namespace {

struct FilledCache {
  CacheGeometry geometry;
  const simd::Kernels& kernels;  // the level's, as a handle that asked for it would get
  KvCache cache;
  std::vector<int32_t> seqs;
  std::vector<std::vector<float>> raw_k, raw_v;  // per sequence [tokens, H, d], as appended

  FilledCache(const CacheGeometry& g, simd::Level isa, const std::vector<uint64_t>& lengths,
              uint32_t seed)
      : geometry(g), kernels(simd::kernels_for(simd::resolve_level(isa))),
        cache(g, options(), kernels) {
    for (uint64_t n : lengths) {
      const int32_t seq = cache.create_sequence();
      seqs.push_back(seq);
      raw_k.push_back(test::random_floats(n * g.n_kv_heads * g.head_dim, ++seed, 2.0f));
      raw_v.push_back(test::random_floats(n * g.n_kv_heads * g.head_dim, ++seed));
      if (n > 0)
        cache.append(seq, 0, static_cast<uint32_t>(n), raw_k.back().data(), raw_v.back().data());
    }
  }
  static CacheOptions options() {
    CacheOptions o;
    o.max_pages = 1 << 16;
    return o;
  }

  // Reference output for sequence i over the tokens of the listed pages (all when null), from
  // the stored values (stored == true) or from the float inputs before rounding.
  std::vector<double> reference(std::size_t i, const std::vector<float>& q,
                                const std::vector<std::vector<uint32_t>>* pages,
                                bool stored) const {
    const uint32_t H = geometry.n_kv_heads, G = geometry.group_size, d = geometry.head_dim;
    const uint32_t B = geometry.page_tokens;
    const uint64_t n = cache.length(seqs[i], 0);
    std::vector<double> out(std::size_t{H} * G * d);
    std::vector<float> k_all(n * d), v_all(n * d);
    for (uint32_t h = 0; h < H; ++h) {
      if (stored) {
        cache.read_tokens(seqs[i], 0, h, 0, n, k_all.data(), v_all.data());
      } else {
        for (uint64_t t = 0; t < n; ++t)
          for (uint32_t c = 0; c < d; ++c) {
            k_all[t * d + c] = raw_k[i][(t * H + h) * d + c];
            v_all[t * d + c] = raw_v[i][(t * H + h) * d + c];
          }
      }
      std::vector<float> ks, vs;
      for (uint64_t t = 0; t < n; ++t) {
        const uint32_t page = static_cast<uint32_t>(t / B);
        if (pages) {
          const auto& list = (*pages)[h];
          if (std::find(list.begin(), list.end(), page) == list.end()) continue;
        }
        ks.insert(ks.end(), k_all.begin() + t * d, k_all.begin() + (t + 1) * d);
        vs.insert(vs.end(), v_all.begin() + t * d, v_all.begin() + (t + 1) * d);
      }
      reference_attention(q.data() + std::size_t{h} * G * d, ks.data(), vs.data(), ks.size() / d, G,
                          d, out.data() + std::size_t{h} * G * d);
    }
    return out;
  }
};

CacheGeometry geometry(uint32_t H, uint32_t G, uint32_t d, uint32_t B = 16) {
  CacheGeometry g;
  g.n_kv_heads = H;
  g.group_size = G;
  g.head_dim = d;
  g.page_tokens = B;
  return g;
}

class DecodeAttentionIsa : public test::IsaTest {};

}  // namespace

TEST_P(DecodeAttentionIsa, ragged_batches_match_float64_on_one_and_two_threads) {
  const std::vector<uint64_t> lengths = {1, 3, 7, 17, 300, 1000};
  for (const CacheGeometry& g :
       {geometry(2, 3, 64), geometry(2, 4, 128), geometry(1, 1, 256, 64)}) {
    const FilledCache s(g, GetParam(), lengths, 10);
    ASSERT_EQ(s.kernels.level, GetParam());
    const std::size_t per_seq = std::size_t{g.n_query_heads()} * g.head_dim;
    const auto q = test::random_floats(lengths.size() * per_seq, 99);
    for (int threads : {1, 2}) {
      DecodeAttention attention(g, 8, threads, s.kernels);
      std::vector<float> out(q.size(), -1.0f);
      AttendCall call;
      call.n_seqs = static_cast<uint32_t>(s.seqs.size());
      call.seq_ids = s.seqs.data();
      call.q = q.data();
      call.out = out.data();
      attention.validate(s.cache, call);
      attention.run(s.cache, call);
      for (std::size_t i = 0; i < lengths.size(); ++i) {
        const std::vector<float> qi(q.begin() + i * per_seq, q.begin() + (i + 1) * per_seq);
        const auto ref = s.reference(i, qi, nullptr, true);
        SCOPED_TRACE(testing::Message() << "d=" << g.head_dim << " G=" << g.group_size
                                        << " threads=" << threads << " tokens=" << lengths[i]);
        EXPECT_LT(test::relative_error(out.data() + i * per_seq, ref.data(), per_seq), 1e-5);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllIsas, DecodeAttentionIsa, ::testing::ValuesIn(simd::kLevels),
                         test::isa_test_name);

TEST(DecodeAttention, page_lists_attend_exactly_the_listed_pages) {
  const CacheGeometry g = geometry(2, 4, 128);
  const FilledCache s(g, simd::Level::avx512, {16 * 40 + 9, 16 * 3}, 20);
  const std::size_t per_seq = std::size_t{g.n_query_heads()} * g.head_dim;
  const auto q = test::random_floats(2 * per_seq, 21);
  // Sequence 0: sink + a scattered middle + the open page per head; sequence 1: one head empty.
  const std::vector<std::vector<uint32_t>> lists0 = {{0, 5, 6, 17, 39, 40}, {0, 1, 40}};
  const std::vector<std::vector<uint32_t>> lists1 = {{2}, {}};
  std::vector<uint32_t> offsets = {0}, ids;
  for (const auto* lists : {&lists0, &lists1})
    for (const auto& list : *lists) {
      ids.insert(ids.end(), list.begin(), list.end());
      offsets.push_back(static_cast<uint32_t>(ids.size()));
    }
  const PageLists pages{offsets.data(), ids.data()};
  DecodeAttention attention(g, 4, 2, s.kernels);
  std::vector<float> out(q.size(), -1.0f);
  AttendCall call;
  call.n_seqs = 2;
  call.seq_ids = s.seqs.data();
  call.q = q.data();
  call.out = out.data();
  call.pages = &pages;
  attention.validate(s.cache, call);
  attention.run(s.cache, call);
  const std::vector<float> q0(q.begin(), q.begin() + per_seq), q1(q.begin() + per_seq, q.end());
  const auto ref0 = s.reference(0, q0, &lists0, true);
  EXPECT_LT(test::relative_error(out.data(), ref0.data(), per_seq), 1e-5);
  const auto ref1 = s.reference(1, q1, &lists1, true);  // the empty head's reference is zeros
  EXPECT_LT(test::relative_error(out.data() + per_seq, ref1.data(), per_seq), 1e-5);
  for (std::size_t c = per_seq / 2; c < per_seq; ++c) ASSERT_EQ(out[per_seq + c], 0.0f);
  // 6 + 3 + 1 pages; tokens: full pages but the open one (9 tokens), twice in sequence 0.
  EXPECT_EQ(attention.last_stats().pages_read, 10u);
  EXPECT_EQ(attention.last_stats().tokens_read, (5 + 2) * 16u + 2 * 9u + 16u);
  EXPECT_EQ(attention.last_stats().bytes_read,
            attention.last_stats().tokens_read * g.token_bytes());
}

// Rows a selector gathered (here: scattered tokens of the middle pages, copied in storage form)
// are attended with the listed pages as one softmax, on every ISA.
TEST(DecodeAttention, row_chunks_attend_with_the_pages_as_one_softmax) {
  const CacheGeometry g = geometry(2, 4, 64);
  const uint32_t H = g.n_kv_heads, G = g.group_size, d = g.head_dim, B = g.page_tokens;
  for (simd::Level isa : test::supported_isas()) {
    const FilledCache s(g, isa, {B * 20 + 5}, 30);
    const uint64_t n = B * 20 + 5;
    const auto q = test::random_floats(std::size_t{H} * G * d, 31);
    // Pages 0 and the open page 20 for both heads; rows: head 0 takes 37 scattered tokens of
    // pages 1..19 (three chunks, the last partial), head 1 takes none.
    const std::vector<uint32_t> offsets = {0, 2, 4}, ids = {0, 20, 0, 20};
    const PageLists pages{offsets.data(), ids.data()};
    std::vector<uint64_t> tokens;
    for (uint64_t t = B + 3; tokens.size() < 37; t += 7) tokens.push_back(t);
    const uint32_t row_counts[2] = {37, 0};
    const uint32_t chunk_offsets[3] = {0, 3, 3};
    std::vector<std::byte> chunks(3 * g.slot_bytes(), std::byte{0xff});  // NaN padding rows
    const std::size_t row_bytes = std::size_t{d} * sizeof(uint16_t);
    const uint32_t* table = s.cache.page_table(s.seqs[0], 0, 0);
    for (std::size_t r = 0; r < tokens.size(); ++r) {
      const std::byte* page = s.cache.pool().slot(table[tokens[r] / B]);
      std::byte* chunk = chunks.data() + (r / B) * g.slot_bytes();
      const std::size_t from = (tokens[r] % B) * row_bytes, to = (r % B) * row_bytes;
      std::memcpy(chunk + to, page + from, row_bytes);  // K
      std::memcpy(chunk + g.slot_bytes() / 2 + to, page + g.slot_bytes() / 2 + from, row_bytes);
    }
    const RowChunks rows{chunks.data(), chunk_offsets, row_counts};
    DecodeAttention attention(g, 1, 2, s.kernels);
    std::vector<float> out(q.size(), -1.0f);
    AttendCall call;
    call.n_seqs = 1;
    call.seq_ids = s.seqs.data();
    call.q = q.data();
    call.out = out.data();
    call.pages = &pages;
    call.rows = &rows;
    attention.validate(s.cache, call);
    attention.run(s.cache, call);
    std::vector<double> ref(q.size());
    std::vector<float> k_all(n * d), v_all(n * d);
    for (uint32_t h = 0; h < H; ++h) {
      s.cache.read_tokens(s.seqs[0], 0, h, 0, n, k_all.data(), v_all.data());
      std::vector<float> ks, vs;
      auto take = [&](uint64_t t) {
        ks.insert(ks.end(), k_all.begin() + t * d, k_all.begin() + (t + 1) * d);
        vs.insert(vs.end(), v_all.begin() + t * d, v_all.begin() + (t + 1) * d);
      };
      for (uint64_t t = 0; t < B; ++t) take(t);
      for (uint64_t t = 20 * B; t < n; ++t) take(t);
      if (h == 0)
        for (uint64_t t : tokens) take(t);
      reference_attention(q.data() + std::size_t{h} * G * d, ks.data(), vs.data(), ks.size() / d, G,
                          d, ref.data() + std::size_t{h} * G * d);
    }
    EXPECT_LT(test::relative_error(out.data(), ref.data(), out.size()), 1e-5)
        << simd::level_name(isa);
    EXPECT_EQ(attention.last_stats().tokens_read, 2 * (B + 5) + 37u);
    // A chunk count that does not match the rows is refused.
    const uint32_t bad_offsets[3] = {0, 2, 2};
    const RowChunks bad{chunks.data(), bad_offsets, row_counts};
    call.rows = &bad;
    test::expect_error([&] { attention.validate(s.cache, call); }, Status::invalid_argument,
                       "37 rows in 2 chunks");
  }
}

TEST(DecodeAttention, split_count_does_not_change_the_result_beyond_rounding) {
  const CacheGeometry g = geometry(1, 4, 128);
  const FilledCache s(g, simd::Level::avx512, {16 * 500 + 3}, 30);
  const auto q = test::random_floats(4 * 128, 31);
  std::vector<float> one(q.size()), many(q.size());
  AttendCall call;
  call.n_seqs = 1;
  call.seq_ids = s.seqs.data();
  call.q = q.data();
  // 1 thread: 4 splits; 2 threads: 8 splits
  DecodeAttention single(g, 1, 1, s.kernels), split(g, 1, 2, s.kernels);
  call.out = one.data();
  single.run(s.cache, call);
  call.out = many.data();
  split.run(s.cache, call);
  EXPECT_LT(test::relative_error(many.data(), one.data(), q.size()), 1e-6);
}

TEST(DecodeAttention, an_empty_sequence_gives_zeros) {
  const CacheGeometry g = geometry(2, 2, 64);
  const FilledCache s(g, simd::Level::avx512, {0, 5}, 40);
  const auto q = test::random_floats(2 * 2 * 2 * 64, 41);
  std::vector<float> out(q.size(), -1.0f);
  AttendCall call;
  call.n_seqs = 2;
  call.seq_ids = s.seqs.data();
  call.q = q.data();
  call.out = out.data();
  DecodeAttention attention(g, 2, 2, s.kernels);
  attention.run(s.cache, call);
  for (std::size_t c = 0; c < q.size() / 2; ++c) ASSERT_EQ(out[c], 0.0f);
  EXPECT_NE(out[q.size() / 2], 0.0f);
}

// fp16 storage error against the unrounded inputs, at 64K tokens (the issue asks < 1e-3).
TEST(DecodeAttention, sixty_four_thousand_tokens_stay_within_fp16_storage_error) {
  const CacheGeometry g = geometry(1, 4, 128);
  const uint64_t n = 65536 + 7;
  const FilledCache s(g, simd::Level::avx512, {n}, 50);
  const auto q = test::random_floats(4 * 128, 51);
  std::vector<float> out(q.size());
  AttendCall call;
  call.n_seqs = 1;
  call.seq_ids = s.seqs.data();
  call.q = q.data();
  call.out = out.data();
  DecodeAttention attention(g, 1, 2, s.kernels);
  attention.validate(s.cache, call);
  attention.run(s.cache, call);
  const double arithmetic =
      test::relative_error(out.data(), s.reference(0, q, nullptr, true).data(), q.size());
  const double storage =
      test::relative_error(out.data(), s.reference(0, q, nullptr, false).data(), q.size());
  RecordProperty("relative_error_vs_stored_fp16", std::to_string(arithmetic));
  RecordProperty("relative_error_vs_fp32_inputs", std::to_string(storage));
  std::printf(
      "64K tokens: relative error %.3g against float64 on the stored values, %.3g against "
      "the unrounded fp32 inputs\n",
      arithmetic, storage);
  EXPECT_LT(arithmetic, 1e-5);
  EXPECT_LT(storage, 1e-3);
  EXPECT_EQ(attention.last_stats().tokens_read, n);
}
