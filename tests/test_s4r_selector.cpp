// The S4R selector through the cache and decode attention: the full-rank limit equals dense
// attention, the bytes held follow the memory model, the per-step selection count and the
// refusals; and, on the real model, the per-layer reconstruction error of its K/V.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "lib/attend/decode_attention.hpp"
#include "lib/core/error.hpp"
#include "lib/model/llama_model.hpp"
#include "lib/select/s4r_core.hpp"
#include "lib/select/s4r_selector.hpp"
#include "tests/model_handle.hpp"
#include "tests/test_util.hpp"

namespace kvsift {
namespace {

using select::Kind;
using select::Policy;
using select::S4rSelector;
using select::Selection;
using select::Selector;

CacheGeometry geometry(simd::Dtype dtype = simd::Dtype::f16) {
  CacheGeometry g;
  g.dtype = dtype;
  g.n_layers = 1;
  g.n_kv_heads = 2;
  g.group_size = 2;
  g.head_dim = 64;
  g.page_tokens = 16;
  return g;
}

CacheOptions pre_rope_options() {
  CacheOptions o;
  o.key_form = KeyForm::pre_rope;
  o.max_pages = 4096;
  return o;
}

Policy s4r_policy(double budget, double compression) {
  Policy p;
  p.kind = Kind::s4r;
  p.budget = budget;
  p.s4r.compression = compression;
  return p;
}

// Keys with the structure S4R relies on: a low-rank part shared across the sequence (rank 24 of
// D' = 128) plus small noise; values likewise with another basis.
std::vector<float> low_rank_rows(uint64_t n, uint32_t dim, uint32_t rank, uint32_t seed) {
  const auto basis = test::random_floats(std::size_t{rank} * dim, seed);
  const auto coeffs = test::random_floats(n * rank, seed + 1);
  const auto noise = test::random_floats(n * dim, seed + 2, 0.05f);
  std::vector<float> rows(n * dim);
  for (uint64_t t = 0; t < n; ++t)
    for (uint32_t c = 0; c < dim; ++c) {
      double x = noise[t * dim + c];
      for (uint32_t j = 0; j < rank; ++j) x += coeffs[t * rank + j] * basis[j * dim + c] / 4.0;
      rows[t * dim + c] = static_cast<float>(x);
    }
  return rows;
}

// One cache, one sequence of n tokens, a selector, and one step's attention through it.
struct Bench {
  CacheGeometry g = geometry();
  KvCache cache{g, pre_rope_options(), test::kernels()};
  int32_t seq = cache.create_sequence();
  std::unique_ptr<Selector> selector;
  Selection selection;
  DecodeAttention attention{g, 1, 2, test::kernels()};

