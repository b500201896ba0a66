// The device page cache's bookkeeping (gpu/page_residency.hpp) on the CPU alone: plan() over a
// LOCKS-like decode trace, the host time every offload step spends before its first copy.
//
// The trace: one Llama-3.1-8B layer at 128K tokens (8 KV heads x 8192 16-token pages per
// sequence), LOCKS at 2%: each (sequence, KV head) lists 164 pages a step, the sink page, the last
// 4 pages (the window) and 159 others, of which each step swaps ~10% for pages it did not list
// (a drifting selection: ~90% of a step's pages were listed the step before, the slow drift of
// bench/bench_gpu_transfer.cpp). Each pair's list is ascending, as the selectors write it. Host
// slots are spread as in a real pool, where every layer's pages are interleaved with 31 other
// layers': host slot = (page * batch + sequence) * 256 + layer * 8 + head, a pool of
// 2^21 * batch slots. The device cache holds 5 steps' pages (OffloadOptions.cache_pages as
// bench/bench_offload.cpp sizes it).
//
// One iteration replays the trace forward then backward (steps 0..S-1, S-1..0), a cycle whose
// every step overlaps the one before as the trace does, so there is no cold step in the timing;
// one cycle runs before the timed loop. Counters: ns_per_page (plan time over the pages listed),
// hit_rate (distinct pages).
//
// BM_plan/<policy>/batch:<b>/layers:<L>: plan() alone. With layers:32, 32 residencies (one per
// layer, as OffloadAttention keeps) step in turn, each on its own layer's host slots, so each
// finds its tables where 31 other layers' steps left the caches, as in a decode step.
// BM_plan_refresh/...: plan() then the refresh scan lib/offload/offload_attention.cpp's
// enqueue_part runs right after it (copied tokens per device slot), timed together as its
// plan_us is.
//
//   kvsift-bench-residency --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
//
// Measured on a 2-vCPU Xeon (Sapphire Rapids, KVM), BM_plan ns per page, median of 9 (3 runs of
// 3, old and new binaries alternating), hit rate 0.95: before (linear probing, a seen set, one
// virtual on_use a page) -> after (gpu/page_residency.hpp's buckets, pending misses, batched
// on_use): one layer, clock 14.4 -> 8.4 (batch 1), 15.7 -> 8.0 (batch 8); lru 14.0 -> 8.6,
// 16.9 -> 10.7. 32 layers in turn: clock 13.1 -> 10.9, 26.1 -> 25.0; lru 16.0 -> 14.1,
// 45.6 -> 38.6 (these vary by up to 2x from run to run on this shared machine).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu/page_residency.hpp"

