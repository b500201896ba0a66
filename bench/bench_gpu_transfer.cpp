// The transfer engine (gpu/page_transfer.hpp): throughput of each path against a plain pinned
// copy, and the page cache's hit rates and bytes per step on a decode-like access pattern.
//
// BM_gpu_transfer/<path>/page:<bytes>/pages:<n>: every iteration asks a cache of n slots for n
// pages it does not hold (the next n of a shuffled walk over a 1 GiB mapped pinned pool), so all
// n move; the time is wall clock from ensure() to the stream's completion, CPU gather included.
// Paths: staged (4 MiB chunks, the CPU gathering chunk c + 1 while chunk c crosses), staged_1copy
// (one chunk: one gather, one copy, one scatter), mapped (the GPU reads the pool), and copy (one
// cudaMemcpyAsync of n * page contiguous pinned bytes, timed the same way: the link's ceiling).
// Each path case also times that plain copy 9 times right after its loop and reports `of_copy`,
// its GB/s over the copy's median GB/s in the same run.
//
// BM_gpu_transfer_pool/gib:<g>: the mapped path from a pool of a KV cache's size (below).
//
// BM_page_cache_hit_rate/<drift>/<policy>/cap_pct:<c> (CPU only): one layer of Llama-3.1-8B (8 KV
// heads, 16-token pages of 8 KiB) decoding 256 steps from 128K tokens. Each KV head selects 2% of
// its pages per step as LOCKS would: the sink page, the last 4 pages (the window) and the top pages
// by a score q . k_p + b_p, where k_p is a page's 32-dim summary (Gaussian), b_p a persistent
// per-page salience (Gaussian, as heavy hitters stay relevant) and q the query, which drifts each
// step: q <- normalise(sqrt(1 - a^2) q + a g), g a random unit vector. drift slow a = 0.15, fast
// a = 0.4; `overlap` reports the share of a step's pages the previous step also selected (0.90 and
// 0.73; ShadowKV reports ~60% step-to-step reuse, nearer fast: docs/platform-notes.md). The
// cache holds c% of a step's distinct pages; `hit_rate` counts distinct pages over steps 1..255
// (step 0 is cold), `MB_per_step` the misses' bytes. policy opt is Belady's offline optimum
// (evict the page needed furthest in the future), the ceiling for any policy.
//
// BM_gpu_transfer_decode/<drift>/<policy>/cap_pct:<c>/<path>: that trace through a real
// DevicePageCache, each step synchronised: microseconds per step, MB and hit rate per step.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "gpu/host_memory.hpp"
#include "gpu/page_residency.hpp"
#include "gpu/page_transfer.hpp"

