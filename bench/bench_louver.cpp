// Louver index (lib/select/louver_index.hpp) against our own AVX-512 brute-force scan, one query
// head on one thread, d = 128, tau from the sample oracle at f = 0.10 (the authors' setting).
//
// Keys have the structure real ones have (each run of 16 tokens a mixture of 4 of 64 topic
// directions plus noise, four outlier channels, RoPE-rotated by position); each query points at
// a few needle tokens plus noise. Cases:
//   BM_louver_query    query() with the oracle; counters: checked (share of keys scored
//                      exactly: the pruning rate is 1 - checked), returned (share of keys in the
//                      answer), bytes_vs_scan (bytes read / the scan's), and index_B_per_key.
//   BM_louver_scan     the brute-force scan over the same keys with the same taus.
//   BM_louver_heads    a layer's step: 8 KV heads through louver_query_many (a thread pool over
//                      the heads) against the 8 brute-force scans on the same pool.
//   BM_louver_build    building the index (wall time); counter ns_per_key.
//   BM_louver_append   one decode step's append (a flush every 256 steps, amortised).
// Compare with tools/louver_numpy_bench.py (numpy matmul + threshold). Run with repetitions:
//   kvsift-bench-louver --benchmark_repetitions=9 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "bench/bench_util.hpp"
#include "lib/select/louver_index.hpp"

