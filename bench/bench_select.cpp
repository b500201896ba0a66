// Selection + sparse attention against dense attention, in the same run, through the C API.
//
// Each BM_select case fills one layer of the Llama-3-8B shape with keys that have the structure
// real ones have (each page its own rank-4 mixture of topic directions plus noise, four outlier
// channels, RoPE-rotated by position), and queries that attend to a few needle tokens. Every
// iteration times one dense kvsift_attend and one kvsift_attend_selected back to back, so the
// counters compare the two under the same machine conditions:
//   dense_ms, selected_ms  medians over the iterations; speedup = their ratio
//   bytes_vs_dense         (index + K/V bytes the selected call read) / dense K/V bytes
//   kept_estimate          the selector's estimated share of softmax mass kept
// BM_summary_build times kvsift_cache_set_selector over a filled cache: summary build per page.
// BM_locks_score times the LOCKS scoring kernel alone over records of such keys (d = 128, B = 16,
// r = 8, G = 4), ns_per_page per (page, KV head): one KV head's 512 pages on one thread stay in L2
// (the kernel's compute); eight KV heads of 8192 pages on two threads are a 128K layer's step.
//
//   kvsift-bench-select --benchmark_filter='locks/llama8b/ctx:131072/batch:1'
//   kvsift-bench-select --benchmark_filter=BM_locks_score
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.hpp"
#include "bench/key_maker.hpp"
#include "kvsift/kvsift.h"
#include "lib/core/aligned.hpp"
#include "lib/select/locks_summary.hpp"
#include "simd/half.hpp"
#include "simd/kernels.hpp"

namespace {

using namespace kvsift::bench;
using Clock = std::chrono::steady_clock;

constexpr uint64_t kContexts[] = {32768, 131072, 524288};
constexpr uint32_t kBatches[] = {1, 8};
constexpr int kThreads = 2;
constexpr double kBudget = 0.02;
constexpr uint64_t kMaxKvBytes = uint64_t{8} << 30;  // 24 GiB box: drops 512K at batch 8

struct Case {
  kvsift_selector selector;
  uint64_t context;
  uint32_t batch;
};

// The filled cache of the case that ran last (see bench_attend.cpp: one multi-GiB cache at a time).
struct Filled {
  uint64_t context = 0;
  uint32_t batch = 0;
  kvsift::cache cache;
  std::vector<int32_t> seq_ids;
  std::vector<float> q, out;
  kvsift_selector selector = KVSIFT_SELECTOR_DENSE;  // the one whose summaries the cache holds
};

Filled& held() {
  static Filled filled;
  return filled;
}

std::string fill(uint64_t context, uint32_t batch) {
  Filled& f = held();
  if (f.cache && f.context == context && f.batch == batch) return "";
  f = Filled{};
  const Shape& shape = kLlama8b;
  const uint32_t H = shape.n_kv_heads, G = shape.group_size, d = shape.head_dim;
  const kvsift_cache_params params = cache_params(shape, context, batch, kThreads);
  kvsift::cache cache;
  if (std::string error = create_cache(params, cache); !error.empty()) return error;
  f.q.assign(std::size_t{batch} * H * G * d, 0.0f);
  Random random(kSeed + 1);
  std::vector<float> k, v;
  for (uint32_t b = 0; b < batch; ++b) {
    int32_t id = -1;
    if (kvsift_sequence_create(cache.get(), &id) != KVSIFT_STATUS_OK) return kvsift_last_error();
    f.seq_ids.push_back(id);
    KeyMaker maker(shape, kSeed + b);
    for (uint64_t done = 0; done < context; done += kAppendTokens) {
      const auto n = static_cast<uint32_t>(std::min<uint64_t>(kAppendTokens, context - done));
      maker.make(done, n, k, v);
      if (kvsift_append(cache.get(), id, 0, n, k.data(), v.data()) != KVSIFT_STATUS_OK)
        return kvsift_last_error();
    }
    add_needle_queries(cache.get(), id, shape, context, random,
                       f.q.data() + std::size_t{b} * H * G * d);
  }
  f.out.resize(f.q.size());
  f.context = context;
  f.batch = batch;
  f.cache = std::move(cache);
  return "";
}

double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

void BM_select(benchmark::State& state, Case c) {
  if (const std::string error = fill(c.context, c.batch); !error.empty()) {
    state.SkipWithError(error.c_str());
    return;
  }
  Filled& f = held();
  kvsift_selector_policy policy;
  kvsift_selector_policy_init(&policy);
  policy.selector = c.selector;
  policy.budget = kBudget;
  // Summaries are built once per cache and selector, not each time the case is entered.
  if (f.selector != c.selector) {
    if (kvsift_cache_set_selector(f.cache.get(), &policy) != KVSIFT_STATUS_OK) {
      state.SkipWithError(kvsift_last_error());
      return;
    }
    f.selector = c.selector;
  }
  kvsift_selection_stats sel{};
  kvsift_cache_stats dense_stats{};
  auto dense = [&] {
    return kvsift_attend(f.cache.get(), 0, c.batch, f.seq_ids.data(), f.q.data(), f.out.data(),
                         nullptr);
  };
  auto selected = [&] {
    return kvsift_attend_selected(f.cache.get(), 0, c.batch, f.seq_ids.data(), f.q.data(),
                                  f.out.data(), &sel);
  };
  // Untimed once each: errors surface, thread pools start, and the byte counts are known.
  if (dense() != KVSIFT_STATUS_OK || kvsift_cache_get_stats(f.cache.get(), &dense_stats) ||
      selected() != KVSIFT_STATUS_OK) {
    state.SkipWithError(kvsift_last_error());
    return;
  }
  std::vector<double> dense_s, selected_s;
  for (auto _ : state) {
    auto t0 = Clock::now();
    dense();
    auto t1 = Clock::now();
    selected();
    auto t2 = Clock::now();
    dense_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    selected_s.push_back(std::chrono::duration<double>(t2 - t1).count());
    state.SetIterationTime(selected_s.back());
  }
  const double dense_median = median(dense_s), selected_median = median(selected_s);
  state.counters["dense_ms"] = dense_median * 1e3;
  state.counters["selected_ms"] = selected_median * 1e3;
  state.counters["speedup"] = dense_median / selected_median;
  state.counters["bytes_vs_dense"] = static_cast<double>(sel.index_bytes_read + sel.kv_bytes_read) /
                                     static_cast<double>(dense_stats.last_bytes_read);
  state.counters["index_MB"] = static_cast<double>(sel.index_bytes_read) * 1e-6;
  state.counters["pages_chosen_share"] =
      static_cast<double>(sel.pages_chosen) / static_cast<double>(sel.pages_stored);
  state.counters["kept_estimate"] = sel.kept_estimate;
}

void BM_summary_build(benchmark::State& state, kvsift_selector selector) {
  const uint64_t context = 32768;
  if (const std::string error = fill(context, 1); !error.empty()) {
    state.SkipWithError(error.c_str());
    return;
  }
  Filled& f = held();
  kvsift_selector_policy policy;
  kvsift_selector_policy_init(&policy);
  policy.selector = selector;
  policy.budget = kBudget;
  const double pages = static_cast<double>(context / kPageTokens * kLlama8b.n_kv_heads);
  double seconds = 0.0;
  for (auto _ : state) {
    const auto start = Clock::now();
    if (kvsift_cache_set_selector(f.cache.get(), &policy) != KVSIFT_STATUS_OK) {
      state.SkipWithError(kvsift_last_error());
      return;
    }
    seconds += std::chrono::duration<double>(Clock::now() - start).count();
  }
  f.selector = selector;
  state.counters["ns_per_page"] = seconds / static_cast<double>(state.iterations()) / pages * 1e9;
}

// LOCKS records of `heads` KV heads over `pages` pages each, with G needle queries per head. The
// heads are copies of one head's records, each in its own memory.
struct LocksPool {
  kvsift::select::LocksShape shape{kLlama8b.head_dim, kPageTokens,
                                   kvsift::select::kLocksDefaultRank};
  std::size_t record_bytes = kvsift::select::locks_record_bytes(shape);
  kvsift::AlignedVector<std::byte> records;  // [heads, pages, record_bytes]
  std::vector<uint32_t> slots;               // [heads, pages]: slot = head * pages + page
  std::vector<float> q;                      // [G, head_dim], shared by the heads

