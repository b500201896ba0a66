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
//
// BM_gpu_prefill_attention: the device forward pass's prefill attention (gpu/device_llama.hpp's
// prefill_attention: the chunk's K/V store, then the flash kernel) on one layer of the same shape,
// a sequence of 8K, 32K or 128K tokens prefilled in chunks of 4096 rows, bf16 scratch. Each
// iteration prefills the whole context; only the prefill_attention calls are timed (events on
// the pass's stream), the rest of the layer (QKV product, copies to the host) is not. Reported:
// the attention time of the whole context (the manual time, per iteration) and of its last chunk
// (`last_chunk_ms`, 4096 rows against the whole context), their TFLOP/s (`TFLOPs`,
// `last_TFLOPs`: 4 * head_dim flops per query head, row and key the row sees, q K^T and P V; the
// masked work of the diagonal tiles not counted) and those over the H200's dense bf16 tensor
// peak (`of_peak`, `last_of_peak`; kH200Bf16PeakTflops, a datasheet constant, not a measurement).
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "gpu/device_llama.hpp"
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

// The prefill attention cases.
constexpr uint64_t kPrefillContexts[] = {8192, 32768, 131072};
constexpr uint32_t kPrefillChunk = 4096;
// NVIDIA's H200 SXM datasheet: 989 TFLOP/s of dense bf16 tensor math (1979 with sparsity).
constexpr double kH200Bf16PeakTflops = 989.0;

// One layer of kShape for the device forward pass, with the smallest feed-forward and vocabulary
// the shape allows: only its attention is timed.
struct PrefillModel {
  gpu::LlamaShape shape;
  std::vector<uint16_t> wqkv, wo, w_gate_up, w_down, token_embd;
  std::vector<float> norm;

  explicit PrefillModel(uint64_t context) {
    shape.n_layers = 1;
    shape.n_heads = kShape.n_kv_heads * kShape.group_size;
    shape.n_kv_heads = kShape.n_kv_heads;
    shape.head_dim = kShape.head_dim;
    shape.n_embd = shape.n_heads * shape.head_dim;
    shape.n_ff = 16;
    shape.n_vocab = 256;
    shape.rope_theta = 500000.0f;
    shape.max_rows = kPrefillChunk;
    shape.max_positions = static_cast<uint32_t>(context);
    shape.max_prefill_tokens = static_cast<uint32_t>(context);
    shape.kv_dtype = simd::Dtype::bf16;
    const uint32_t E = shape.n_embd;
    // Weights of scale 1 / sqrt(in), so that q and k have unit scale and the softmax is neither
    // flat nor one-hot.
    Random random(kSeed);
    auto weights = [&](std::size_t n, float scale) {
      std::vector<uint16_t> w(n);
      for (uint16_t& x : w) x = simd::f32_to_bf16(random.uniform() * scale);
      return w;
    };
    const float in_scale = std::sqrt(3.0f / static_cast<float>(E));  // uniform: variance 1 / E
    wqkv = weights(std::size_t{shape.q_dim() + 2 * shape.kv_dim()} * E, in_scale);
    wo = weights(std::size_t{E} * shape.q_dim(), in_scale);
    w_gate_up = weights(std::size_t{2} * shape.n_ff * E, in_scale);
    w_down = weights(std::size_t{E} * shape.n_ff, in_scale);
    token_embd = weights(std::size_t{shape.n_vocab} * E, 1.0f);
    norm.assign(E, 1.0f);
  }

  gpu::LlamaWeights weights() const {
    gpu::LlamaWeights w;
    w.layers.push_back(
        {wqkv.data(), wo.data(), w_gate_up.data(), w_down.data(), norm.data(), norm.data()});
    w.token_embd = token_embd.data();
    w.output = token_embd.data();
    w.output_norm = norm.data();
    return w;
  }
};

// Flops of causal attention for rows pos0 .. pos0 + rows - 1, each over its pos0 + r + 1 keys.
double prefill_flops(uint64_t pos0, uint64_t rows) {
  const double keys = static_cast<double>(rows) * static_cast<double>(pos0) +
                      static_cast<double>(rows) * static_cast<double>(rows + 1) / 2.0;
  return 4.0 * kShape.head_dim * kShape.n_kv_heads * kShape.group_size * keys;
}

