// The offload step (lib/offload) against the CPU kernel on the same selections: decode steps with
// appends over a pinned cache, a 5% LOCKS or oracle selection made by two selectors of the same
// policy (one per mode), and per call: the same pages chosen, the pages the device attended equal
// to the selection's host pages byte for byte, the output within 1e-3 of DecodeAttention's (or the
// CPU kernel's own bound where it attends with integer products: tests/test_util.hpp). Skips
// without a CUDA build or a usable device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "gpu/host_memory.hpp"
#include "kvsift/kvsift.h"
#include "lib/attend/decode_attention.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/core/error.hpp"
#include "lib/engine/decode_engine.hpp"
#include "lib/model/llama_model.hpp"
#include "lib/offload/offload_attention.hpp"
#include "lib/select/s4r_selector.hpp"
#include "lib/select/selector.hpp"
#include "simd/half.hpp"
#include "tests/gpu_skip.hpp"
#include "tests/model_handle.hpp"
#include "tests/test_util.hpp"

namespace kvsift {
namespace {

using select::Kind;
using select::Selection;
using select::Selector;

struct Case {
  const char* name;
  Kind kind;
  simd::Dtype dtype;
  uint32_t n_layers, n_kv_heads, group_size;
  uint64_t context;  // prompt tokens per sequence
  uint32_t batch, steps;
  uint64_t max_pages_per_pair;  // the device cache's pages per pair; 0: a mirror of the whole pool
  uint32_t free_at_step;  // replace the last sequence by a new one before this step (0: never)
};

// Keys: Gaussian plus a per-page gain along one direction, so pages differ in mass and a drifting
// query keeps choosing many of the same pages (hits) and some new ones (misses).
class Model {
 public:
  Model(const Case& c, uint32_t seed, KeyForm key_form = KeyForm::post_rope) : c_(c), seed_(seed) {
    geometry_.n_layers = c.n_layers;
    geometry_.n_kv_heads = c.n_kv_heads;
    geometry_.group_size = c.group_size;
    geometry_.head_dim = 128;
    geometry_.page_tokens = 16;
    geometry_.dtype = c.dtype;
    CacheOptions options;
    options.pinned = true;
    options.key_form = key_form;
    options.max_pages = max_pages() * c.n_layers * c.n_kv_heads * (c.batch + 1);
    cache_ = std::make_unique<KvCache>(geometry_, options, test::kernels());
    dir_ = test::random_floats(geometry_.head_dim, seed + 1);
    for (uint32_t s = 0; s < c.batch; ++s) seq_ids_.push_back(new_sequence());
    q_ = test::random_floats(c.batch * geometry_.n_query_heads() * geometry_.head_dim, seed + 2,
                             1.5f);
  }

  uint64_t max_pages() const { return geometry_.pages_for(c_.context + c_.steps) + 1; }

  int32_t new_sequence() {
    const int32_t id = cache_->create_sequence();
    for (uint32_t layer = 0; layer < c_.n_layers; ++layer) append(id, layer, c_.context);
    return id;
  }

  void append(int32_t id, uint32_t layer, uint64_t n) {
    const uint32_t H = geometry_.n_kv_heads, d = geometry_.head_dim, B = geometry_.page_tokens;
    const uint64_t first = cache_->length(id, layer);
    std::vector<float> k = test::random_floats(n * H * d, seed_ + 100 + next_++);
    const std::vector<float> v = test::random_floats(n * H * d, seed_ + 100 + next_++);
    const std::vector<float> gain = test::random_floats((first + n) / B + 1, seed_ + 7, 1.5f);
    for (uint64_t t = 0; t < n; ++t)
      for (uint32_t h = 0; h < H; ++h)
        for (uint32_t i = 0; i < d; ++i) k[(t * H + h) * d + i] += gain[(first + t) / B] * dir_[i];
    cache_->append(id, layer, static_cast<uint32_t>(n), k.data(), v.data());
  }

  // The next step's queries: most of the last one plus some new direction.
  void drift() {
    const std::vector<float> fresh = test::random_floats(q_.size(), seed_ + 5000 + next_++, 1.5f);
    for (std::size_t i = 0; i < q_.size(); ++i) q_[i] = 0.85f * q_[i] + 0.5f * fresh[i];
  }

  const CacheGeometry& geometry() const { return geometry_; }
  KvCache& cache() { return *cache_; }
  std::vector<int32_t>& seq_ids() { return seq_ids_; }
  const std::vector<float>& q() const { return q_; }

