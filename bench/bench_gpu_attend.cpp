// GPU sparse paged decode attention (gpu/sparse_attention.hpp) with the pages resident in device
// memory, against the device's own copy bandwidth.
//
// Shape: one Llama-3.1-8B layer (32 query heads, 8 KV heads, head_dim 128, 16-token pages, bf16).
// Cases: contexts 32K and 128K, batch 1 and 8, 2% and 100% of each (sequence, KV head)'s pages
// listed in the page form, and the 2% selections also as token lists. The page-form cases run
// under each tuning of kTunings (gpu::AttendTuning, `/tune:<ctas_per_sm>x<min_tiles>x<chunks>` in
// the name; 0 CTAs per multiprocessor is the kernel's occupancy; 0x2x1 is the default), so that
// one run shows which split and row layout serve selective and dense calls best. Each case draws 8
// page lists at random from one 4 GiB pool (far past the 60 MB L2, so a call streams from HBM as a
// decode step would) and times one CUDA graph of the 8 calls with events; the time shown is per
// call.
//
// A call reads each listed K/V byte once, so its ceiling is HBM bandwidth. Each case reports
// `TBps` (K+V bytes of the listed tokens per second; q, out, lists and split partials are not
// counted) and `of_copy`, that over the device-to-device copy bandwidth (bytes read + written)
// measured around the same repetition: the median of five 1 GiB copies, three before its timed
// loop and two after. Run with repetitions for medians and spread (min, max):
//
//   kvsift-bench-gpu-attend --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "gpu/sparse_attention.hpp"
#include "simd/half.hpp"

namespace {

using namespace kvsift;
using namespace kvsift::bench;

constexpr Shape kShape = kLlama8b;
constexpr uint64_t kContexts[] = {32768, 131072};
constexpr uint32_t kBatches[] = {1, 8};
constexpr double kSelections[] = {0.02, 1.0};
// (ctas_per_sm, min_tiles_per_split, chunks_per_lane): the default first; longer splits; several
// waves; two pieces a lane, alone and with longer splits.
constexpr gpu::AttendTuning kTunings[] = {{0, 2, 1}, {0, 8, 1}, {8, 2, 1}, {0, 2, 2}, {0, 8, 2}};
constexpr int kListsPerGraph = 8;
constexpr std::size_t kSlotBytes = std::size_t{2} * kPageTokens * 128 * sizeof(uint16_t);
// 4 GiB of slots: every page of the largest case (batch 8 at 128K) once.
constexpr uint64_t kPoolSlots = uint64_t{8} * 8 * (131072 / kPageTokens);
constexpr std::size_t kCopyBytes = std::size_t{1} << 30;
constexpr int kCopiesBefore = 3;
constexpr int kCopiesAfter = 2;

std::string cuda_error(cudaError_t err, const char* what) {
  return err == cudaSuccess ? "" : std::string(what) + ": " + cudaGetErrorString(err);
}

// The device buffers every case shares, made at the first case: the pool (random bf16 values,
// never zeros: they can time faster than real data) and the copy probe's two buffers.
struct Device {
  std::string error;
  void* pool = nullptr;
  void* copy_from = nullptr;
  void* copy_to = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;