namespace {

using namespace kvsift;
using namespace kvsift::bench;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kPoolBytes = std::size_t{1} << 30;
constexpr std::size_t kPageSizes[] = {4096, 8192};
constexpr uint32_t kPageCounts[] = {8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096};
constexpr int kCopyProbes = 9;

std::string cuda_error(cudaError_t err, const char* what) {
  return err == cudaSuccess ? "" : std::string(what) + ": " + cudaGetErrorString(err);
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// ---- The decode trace
// ----------------------------------------------------------------------------

constexpr uint32_t kHeads = 8;
constexpr uint32_t kSummaryDim = 32;
constexpr uint64_t kStartTokens = 131072;
constexpr uint32_t kSteps = 256;
constexpr uint32_t kTracePageTokens = 16;
constexpr uint32_t kSinkPages = 1;
constexpr uint32_t kWindowPages = 4;
constexpr double kBudget = 0.02;
constexpr std::size_t kTraceSlotBytes = 8192;  // 16 tokens x 128 dims x K, V x bf16
// Host slot of (head, page): head * kHeadStride + page, one layer's pages in one pool.
constexpr uint32_t kHeadStride = 8704;  // > (kStartTokens + kSteps) / kTracePageTokens

struct Trace {
  std::vector<std::vector<uint32_t>> steps;  // host slots per step, distinct
  double overlap = 0.0;                      // mean share of step t's pages also in step t - 1
  std::size_t max_pages = 0;                 // most distinct pages of a step
};

Trace make_trace(double drift) {
  std::mt19937_64 rng(kSeed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const uint32_t max_pages = kHeadStride;
  std::vector<float> keys(std::size_t{kHeads} * max_pages * kSummaryDim);
  std::vector<float> salience(std::size_t{kHeads} * max_pages);
  for (float& x : keys) x = normal(rng);
  for (float& x : salience) x = normal(rng);
  std::vector<float> q(std::size_t{kHeads} * kSummaryDim);
  auto normalise = [](float* v) {
    double norm = 0.0;
    for (uint32_t i = 0; i < kSummaryDim; ++i) norm += double(v[i]) * v[i];
    const float inv = static_cast<float>(1.0 / std::sqrt(norm));
    for (uint32_t i = 0; i < kSummaryDim; ++i) v[i] *= inv;
  };
  for (float& x : q) x = normal(rng);
  for (uint32_t h = 0; h < kHeads; ++h) normalise(&q[h * kSummaryDim]);

  Trace trace;
  std::vector<float> scores;
  std::vector<uint32_t> order;
  double overlap_sum = 0.0;
  for (uint32_t t = 0; t < kSteps; ++t) {
    const uint64_t tokens = kStartTokens + t;
    const auto pages = static_cast<uint32_t>((tokens + kTracePageTokens - 1) / kTracePageTokens);
    const auto budget = static_cast<uint32_t>(std::lround(kBudget * pages));
    std::vector<uint32_t> step;
    for (uint32_t h = 0; h < kHeads; ++h) {
      float* qh = &q[h * kSummaryDim];
      if (t > 0) {
        float g[kSummaryDim];
        for (float& x : g) x = normal(rng);
        normalise(g);
        const float keep = static_cast<float>(std::sqrt(1.0 - drift * drift));
        for (uint32_t i = 0; i < kSummaryDim; ++i)
          qh[i] = keep * qh[i] + static_cast<float>(drift) * g[i];
        normalise(qh);
      }
      const uint32_t first = kSinkPages, end = pages - kWindowPages;
      scores.resize(pages);
      order.resize(end - first);
      for (uint32_t p = first; p < end; ++p) {
        const float* k = &keys[(std::size_t{h} * max_pages + p) * kSummaryDim];
        float s = salience[std::size_t{h} * max_pages + p];
        for (uint32_t i = 0; i < kSummaryDim; ++i) s += qh[i] * k[i];
        scores[p] = s;
        order[p - first] = p;
      }
      const uint32_t top = budget - kSinkPages - kWindowPages;
      std::nth_element(order.begin(), order.begin() + top, order.end(),
                       [&](uint32_t a, uint32_t b) { return scores[a] > scores[b]; });
      for (uint32_t p = 0; p < kSinkPages; ++p) step.push_back(h * kHeadStride + p);
      for (uint32_t i = 0; i < top; ++i) step.push_back(h * kHeadStride + order[i]);
      for (uint32_t p = end; p < pages; ++p) step.push_back(h * kHeadStride + p);
    }
    if (t > 0) {
      const std::set<uint32_t> last(trace.steps.back().begin(), trace.steps.back().end());
      std::size_t shared = 0;
      for (uint32_t id : step) shared += last.count(id);
      overlap_sum += static_cast<double>(shared) / static_cast<double>(step.size());
    }
    trace.max_pages = std::max(trace.max_pages, step.size());
    trace.steps.push_back(std::move(step));
  }
  trace.overlap = overlap_sum / (kSteps - 1);
  return trace;
}

const Trace& trace(bool fast) {
  static const Trace slow_trace = make_trace(0.15);
  static const Trace fast_trace = make_trace(0.4);
  return fast ? fast_trace : slow_trace;
}

struct Replay {
  uint64_t hits = 0, misses = 0;  // steps 1.. (step 0 is cold)
};

Replay replay_policy(const Trace& tr, gpu::EvictionPolicy policy, uint32_t capacity) {
  gpu::PageResidency residency;
  residency.init(capacity, uint64_t{kHeads} * kHeadStride, policy);
  std::vector<uint32_t> slots(tr.max_pages);
  Replay r;
  for (std::size_t t = 0; t < tr.steps.size(); ++t) {
    residency.plan(tr.steps[t].data(), tr.steps[t].size(), slots.data());
    if (t == 0) continue;
    r.hits += residency.last_counts().hits;
    r.misses += residency.last_counts().misses;
  }
  return r;
}

// Belady: on a miss with the cache full, evict the resident page whose next use is furthest.
Replay replay_optimal(const Trace& tr, uint32_t capacity) {
  std::map<uint32_t, std::vector<uint32_t>> uses;  // page -> steps that need it, ascending
  for (uint32_t t = 0; t < tr.steps.size(); ++t)
    for (uint32_t id : tr.steps[t]) uses[id].push_back(t);
  auto next_use = [&](uint32_t id, uint32_t after) {
    const std::vector<uint32_t>& u = uses[id];
    const auto it = std::upper_bound(u.begin(), u.end(), after);
    return it == u.end() ? UINT32_MAX : *it;
  };
  std::set<std::pair<uint32_t, uint32_t>> by_next;  // (next use, page) of resident pages
  std::map<uint32_t, uint32_t> resident;            // page -> its key's next use
  Replay r;
  for (uint32_t t = 0; t < tr.steps.size(); ++t) {
    const std::vector<uint32_t>& step = tr.steps[t];
    std::vector<uint32_t> missing;
    for (uint32_t id : step) {
      const auto it = resident.find(id);
      if (it == resident.end()) {
        missing.push_back(id);
        continue;
      }
      by_next.erase({it->second, id});
      it->second = next_use(id, t);
      by_next.insert({it->second, id});
      if (t > 0) ++r.hits;
    }
    // The step's pages now have next uses after t; every other resident page is a candidate,
    // and those with the furthest next use go first.
    for (uint32_t id : missing) {
      if (resident.size() == capacity) {
        auto victim = std::prev(by_next.end());
        resident.erase(victim->second);
        by_next.erase(victim);
      }
      const uint32_t n = next_use(id, t);
      resident[id] = n;
      by_next.insert({n, id});
      if (t > 0) ++r.misses;
    }
  }
  return r;
}

void BM_page_cache_hit_rate(benchmark::State& state, bool fast, int policy, int cap_pct) {
  const Trace& tr = trace(fast);
  const auto capacity = static_cast<uint32_t>(tr.max_pages * cap_pct / 100);
  Replay r;
  double seconds = 0.0;
  for (auto _ : state) {
    const auto start = Clock::now();
    r = policy < 0 ? replay_optimal(tr, capacity)
                   : replay_policy(tr, static_cast<gpu::EvictionPolicy>(policy), capacity);
    seconds += seconds_since(start);
  }
  const double steps = kSteps - 1;
  state.counters["hit_rate"] = static_cast<double>(r.hits) / static_cast<double>(r.hits + r.misses);
  state.counters["MB_per_step"] = static_cast<double>(r.misses) * kTraceSlotBytes / steps * 1e-6;
  state.counters["pages_per_step"] = static_cast<double>(r.hits + r.misses) / steps;
  state.counters["overlap"] = tr.overlap;
  state.counters["capacity"] = capacity;
  // The bookkeeping's own cost per step (plan() for lru and clock; opt is offline).
  state.counters["us_per_step"] = seconds / static_cast<double>(state.iterations()) / kSteps * 1e6;
}

// ---- Device cases
// --------------------------------------------------------------------------------

// The buffers every device case shares: a mapped pinned pool of random bytes (never zeros), the
// plain copy's destination, and a stream.
struct Device {
  std::string error;
  unsigned char* pool = nullptr;
  void* copy_to = nullptr;
  cudaStream_t stream = nullptr;

  Device() { error = setup(); }
  ~Device() {
    gpu::pinned_free(pool);
    cudaFree(copy_to);
    if (stream) cudaStreamDestroy(stream);
  }
  std::string setup() {
    void* p = nullptr;
    if (gpu::Result r = gpu::pinned_alloc(kPoolBytes, &p); !r.ok) return r.message;
    pool = static_cast<unsigned char*>(p);
    Random random(kSeed);
    auto* words = reinterpret_cast<float*>(pool);
    for (std::size_t i = 0; i < kPoolBytes / sizeof(float); ++i) words[i] = random.uniform();
    const std::size_t most = std::size_t{kPageCounts[std::size(kPageCounts) - 1]} * 8192;
    if (auto e = cuda_error(cudaMalloc(&copy_to, most), "copy buffer"); !e.empty()) return e;
    return cuda_error(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  }
  // Wall seconds of one plain pinned copy of `bytes` from `offset` into the pool, synchronised.
  double copy_seconds(std::size_t bytes, std::size_t offset) {
    const auto start = Clock::now();
    cudaMemcpyAsync(copy_to, pool + offset, bytes, cudaMemcpyHostToDevice, stream);
    cudaStreamSynchronize(stream);
    return seconds_since(start);
  }
};

Device& device() {
  static Device held;
  return held;
}

enum class Path { staged, staged_1copy, mapped, copy };
const char* path_name(Path p) {
  switch (p) {
    case Path::staged: return "staged";
    case Path::staged_1copy: return "staged_1copy";
    case Path::mapped: return "mapped";
    default: return "copy";
  }
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

void BM_gpu_transfer(benchmark::State& state, Path path, std::size_t page, uint32_t n) {
  Device& dev = device();
  if (!dev.error.empty()) {
    state.SkipWithError(dev.error.c_str());
    return;
  }
  const std::size_t bytes = std::size_t{n} * page;
  const uint64_t host_slots = kPoolBytes / page;
  gpu::DevicePageCache cache;
  std::vector<uint32_t> walk(host_slots), slots(n);
  if (path != Path::copy) {
    gpu::PageCacheConfig config;
    config.slot_bytes = page;
    config.capacity = n;
    config.host_pool = dev.pool;
    config.host_slots = host_slots;
    config.path = path == Path::mapped ? gpu::TransferPath::mapped : gpu::TransferPath::staged;
    if (path == Path::staged_1copy) config.staging_chunk_bytes = n * (page + 4);
    if (gpu::Result r = cache.init(config); !r.ok) {
      state.SkipWithError(r.message.c_str());
      return;
    }
    std::iota(walk.begin(), walk.end(), 0u);
    std::shuffle(walk.begin(), walk.end(), std::mt19937_64(kSeed + n + page));
  }
  std::size_t cursor = 0;
  // The next n pages of the walk: none of them is in the cache, which holds the previous n.
  auto step = [&]() -> gpu::Result {
    if (cursor + n > walk.size()) cursor = 0;
    const gpu::Result r = cache.ensure(walk.data() + cursor, n, slots.data(), dev.stream);
    cursor += n;
    return r;
  };
  std::size_t copy_offset = 0;
  auto copy = [&]() {
    copy_offset = (copy_offset + bytes) % (kPoolBytes - bytes);
    return dev.copy_seconds(bytes, copy_offset);
  };
  for (int i = 0; i < 3; ++i) {  // warm-up: the first calls page in the staging and fork threads
    if (path == Path::copy) {
      copy();
    } else if (gpu::Result r = step(); !r.ok) {
      state.SkipWithError(r.message.c_str());
      return;
    }
  }
  cudaStreamSynchronize(dev.stream);
  double seconds = 0.0;
  for (auto _ : state) {
    double s = 0.0;
    if (path == Path::copy) {
      s = copy();
    } else {
      const auto start = Clock::now();
      step();
      cudaStreamSynchronize(dev.stream);
      s = seconds_since(start);
    }
    state.SetIterationTime(s);
    seconds += s;
  }
  if (auto e = cuda_error(cudaGetLastError(), "timed loop"); !e.empty()) {
    state.SkipWithError(e.c_str());
    return;
  }
  if (path != Path::copy && cache.totals().hits != 0) {
    state.SkipWithError("a timed step hit the cache: the case measures misses only");
    return;
  }
  std::vector<double> copies;
  for (int i = 0; i < kCopyProbes; ++i) copies.push_back(copy());
  const double gbps =
      static_cast<double>(bytes) * static_cast<double>(state.iterations()) / seconds * 1e-9;
  const double copy_gbps = static_cast<double>(bytes) / median(copies) * 1e-9;
  state.SetBytesProcessed(static_cast<int64_t>(bytes * state.iterations()));
  state.counters["GBps"] = gbps;
  state.counters["copy_GBps"] = copy_gbps;
  state.counters["of_copy"] = gbps / copy_gbps;
  state.counters["bytes"] = static_cast<double>(bytes);
}

// A pool of a KV cache's size: the mapped path's 4,096 random 8 KiB pages a step (32 MiB) from a
// pinned pool of `gib` GiB, against one plain copy of as many contiguous bytes of the same pool.
// A KV pool of tens of GiB spreads a step's reads over far more 4 KiB pages than any translation
// cache holds; this case measures what that costs against a pool of 1 GiB.
void BM_gpu_transfer_pool(benchmark::State& state, std::size_t gib) {
  Device& dev = device();
  if (!dev.error.empty()) {
    state.SkipWithError(dev.error.c_str());
    return;
  }
  constexpr std::size_t kPage = 8192;
  constexpr uint32_t kPages = 4096;
  const std::size_t pool_bytes = gib << 30;
  void* pool = nullptr;
  if (gpu::Result r = gpu::pinned_alloc(pool_bytes, &pool); !r.ok) {
    state.SkipWithError(r.message.c_str());
    return;
  }
  const auto release = [&] { gpu::pinned_free(pool); };
  std::memset(pool, 1, pool_bytes);
  const uint64_t host_slots = pool_bytes / kPage;
  gpu::PageCacheConfig config;
  config.slot_bytes = kPage;
  config.capacity = kPages;
  config.host_pool = pool;
  config.host_slots = host_slots;
  config.path = gpu::TransferPath::mapped;
  gpu::DevicePageCache cache;
  if (gpu::Result r = cache.init(config); !r.ok) {
    state.SkipWithError(r.message.c_str());
    release();
    return;
  }
  std::mt19937_64 rng(kSeed + gib);
  std::vector<uint32_t> ids(kPages), slots(kPages);
  std::vector<double> copies;
  double seconds = 0.0;
  for (auto _ : state) {
    cache.clear();
    for (uint32_t& id : ids) id = static_cast<uint32_t>(rng() % host_slots);  // repeats: rare
    const auto start = Clock::now();
    const gpu::Result r = cache.ensure(ids.data(), ids.size(), slots.data(), dev.stream);
    cudaStreamSynchronize(dev.stream);
    const double s = seconds_since(start);
    if (!r.ok) {
      state.SkipWithError(r.message.c_str());
      break;
    }
    state.SetIterationTime(s);
    seconds += s;
    const std::size_t offset = (rng() % (host_slots - kPages)) * kPage;
    const auto copy_start = Clock::now();
    cudaMemcpyAsync(dev.copy_to, static_cast<unsigned char*>(pool) + offset, kPages * kPage,
                    cudaMemcpyHostToDevice, dev.stream);
    cudaStreamSynchronize(dev.stream);
    copies.push_back(seconds_since(copy_start));
  }
  release();
  const double bytes = static_cast<double>(cache.totals().bytes_moved);
  state.counters["GBps"] = bytes / seconds * 1e-9;
  state.counters["copy_GBps"] = static_cast<double>(kPages * kPage) / median(copies) * 1e-9;
}

// The staged path's CPU half alone: n random 8 KiB pages of the pinned pool into pinned staging
// with T OpenMP threads (0: OpenMP's default), GB/s of pages copied.
void BM_page_gather(benchmark::State& state, uint32_t threads, uint32_t n) {
  Device& dev = device();
  if (!dev.error.empty()) {
    state.SkipWithError(dev.error.c_str());
    return;
  }
  constexpr std::size_t kPage = 8192;
  void* staging = nullptr;
  if (gpu::Result r = gpu::pinned_alloc(n * (kPage + 4), &staging); !r.ok) {
    state.SkipWithError(r.message.c_str());
    return;
  }
  std::vector<uint32_t> walk(kPoolBytes / kPage);
  std::iota(walk.begin(), walk.end(), 0u);
  std::shuffle(walk.begin(), walk.end(), std::mt19937_64(kSeed + n));
  std::vector<gpu::PageMove> moves(n);
  std::size_t cursor = 0;
  auto next = [&]() {
    if (cursor + n > walk.size()) cursor = 0;
    for (uint32_t i = 0; i < n; ++i) moves[i] = {walk[cursor + i], i};
    cursor += n;
  };
  next();
  gpu::gather_pages(dev.pool, kPage, moves.data(), n, staging, threads);
  double seconds = 0.0;
  for (auto _ : state) {
    next();
    const auto start = Clock::now();
    gpu::gather_pages(dev.pool, kPage, moves.data(), n, staging, threads);
    const double s = seconds_since(start);
    state.SetIterationTime(s);
    seconds += s;
  }
  gpu::pinned_free(staging);
  const double bytes = static_cast<double>(n) * kPage * static_cast<double>(state.iterations());
  state.counters["GBps"] = bytes / seconds * 1e-9;
  state.counters["bytes"] = static_cast<double>(n) * kPage;
}

void BM_gpu_transfer_decode(benchmark::State& state, bool fast, gpu::EvictionPolicy policy,
                            int cap_pct, gpu::TransferPath path) {
  Device& dev = device();
  if (!dev.error.empty()) {
    state.SkipWithError(dev.error.c_str());
    return;
  }
  const Trace& tr = trace(fast);
  gpu::PageCacheConfig config;
  config.slot_bytes = kTraceSlotBytes;
  config.capacity = static_cast<uint32_t>(tr.max_pages * cap_pct / 100);
  config.host_pool = dev.pool;
  config.host_slots = kPoolBytes / kTraceSlotBytes;
  config.policy = policy;
  config.path = path;
  std::vector<uint32_t> slots(tr.max_pages);
  gpu::TransferStats totals;
  double seconds = 0.0;
  for (auto _ : state) {
    gpu::DevicePageCache cache;
    if (gpu::Result r = cache.init(config); !r.ok) {
      state.SkipWithError(r.message.c_str());
      return;
    }
    double s = 0.0;
    for (std::size_t t = 0; t < tr.steps.size(); ++t) {
      const auto start = Clock::now();
      cache.ensure(tr.steps[t].data(), tr.steps[t].size(), slots.data(), dev.stream);
      cudaStreamSynchronize(dev.stream);
      if (t > 0) s += seconds_since(start);  // step 0 is the cold fill
    }
    state.SetIterationTime(s);
    seconds += s;
    totals = cache.totals();
  }
  if (auto e = cuda_error(cudaGetLastError(), "decode replay"); !e.empty()) {
    state.SkipWithError(e.c_str());
    return;
  }
  const double steps = static_cast<double>(totals.steps);
  state.counters["us_per_step"] =
      seconds / static_cast<double>(state.iterations()) / (kSteps - 1) * 1e6;
  state.counters["MB_per_step"] = static_cast<double>(totals.bytes_moved) / steps * 1e-6;
  state.counters["hit_rate_all"] = totals.hit_rate();  // step 0's cold misses included
  state.counters["mapped_steps"] = static_cast<double>(totals.mapped_steps);
  state.counters["staged_steps"] = static_cast<double>(totals.staged_steps);
}

double min_of(const std::vector<double>& v) {
  return *std::min_element(v.begin(), v.end());
}
double max_of(const std::vector<double>& v) {
  return *std::max_element(v.begin(), v.end());
}

void register_benchmarks() {
  for (bool fast : {false, true})
    for (int policy : {static_cast<int>(gpu::EvictionPolicy::lru),
                       static_cast<int>(gpu::EvictionPolicy::clock), -1})
      for (int cap_pct : {100, 125, 150, 200, 400}) {
        const std::string name =
            std::string("BM_page_cache_hit_rate/") + (fast ? "fast" : "slow") + "/" +
            (policy < 0 ? "opt"
                        : gpu::eviction_policy_name(static_cast<gpu::EvictionPolicy>(policy))) +
            "/cap_pct:" + std::to_string(cap_pct);
        // Deterministic: one run, whatever --benchmark_repetitions says.
        benchmark::RegisterBenchmark(name.c_str(), BM_page_cache_hit_rate, fast, policy, cap_pct)
            ->Iterations(1)
            ->Repetitions(1)
            ->Unit(benchmark::kMillisecond);
      }
  for (std::size_t page : kPageSizes)
    for (uint32_t n : kPageCounts)
      for (Path path : {Path::staged, Path::staged_1copy, Path::mapped, Path::copy}) {
        // One chunk differs from the chunked staging only past one 4 MiB chunk.
        if (path == Path::staged_1copy && n * (page + 4) <= (std::size_t{4} << 20)) continue;
        const std::string name = std::string("BM_gpu_transfer/") + path_name(path) +
                                 "/page:" + std::to_string(page) + "/pages:" + std::to_string(n);
        benchmark::RegisterBenchmark(name.c_str(), BM_gpu_transfer, path, page, n)
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond)
            ->ComputeStatistics("min", min_of)
            ->ComputeStatistics("max", max_of);
      }
  for (std::size_t gib : {1, 48})
    benchmark::RegisterBenchmark(("BM_gpu_transfer_pool/gib:" + std::to_string(gib)).c_str(),
                                 BM_gpu_transfer_pool, gib)
        ->UseManualTime()
        ->Iterations(40)
        ->Unit(benchmark::kMicrosecond);
  for (uint32_t threads : {1u, 4u, 8u, 16u, 0u})
    for (uint32_t n : {512u, 4096u}) {
      const std::string name = "BM_page_gather/threads:" + std::to_string(threads) +
                               "/page:8192/pages:" + std::to_string(n);
      benchmark::RegisterBenchmark(name.c_str(), BM_page_gather, threads, n)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond)
          ->ComputeStatistics("min", min_of)
          ->ComputeStatistics("max", max_of);
    }
  for (bool fast : {false, true})
    for (gpu::EvictionPolicy policy : {gpu::EvictionPolicy::lru, gpu::EvictionPolicy::clock})
      for (gpu::TransferPath path :
           {gpu::TransferPath::automatic, gpu::TransferPath::staged, gpu::TransferPath::mapped}) {
        const std::string name = std::string("BM_gpu_transfer_decode/") + (fast ? "fast" : "slow") +
                                 "/" + gpu::eviction_policy_name(policy) + "/cap_pct:150/" +
                                 gpu::transfer_path_name(path);
        benchmark::RegisterBenchmark(name.c_str(), BM_gpu_transfer_decode, fast, policy, 150, path)
            ->UseManualTime()
            ->Iterations(2)
            ->Unit(benchmark::kMillisecond);
      }
}

std::string device_name() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "(none)";
  return std::string(prop.name) + ", " + std::to_string(prop.multiProcessorCount) + " SMs";
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_benchmarks();
  benchmark::AddCustomContext("gpu", device_name());
  benchmark::AddCustomContext("omp_max_threads", std::to_string(omp_get_max_threads()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