namespace {

using namespace kvsift;
using kvsift::bench::Random;

constexpr uint32_t kDim = 128;
constexpr uint32_t kTopics = 64, kMix = 4, kNeedles = 4, kQueries = 64;
constexpr uint32_t kOutliers[] = {5, 37, 70, 101};

void rope(float* x, uint64_t pos) {
  for (uint32_t i = 0; i < kDim / 2; ++i) {
    const double angle = double(pos) * std::pow(500000.0, -2.0 * i / kDim);
    const float c = float(std::cos(angle)), s = float(std::sin(angle));
    const float a = x[2 * i], b = x[2 * i + 1];
    x[2 * i] = a * c - b * s;
    x[2 * i + 1] = a * s + b * c;
  }
}

std::vector<float> make_keys(uint64_t n, Random& random) {
  std::vector<float> topics(kTopics * kDim);
  random.fill(topics);
  std::vector<float> keys(n * kDim, 0.0f);
  uint32_t picks[kMix] = {};
  for (uint64_t i = 0; i < n; ++i) {
    if (i % 16 == 0)
      for (uint32_t& p : picks) p = uint32_t((random.uniform() + 1.0f) * 0.5f * kTopics) % kTopics;
    float* row = keys.data() + i * kDim;
    for (uint32_t p : picks) {
      const float w = 2.0f * random.uniform();
      for (uint32_t c = 0; c < kDim; ++c) row[c] += w * topics[p * kDim + c];
    }
    for (uint32_t c = 0; c < kDim; ++c) row[c] += 0.2f * random.uniform();
    for (uint32_t c : kOutliers) row[c] += 6.0f;
    rope(row, i);
  }
  return keys;
}

std::vector<float> make_queries(const std::vector<float>& keys, uint64_t n, Random& random) {
  std::vector<float> q(kQueries * kDim, 0.0f);
  for (uint32_t t = 0; t < kQueries; ++t) {
    float* row = q.data() + t * kDim;
    for (uint32_t j = 0; j < kNeedles; ++j) {
      const uint64_t needle = uint64_t((random.uniform() + 1.0f) * 0.5f * n) % n;
      for (uint32_t c = 0; c < kDim; ++c) row[c] += 0.1f * keys[needle * kDim + c];
    }
    for (uint32_t c = 0; c < kDim; ++c) row[c] += 0.2f * random.uniform();
  }
  return q;
}

struct Data {
  std::vector<float> keys, queries;
};

const Data& data(uint64_t n) {
  static std::map<uint64_t, Data> cache;
  auto it = cache.find(n);
  if (it == cache.end()) {
    Random random(bench::kSeed + n);
    Data d;
    d.keys = make_keys(n, random);
    d.queries = make_queries(d.keys, n, random);
    it = cache.emplace(n, std::move(d)).first;
  }
  return it->second;
}

LouverParams params_of(uint32_t r, LouverSplit split, uint32_t S = 0) {
  LouverParams p;
  p.head_dim = kDim;
  p.n_subspaces = S;
  p.cluster_keys = r;
  p.split = split;
  return p;
}

// One index per (n, r, split), kept for the process: a 128K build takes a while.
LouverIndex& index_of(uint64_t n, uint32_t r, LouverSplit split, uint32_t S = 0) {
  static std::map<std::tuple<uint64_t, uint32_t, int, uint32_t>, std::unique_ptr<LouverIndex>>
      cache;
  auto& slot = cache[{n, r, int(split), S}];
  if (!slot) slot = std::make_unique<LouverIndex>(params_of(r, split, S), data(n).keys.data(), n);
  return *slot;
}

// gate 0: summed key bound, no scan fallback (the pruning the bounds achieve); 1: Query 1;
// 2: Query 2 (TA); 3: summed with the fallback (the default query).
LouverQuery query_of(int64_t gate) {
  LouverQuery q;
  q.summed_key_bound = gate == 0 || gate == 3;
  q.scan_fallback = gate == 3;
  q.search = gate == 2 ? LouverSearch::threshold_algorithm : LouverSearch::all_subspace;
  return q;  // sample_fraction, f = 0.10
}

void BM_louver_query(benchmark::State& state) {
  const uint64_t n = state.range(0);
  const auto split = LouverSplit(state.range(3));
  LouverIndex& index = index_of(n, uint32_t(state.range(2)), split, uint32_t(state.range(4)));
  LouverQuery query = query_of(state.range(1));
  query.fraction = float(state.range(5)) * 1e-3f;
  const Data& d = data(n);
  double checked = 0, returned = 0, bytes = 0;
  uint32_t t = 0;
  for (auto _ : state) {
    const LouverResult r = index.query(d.queries.data() + (t++ % kQueries) * kDim, 1, query);
    benchmark::DoNotOptimize(r.token_ids.data());
    checked += r.checked, returned += r.token_ids.size(), bytes += r.bytes_read;
  }
  const double iters = double(state.iterations());
  state.counters["checked"] = checked / iters / n;
  state.counters["returned"] = returned / iters / n;
  state.counters["bytes_vs_scan"] = bytes / iters / (double(n) * kDim * 2);
  state.counters["index_B_per_key"] = double(index.index_bytes()) / n;
  state.SetItemsProcessed(state.iterations() * int64_t(n));
  state.SetBytesProcessed(int64_t(bytes));
  state.SetLabel(simd::level_name(index.kernels().level));
}

void BM_louver_scan(benchmark::State& state) {
  const uint64_t n = state.range(0);
  LouverIndex& index = index_of(n, 4, LouverSplit::pca);
  const Data& d = data(n);
  LouverQuery oracle;
  oracle.fraction = float(state.range(1)) * 1e-3f;
  std::vector<float> taus(kQueries);
  for (uint32_t t = 0; t < kQueries; ++t)
    taus[t] = index.query(d.queries.data() + t * kDim, 1, oracle).tau[0];
  std::vector<uint32_t> out(n);
  uint32_t t = 0;
  for (auto _ : state) {
    const uint32_t i = t++ % kQueries;
    benchmark::DoNotOptimize(index.scan(d.queries.data() + i * kDim, 1, &taus[i], out.data()));
  }
  state.SetItemsProcessed(state.iterations() * int64_t(n));
  state.SetBytesProcessed(state.iterations() * int64_t(n) * kDim * 2);
  state.SetLabel(simd::level_name(index.kernels().level));
}

// A layer's decode step: 8 KV heads (copies of one index, each its own query), one OpenMP
// iteration per head, against the same heads' brute-force scans in the same OpenMP loop.
constexpr uint32_t kHeads = 8;

void BM_louver_heads(benchmark::State& state) {
  const uint64_t n = state.range(0);
  const bool brute = state.range(1) != 0;
  LouverQuery query = query_of(3);
  std::vector<std::unique_ptr<LouverIndex>> heads;
  for (uint32_t h = 0; h < kHeads; ++h)
    heads.push_back(std::make_unique<LouverIndex>(index_of(n, 4, LouverSplit::pca)));
  std::vector<LouverIndex*> ptrs;
  for (auto& h : heads) ptrs.push_back(h.get());
  const Data& d = data(n);
  std::vector<const float*> q(kHeads);
  std::vector<LouverResult> results(kHeads);
  std::vector<float> taus(kQueries);
  for (uint32_t t = 0; t < kQueries; ++t)
    taus[t] = heads[0]->query(d.queries.data() + t * kDim, 1, query).tau[0];
  std::vector<std::vector<uint32_t>> out(kHeads, std::vector<uint32_t>(n));
  std::vector<uint32_t> counts(kHeads);
  uint32_t t = 0;
  ThreadPool pool(0);
  for (auto _ : state) {
    for (uint32_t h = 0; h < kHeads; ++h) q[h] = d.queries.data() + ((t + h) % kQueries) * kDim;
    if (brute) {
      pool.parallel_for(kHeads, 1, [&](uint64_t h, uint64_t, int) noexcept {
        counts[h] = heads[h]->scan(q[h], 1, &taus[(t + h) % kQueries], out[h].data());
      });
    } else {
      louver_query_many(ptrs, q.data(), 1, query, results.data(), pool);
    }
    ++t;
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * int64_t(n) * kHeads);
  state.SetLabel(brute ? "brute-force scan" : "louver");
}

void BM_louver_build(benchmark::State& state) {
  const uint64_t n = state.range(0);
  const Data& d = data(n);
  const LouverParams p = params_of(uint32_t(state.range(1)), LouverSplit(state.range(2)));
  for (auto _ : state) {
    LouverIndex index(p, d.keys.data(), n);
    benchmark::DoNotOptimize(index.n_clusters());
  }
  state.counters["ns_per_key"] =
      benchmark::Counter(double(n) * 1e-9, benchmark::Counter::kIsIterationInvariantRate |
                                               benchmark::Counter::kInvert);
  state.SetItemsProcessed(state.iterations() * int64_t(n));
}

// Decode steps: each iteration appends one key to an index over 40K keys; every 256th flushes.
void BM_louver_append(benchmark::State& state) {
  const uint64_t n = 40960, extra = 1 << 16;
  Random random(7);
  const std::vector<float> more = make_keys(extra, random);
  const LouverParams p = params_of(4, LouverSplit(state.range(0)));
  auto index = std::make_unique<LouverIndex>(p, data(n).keys.data(), n);
  index->reserve(n + extra);
  uint64_t i = 0;
  for (auto _ : state) {
    if (i == extra) {
      state.PauseTiming();
      index = std::make_unique<LouverIndex>(p, data(n).keys.data(), n);
      index->reserve(n + extra);
      i = 0;
      state.ResumeTiming();
    }
    index->append(more.data() + (i++) * kDim);
  }
  state.SetItemsProcessed(state.iterations());
}

void query_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "gate", "r", "split", "S", "f_permille"});
  for (int64_t n : {40960, 131072}) {
    for (int64_t gate : {3, 0, 1, 2}) b->Args({n, gate, 4, 0, 4, 100});
    for (int64_t S : {8, 16, 32}) b->Args({n, 0, 4, 0, S, 100});
    b->Args({n, 0, 8, 0, 16, 100});
    b->Args({n, 0, 4, 1, 16, 100});
    // A tail threshold (1% of the sample), where the bounds can prune.
    for (int64_t S : {4, 16}) b->Args({n, 3, 4, 0, S, 10});
  }
}

BENCHMARK(BM_louver_query)->Apply(query_args)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_louver_scan)
    ->ArgNames({"n", "f_permille"})
    ->ArgsProduct({{40960, 131072}, {100, 10}})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_louver_heads)
    ->ArgNames({"n", "brute"})
    ->ArgsProduct({{40960, 131072}, {0, 1}})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_louver_build)
    ->ArgNames({"n", "r", "split"})
    ->Args({40960, 4, 0})
    ->Args({40960, 4, 1})
    ->Args({131072, 4, 0})
    ->UseRealTime()  // the build runs one OpenMP task per subspace
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_louver_append)->ArgNames({"split"})->Arg(0)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