namespace {

using namespace kvsift;

constexpr uint32_t kHeads = 8;
constexpr uint32_t kPagesPerHead = 131072 / 16;
constexpr uint32_t kListed = 164;  // 2% of 8192
constexpr uint32_t kSinkPages = 1, kWindowPages = 4;
constexpr uint32_t kSwapped = 16;  // of the 159 selected pages, swapped each step: ~90% overlap
constexpr uint32_t kSteps = 96;
constexpr uint32_t kPoolLayers = 32;
constexpr uint32_t kPageTokens = 16;
constexpr uint32_t kCachePagesPerStep = 5;

// Per step, the listed pages of each (sequence, KV head) pair, as page indices in that pair.
struct Trace {
  uint32_t batch = 0;
  std::vector<std::vector<uint32_t>> pages;  // [step][pair * kListed + i]
  double overlap = 0.0;
};

const Trace& trace(uint32_t batch) {
  static std::vector<std::unique_ptr<Trace>> traces(9);
  if (traces[batch]) return *traces[batch];
  auto tr = std::make_unique<Trace>();
  tr->batch = batch;
  std::mt19937_64 rng(0x6b7673696674 + batch);
  const uint32_t pairs = batch * kHeads, first = kSinkPages, end = kPagesPerHead - kWindowPages;
  const uint32_t chosen = kListed - kSinkPages - kWindowPages;
  // Per pair, the chosen middle pages and a membership flag.
  std::vector<std::vector<uint32_t>> picks(pairs);
  std::vector<std::vector<uint8_t>> in(pairs, std::vector<uint8_t>(kPagesPerHead, 0));
  auto pick_new = [&](uint32_t pair) {
    for (;;) {
      const auto p = static_cast<uint32_t>(first + rng() % (end - first));
      if (!in[pair][p]) {
        in[pair][p] = 1;
        return p;
      }
    }
  };
  for (uint32_t pair = 0; pair < pairs; ++pair)
    for (uint32_t i = 0; i < chosen; ++i) picks[pair].push_back(pick_new(pair));
  uint64_t shared = 0, listed = 0;
  for (uint32_t t = 0; t < kSteps; ++t) {
    std::vector<uint32_t> step;
    for (uint32_t pair = 0; pair < pairs; ++pair) {
      if (t > 0)
        for (uint32_t k = 0; k < kSwapped; ++k) {
          const std::size_t i = rng() % chosen;
          const uint32_t fresh = pick_new(pair);
          in[pair][picks[pair][i]] = 0;
          picks[pair][i] = fresh;
        }
      std::vector<uint32_t> list(picks[pair]);
      for (uint32_t p = 0; p < kSinkPages; ++p) list.push_back(p);
      for (uint32_t p = end; p < kPagesPerHead; ++p) list.push_back(p);
      std::sort(list.begin(), list.end());
      step.insert(step.end(), list.begin(), list.end());
    }
    if (t > 0) {
      const std::vector<uint32_t>& last = tr->pages.back();
      for (uint32_t pair = 0; pair < pairs; ++pair) {
        const auto a = last.begin() + pair * kListed;
        const auto b = step.cbegin() + pair * kListed;
        std::vector<uint32_t> both;
        std::set_intersection(a, a + kListed, b, b + kListed, std::back_inserter(both));
        shared += both.size();
      }
      listed += step.size();
    }
    tr->pages.push_back(std::move(step));
  }
  tr->overlap = static_cast<double>(shared) / static_cast<double>(listed);
  traces[batch] = std::move(tr);
  return *traces[batch];
}

// The trace's host slots for one layer: [step][i].
std::vector<std::vector<uint32_t>> host_slots(const Trace& tr, uint32_t layer) {
  std::vector<std::vector<uint32_t>> out;
  for (const std::vector<uint32_t>& step : tr.pages) {
    std::vector<uint32_t> ids(step.size());
    for (std::size_t i = 0; i < step.size(); ++i) {
      const auto pair = static_cast<uint32_t>(i / kListed);
      const uint32_t seq = pair / kHeads, head = pair % kHeads;
      ids[i] = ((step[i] * tr.batch + seq) * 256) + layer * 8 + head;
    }
    out.push_back(std::move(ids));
  }
  return out;
}

// lib/offload/offload_attention.cpp's refresh scan after a plan: pages whose copy holds fewer
// tokens than the host page go again. Here every listed page is full (B tokens) and the last of
// each pair is the open page, one token longer each step.
constexpr uint32_t kFresh = 0xffffffffu;
uint32_t refresh_scan(const gpu::PageResidency& residency, const uint32_t* ids,
                      const uint32_t* slots, uint32_t pairs, uint32_t open_tokens, uint32_t* tokens,
                      gpu::PageMove* refresh) {
  for (const gpu::PageMove& move : residency.moves()) tokens[move.device_slot] = kFresh;
  uint32_t n_refresh = 0;
  const uint32_t n = pairs * kListed;
  constexpr uint32_t kAhead = 16;
  for (uint32_t pair = 0; pair < pairs; ++pair)
    for (uint32_t i = pair * kListed; i < (pair + 1) * kListed; ++i) {
      if (i + kAhead < n) __builtin_prefetch(&tokens[slots[i + kAhead]], 1);
      const uint32_t slot = slots[i];
      const uint32_t held = i + 1 == (pair + 1) * kListed ? open_tokens : kPageTokens;
      if (tokens[slot] != kFresh && tokens[slot] < held)
        refresh[n_refresh++] = gpu::PageMove{ids[i], slot};
      tokens[slot] = held;
    }
  return n_refresh;
}

void BM_plan(benchmark::State& state, gpu::EvictionPolicy policy, bool with_refresh) {
  const auto batch = static_cast<uint32_t>(state.range(0));
  const auto layers = static_cast<uint32_t>(state.range(1));
  const Trace& tr = trace(batch);
  const uint32_t pairs = batch * kHeads, step_pages = pairs * kListed;
  const uint32_t capacity = kCachePagesPerStep * step_pages;
  const uint64_t pool = uint64_t{kPagesPerHead} * batch * 256;
  std::vector<std::vector<std::vector<uint32_t>>> ids(layers);
  std::vector<gpu::PageResidency> residency(layers);
  std::vector<std::vector<uint32_t>> tokens(layers, std::vector<uint32_t>(capacity, 0));
  for (uint32_t l = 0; l < layers; ++l) {
    ids[l] = host_slots(tr, l * (kPoolLayers / layers));
    if (const gpu::Result r = residency[l].init(capacity, pool, policy); !r.ok) {
      state.SkipWithError(r.message.c_str());
      return;
    }
  }
  std::vector<uint32_t> slots(step_pages);
  std::vector<gpu::PageMove> refresh(step_pages);
  uint64_t hits = 0, misses = 0, refreshed = 0, open_tokens = 0;
  bool ok = true;
  auto cycle = [&] {
    for (uint32_t k = 0; k < 2 * kSteps; ++k) {
      const uint32_t t = k < kSteps ? k : 2 * kSteps - 1 - k;
      open_tokens = open_tokens % kPageTokens + 1;
      for (uint32_t l = 0; l < layers; ++l) {
        const uint32_t* step = ids[l][t].data();
        ok &= residency[l].plan(step, step_pages, slots.data()).ok;
        hits += residency[l].last_counts().hits;
        misses += residency[l].last_counts().misses;
        if (with_refresh)
          refreshed +=
              refresh_scan(residency[l], step, slots.data(), pairs,
                           static_cast<uint32_t>(open_tokens), tokens[l].data(), refresh.data());
        benchmark::DoNotOptimize(slots.data());
      }
    }
  };
  cycle();
  hits = misses = refreshed = 0;
  for (auto _ : state) cycle();
  if (!ok) {
    state.SkipWithError("a plan was refused");
    return;
  }
  const double pages = static_cast<double>(state.iterations()) * 2 * kSteps * layers * step_pages;
  state.counters["ns_per_page"] =
      benchmark::Counter(pages * 1e-9, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["hit_rate"] = static_cast<double>(hits) / static_cast<double>(hits + misses);
  state.counters["overlap"] = tr.overlap;
  state.counters["pages_per_step"] = step_pages;
  if (with_refresh)
    state.counters["refreshed_per_step"] =
        static_cast<double>(refreshed) /
        (static_cast<double>(state.iterations()) * 2 * kSteps * layers);
}

void register_all() {
  for (const bool with_refresh : {false, true})
    for (const gpu::EvictionPolicy policy :
         {gpu::EvictionPolicy::clock, gpu::EvictionPolicy::lru}) {
      const std::string name = std::string(with_refresh ? "BM_plan_refresh/" : "BM_plan/") +
                               gpu::eviction_policy_name(policy);
      benchmark::RegisterBenchmark(name.c_str(), BM_plan, policy, with_refresh)
          ->ArgNames({"batch", "layers"})
          ->ArgsProduct({{1, 8}, {1, 32}})
          ->Unit(benchmark::kMicrosecond)
          ->MinTime(0.2);
    }
}

}  // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