void BM_gpu_prefill_attention(benchmark::State& state, uint64_t context) {
  const PrefillModel model(context);
  gpu::DeviceLlama llama;
  if (const gpu::Result r = llama.init(model.shape, model.weights(), 0); !r.ok) {
    state.SkipWithError(r.message.c_str());
    return;
  }
  const auto stream = static_cast<cudaStream_t>(llama.stream());
  cudaEvent_t start = nullptr, stop = nullptr;
  if (auto e = cuda_error(cudaEventCreate(&start), "event"); !e.empty()) {
    state.SkipWithError(e.c_str());
    return;
  }
  if (auto e = cuda_error(cudaEventCreate(&stop), "event"); !e.empty()) {
    cudaEventDestroy(start);
    state.SkipWithError(e.c_str());
    return;
  }
  std::vector<int32_t> tokens(context);
  std::mt19937 rng(static_cast<uint32_t>(kSeed));
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(model.shape.n_vocab) - 1);
  for (int32_t& t : tokens) t = token(rng);
  std::vector<uint64_t> positions(kPrefillChunk);
  std::string error;
  // Seconds of every chunk's prefill_attention, in order; empty with error set on a failure.
  auto prefill = [&]() {
    std::vector<double> chunks;
    llama.reset_prefill();
    for (uint64_t pos0 = 0; pos0 < context && error.empty(); pos0 += kPrefillChunk) {
      const auto rows = static_cast<uint32_t>(std::min<uint64_t>(kPrefillChunk, context - pos0));
      std::iota(positions.begin(), positions.begin() + rows, pos0);
      gpu::Result r = llama.embed(tokens.data() + pos0, rows);
      if (r.ok) r = llama.attention_inputs(0, positions.data(), rows);
      if (!r.ok) {
        error = r.message;
        break;
      }
      cudaEventRecord(start, stream);
      r = llama.prefill_attention(0, pos0, rows);
      cudaEventRecord(stop, stream);
      if (r.ok) r = llama.finish_layer(0, false);
      error = !r.ok ? r.message : cuda_error(cudaEventSynchronize(stop), "prefill attention");
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, start, stop);
      chunks.push_back(ms * 1e-3);
    }
    if (!error.empty()) chunks.clear();
    return chunks;
  };
  prefill();  // warm-up: module loading, the first launch of each kernel
  double total = 0.0, last = 0.0;
  for (auto _ : state) {
    const std::vector<double> chunks = error.empty() ? prefill() : std::vector<double>{};
    if (chunks.empty()) {
      state.SkipWithError(error.c_str());
      break;
    }
    const double seconds = std::accumulate(chunks.begin(), chunks.end(), 0.0);
    state.SetIterationTime(seconds);
    total += seconds;
    last += chunks.back();
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  if (!error.empty()) return;
  const double iterations = static_cast<double>(state.iterations());
  const uint64_t last_rows = context - (context - 1) / kPrefillChunk * kPrefillChunk;
  const double total_tflops = prefill_flops(0, context) * iterations / total * 1e-12;
  const double last_tflops =
      prefill_flops(context - last_rows, last_rows) * iterations / last * 1e-12;
  state.counters["total_ms"] = total / iterations * 1e3;
  state.counters["last_chunk_ms"] = last / iterations * 1e3;
  state.counters["TFLOPs"] = total_tflops;
  state.counters["last_TFLOPs"] = last_tflops;
  state.counters["of_peak"] = total_tflops / kH200Bf16PeakTflops;
  state.counters["last_of_peak"] = last_tflops / kH200Bf16PeakTflops;
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
  for (uint64_t context : kPrefillContexts) {
    const std::string name = std::string("BM_gpu_prefill_attention/") + kShape.name +
                             "/ctx:" + std::to_string(context) +
                             "/chunk:" + std::to_string(kPrefillChunk);
    benchmark::RegisterBenchmark(name.c_str(), BM_gpu_prefill_attention, context)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond)
        ->Iterations(context >= 131072 ? 2 : 5)
        ->ComputeStatistics("min", min_of)
        ->ComputeStatistics("max", max_of);
  }
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
