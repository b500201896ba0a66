// Louver's filter pass (lib/select/louver_index.hpp: the cluster bounds and the per-key summed
// bound, the part of a query before the exact check) on the CPU against the device
// (gpu/louver_filter.hpp), for one layer's batch of 8 indexes (8 KV heads, or 8 sequences of one
// head), d = 128, structured keys (bench/key_maker.hpp), each index its own GQA query of G heads
// and its own tau from the sample oracle.
//   BM_louver_filter_cpu  LouverIndex::filter_mask on every index, one OpenMP iteration per index
//                         (as louver_query_many runs queries).
//   BM_louver_filter_gpu  LouverFilter::run on the batch: the upload of the queries and terms, the
//                         two kernels and the copy of the masks back, waited for. Counters:
//                         us_device (events around the device work), cpu_over_gpu (the CPU case's
//                         time over this one's, measured here before the loop), masks_equal (the
//                         device's masks against the CPU's, 1 when every bit matches).
// Both: items = keys filtered (per second: keys/s over the batch), kept = the share of indexed keys
// the bounds keep (the candidates the host then checks exactly). The sample-oracle tau is chosen
// on the host in both modes and is not timed. Run on the GPU machine:
//   kvsift-bench-gpu-louver --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>
#include <omp.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "bench/key_maker.hpp"
#include "gpu/host_memory.hpp"
#include "gpu/louver_filter.hpp"
#include "lib/select/louver_index.hpp"
#include "lib/select/louver_selector.hpp"

namespace {

using namespace kvsift;

constexpr uint32_t kDim = 128, kIndexes = 8, kMaxGroup = 4;

const std::vector<float>& keys_of(uint64_t n) {
  static std::map<uint64_t, std::vector<float>> cache;
  auto& keys = cache[n];
  if (keys.empty()) {
    bench::KeyMaker maker(bench::Shape{"bench", 1, 1, kDim}, bench::kSeed + n);
    std::vector<float> v;
    maker.make(0, static_cast<uint32_t>(n), keys, v);
  }
  return keys;
}

// One index per (n, S), built once for the process (a 128K build takes a while); the batch holds
// copies of it, each with its own query.
const LouverIndex& index_of(uint64_t n, uint32_t S) {
  static std::map<std::pair<uint64_t, uint32_t>, std::unique_ptr<LouverIndex>> cache;
  auto& slot = cache[{n, S}];
  if (!slot) {
    LouverParams params;
    params.head_dim = kDim;
    params.n_subspaces = S;
    params.max_group = kMaxGroup;
    slot = std::make_unique<LouverIndex>(params, keys_of(n).data(), n);
  }
  return *slot;
}

// The batch of one case: indexes, queries (needles plus noise, as bench_louver.cpp's), each
// index's gate terms for its tau, and the same laid out for the device filter.
struct Batch {
  std::vector<std::unique_ptr<LouverIndex>> indexes;
  std::vector<std::vector<float>> q, q_norm, t;
  std::vector<std::vector<LouverGateTerms>> terms;
  std::vector<std::vector<uint32_t>> masks;
  uint32_t group = 1;

  Batch(uint64_t n, uint32_t S, uint32_t group_, float fraction) : group(group_) {
    const std::vector<float>& keys = keys_of(n);
    bench::Random random(n + S);
    LouverQuery query;
    query.fraction = fraction;
    for (uint32_t i = 0; i < kIndexes; ++i) {
      indexes.push_back(std::make_unique<LouverIndex>(index_of(n, S)));
      std::vector<float> qi(std::size_t{group} * kDim, 0.0f);
      for (uint32_t g = 0; g < group; ++g) {
        float* row = qi.data() + std::size_t{g} * kDim;
        for (uint32_t j = 0; j < 4; ++j) {
          const uint64_t needle = uint64_t((random.uniform() + 1.0f) * 0.5f * n) % n;
          for (uint32_t c = 0; c < kDim; ++c) row[c] += 0.1f * keys[needle * kDim + c];
        }
        for (uint32_t c = 0; c < kDim; ++c) row[c] += 0.2f * random.uniform();
      }
      terms.emplace_back(group);
      indexes[i]->begin_query(qi.data(), group, query, terms[i].data());
      q_norm.emplace_back(std::size_t{group} * simd::kLouverMaxSubspaces);
      t.emplace_back(group);
      for (uint32_t g = 0; g < group; ++g) {
        std::copy_n(terms[i][g].q_norm, simd::kLouverMaxSubspaces,
                    q_norm[i].data() + std::size_t{g} * simd::kLouverMaxSubspaces);
        t[i][g] = terms[i][g].t;
      }
      q.push_back(std::move(qi));
      masks.emplace_back((n + 31) / 32);
    }
  }