  Device() { error = setup(); }
  std::string setup() {
    if (auto e = cuda_error(cudaMalloc(&pool, kPoolSlots * kSlotBytes), "pool"); !e.empty())
      return e;
    if (auto e = cuda_error(cudaMalloc(&copy_from, kCopyBytes), "copy buffer"); !e.empty())
      return e;
    if (auto e = cuda_error(cudaMalloc(&copy_to, kCopyBytes), "copy buffer"); !e.empty()) return e;
    if (auto e = cuda_error(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
        !e.empty())
      return e;
    if (auto e = cuda_error(cudaEventCreate(&start), "event"); !e.empty()) return e;
    if (auto e = cuda_error(cudaEventCreate(&stop), "event"); !e.empty()) return e;
    // 64 MiB of random bf16 repeated over the pool and the copy source.
    std::vector<uint16_t> chunk(std::size_t{32} << 20);
    Random random(kSeed);
    for (uint16_t& x : chunk) x = simd::f32_to_bf16(random.uniform());
    const std::size_t chunk_bytes = chunk.size() * sizeof(uint16_t);
    auto fill = [&](void* base, std::size_t bytes) {
      for (std::size_t at = 0; at < bytes; at += chunk_bytes) {
        const cudaError_t err =
            cudaMemcpy(static_cast<char*>(base) + at, chunk.data(),
                       std::min(chunk_bytes, bytes - at), cudaMemcpyHostToDevice);
        if (err != cudaSuccess) return err;
      }
      return cudaSuccess;
    };
    if (auto e = cuda_error(fill(pool, kPoolSlots * kSlotBytes), "pool fill"); !e.empty()) return e;
    return cuda_error(fill(copy_from, kCopyBytes), "copy buffer fill");
  }
  // Seconds of one 1 GiB device-to-device copy on the stream.
  double copy_seconds() {
    cudaEventRecord(start, stream);
    cudaMemcpyAsync(copy_to, copy_from, kCopyBytes, cudaMemcpyDeviceToDevice, stream);
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    return ms * 1e-3;
  }
};

Device& device() {
  static Device held;
  return held;
}

struct CaseKey {
  uint64_t context;
  uint32_t batch;
  double selection;
  bool tokens;
  uint32_t ctas_per_sm;  // gpu::AttendTuning's fields
  uint32_t min_tiles;
  uint32_t chunks;
  bool operator==(const CaseKey&) const = default;
};

// The lists of one call in both views.
struct Lists {
  std::vector<uint32_t> offsets{0}, slots, last_page_tokens;
  std::vector<gpu::TokenAddress> tokens;
  uint64_t listed_tokens = 0;
  uint32_t *d_offsets = nullptr, *d_slots = nullptr, *d_last = nullptr;
  gpu::TokenAddress* d_tokens = nullptr;
};

// Per (sequence, KV head), `selection` of its context's pages, in slots drawn at random from the
// whole pool (distinct within a call), every page full; the token form lists their rows.
Lists make_lists(const CaseKey& key, std::mt19937_64& rng) {
  const uint64_t context_pages = key.context / kPageTokens;
  const uint64_t listed = std::max<uint64_t>(
      1, static_cast<uint64_t>(static_cast<double>(context_pages) * key.selection + 0.5));
  const uint32_t pairs = key.batch * kShape.n_kv_heads;
  std::vector<uint32_t> order(kPoolSlots);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), rng);
  Lists lists;
  for (uint32_t pair = 0; pair < pairs; ++pair) {
    for (uint64_t i = 0; i < listed; ++i) {
      const uint32_t slot = order[pair * listed + i];
      if (key.tokens)
        for (uint32_t row = 0; row < kPageTokens; ++row) lists.tokens.push_back({slot, row});
      else
        lists.slots.push_back(slot);
    }
    lists.offsets.push_back(
        static_cast<uint32_t>(key.tokens ? lists.tokens.size() : lists.slots.size()));
    lists.last_page_tokens.push_back(kPageTokens);
    lists.listed_tokens += listed * kPageTokens;
  }
  return lists;
}