  LocksPool(uint32_t pages, uint32_t heads)
      : records(std::size_t{pages} * heads * record_bytes), slots(std::size_t{pages} * heads) {
    const Shape one{"one_head", 1, kLlama8b.group_size, kLlama8b.head_dim};
    const uint32_t d = one.head_dim, B = kPageTokens;
    KeyMaker maker(one, kSeed);
    std::vector<float> k, v, needles;
    std::vector<uint16_t> stored(std::size_t{B} * d);
    for (uint32_t p = 0; p < pages; ++p) {
      maker.make(uint64_t{p} * B, B, k, v);
      for (std::size_t i = 0; i < stored.size(); ++i) stored[i] = kvsift::simd::f32_to_f16(k[i]);
      kvsift::select::locks_build(shape, stored.data(), kvsift::simd::Dtype::f16,
                                  records.data() + std::size_t{p} * record_bytes);
      if (p % (pages / kNeedles) == 0) needles.insert(needles.end(), k.begin(), k.begin() + d);
    }
    for (uint32_t h = 1; h < heads; ++h)
      std::copy(records.begin(), records.begin() + std::ptrdiff_t(pages * record_bytes),
                records.begin() + std::ptrdiff_t(h * pages * record_bytes));
    for (std::size_t i = 0; i < slots.size(); ++i) slots[i] = static_cast<uint32_t>(i);
    Random random(kSeed + 2);
    q.assign(std::size_t{one.group_size} * d, 0.0f);
    for (uint32_t g = 0; g < one.group_size; ++g)
      for (uint32_t c = 0; c < d; ++c) {
        float& x = q[std::size_t{g} * d + c];
        for (std::size_t j = 0; j < needles.size() / d; ++j) x += 0.3f * needles[j * d + c];
        x += 0.3f * random.uniform();
      }
  }
};

// kernel 0: the AVX-512 VNNI int8-query kernel; 1: the AVX-512 float kernel (exact query).
// heads 1: one job on this thread; 8: a layer's eight KV heads, one job each, on kThreads threads
// (as the selector runs them), the records streamed from memory.
void BM_locks_score(benchmark::State& state) {
  const auto pages = static_cast<uint32_t>(state.range(0));
  const bool vnni = state.range(1) == 0;
  const auto heads = static_cast<uint32_t>(state.range(2));
  using kvsift::simd::Level;
  const Level level = vnni ? Level::avx512_vnni : Level::avx512;
  const kvsift::simd::LocksScoreFn fn = kvsift::simd::kernels_for(level).locks_score;
  if (!kvsift::simd::cpu_has(level)) {
    state.SkipWithError(vnni ? "CPU lacks AVX-512 VNNI" : "CPU lacks AVX-512");
    return;
  }
  // One pool per shape for the process: the keys take seconds to make.
  static std::map<std::pair<uint32_t, uint32_t>, std::unique_ptr<LocksPool>> pools;
  auto& held_pool = pools[{pages, heads}];
  if (!held_pool) held_pool = std::make_unique<LocksPool>(pages, heads);
  const LocksPool& pool = *held_pool;
  const uint32_t G = kLlama8b.group_size;
  std::vector<float> lse(std::size_t{G} * pages * heads);
  auto job_of = [&](uint32_t h) {
    kvsift::simd::LocksScoreJob job{};
    job.q = pool.q.data();
    job.group = G;
    job.head_dim = pool.shape.head_dim;
    job.page_tokens = pool.shape.page_tokens;
    job.rank = pool.shape.rank;
    job.int8_query = vnni;
    job.scale = 1.0f / std::sqrt(float(job.head_dim));
    job.records = pool.records.data();
    job.record_bytes = pool.record_bytes;
    job.slots = pool.slots.data() + std::size_t{h} * pages;
    job.count = pages;
    job.lse = lse.data() + std::size_t{h} * G * pages;
    return job;
  };
  const int threads = heads == 1 ? 1 : kThreads;
  std::vector<double> seconds;
  for (auto _ : state) {
    const auto start = Clock::now();
    if (threads == 1) {
      for (uint32_t h = 0; h < heads; ++h) fn(job_of(h));
    } else {
      std::vector<std::thread> team;
      for (int t = 0; t < threads; ++t)
        team.emplace_back([&, t] {
          for (uint32_t h = uint32_t(t); h < heads; h += threads) fn(job_of(h));
        });
      for (std::thread& member : team) member.join();
    }
    benchmark::DoNotOptimize(lse.data());
    benchmark::ClobberMemory();
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  const auto items = static_cast<int64_t>(state.iterations()) * pages * heads;
  state.SetItemsProcessed(items);
  state.SetBytesProcessed(items * static_cast<int64_t>(pool.record_bytes));
  // The median iteration: other builds on this 2-core box only ever slow some iterations down.
  // Per (page, KV head) of wall time, and of thread time (times the threads).
  const double per_page = median(seconds) / (double(pages) * heads) * 1e9;
  state.counters["ns_per_page"] = per_page;
  state.counters["thread_ns_per_page"] = per_page * threads;
  state.SetLabel(vnni ? "avx512_vnni" : "avx512");
}

void register_benchmarks() {
  for (kvsift_selector selector :
       {KVSIFT_SELECTOR_LOCKS, KVSIFT_SELECTOR_QUEST, KVSIFT_SELECTOR_ORACLE})
    for (uint64_t context : kContexts)
      for (uint32_t batch : kBatches) {
        if (kv_bytes(kLlama8b, context, batch) > kMaxKvBytes) continue;
        const std::string name = std::string("BM_select/") + kvsift_selector_name(selector) +
                                 "/llama8b/ctx:" + std::to_string(context) +
                                 "/batch:" + std::to_string(batch) + "/threads:2";
        benchmark::RegisterBenchmark(name.c_str(), BM_select, Case{selector, context, batch})
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
  for (kvsift_selector selector : {KVSIFT_SELECTOR_LOCKS, KVSIFT_SELECTOR_QUEST}) {
    const std::string name = std::string("BM_summary_build/") + kvsift_selector_name(selector) +
                             "/llama8b/ctx:32768/threads:2";
    benchmark::RegisterBenchmark(name.c_str(), BM_summary_build, selector)
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("BM_locks_score/llama8b", BM_locks_score)
      ->ArgNames({"pages", "kernel", "heads"})
      ->Args({512, 0, 1})
      ->Args({512, 1, 1})
      ->Args({8192, 0, 8})  // 128K context: 54 MB of records, from memory
      ->Args({8192, 1, 8})
      ->UseRealTime()
      ->Unit(benchmark::kMicrosecond);
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_benchmarks();
  benchmark::AddCustomContext("kvsift_version", kvsift_version_string());
  benchmark::AddCustomContext("budget", std::to_string(kBudget));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