  void filter_on_cpu() {
#pragma omp parallel for schedule(dynamic)
    for (int i = 0; i < int(kIndexes); ++i)
      indexes[i]->filter_mask(q[i].data(), group, terms[i].data(), masks[i].data());
  }

  double kept_share() const {
    uint64_t kept = 0, total = 0;
    for (uint32_t i = 0; i < kIndexes; ++i) {
      for (uint32_t w : masks[i]) kept += std::popcount(w);
      total += indexes[i]->indexed();
    }
    return double(kept) / double(total);
  }
};

void set_common(benchmark::State& state, const Batch& batch, uint64_t n) {
  state.SetItemsProcessed(state.iterations() * int64_t(n) * kIndexes);
  state.counters["kept"] = batch.kept_share();
}

void BM_louver_filter_cpu(benchmark::State& state) {
  const uint64_t n = state.range(0);
  Batch batch(n, uint32_t(state.range(1)), uint32_t(state.range(2)), state.range(3) * 1e-3f);
  for (auto _ : state) {
    batch.filter_on_cpu();
    benchmark::ClobberMemory();
  }
  set_common(state, batch, n);
  state.SetLabel(std::string(simd::level_name(batch.indexes[0]->kernels().level)) + ", " +
                 std::to_string(omp_get_max_threads()) + " threads");
}

void BM_louver_filter_gpu(benchmark::State& state) {
  int n_devices = 0;
  const gpu::Result present = gpu::device_count(&n_devices);
  if (!present.ok) {
    state.SkipWithError(("no GPU: " + present.message).c_str());
    return;
  }
  const uint64_t n = state.range(0);
  Batch batch(n, uint32_t(state.range(1)), uint32_t(state.range(2)), state.range(3) * 1e-3f);
  gpu::LouverFilter filter;
  gpu::LouverFilterShape shape;
  shape.head_dim = kDim;
  shape.max_group = kMaxGroup;
  shape.max_items = kIndexes;
  gpu::Result r = filter.init(0, shape);
  for (uint32_t i = 0; r.ok && i < kIndexes; ++i)
    r = filter.sync(i, select::louver_device_view(*batch.indexes[i]));
  std::vector<gpu::LouverFilterItem> items;
  for (uint32_t i = 0; i < kIndexes; ++i)
    items.push_back(gpu::LouverFilterItem{i, batch.group, batch.q[i].data(), batch.q_norm[i].data(),
                                          batch.t[i].data()});
  if (r.ok) r = filter.validate(items.data(), kIndexes);
  if (r.ok) r = filter.run(items.data(), kIndexes);  // warm-up
  if (!r.ok) {
    state.SkipWithError(r.message.c_str());
    return;
  }
  // The CPU's time for the same batch (best of 5), and its masks to compare with the device's.
  using Clock = std::chrono::steady_clock;
  double cpu_s = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const auto start = Clock::now();
    batch.filter_on_cpu();
    cpu_s = std::min(cpu_s, std::chrono::duration<double>(Clock::now() - start).count());
  }
  bool equal = true;
  for (uint32_t i = 0; i < kIndexes; ++i)
    equal = equal && std::equal(batch.masks[i].begin(), batch.masks[i].end(), filter.mask(i));
  double wall_s = 0.0, device_ms = 0.0;
  for (auto _ : state) {
    const auto start = Clock::now();
    r = filter.run(items.data(), kIndexes);
    wall_s += std::chrono::duration<double>(Clock::now() - start).count();
    device_ms += filter.last_run_ms();
    if (!r.ok) {
      state.SkipWithError(r.message.c_str());
      break;
    }
  }
  const double iters = double(state.iterations());
  set_common(state, batch, n);
  state.counters["us_device"] = device_ms * 1e3 / iters;
  state.counters["cpu_over_gpu"] = cpu_s / (wall_s / iters);
  state.counters["masks_equal"] = equal ? 1.0 : 0.0;
  state.counters["device_MB"] = double(filter.device_bytes()) / 1e6;
}

void filter_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"n", "S", "G", "f_permille"});
  for (int64_t n : {8192, 32768, 131072})
    for (int64_t S : {4, 16}) {
      for (int64_t G : {1, 4}) b->Args({n, S, G, 100});
      b->Args({n, S, 4, 10});  // a tail threshold, where the bounds prune
    }
}

BENCHMARK(BM_louver_filter_cpu)->Apply(filter_args)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_louver_filter_gpu)->Apply(filter_args)->UseRealTime()->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