template <class T>
std::string upload(const std::vector<T>& host, T** device_copy) {
  if (auto e = cuda_error(
          cudaMalloc(device_copy, std::max<std::size_t>(host.size(), 1) * sizeof(T)), "list");
      !e.empty())
    return e;
  return cuda_error(
      cudaMemcpy(*device_copy, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
      "list upload");
}

// A case ready to time: its lists on the device and the graph of its calls. Google Benchmark
// calls a case's function several times (iteration estimate, repetitions); the case is built
// once and held until the next one starts.
struct Prepared {
  CaseKey key{};
  std::string error;
  gpu::SparseDecodeAttention attention;
  gpu::SplitPlan plan;
  uint64_t listed_tokens = 0;
  std::vector<void*> allocations;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t graph_exec = nullptr;

  ~Prepared() {
    if (graph_exec != nullptr) cudaGraphExecDestroy(graph_exec);
    if (graph != nullptr) cudaGraphDestroy(graph);
    for (void* p : allocations) cudaFree(p);
  }
  std::string build(Device& dev);
  template <class T>
  std::string to_device(const std::vector<T>& host, T** device_copy) {
    std::string e = upload(host, device_copy);
    if (*device_copy != nullptr) allocations.push_back(*device_copy);
    return e;
  }
};

std::string Prepared::build(Device& dev) {
  const gpu::AttentionShape shape{kShape.n_kv_heads, kShape.group_size, kShape.head_dim,
                                  kPageTokens, simd::Dtype::bf16};
  const gpu::AttendTuning tuning{key.ctas_per_sm, key.min_tiles, key.chunks};
  if (gpu::Result r = attention.init(shape, key.batch, tuning); !r.ok) return r.message;
  std::vector<float> q(std::size_t{key.batch} * shape.n_query_heads() * shape.head_dim);
  Random random(kSeed + 1);
  random.fill(q);
  float *d_q = nullptr, *d_out = nullptr;
  if (auto e = to_device(q, &d_q); !e.empty()) return e;
  if (auto e = to_device(q, &d_out); !e.empty()) return e;

  std::mt19937_64 rng(kSeed + key.context + key.batch);
  std::vector<Lists> lists;
  for (int i = 0; i < kListsPerGraph; ++i) {
    Lists l = make_lists(key, rng);
    for (const std::string& e :
         {to_device(l.offsets, &l.d_offsets), to_device(l.slots, &l.d_slots),
          to_device(l.last_page_tokens, &l.d_last), to_device(l.tokens, &l.d_tokens)})
      if (!e.empty()) return e;
    lists.push_back(std::move(l));
  }
  listed_tokens = lists[0].listed_tokens;
  const gpu::AttendTarget target{key.batch, dev.pool, kPoolSlots, d_q, d_out, dev.stream};
  auto attend = [&](const Lists& l, bool check) -> gpu::Result {
    if (key.tokens) {
      const gpu::TokenAttendCall call{
          target, {l.offsets.data(), l.tokens.data()}, {l.d_offsets, l.d_tokens}};
      if (check)
        if (gpu::Result r = attention.validate(call); !r.ok) return r;
      return attention.run(call);
    }
    const gpu::PageAttendCall call{target,
                                   {l.offsets.data(), l.slots.data(), l.last_page_tokens.data()},
                                   {l.d_offsets, l.d_slots, l.d_last}};
    if (check)
      if (gpu::Result r = attention.validate(call); !r.ok) return r;
    return attention.run(call);
  };
  // Every call validated and run once, synchronised: fails early, and gives the plan.
  for (const Lists& l : lists)
    if (gpu::Result r = attend(l, true); !r.ok) return r.message;
  if (auto e = cuda_error(cudaStreamSynchronize(dev.stream), "first calls"); !e.empty()) return e;
  plan = attention.last_plan();

  // The calls as one graph: what a decode step would replay, without per-launch host gaps.
  if (auto e = cuda_error(cudaStreamBeginCapture(dev.stream, cudaStreamCaptureModeThreadLocal),
                          "graph capture");
      !e.empty())
    return e;
  for (const Lists& l : lists)
    if (gpu::Result r = attend(l, false); !r.ok) {
      cudaStreamEndCapture(dev.stream, &graph);
      return r.message;
    }
  if (auto e = cuda_error(cudaStreamEndCapture(dev.stream, &graph), "graph capture"); !e.empty())
    return e;
  if (auto e = cuda_error(cudaGraphInstantiate(&graph_exec, graph, 0), "graph instantiate");
      !e.empty())
    return e;
  for (int i = 0; i < 3; ++i) cudaGraphLaunch(graph_exec, dev.stream);  // warm-up
  return cuda_error(cudaStreamSynchronize(dev.stream), "warm-up");
}

Prepared& prepared(const CaseKey& key, Device& dev) {
  static std::unique_ptr<Prepared> held;
  if (!held || !(held->key == key)) {
    held.reset();  // frees the previous case's device memory first
    held = std::make_unique<Prepared>();
    held->key = key;
    held->error = held->build(dev);
  }
  return *held;
}

void BM_gpu_attend(benchmark::State& state, CaseKey key) {
  Device& dev = device();
  if (!dev.error.empty()) {
    state.SkipWithError(dev.error.c_str());
    return;
  }
  Prepared& prep = prepared(key, dev);
  if (!prep.error.empty()) {
    state.SkipWithError(prep.error.c_str());
    return;
  }
  std::vector<double> copies;
  for (int i = 0; i < kCopiesBefore; ++i) copies.push_back(dev.copy_seconds());
  double seconds = 0.0;
  for (auto _ : state) {
    cudaEventRecord(dev.start, dev.stream);
    cudaGraphLaunch(prep.graph_exec, dev.stream);
    cudaEventRecord(dev.stop, dev.stream);
    cudaEventSynchronize(dev.stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, dev.start, dev.stop);
    const double per_call = ms * 1e-3 / kListsPerGraph;
    state.SetIterationTime(per_call);
    seconds += per_call;
  }
  for (int i = 0; i < kCopiesAfter; ++i) copies.push_back(dev.copy_seconds());
  if (auto e = cuda_error(cudaGetLastError(), "timed loop"); !e.empty()) {
    state.SkipWithError(e.c_str());
    return;
  }

  std::nth_element(copies.begin(), copies.begin() + copies.size() / 2, copies.end());
  const double copy_bps = 2.0 * kCopyBytes / copies[copies.size() / 2];
  const double bytes_per_call =
      static_cast<double>(prep.listed_tokens) * 2 * kShape.head_dim * sizeof(uint16_t);
  const double bytes = bytes_per_call * static_cast<double>(state.iterations());
  const double achieved_bps = seconds > 0.0 ? bytes / seconds : 0.0;
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  // Plain numbers from the events (the manual time the benchmark reports), so that of_copy prints
  // as a ratio rather than as a rate.
  state.counters["TBps"] = achieved_bps * 1e-12;
  state.counters["copy_TBps"] = copy_bps * 1e-12;
  state.counters["of_copy"] = achieved_bps / copy_bps;
  state.counters["MB_per_call"] = bytes_per_call * 1e-6;
  state.counters["splits"] = prep.plan.splits_per_pair;
  state.counters["ctas"] = static_cast<double>(prep.plan.ctas);
  state.counters["device_ctas"] = prep.plan.device_ctas;
}

// The copy probe alone, so its spread shows beside the attention cases.
void BM_gpu_copy(benchmark::State& state) {
  Device& dev = device();
  if (!dev.error.empty()) {
    state.SkipWithError(dev.error.c_str());
    return;
  }
  dev.copy_seconds();
  double seconds = 0.0;
  for (auto _ : state) {
    const double s = dev.copy_seconds();
    state.SetIterationTime(s);
    seconds += s;
  }
  const double bytes = 2.0 * kCopyBytes * static_cast<double>(state.iterations());
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["TBps"] = seconds > 0.0 ? bytes / seconds * 1e-12 : 0.0;
}

double min_of(const std::vector<double>& v) {
  return *std::min_element(v.begin(), v.end());
}
double max_of(const std::vector<double>& v) {
  return *std::max_element(v.begin(), v.end());
}

void register_benchmarks() {
  benchmark::RegisterBenchmark("BM_gpu_copy/1GiB", BM_gpu_copy)
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond)
      ->ComputeStatistics("min", min_of)
      ->ComputeStatistics("max", max_of);
  for (uint64_t context : kContexts)
    for (uint32_t batch : kBatches)
      for (double selection : kSelections)
        for (bool tokens : {false, true})
          for (const gpu::AttendTuning& tuning : kTunings) {
            if (tokens && selection > 0.5) continue;          // token lists are for selective calls
            if (tokens && &tuning != &kTunings[0]) continue;  // the sweep is over the page form
            const std::string name =
                std::string("BM_gpu_attend/") + kShape.name + "/ctx:" + std::to_string(context) +
                "/batch:" + std::to_string(batch) +
                "/sel_pct:" + std::to_string(static_cast<int>(selection * 100)) +
                (tokens ? "/tokens" : "/pages") + "/tune:" + std::to_string(tuning.ctas_per_sm) +
                "x" + std::to_string(tuning.min_tiles_per_split) + "x" +
                std::to_string(tuning.chunks_per_lane);
            benchmark::RegisterBenchmark(
                name.c_str(), BM_gpu_attend,
                CaseKey{context, batch, selection, tokens, tuning.ctas_per_sm,
                        tuning.min_tiles_per_split, tuning.chunks_per_lane})
                ->UseManualTime()
                ->Unit(benchmark::kMicrosecond)
                ->ComputeStatistics("min", min_of)
                ->ComputeStatistics("max", max_of);
          }
}

std::string device_name() {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "(none)";
  return std::string(prop.name) + ", " + std::to_string(prop.multiProcessorCount) + " SMs, " +
         std::to_string(prop.l2CacheSize >> 20) + " MiB L2";
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_benchmarks();
  benchmark::AddCustomContext("gpu", device_name());
  benchmark::AddCustomContext("shape",
                              "llama8b: 32 q heads, 8 KV heads, d 128, 16-token pages, bf16");
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