  Bench(uint64_t n, const Policy& policy, uint32_t seed, simd::Dtype dtype = simd::Dtype::f16)
      : g(geometry(dtype)) {
    const uint32_t dim = g.n_kv_heads * g.head_dim;
    const auto k = low_rank_rows(n, dim, 24, seed), v = low_rank_rows(n, dim, 24, seed + 10);
    cache.append(seq, 0, static_cast<uint32_t>(n), k.data(), v.data());
    selector =
        Selector::create(policy, cache, 1, g.pages_for(n + 64), test::pool(2), test::kernels());
    selector->reserve_selection(selection);
  }
  // Appends one token, selects and attends with q; returns the output.
  std::vector<float> step(const std::vector<float>& q, uint32_t seed) {
    const auto kv = test::random_floats(2 * std::size_t{g.n_kv_heads} * g.head_dim, seed);
    cache.append(seq, 0, 1, kv.data(), kv.data() + g.n_kv_heads * g.head_dim);
    const select::SelectCall call{0, 1, &seq, q.data()};
    selector->prepare(call, selection);
    selector->select(call, selection);
    const PageLists lists = selection.lists();
    const RowChunks rows = selection.rows();
    std::vector<float> out(q.size(), std::nanf(""));
    AttendCall attend{0, 1, &seq, q.data(), out.data(), &lists, &rows};
    attention.validate(cache, attend);
    attention.run(cache, attend);
    return out;
  }
};

TEST(S4r, full_rank_with_every_token_reconstructed_equals_dense_attention) {
  // Dense reference: the same tokens in an uncompressed cache, attended over every page.
  Bench s4r(700, s4r_policy(1.0, 1.0), 40);
  Bench dense(700, Policy{}, 40);
  const uint64_t pages_before = s4r.cache.pool().in_use();
  for (uint32_t step = 0; step < 3; ++step) {
    const auto q =
        test::random_floats(std::size_t{s4r.g.n_query_heads()} * s4r.g.head_dim, 50 + step, 2.0f);
    const auto out = s4r.step(q, 60 + step), ref = dense.step(q, 60 + step);
    EXPECT_LT(test::relative_error(out.data(), ref.data(), out.size()), 2e-3) << "step " << step;
  }
  // Compressed: tokens [16, 688) in coefficients, their 42 pages per head back in the pool.
  const auto c = dynamic_cast<const S4rSelector&>(*s4r.selector).compressed(s4r.seq, 0);
  EXPECT_EQ(c.first, 16u);
  EXPECT_EQ(c.end, 688u);
  EXPECT_EQ(c.rank, 128u);
  EXPECT_EQ(s4r.cache.pool().in_use(), pages_before - 2 * 42);
  // Every compressed token came back as a row of each pair.
  EXPECT_EQ(s4r.selection.row_counts[0], 672u);
  EXPECT_EQ(s4r.selection.row_counts[1], 672u);
}

// A q8 cache: S4R fits its bases to the dequantized tokens, keeps fp16 coefficients, and its
// reconstructed rows are quantized again into q8 row chunks, so the output differs from dense
// attention over the q8 cache by about two quantizations' worth (measured: 2.6e-3 relative).
TEST(S4r, full_rank_on_a_q8_cache_stays_within_quantization_of_dense_attention) {
  Bench s4r(700, s4r_policy(1.0, 1.0), 40, simd::Dtype::q8);
  Bench dense(700, Policy{}, 40, simd::Dtype::q8);
  for (uint32_t step = 0; step < 2; ++step) {
    const auto q =
        test::random_floats(std::size_t{s4r.g.n_query_heads()} * s4r.g.head_dim, 80 + step, 2.0f);
    const auto out = s4r.step(q, 90 + step), ref = dense.step(q, 90 + step);
    EXPECT_LT(test::relative_error(out.data(), ref.data(), out.size()), 2e-2) << "step " << step;
  }
  EXPECT_EQ(s4r.selection.row_counts[0], 672u);
}

TEST(S4r, low_rank_reconstruction_stays_close_to_dense_on_low_rank_keys) {
  Bench s4r(2000, s4r_policy(1.0, 2.5), 70);
  Bench dense(2000, Policy{}, 70);
  const auto q = test::random_floats(std::size_t{s4r.g.n_query_heads()} * s4r.g.head_dim, 71);
  const auto out = s4r.step(q, 72), ref = dense.step(q, 72);
  // Rank 48 against rank-24 structure plus noise at 5% of it: the noise is what is lost.
  EXPECT_LT(test::relative_error(out.data(), ref.data(), out.size()), 0.05);
}

TEST(S4r, each_step_reconstructs_the_budget_less_the_exact_tokens_recent_ones_included) {
  const uint64_t n = 1000;
  Bench b(n, s4r_policy(0.2, 2.5), 80);
  const auto q = test::random_floats(std::size_t{b.g.n_query_heads()} * b.g.head_dim, 81);
  b.step(q, 82);
  // 1001 tokens: budget floor(0.2 * 1001) = 200; exact: the sink page (16) and the tokens from
  // 992 on (9); 175 reconstructed, the last 32 compressed ones among them.
  EXPECT_EQ(b.selection.row_counts[0], 175u);
  const uint32_t page_ids[] = {0, 62};
  ASSERT_EQ(b.selection.offsets[1], 2u);
  EXPECT_TRUE(std::equal(page_ids, page_ids + 2, b.selection.page_ids.data()));
  EXPECT_EQ(b.selection.offsets[2], 4u);
}

TEST(S4r, the_bytes_held_follow_the_memory_model) {
  for (const double compression : {2.5, 5.0}) {
    const uint64_t n = 4096 + 5;
    Bench b(n, s4r_policy(0.1, compression), 90);
    const uint64_t dense_bytes = (n + 1) * b.g.n_kv_heads * b.g.token_bytes();
    const auto q = test::random_floats(std::size_t{b.g.n_query_heads()} * b.g.head_dim, 91);
    b.step(q, 92);
    const uint64_t held =
        b.cache.pool().in_use() * b.cache.pool().slot_bytes() + b.selector->held_bytes();
    const auto c = dynamic_cast<const S4rSelector&>(*b.selector).compressed(b.seq, 0);
    const uint32_t dim = b.g.n_kv_heads * b.g.head_dim;
    const double model =
        select::s4r::memory_ratio(dim, c.end - c.first, c.first, b.g.group_size, 32, c.rank);
    const double measured = static_cast<double>(held) / static_cast<double>(dense_bytes);
    std::printf("s4r compression %.1f: rank %u, held %.4f of dense, memory model %.4f\n",
                compression, c.rank, measured, model);
    // The model covers the sinks and the compressed span, [0, end); besides it the cache holds
    // the partial last page (all of its 16 slots), and the bases and the query window are kept in
    // float32 where the model counts fp16 elements.
    const double token_bytes = static_cast<double>(b.g.n_kv_heads) * b.g.token_bytes();
    const double expected = model * static_cast<double>(c.end) * token_bytes + 16 * token_bytes +
                            2.0 * dim * c.rank * 2 + 32.0 * b.g.group_size * c.rank * 2;
    EXPECT_NEAR(measured, expected / static_cast<double>(dense_bytes), 1e-4);
    EXPECT_LE(measured, 1.0 / compression + 0.02);
  }
}

// Latent rows (SelectCall::latent_rows, what the decode engine asks for when its backend
// reconstructs on a device): the same choice as a selection of values over an identical cache, the
// rows' chunks left unwritten, units that name the bases, coefficients and positions, and a host
// reconstruction of them (the device's reference) equal to the values byte for byte. The CPU's
// attention refuses latent rows.
TEST(S4r, latent_rows_name_the_same_choice_and_reconstruct_to_the_same_rows) {
  for (const bool per_head : {false, true}) {
    SCOPED_TRACE(per_head ? "per-head bases" : "per-layer bases");
    Policy policy = s4r_policy(0.2, 2.5);
    policy.s4r.per_head_bases = per_head;
    Bench values(1000, policy, 120), latent(1000, policy, 120);
    const auto q =
        test::random_floats(std::size_t{values.g.n_query_heads()} * values.g.head_dim, 121);
    values.step(q, 122);
    const auto kv =
        test::random_floats(2 * std::size_t{latent.g.n_kv_heads} * latent.g.head_dim, 122);
    latent.cache.append(latent.seq, 0, 1, kv.data(), kv.data() + latent.g.n_kv_heads * 64);
    select::SelectCall call{0, 1, &latent.seq, q.data()};
    call.latent_rows = true;
    Selection& sel = latent.selection;
    std::fill(sel.row_chunks.begin(), sel.row_chunks.end(), std::byte{0x5a});
    latent.selector->prepare(call, sel);
    std::fill(sel.row_chunks.begin(), sel.row_chunks.end(), std::byte{0x5a});
    latent.selector->select(call, sel);
    ASSERT_TRUE(sel.latent);
    EXPECT_FALSE(values.selection.latent);
    const uint32_t pairs = latent.g.n_kv_heads, hpu = per_head ? 1 : pairs;
    EXPECT_EQ(sel.heads_per_unit, hpu);
    const uint32_t chunks = sel.chunk_offsets[pairs];
    ASSERT_EQ(chunks, values.selection.chunk_offsets[pairs]);
    ASSERT_GT(chunks, 0u);
    for (uint32_t pair = 0; pair < pairs; ++pair)
      ASSERT_EQ(sel.row_counts[pair], values.selection.row_counts[pair]);
    const std::size_t rows = std::size_t{chunks} * latent.g.page_tokens;
    EXPECT_TRUE(std::equal(sel.row_tokens.begin(), sel.row_tokens.begin() + rows,
                           values.selection.row_tokens.begin()));
    auto* s4r = dynamic_cast<S4rSelector*>(latent.selector.get());
    ASSERT_NE(s4r, nullptr);
    const S4rSelector::Compressed c = s4r->compressed(latent.seq, 0);
    for (uint32_t u = 0; u < pairs / hpu; ++u) {
      const LatentUnit& unit = sel.latent_units[u];
      EXPECT_NE(unit.basis_id, 0u);
      EXPECT_EQ(unit.rank, c.rank);
      EXPECT_EQ(unit.first, c.first);
      EXPECT_EQ(unit.n_tokens, c.end - c.first);
      EXPECT_EQ(unit.positions, sel.row_tokens.data() +
                                    std::size_t{sel.chunk_offsets[u * hpu]} * latent.g.page_tokens);
      ASSERT_NE(unit.key_coeffs, nullptr);
      ASSERT_NE(unit.value_basis, nullptr);
      if (u > 0) {
        EXPECT_NE(unit.basis_id, sel.latent_units[u - 1].basis_id);
      }
    }
    EXPECT_EQ(sel.row_chunks[0], std::byte{0x5a}) << "latent rows were reconstructed anyway";

    std::vector<float> out(q.size());
    const PageLists lists = sel.lists();
    const RowChunks chunk_rows = sel.rows();
    const LatentRows latent_rows = sel.latent_rows();
    AttendCall attend{0, 1, &latent.seq, q.data(), out.data(), &lists, &chunk_rows, &latent_rows};
    test::expect_error([&] { latent.attention.validate(latent.cache, attend); },
                       Status::unsupported, "latent rows");

    s4r->reconstruct_rows(call, sel);
    const simd::PageLayout layout = latent.g.layout();
    for (uint32_t pair = 0; pair < pairs; ++pair)
      for (uint32_t r = 0; r < sel.row_counts[pair]; ++r) {
        const std::size_t chunk = sel.chunk_offsets[pair] + r / latent.g.page_tokens;
        const uint32_t t = r % latent.g.page_tokens;
        const std::byte* ours = layout.slot(sel.row_chunks.data(), chunk);
        const std::byte* theirs = layout.slot(values.selection.row_chunks.data(), chunk);
        ASSERT_EQ(std::memcmp(layout.key(ours, t), layout.key(theirs, t), layout.row_bytes()), 0)
            << "pair " << pair << " row " << r;
        ASSERT_EQ(std::memcmp(layout.value(ours, t), layout.value(theirs, t), layout.row_bytes()),
                  0)
            << "pair " << pair << " row " << r;
      }
  }
}

TEST(S4r, refusals_are_clear_errors) {
  const CacheGeometry g = geometry();
  KvCache post(g, CacheOptions{}, test::kernels());
  test::expect_error(
      [&] { Selector::create(s4r_policy(0.1, 2.5), post, 1, 64, test::pool(1), test::kernels()); },
      Status::invalid_argument, "pre-RoPE");
  Bench b(800, s4r_policy(0.1, 2.5), 100);
  const auto q = test::random_floats(std::size_t{g.n_query_heads()} * g.head_dim, 101);
  b.step(q, 102);
  test::expect_error([&] { b.cache.fork_sequence(b.seq); }, Status::unsupported, "compressed");
  test::expect_error(
      [&] { Selector::create(Policy{}, b.cache, 1, 64, test::pool(1), test::kernels()); },
      Status::invalid_argument, "free them");
  std::vector<float> out(q.size());
  AttendCall dense{0, 1, &b.seq, q.data(), out.data(), nullptr, nullptr};
  test::expect_error([&] { b.attention.validate(b.cache, dense); }, Status::invalid_argument,
                     "released");
  std::vector<float> k(g.head_dim);
  test::expect_error([&] { b.cache.read_tokens(b.seq, 0, 0, 100, 1, k.data(), nullptr); },
                     Status::invalid_argument, "released");
  Policy bad = s4r_policy(0.1, 0.5);
  test::expect_error([&] { bad.validate(); }, Status::invalid_argument, "compression");
}

// Through the model runner: S4R at full rank with every token reconstructed decodes the same
// greedy tokens as dense, and Louver decodes (its rows grow per step inside the runner's call).
TEST(S4r, the_model_runner_decodes_through_token_level_selectors) {
  if (test::model_path() == nullptr) GTEST_SKIP() << "KVSIFT_MODEL is not set (make test sets it)";
  model::ModelOptions options;
  options.n_ctx = 512;
  auto m = model::LlamaModel::load(test::model_path(), options);
  std::string text;
  for (int i = 0; i < 12; ++i)
    text += "Note " + std::to_string(i) + ": the lamp was lit at " + std::to_string(17 + i % 5) +
            " o'clock and the log was signed. ";
  const std::vector<int32_t> tokens = m->tokenizer().encode(text, false);
  auto greedy = [&](const Policy& policy, uint32_t steps) {
    m->set_selector(Policy{});
    const int32_t seq = m->create_sequence();
    m->prefill(seq, tokens, nullptr, nullptr, nullptr);
    m->set_selector(policy);
    std::vector<int32_t> out;
    for (uint32_t step = 0; step < steps; ++step) {
      const auto logits = m->logits(seq);
      const int32_t next =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      out.push_back(next);
      m->decode({&seq, 1}, {&next, 1});
    }
    m->free_sequence(seq);
    return out;
  };
  const auto dense = greedy(Policy{}, 3);
  EXPECT_EQ(greedy(s4r_policy(1.0, 1.0), 3), dense);
  Policy louver;
  louver.kind = Kind::louver;
  louver.budget = 0.3;
  EXPECT_EQ(greedy(louver, 3).size(), 3u);
  EXPECT_GT(m->stats().last_step.tokens_read, 0u);
}

// The real model's keys and values before RoPE, per layer: the relative reconstruction error of
// the compressed span at 2.5x and 5x (printed; bounded loosely, since it is a property of the
// model), and the latent relevance keeps the model's own top tokens.
TEST(S4r, real_model_kv_reconstruction_error_per_layer) {
  if (test::model_path() == nullptr) GTEST_SKIP() << "KVSIFT_MODEL is not set (make test sets it)";
  model::ModelOptions options;
  options.n_ctx = 1024;
  auto m = model::LlamaModel::load(test::model_path(), options);
  std::string text;
  for (int i = 0; i < 30; ++i)
    text += "Entry " + std::to_string(i) + ": the keeper logged wind, tide and " +
            std::to_string(i * 7 % 13) + " ships passing the northern light. ";
  const std::vector<int32_t> tokens = m->tokenizer().encode(text, false);
  const int32_t seq = m->create_sequence();
  m->prefill(seq, tokens, nullptr, nullptr, nullptr);
  const KvCache& cache = m->cache();
  const CacheGeometry& g = cache.geometry();
  const uint32_t dim = g.n_kv_heads * g.head_dim;
  const uint64_t first = g.page_tokens, n = tokens.size() / g.page_tokens * g.page_tokens - first;
  std::vector<float> head(n * g.head_dim), rows(n * dim), part(n * dim), back(n * dim);
  std::vector<uint16_t> coeffs;
  std::vector<uint32_t> ids(n);
  for (uint32_t t = 0; t < n; ++t) ids[t] = t;
  // Squared error and squared norm of a rank-r fit of columns [c0, c0 + width) of `rows`, with
  // the rank the compression target gives that width (one basis per layer: width = D'; per KV
  // head: width = head_dim).
  auto fit = [&](uint32_t c0, uint32_t width, double compression, double& err, double& norm) {
    for (uint64_t t = 0; t < n; ++t)
      std::copy_n(rows.data() + t * dim + c0, width, part.data() + t * width);
    const uint32_t rank = select::s4r::solve_rank(width, n, static_cast<uint32_t>(first),
                                                  g.group_size, 32, compression);
    const auto sample = select::s4r::hybrid_sample(
        0, n, std::max<uint64_t>(rank, static_cast<uint64_t>(n / compression)));
    const auto basis =
        select::s4r::fit_basis(part.data(), n, width, width, sample.data(), sample.size(), rank);
    coeffs.resize(n * rank);
    select::s4r::project(part.data(), n, width, basis, coeffs.data(), g.dtype, test::kernels());
    std::vector<float> workspace(select::s4r::reconstruct_workspace_floats(basis));
    select::s4r::reconstruct(coeffs.data(), g.dtype, basis, ids.data(), static_cast<uint32_t>(n),
                             back.data(), test::kernels(), workspace.data());
    for (std::size_t i = 0; i < n * width; ++i) {
      err += (double(back[i]) - part[i]) * (double(back[i]) - part[i]);
      norm += double(part[i]) * part[i];
    }
  };
  for (const double compression : {2.5, 5.0}) {
    double worst_k = 0.0, worst_v = 0.0;
    for (uint32_t layer = 0; layer < g.n_layers; ++layer) {
      double by_layer[2], by_head[2];
      for (const bool keys : {true, false}) {
        for (uint32_t h = 0; h < g.n_kv_heads; ++h) {
          cache.read_tokens(seq, layer, h, first, n, keys ? head.data() : nullptr,
                            keys ? nullptr : head.data(), KeyForm::pre_rope);
          for (uint64_t t = 0; t < n; ++t)
            std::copy_n(head.data() + t * g.head_dim, g.head_dim,
                        rows.data() + t * dim + std::size_t{h} * g.head_dim);
        }
        double err = 0.0, norm = 0.0;
        fit(0, dim, compression, err, norm);
        by_layer[keys ? 0 : 1] = std::sqrt(err / norm);
        err = norm = 0.0;
        for (uint32_t h = 0; h < g.n_kv_heads; ++h)
          fit(h * g.head_dim, g.head_dim, compression, err, norm);
        by_head[keys ? 0 : 1] = std::sqrt(err / norm);
      }
      std::printf("s4r %.1fx layer %2u: K error %.4f (per-head bases %.4f), V error %.4f (%.4f)\n",
                  compression, layer, by_layer[0], by_head[0], by_layer[1], by_head[1]);
      worst_k = std::max({worst_k, by_layer[0], by_head[0]});
      worst_v = std::max({worst_v, by_layer[1], by_head[1]});
    }
    // Loose: a low-rank fit of real K/V keeps most of the energy; a broken pipeline (RoPE left
    // in, wrong layout) would not.
    EXPECT_LT(worst_k, compression < 3.0 ? 0.35 : 0.5) << compression;
    EXPECT_LT(worst_v, compression < 3.0 ? 0.6 : 0.8) << compression;
  }
}

}  // namespace
}  // namespace kvsift