 private:
  Case c_;
  uint32_t seed_;
  uint32_t next_ = 0;
  CacheGeometry geometry_;
  std::unique_ptr<KvCache> cache_;
  std::vector<float> dir_, q_;
  std::vector<int32_t> seq_ids_;
};

// Offload options for calls with token rows: a device cache and a row reserve of every page a
// call could list.
OffloadOptions options_with_rows(const Case& c, const Model& model) {
  const uint64_t pages = uint64_t{c.batch} * model.geometry().n_kv_heads * model.max_pages();
  OffloadOptions options;
  options.max_batch = c.batch;
  options.max_pages_per_pair = model.max_pages();
  options.max_row_chunks = pages;
  options.cache_pages = static_cast<uint32_t>(pages);
  return options;
}

class OffloadCase : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override { KVSIFT_SKIP_WITHOUT_DEVICE(); }
};

TEST_P(OffloadCase, attends_the_cpu_selection_and_matches_the_cpu_kernel) {
  const Case c = GetParam();
  Model model(c, 4242 + c.context);
  const CacheGeometry& g = model.geometry();
  const uint32_t H = g.n_kv_heads;
  select::Policy policy;
  policy.kind = c.kind;
  policy.budget = c.kind == Kind::dense ? 0.0 : 0.05;  // dense takes none
  // One selector per mode, each seeing the same seals: the CPU-only and the offload mode must
  // choose the same pages for the same inputs.
  auto cpu_selector = Selector::create(policy, model.cache(), c.batch, model.max_pages() + 64,
                                       test::pool(2), test::kernels());
  Selection cpu_selection;
  cpu_selector->reserve_selection(cpu_selection);
  DecodeAttention cpu(g, c.batch, 2, test::kernels());
  EngineOptions options;
  options.max_batch = c.batch;
  options.n_threads = 2;
  options.max_pages_per_pair = model.max_pages() + 64;
  options.device = 0;
  options.device_cache_pages = static_cast<uint32_t>(c.batch * H * c.max_pages_per_pair);
  // One part: the checks below read what the device attended for the whole batch
  // (attended_*() report the last part); the split is checked by its own test.
  options.device_step_parts = 1;
  DecodeEngine engine(model.cache(), test::kernels(), options);
  engine.set_selector(policy);
  OffloadAttention* offload = engine.offload();
  const Selection& gpu_selection = engine.selection();

  const std::size_t out_elems = std::size_t{c.batch} * g.n_query_heads() * g.head_dim;
  std::vector<float> out_cpu(out_elems), out_gpu(out_elems);
  std::vector<std::byte> device_page(g.slot_bytes());
  double worst_error = 0.0, select_us = 0.0;
  std::printf("%-18s %4s %5s %6s %5s %5s %5s %5s %9s %8s %8s %8s %8s %8s\n", c.name, "step",
              "layer", "pages", "hit", "miss", "evict", "fresh", "KiB_h2d", "sel_us", "host_us",
              "xfer_us", "attn_us", "total_us");
  for (uint32_t step = 1; step <= c.steps; ++step) {
    if (step == c.free_at_step) {
      // The freed sequence's slots go back to the pool, and the new sequence's prompt reuses
      // them: the device cache must not serve the old pages' bytes for them.
      model.cache().free_sequence(model.seq_ids().back());
      model.seq_ids().back() = model.new_sequence();
    }
    model.drift();
    for (uint32_t layer = 0; layer < c.n_layers; ++layer) {
      for (int32_t id : model.seq_ids()) model.append(id, layer, 1);
      const AttendCall call{layer, c.batch, model.seq_ids().data(), model.q().data(),
                            out_gpu.data()};
      std::fill(out_gpu.begin(), out_gpu.end(), std::numeric_limits<float>::quiet_NaN());
      engine.attend_selected(call);

      const select::SelectCall select_call{layer, c.batch, model.seq_ids().data(),
                                           model.q().data()};
      cpu_selector->select(select_call, cpu_selection);
      const PageLists lists = cpu_selection.lists();
      AttendCall cpu_call = call;
      cpu_call.out = out_cpu.data();
      cpu_call.pages = &lists;
      cpu.validate(model.cache(), cpu_call);
      cpu.run(model.cache(), cpu_call);

      // Same pages chosen in both modes (a dense device step selects nothing: it attends every
      // page, which is what the CPU's dense selection lists).
      const uint32_t pairs = c.batch * H;
      ASSERT_EQ(cpu_selection.n_pairs, pairs);
      if (c.kind != Kind::dense) {
        ASSERT_EQ(gpu_selection.n_pairs, pairs);
        for (uint32_t pair = 0; pair <= pairs; ++pair)
          ASSERT_EQ(gpu_selection.offsets[pair], cpu_selection.offsets[pair]) << "pair " << pair;
        for (uint32_t i = 0; i < cpu_selection.offsets[pairs]; ++i)
          ASSERT_EQ(gpu_selection.page_ids[i], cpu_selection.page_ids[i]) << "entry " << i;
      }

      // The device attended exactly those pages: their host slots, and device slots holding the
      // host pages' current bytes (a stale or wrong slot would differ).
      const auto offsets = offload->attended_offsets();
      const auto host_slots = offload->attended_host_slots();
      const auto device_slots = offload->attended_device_slots();
      ASSERT_EQ(offsets.size(), pairs + 1);
      ASSERT_EQ(host_slots.size(), cpu_selection.offsets[pairs]);
      for (uint32_t pair = 0; pair < pairs; ++pair) {
        ASSERT_EQ(offsets[pair], cpu_selection.offsets[pair]);
        const uint32_t* table =
            model.cache().page_table(model.seq_ids()[pair / H], layer, pair % H);
        for (uint32_t i = offsets[pair]; i < offsets[pair + 1]; ++i) {
          ASSERT_EQ(host_slots[i], table[cpu_selection.page_ids[i]]) << "pair " << pair;
          offload->read_device_slot(layer, device_slots[i], device_page.data());
          ASSERT_EQ(std::memcmp(device_page.data(), model.cache().pool().slot(host_slots[i]),
                                g.slot_bytes()),
                    0)
              << "step " << step << " layer " << layer << " pair " << pair << " page "
              << cpu_selection.page_ids[i] << ": the device slot is not the host page";
        }
      }

      for (std::size_t i = 0; i < out_elems; ++i)
        ASSERT_TRUE(std::isfinite(out_gpu[i])) << "out[" << i << "] not written";
      const double error = test::relative_error(out_gpu.data(), out_cpu.data(), out_elems);
      EXPECT_LE(error, std::max(1e-3, test::attend_tolerance(test::kernels().level, c.dtype)))
          << "step " << step << " layer " << layer;
      worst_error = std::max(worst_error, error);

      const OffloadStats& s = offload->last_step();
      EXPECT_EQ(s.pages_listed, cpu_selection.offsets[pairs]);
      // A mirror holds every page: what it sends is each listed open page (refreshed) and every
      // page sealed since the last call (misses, listed or not).
      if (c.max_pages_per_pair == 0) {
        EXPECT_EQ(s.hits + s.refreshed, s.pages_listed);
        EXPECT_EQ(s.evictions, 0u);
      } else {
        EXPECT_EQ(s.hits + s.misses, s.pages_listed);
      }
      // Every pair's open page grew by one token since the last step: sent again unless missed.
      if (step > 1) {
        EXPECT_GE(s.refreshed + s.misses, pairs);
      }
      std::printf("%-18s %4u %5u %6lu %5lu %5lu %5lu %5lu %9.1f %8.1f %8.1f %8.1f %8.1f %8.1f\n",
                  "", step, layer, static_cast<unsigned long>(s.pages_listed),
                  static_cast<unsigned long>(s.hits), static_cast<unsigned long>(s.misses),
                  static_cast<unsigned long>(s.evictions), static_cast<unsigned long>(s.refreshed),
                  s.bytes_h2d / 1024.0, engine.last_step().select_us, s.host_us, s.transfer_us,
                  s.attend_us, s.total_us);
      select_us += engine.last_step().select_us;
    }
  }
  const OffloadStats& t = offload->totals();
  EXPECT_GT(t.hits, 0u) << "no page was reused across steps";
  EXPECT_GT(t.misses, 0u);
  std::printf(
      "%s: worst relative error %.2e; %lu calls, hit rate %.3f, %.1f KiB of pages per call "
      "(%lu refreshed pages in all), mean us per call: select %.1f host %.1f transfer %.1f attend "
      "%.1f out %.1f total %.1f\n",
      c.name, worst_error, static_cast<unsigned long>(t.calls), t.hit_rate(),
      t.page_bytes_h2d / 1024.0 / t.calls, static_cast<unsigned long>(t.refreshed),
      select_us / t.calls, t.host_us / t.calls, t.transfer_us / t.calls, t.attend_us / t.calls,
      t.copy_out_us / t.calls, t.total_us / t.calls);
}

INSTANTIATE_TEST_SUITE_P(
    Offload, OffloadCase,
    ::testing::Values(
        // Evictions: the cache holds 4/3 of a step's pages; a sequence replaced midway.
        Case{"locks_bf16_b2", Kind::locks, simd::Dtype::bf16, 2, 2, 4, 4096, 2, 6, 16, 4},
        Case{"oracle_f16_b3", Kind::oracle, simd::Dtype::f16, 1, 2, 2, 2048, 3, 5, 8, 0},
        // A q8 cache (the offload model's decode attention over one: tests/test_model.cpp).
        Case{"locks_q8_b2", Kind::locks, simd::Dtype::q8, 2, 2, 4, 2048, 2, 4, 16, 3},
        // One Llama-3.1-8B layer (8 KV heads, G = 4, d = 128) at 32K, LOCKS at 5%.
        Case{"locks_llama_32k", Kind::locks, simd::Dtype::bf16, 1, 8, 4, 32768, 1, 8, 128, 0},
        // Mirrors of the whole pool (the KV cache in HBM): a replaced sequence's slots are reused
        // by its successor's prompt, whose pages must be sent again when they seal.
        Case{"locks_mirror_b2", Kind::locks, simd::Dtype::bf16, 2, 2, 4, 4096, 2, 6, 0, 4},
        Case{"dense_mirror_q8", Kind::dense, simd::Dtype::q8, 2, 2, 4, 2000, 2, 4, 0, 3}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

class OffloadTest : public OffloadCase {};

TEST_F(OffloadTest, dense_calls_attend_every_page) {
  const Case c{"dense", Kind::dense, simd::Dtype::f16, 1, 2, 4, 1000, 2, 1, 64, 0};
  Model model(c, 77);
  const CacheGeometry& g = model.geometry();
  OffloadOptions options;
  options.max_batch = 2;
  options.max_pages_per_pair = 64;
  options.cache_pages = 2 * 2 * 64;
  auto offload = OffloadAttention::create(model.cache(), options);
  DecodeAttention cpu(g, 2, 2, test::kernels());
  const std::size_t elems = 2 * std::size_t{g.n_query_heads()} * g.head_dim;
  std::vector<float> out_cpu(elems), out_gpu(elems, std::numeric_limits<float>::quiet_NaN());
  AttendCall call{0, 2, model.seq_ids().data(), model.q().data(), out_gpu.data()};
  offload->validate(model.cache(), call);
  ASSERT_EQ(offload->run(model.cache(), call), Status::ok) << offload->last_error();
  call.out = out_cpu.data();
  cpu.run(model.cache(), call);
  EXPECT_LE(test::relative_error(out_gpu.data(), out_cpu.data(), elems), 1e-3);
  EXPECT_EQ(offload->last_step().misses, 2 * 2 * g.pages_for(1000));
  // Again: every page is resident, and no page changed.
  ASSERT_EQ(offload->run(model.cache(), AttendCall{0, 2, model.seq_ids().data(), model.q().data(),
                                                   out_gpu.data()}),
            Status::ok);
  EXPECT_EQ(offload->last_step().misses, 0u);
  EXPECT_EQ(offload->last_step().refreshed, 0u);
  EXPECT_EQ(offload->last_step().page_bytes_h2d, 0u);
  EXPECT_LE(test::relative_error(out_gpu.data(), out_cpu.data(), elems), 1e-3);

  // A mirror of the pool, made over the filled cache: the first call sends every slot handed out
  // (63 pages a pair, the last one open); the next only the open pages, which a mirror always
  // sends again; after 8 more tokens they seal and go as sealed pages, no open page left.
  options.cache_pages = 0;
  auto mirror = OffloadAttention::create(model.cache(), options);
  const uint64_t pages = 2 * 2 * g.pages_for(1000);
  const auto run_mirror = [&] {
    std::fill(out_gpu.begin(), out_gpu.end(), std::numeric_limits<float>::quiet_NaN());
    ASSERT_EQ(mirror->run(model.cache(), AttendCall{0, 2, model.seq_ids().data(), model.q().data(),
                                                    out_gpu.data()}),
              Status::ok)
        << mirror->last_error();
    EXPECT_LE(test::relative_error(out_gpu.data(), out_cpu.data(), elems), 1e-3);
  };
  run_mirror();
  EXPECT_EQ(mirror->last_step().misses, pages);
  EXPECT_EQ(mirror->last_step().refreshed, 0u);
  EXPECT_EQ(mirror->last_step().page_bytes_h2d, pages * g.slot_bytes());
  run_mirror();
  EXPECT_EQ(mirror->last_step().misses, 0u);
  EXPECT_EQ(mirror->last_step().refreshed, 2u * 2u);
  EXPECT_EQ(mirror->last_step().page_bytes_h2d, 2 * 2 * g.slot_bytes());
  for (int32_t id : model.seq_ids()) model.append(id, 0, 8);
  call.out = out_cpu.data();
  cpu.run(model.cache(), call);
  run_mirror();
  EXPECT_EQ(mirror->last_step().misses, 2u * 2u);
  EXPECT_EQ(mirror->last_step().refreshed, 0u);
}

TEST_F(OffloadTest, refuses_oversized_lists_and_row_chunks_beyond_the_reserve) {
  const Case c{"refusals", Kind::dense, simd::Dtype::f16, 1, 1, 1, 200, 1, 1, 4, 0};
  Model model(c, 78);
  const CacheGeometry& g = model.geometry();
  OffloadOptions options;
  options.max_pages_per_pair = 4;
  options.cache_pages = 4;
  auto offload = OffloadAttention::create(model.cache(), options);
  std::vector<float> out(g.n_query_heads() * g.head_dim);
  AttendCall call{0, 1, model.seq_ids().data(), model.q().data(), out.data()};
  test::expect_error([&] { offload->validate(model.cache(), call); }, Status::capacity_exceeded,
                     "max_pages_per_pair");
  const uint32_t offsets[2] = {0, 2}, page_ids[2] = {0, 12};
  const PageLists lists{offsets, page_ids};
  call.pages = &lists;
  offload->validate(model.cache(), call);
  std::vector<std::byte> chunk(g.slot_bytes());
  const uint32_t chunk_offsets[2] = {0, 1}, row_counts[1] = {5};
  const RowChunks rows{chunk.data(), chunk_offsets, row_counts};
  call.rows = &rows;
  test::expect_error([&] { offload->validate(model.cache(), call); }, Status::capacity_exceeded,
                     "max_row_chunks");
  OffloadOptions small = options;
  small.cache_pages = 1;
  auto tiny = OffloadAttention::create(model.cache(), small);
  call.rows = nullptr;
  test::expect_error([&] { tiny->validate(model.cache(), call); }, Status::capacity_exceeded,
                     "cache_pages");
  small.cache_pages = 1u << 31;
  test::expect_error([&] { OffloadAttention::create(model.cache(), small); },
                     Status::invalid_argument, "cache_pages");
  OffloadOptions parts = options;
  parts.step_parts = 5;
  test::expect_error([&] { OffloadAttention::create(model.cache(), parts); },
                     Status::invalid_argument, "step_parts");
}

// Token-level selectors: Louver gathers rows from the cache, S4R reconstructs them (and releases
// the compressed pages, whose slots later appends reuse). One selection per call, attended by both
// backends: the device's token form over the pages' and the staged rows' tokens must give the CPU
// kernel's output.
TEST_F(OffloadTest, token_rows_of_louver_and_s4r_match_the_cpu_kernel) {
  for (const Kind kind : {Kind::louver, Kind::s4r}) {
    SCOPED_TRACE(select::kind_name(kind));
    const Case c{"rows", kind, simd::Dtype::f16, 2, 2, 3, 1500, 2, 6, 0, 0};
    Model model(c, 91, KeyForm::pre_rope);
    const CacheGeometry& g = model.geometry();
    select::Policy policy;
    policy.kind = kind;
    policy.budget = 0.1;
    auto selector = Selector::create(policy, model.cache(), c.batch, model.max_pages() + 64,
                                     test::pool(2), test::kernels());
    Selection selection;
    selector->reserve_selection(selection);
    DecodeAttention cpu(g, c.batch, 2, test::kernels());
    auto offload = OffloadAttention::create(model.cache(), options_with_rows(c, model));
    const std::size_t elems = std::size_t{c.batch} * g.n_query_heads() * g.head_dim;
    std::vector<float> out_cpu(elems), out_gpu(elems);
    uint64_t rows_attended = 0;
    for (uint32_t step = 1; step <= c.steps; ++step) {
      model.drift();
      for (uint32_t layer = 0; layer < c.n_layers; ++layer) {
        for (int32_t id : model.seq_ids()) model.append(id, layer, 1);
        // S4R's rows as coefficients, reconstructed by the device (what the decode engine asks
        // for in offload mode); the CPU attends the host's reconstruction of the same choice.
        select::SelectCall select_call{layer, c.batch, model.seq_ids().data(), model.q().data()};
        select_call.latent_rows = kind == Kind::s4r;
        selector->prepare(select_call, selection);
        selector->select(select_call, selection);
        ASSERT_EQ(selection.latent, kind == Kind::s4r);
        if (selection.latent)
          dynamic_cast<select::S4rSelector&>(*selector).reconstruct_rows(select_call, selection);
        const PageLists lists = selection.lists();
        const RowChunks rows = selection.rows();
        const LatentRows latent = selection.latent_rows();
        ASSERT_TRUE(selection.has_rows);
        const uint64_t chunks = selection.chunk_offsets[selection.n_pairs];
        rows_attended += chunks;
        AttendCall call{layer,  c.batch, model.seq_ids().data(), model.q().data(), out_cpu.data(),
                        &lists, &rows};
        cpu.validate(model.cache(), call);
        cpu.run(model.cache(), call);
        call.out = out_gpu.data();
        call.latent = selection.latent ? &latent : nullptr;
        std::fill(out_gpu.begin(), out_gpu.end(), std::numeric_limits<float>::quiet_NaN());
        offload->validate(model.cache(), call);
        ASSERT_EQ(offload->run(model.cache(), call), Status::ok) << offload->last_error();
        for (std::size_t i = 0; i < elems; ++i)
          ASSERT_TRUE(std::isfinite(out_gpu[i])) << "out[" << i << "] not written";
        EXPECT_LE(test::relative_error(out_gpu.data(), out_cpu.data(), elems), 1e-3)
            << "step " << step << " layer " << layer;
        EXPECT_EQ(offload->last_stats().tokens_read, cpu.last_stats().tokens_read);
        const OffloadStats& sent = offload->last_step();
        EXPECT_EQ(sent.rows_equivalent_bytes, chunks * g.slot_bytes());
        if (kind == Kind::louver || chunks == 0) {
          EXPECT_EQ(sent.row_bytes_h2d, sent.rows_equivalent_bytes);
        } else {
          EXPECT_LT(sent.row_bytes_h2d, sent.rows_equivalent_bytes);
        }
      }
    }
    EXPECT_GT(rows_attended, 0u) << "the selector returned no rows";
    if (kind == Kind::s4r) {
      EXPECT_TRUE(offload->reconstructs_rows());
      EXPECT_GT(offload->totals().basis_bytes_h2d, 0u);
    }
    if (kind == Kind::s4r) {
      EXPECT_TRUE(model.cache().has_released_pages());
    }
  }
}

// The device's S4R rows against the host's (S4rSelector::reconstruct_rows, the CPU path's
// reconstruction of the same choice), read back from the reserved slots: per-layer and per-head
// bases, f16 and bf16, full rank and the ranks of compression 2.5 and 5, positions up to 5,000.
// Both sum in fp32 in different orders and round once to the dtype, so each value must be within
// 1 ulp of the dtype at its magnitude; where the value is far below its row's largest (the sum
// cancelled), the fp32 difference is relative to the row's norm, not to the value (about
// sqrt(r) 2^-24 |x|), so the ulp is taken at 1/16 of the row's largest magnitude there. Nearly
// every value must be equal outright.
TEST_F(OffloadTest, device_reconstructed_s4r_rows_equal_the_host_rows_to_an_ulp) {
  for (const simd::Dtype dtype : {simd::Dtype::f16, simd::Dtype::bf16})
    for (const bool per_head : {false, true})
      for (const double compression : {1.0, 2.5, 5.0}) {
        const uint64_t context = compression == 2.5 ? 5000 : 1500;
        SCOPED_TRACE(testing::Message()
                     << (dtype == simd::Dtype::f16 ? "f16" : "bf16")
                     << (per_head ? " per-head" : " per-layer") << " compression " << compression);
        const Case c{"ulp", Kind::s4r, dtype, 1, 2, 2, context, 2, 1, 0, 0};
        Model model(c, 301, KeyForm::pre_rope);
        const CacheGeometry& g = model.geometry();
        select::Policy policy;
        policy.kind = Kind::s4r;
        policy.budget = 0.2;
        policy.s4r.compression = compression;
        policy.s4r.per_head_bases = per_head;
        auto selector = Selector::create(policy, model.cache(), c.batch, model.max_pages() + 64,
                                         test::pool(2), test::kernels());
        auto& s4r = dynamic_cast<select::S4rSelector&>(*selector);
        Selection selection;
        selector->reserve_selection(selection);
        auto offload = OffloadAttention::create(model.cache(), options_with_rows(c, model));
        ASSERT_TRUE(offload->reconstructs_rows());
        for (int32_t id : model.seq_ids()) model.append(id, 0, 1);
        select::SelectCall select_call{0, c.batch, model.seq_ids().data(), model.q().data()};
        select_call.latent_rows = true;
        selector->prepare(select_call, selection);
        selector->select(select_call, selection);
        ASSERT_TRUE(selection.latent);
        const uint32_t rank = s4r.compressed(model.seq_ids()[0], 0).rank;
        ASSERT_GT(rank, 0u) << "not compressed";
        if (compression == 1.0) {
          EXPECT_EQ(rank, (per_head ? 1 : g.n_kv_heads) * g.head_dim);
        }
        const PageLists lists = selection.lists();
        const RowChunks rows = selection.rows();
        const LatentRows latent = selection.latent_rows();
        std::vector<float> out(std::size_t{c.batch} * g.n_query_heads() * g.head_dim);
        const AttendCall call{
            0,     c.batch, model.seq_ids().data(), model.q().data(), out.data(), &lists,
            &rows, &latent};
        offload->validate(model.cache(), call);
        ASSERT_EQ(offload->run(model.cache(), call), Status::ok) << offload->last_error();
        s4r.reconstruct_rows(select_call, selection);

        const simd::PageLayout layout = g.layout();
        const bool bf16 = dtype == simd::Dtype::bf16;
        const auto decode = [&](uint16_t h) {
          return bf16 ? simd::bf16_to_f32(h) : simd::f16_to_f32(h);
        };
        const auto ulp = [&](float x) {
          int e = 0;
          std::frexp(x, &e);  // x = m 2^e, 0.5 <= |m| < 1
          return std::ldexp(1.0f, std::max(e - 1, bf16 ? -126 : -14) - (bf16 ? 7 : 10));
        };
        std::vector<std::byte> slot(g.slot_bytes());
        uint64_t values = 0, equal = 0;
        const uint32_t base = offload->device_cache(0).capacity();
        for (uint32_t pair = 0; pair < selection.n_pairs; ++pair)
          for (uint32_t ch = selection.chunk_offsets[pair]; ch < selection.chunk_offsets[pair + 1];
               ++ch) {
            offload->read_device_slot(0, base + ch, slot.data());
            const std::byte* host = layout.slot(selection.row_chunks.data(), ch);
            const uint32_t first_row = (ch - selection.chunk_offsets[pair]) * g.page_tokens;
            const uint32_t n = std::min(g.page_tokens, selection.row_counts[pair] - first_row);
            for (uint32_t t = 0; t < n; ++t)
              for (const bool keys : {true, false}) {
                const uint16_t* dev =
                    keys ? layout.key(slot.data(), t) : layout.value(slot.data(), t);
                const uint16_t* ref = keys ? layout.key(host, t) : layout.value(host, t);
                float row_max = 0.0f;
                for (uint32_t i = 0; i < g.head_dim; ++i)
                  row_max = std::max(row_max, std::fabs(decode(ref[i])));
                for (uint32_t i = 0; i < g.head_dim; ++i) {
                  const float a = decode(dev[i]), b = decode(ref[i]);
                  const float scale = std::max({std::fabs(a), std::fabs(b), row_max / 16.0f});
                  ASSERT_LE(std::fabs(a - b), ulp(scale))
                      << "pair " << pair << " row " << first_row + t << (keys ? " K" : " V") << "["
                      << i << "]: device " << a << ", host " << b;
                  ++values;
                  equal += dev[i] == ref[i];
                }
              }
          }
        ASSERT_GT(values, 0u);
        EXPECT_GE(static_cast<double>(equal), 0.98 * static_cast<double>(values));
        std::printf("%s %s compression %.1f rank %u: %lu of %lu values equal\n",
                    bf16 ? "bf16" : "f16", per_head ? "per-head" : "per-layer", compression, rank,
                    static_cast<unsigned long>(equal), static_cast<unsigned long>(values));
      }
}

// The engine's S4R in offload mode, its rows reconstructed on the device, against the engine's
// S4R on the CPU, over two identical caches (one selector each: S4R releases the pages it
// compresses, so two cannot share a cache): steps in two parts, the outputs within the offload
// tests' bound, coefficients sent in place of rows. A q8 cache reconstructs on the host, as on
// the CPU, and sends rows.
TEST_F(OffloadTest, an_s4r_decode_in_offload_mode_matches_the_cpu_s4r_path) {
  for (const simd::Dtype dtype : {simd::Dtype::bf16, simd::Dtype::q8}) {
    const bool q8 = dtype == simd::Dtype::q8;
    SCOPED_TRACE(q8 ? "q8" : "bf16");
    const Case c{"s4r", Kind::s4r, dtype, 2, 2, 4, 2000, 2, 6, 0, 0};
    Model cpu_model(c, 404, KeyForm::pre_rope), gpu_model(c, 404, KeyForm::pre_rope);
    const CacheGeometry& g = cpu_model.geometry();
    select::Policy policy;
    policy.kind = Kind::s4r;
    policy.budget = 0.1;
    EngineOptions options;
    options.max_batch = c.batch;
    options.n_threads = 2;
    options.max_pages_per_pair = cpu_model.max_pages() + 64;
    DecodeEngine cpu(cpu_model.cache(), test::kernels(), options);
    options.device = 0;
    options.device_step_parts = 2;
    DecodeEngine gpu(gpu_model.cache(), test::kernels(), options);
    cpu.set_selector(policy);
    gpu.set_selector(policy);
    ASSERT_EQ(gpu.offload()->reconstructs_rows(), !q8);
    const std::size_t elems = std::size_t{c.batch} * g.n_query_heads() * g.head_dim;
    std::vector<float> out_cpu(elems), out_gpu(elems);
    uint64_t sent = 0, as_values = 0;
    for (uint32_t step = 1; step <= c.steps; ++step) {
      cpu_model.drift();
      gpu_model.drift();
      for (uint32_t layer = 0; layer < c.n_layers; ++layer) {
        for (int32_t id : cpu_model.seq_ids()) cpu_model.append(id, layer, 1);
        for (int32_t id : gpu_model.seq_ids()) gpu_model.append(id, layer, 1);
        ASSERT_EQ(cpu_model.q(), gpu_model.q());
        cpu.attend_selected(AttendCall{layer, c.batch, cpu_model.seq_ids().data(),
                                       cpu_model.q().data(), out_cpu.data()});
        std::fill(out_gpu.begin(), out_gpu.end(), std::numeric_limits<float>::quiet_NaN());
        gpu.attend_selected(AttendCall{layer, c.batch, gpu_model.seq_ids().data(),
                                       gpu_model.q().data(), out_gpu.data()});
        for (std::size_t i = 0; i < elems; ++i)
          ASSERT_TRUE(std::isfinite(out_gpu[i])) << "out[" << i << "] not written";
        EXPECT_LE(test::relative_error(out_gpu.data(), out_cpu.data(), elems),
                  std::max(1e-3, test::attend_tolerance(test::kernels().level, dtype)))
            << "step " << step << " layer " << layer;
        EXPECT_EQ(gpu.last_step().attended.tokens_read, cpu.last_step().attended.tokens_read);
        EXPECT_EQ(gpu.selection().latent, !q8);
        sent += gpu.last_step().row_h2d_bytes;
        as_values += gpu.last_step().rows_equivalent_bytes;
      }
    }
    EXPECT_GT(as_values, 0u) << "no rows were attended";
    if (q8) {
      EXPECT_EQ(sent, as_values);
    } else {
      EXPECT_LT(sent, as_values);
    }
    std::printf("s4r %s: row bytes sent %lu, as values %lu\n", q8 ? "q8" : "bf16",
                static_cast<unsigned long>(sent), static_cast<unsigned long>(as_values));
  }
}

// step() in parts: the CPU selects part i + 1 while the device attends part i. The output must be
// the CPU kernel's over the same selection of the whole batch, and the telemetry must cover every
// pair, not only the last part's.
TEST_F(OffloadTest, a_step_in_parts_equals_one_selection_of_the_whole_batch) {
  const Case c{"parts", Kind::locks, simd::Dtype::bf16, 2, 2, 4, 3000, 5, 4, 16, 0};
  Model model(c, 93);
  const CacheGeometry& g = model.geometry();
  select::Policy policy;
  policy.kind = Kind::locks;
  policy.budget = 0.05;
  auto cpu_selector = Selector::create(policy, model.cache(), c.batch, model.max_pages() + 64,
                                       test::pool(2), test::kernels());
  Selection cpu_selection;
  cpu_selector->reserve_selection(cpu_selection);
  DecodeAttention cpu(g, c.batch, 2, test::kernels());
  for (const uint32_t parts : {2u, 3u}) {
    SCOPED_TRACE(parts);
    EngineOptions options;
    options.max_batch = c.batch;
    options.n_threads = 2;
    options.max_pages_per_pair = model.max_pages() + 64;
    options.device = 0;
    options.device_cache_pages =
        static_cast<uint32_t>(c.batch * g.n_kv_heads * c.max_pages_per_pair);
    options.device_step_parts = parts;
    DecodeEngine engine(model.cache(), test::kernels(), options);
    engine.set_selector(policy);
    const OffloadAttention* offload = engine.offload();
    double select_us = 0.0, overlap_us = 0.0;
    const std::size_t elems = std::size_t{c.batch} * g.n_query_heads() * g.head_dim;
    std::vector<float> out_cpu(elems), out_gpu(elems);
    for (uint32_t step = 1; step <= c.steps; ++step) {
      model.drift();
      for (uint32_t layer = 0; layer < c.n_layers; ++layer) {
        for (int32_t id : model.seq_ids()) model.append(id, layer, 1);
        AttendCall call{layer, c.batch, model.seq_ids().data(), model.q().data(), out_gpu.data()};
        std::fill(out_gpu.begin(), out_gpu.end(), std::numeric_limits<float>::quiet_NaN());
        engine.attend_selected(call);
        const select::SelectCall select_call{layer, c.batch, model.seq_ids().data(),
                                             model.q().data()};
        cpu_selector->select(select_call, cpu_selection);
        const PageLists lists = cpu_selection.lists();
        call.out = out_cpu.data();
        call.pages = &lists;
        cpu.run(model.cache(), call);
        for (std::size_t i = 0; i < elems; ++i)
          ASSERT_TRUE(std::isfinite(out_gpu[i])) << "out[" << i << "] not written";
        EXPECT_LE(test::relative_error(out_gpu.data(), out_cpu.data(), elems), 1e-3);
        const LayerStepStats& s = engine.last_step();
        EXPECT_EQ(s.pairs, c.batch * g.n_kv_heads);
        EXPECT_EQ(offload->last_step().pages_listed, cpu_selection.pages_chosen());
        EXPECT_EQ(offload->last_step().parts, parts);
        EXPECT_NEAR(s.kept_estimate_sum, cpu_selection.kept_estimate_sum(), 1e-3);
        select_us += s.select_us;
        overlap_us += s.overlap_us;
      }
    }
    const OffloadStats& t = offload->totals();
    std::printf(
        "parts %u: %lu calls, mean us per call: select %.1f (hidden %.1f) host %.1f "
        "transfer %.1f attend %.1f total %.1f\n",
        parts, static_cast<unsigned long>(t.calls), select_us / t.calls, overlap_us / t.calls,
        t.host_us / t.calls, t.transfer_us / t.calls, t.attend_us / t.calls, t.total_us / t.calls);
  }
}

// The real model in offload mode (weights and compute on the device, the KV in host memory)
// against the same model on the CPU: the same prompt, greedy decoding of two sequences together.
// Dense must give the same tokens, and logits within the bf16 products' noise (the CPU's own
// prefill and decode logits differ by 2e-2, test_model.cpp). A selector sees queries that differ
// by that noise in the two modes, so near-tied pages may go either way: its tokens must agree at
// the start and are otherwise reported. Every offload step must have sent or hit pages.
TEST_F(OffloadTest, the_model_decodes_the_same_tokens_in_offload_mode) {
  if (test::model_path() == nullptr) GTEST_SKIP() << "KVSIFT_MODEL is not set (make test sets it)";
  model::ModelOptions options;
  options.n_ctx = 1024;
  options.max_seqs = 2;
  auto cpu = model::LlamaModel::load(test::model_path(), options);
  options.device = 0;
  auto gpu = model::LlamaModel::load(test::model_path(), options);
  ASSERT_STREQ(gpu->attention_backend(), "cuda:0");
  std::string text;
  for (int i = 0; i < 24; ++i)
    text += "Entry " + std::to_string(i) + ": the ferry left pier " + std::to_string(3 + i % 7) +
            " at " + std::to_string(6 + i % 12) + " o'clock carrying " + std::to_string(20 + i) +
            " crates. ";
  text += "Question: which pier did entry 9's ferry leave from? Answer:";
  const std::vector<int32_t> prompt = cpu->tokenizer().encode(text, false);
  select::Policy locks;
  locks.kind = Kind::locks;
  locks.budget = 0.25;
  select::Policy louver;
  louver.kind = Kind::louver;
  louver.budget = 0.25;
  select::Policy s4r;
  s4r.kind = Kind::s4r;
  s4r.budget = 0.25;
  for (const select::Policy& policy : {select::Policy{}, locks, louver, s4r}) {
    SCOPED_TRACE(select::kind_name(policy.kind));
    std::vector<int32_t> tokens[2];
    int32_t seqs[2][2];
    model::LlamaModel* models[2] = {cpu.get(), gpu.get()};
    for (int mode = 0; mode < 2; ++mode) {
      model::LlamaModel& m = *models[mode];
      m.set_selector(policy);
      seqs[mode][0] = m.create_sequence();
      m.prefill(seqs[mode][0], prompt, nullptr, nullptr, nullptr);
      seqs[mode][1] = m.fork_sequence(seqs[mode][0]);
      for (uint32_t step = 0; step < 24; ++step) {
        int32_t next[2];
        for (int b = 0; b < 2; ++b) {
          const auto logits = m.logits(seqs[mode][b]);
          next[b] =
              static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
        }
        tokens[mode].push_back(next[0]);
        EXPECT_EQ(next[0], next[1]) << "the two copies of the prompt diverged";
        m.decode(seqs[mode], next);
        if (mode == 1) {
          const model::StepStats& s = m.stats().last_step;
          EXPECT_GT(s.cache_hits + s.cache_misses, 0u);
          EXPECT_GT(s.h2d_bytes, 0u);
          EXPECT_GT(s.plan_us, 0.0);  // every offload step plans its moves
          // S4R's rows go as coefficients once the prompt is compressed (the first step).
          if (policy.kind == Kind::s4r && gpu->cache().geometry().dtype != simd::Dtype::q8) {
            EXPECT_GT(s.rows_equivalent_bytes, 0u);
            EXPECT_LT(s.row_h2d_bytes, s.rows_equivalent_bytes);
          }
        }
      }
    }
    // The last step's logits, after the same tokens in both modes.
    const auto a = cpu->logits(seqs[0][0]), b = gpu->logits(seqs[1][0]);
    const double worst = test::relative_error(b.data(), a.data(), a.size());
    for (int mode = 0; mode < 2; ++mode)
      for (int32_t id : seqs[mode]) models[mode]->free_sequence(id);
    std::size_t agree = 0;
    while (agree < tokens[0].size() && tokens[0][agree] == tokens[1][agree]) ++agree;
    if (policy.kind == Kind::dense) {
      EXPECT_EQ(tokens[1], tokens[0]);
      EXPECT_LE(worst, 5e-2);
    } else {
      EXPECT_GE(agree, 4u);
    }
    std::printf(
        "%s: the first %zu of %zu tokens equal in both modes; last logits relative error "
        "%.2e; hit rate of the last step %.3f\n",
        std::string(select::kind_name(policy.kind)).c_str(), agree, tokens[0].size(), worst,
        static_cast<double>(gpu->stats().last_step.cache_hits) /
            static_cast<double>(gpu->stats().last_step.cache_hits +
                                gpu->stats().last_step.cache_misses));
  }
}

// The C API's offload mode: two caches fed the same K/V, one attending on the CPU and one on the
// device, through kvsift_attend_selected with a page selector and a token-level one.
TEST_F(OffloadTest, the_c_api_offload_cache_attends_like_the_cpu_cache) {
  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  params.n_layers = 2;
  params.n_kv_heads = 2;
  params.group_size = 4;
  params.head_dim = 64;
  params.max_pages = 2 * 2 * 2 * 128;
  params.max_batch = 2;
  params.n_threads = 2;
  kvsift_cache* caches[2] = {nullptr, nullptr};
  ASSERT_EQ(kvsift_cache_create(&params, &caches[0]), KVSIFT_STATUS_OK) << kvsift_last_error();
  params.device = 0;
  ASSERT_EQ(kvsift_cache_create(&params, &caches[1]), KVSIFT_STATUS_OK) << kvsift_last_error();
  const uint32_t kv = 2 * 64, qdim = 8 * 64, prompt = 1500;
  int32_t seqs[2][2];
  for (kvsift_cache* cache : caches)
    for (int b = 0; b < 2; ++b) {
      int32_t& id = seqs[cache == caches[1]][b];
      ASSERT_EQ(kvsift_sequence_create(cache, &id), KVSIFT_STATUS_OK);
      for (uint32_t layer = 0; layer < 2; ++layer) {
        const std::vector<float> k = test::random_floats(prompt * kv, 500 + 10 * b + layer);
        const std::vector<float> v = test::random_floats(prompt * kv, 600 + 10 * b + layer);
        ASSERT_EQ(kvsift_append(cache, id, layer, prompt, k.data(), v.data()), KVSIFT_STATUS_OK);
      }
    }
  for (const kvsift_selector selector : {KVSIFT_SELECTOR_LOCKS, KVSIFT_SELECTOR_LOUVER}) {
    kvsift_selector_policy policy;
    kvsift_selector_policy_init(&policy);
    policy.selector = selector;
    policy.budget = 0.1;
    for (kvsift_cache* cache : caches)
      ASSERT_EQ(kvsift_cache_set_selector(cache, &policy), KVSIFT_STATUS_OK) << kvsift_last_error();
    for (uint32_t step = 0; step < 3; ++step)
      for (uint32_t layer = 0; layer < 2; ++layer) {
        const std::vector<float> q = test::random_floats(2 * qdim, 700 + step * 2 + layer, 1.5f);
        std::vector<float> out[2];
        kvsift_selection_stats stats[2];
        for (int mode = 0; mode < 2; ++mode) {
          out[mode].assign(2 * qdim, std::numeric_limits<float>::quiet_NaN());
          ASSERT_EQ(kvsift_attend_selected(caches[mode], layer, 2, seqs[mode], q.data(),
                                           out[mode].data(), &stats[mode]),
                    KVSIFT_STATUS_OK)
              << kvsift_last_error();
        }
        EXPECT_EQ(stats[1].pages_chosen, stats[0].pages_chosen);
        EXPECT_EQ(stats[1].kv_bytes_read, stats[0].kv_bytes_read);
        EXPECT_LE(test::relative_error(out[1].data(), out[0].data(), out[0].size()), 1e-3);
      }
    kvsift_cache_stats cache_stats;
    ASSERT_EQ(kvsift_cache_get_stats(caches[1], &cache_stats), KVSIFT_STATUS_OK);
    EXPECT_GT(cache_stats.last_cache_hits + cache_stats.last_cache_misses, 0u);
  }
  for (kvsift_cache* cache : caches) kvsift_cache_free(cache);
}

// Runs everywhere: the refusal comes before any device is touched.
TEST(Offload, create_refuses_an_unpinned_cache_or_a_missing_backend) {
  CacheGeometry geometry;
  KvCache cache(geometry, CacheOptions{}, test::kernels());
  OffloadOptions options;
  options.max_pages_per_pair = 4;
  options.cache_pages = 4;
  if (gpu::backend_status().ok) {
    test::expect_error([&] { OffloadAttention::create(cache, options); }, Status::invalid_argument,
                       "not pinned");
  } else {
    test::expect_error([&] { OffloadAttention::create(cache, options); }, Status::unsupported,
                       "libkvsift_cuda.so");
  }
}

}  // namespace
}  // namespace kvsift
