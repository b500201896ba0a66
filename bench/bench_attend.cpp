// Dense decode attention through the C API, measured against the machine's own read bandwidth.
//
// Decode attention reads every K/V byte once per call, so its ceiling is the streaming read
// bandwidth of the threads that run it. Each BM_attend_dense case therefore reports, besides
// bytes/s, `bw_ratio`: its KV bytes/s over the bandwidth that BM_read_bandwidth's probe measures
// with the same thread count (`read_GBps`), measured around each repetition: the median of five
// passes, three just before its timed loop and two just after. The dev box is noisy (about +-10%,
// and bimodal on 2 threads: docs/platform-notes.md, Timing), so compare medians of repetitions.
// BM_attend_scattered runs the same attention over pages scattered through the pool (as decode
// appends them), against the same sequential probe: its ratio says what the scatter costs.
//
// Each case also runs over a q8 cache (name suffix /kv:q8), whose bytes are its int8 codes and
// float32 row scales: the filter below times the fp16 and the q8 case side by side.
//
//   kvsift-bench-attend --benchmark_filter='dense/llama8b/ctx:131072/batch:1/threads:2'
//                       --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "kvsift/kvsift.h"
#include "lib/core/aligned.hpp"
#include "simd/kernels.hpp"
#include "simd/page_rows.hpp"

namespace {

using namespace kvsift::bench;
using kvsift::AlignedVector;
namespace simd = kvsift::simd;

constexpr Shape kShapes[] = {kLlama8b, kSmollm2};
constexpr uint64_t kContexts[] = {4096, 8192, 32768, 131072, 524288};
constexpr uint32_t kBatches[] = {1, 8};
constexpr int kThreadCounts[] = {1, 2};
// The dev box has 24 GiB: larger caches are not registered. The one case this drops is llama8b at
// 512K tokens and batch 8 (16 GiB of K+V).
constexpr uint64_t kMaxKvBytes = uint64_t{8} << 30;

// ---- Read-bandwidth probe ----------------------------------------------------------------------

// 1 GiB: 32 times the L3, so a pass streams from DRAM.
constexpr std::size_t kProbeFloats = std::size_t{1} << 28;
constexpr int kProbePassesBefore = 3;
constexpr int kProbePassesAfter = 2;

// Anonymous mmap like kvsift's page pool, so both get the same (transparent huge) pages.
class ProbeBuffer {
 public:
  ProbeBuffer() {
    void* p = mmap(nullptr, bytes(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return;
    data_ = static_cast<float*>(p);
#pragma omp parallel for schedule(static)
    for (std::size_t i = 0; i < kProbeFloats; ++i) data_[i] = 1.0f;  // commit it, untimed
  }
  ~ProbeBuffer() {
    if (data_ != nullptr) munmap(data_, bytes());
  }
  ProbeBuffer(const ProbeBuffer&) = delete;
  ProbeBuffer& operator=(const ProbeBuffer&) = delete;

  const float* data() const {
    return data_;
  }
  static constexpr std::size_t bytes() {
    return kProbeFloats * sizeof(float);
  }

 private:
  float* data_ = nullptr;
};

const ProbeBuffer& probe_buffer() {
  static const ProbeBuffer buffer;
  return buffer;
}

// Sixteen independent sums, which GCC turns into four 4-wide SSE2 chains at baseline. On the dev
// box it reads as fast as an AVX-512 loop with eight 16-wide accumulators and as an fp16-converting
// one (medians of 7 passes over 1 GiB, 3 rounds x {1, 2} threads: fastest of the three in 5 of the
// 6), so the probe needs no ISA dispatch.
float sum_floats(const float* p, std::size_t n) {
  float acc[16] = {};
  for (std::size_t i = 0; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += p[i + j];
  float total = 0.0f;
  for (float a : acc) total += a;
  return total;
}

// One pass over the buffer with `threads` threads, each summing one contiguous slice.
double read_pass_seconds(const float* data, int threads, float* sink) {
  float total = 0.0f;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const std::size_t n = omp_get_num_threads(), t = omp_get_thread_num();
    const std::size_t first = kProbeFloats * t / n, last = kProbeFloats * (t + 1) / n;
    total += sum_floats(data + first, last - first);
  }
  const auto stop = std::chrono::steady_clock::now();
  *sink = total;
  return std::chrono::duration<double>(stop - start).count();
}

// Bytes/s of a streaming read with `threads` threads: the median of the given pass times.
double median_bandwidth(std::vector<double> seconds) {
  std::nth_element(seconds.begin(), seconds.begin() + seconds.size() / 2, seconds.end());
  return ProbeBuffer::bytes() / seconds[seconds.size() / 2];
}

void BM_read_bandwidth(benchmark::State& state, int threads) {
  const float* data = probe_buffer().data();
  if (data == nullptr) {
    state.SkipWithError("cannot map the 1 GiB probe buffer");
    return;
  }
  float sink = 0.0f;
  read_pass_seconds(data, threads, &sink);  // starts the thread pool
  double seconds = 0.0;
  for (auto _ : state) seconds += read_pass_seconds(data, threads, &sink);
  benchmark::DoNotOptimize(sink);
  const double bytes = static_cast<double>(state.iterations()) * ProbeBuffer::bytes();
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.counters["GBps"] = seconds > 0.0 ? bytes / seconds * 1e-9 : 0.0;
  state.counters["threads"] = threads;
}

// ---- Dense decode attention --------------------------------------------------------------------

struct CaseKey {
  const Shape* shape;
  uint64_t context;
  uint32_t batch;
  int threads;
  // Tokens per append. kAppendTokens: a head's pages lie in runs of adjacent pool slots, as a
  // prefill leaves them. kPageTokens: every head takes one page per append, as decode leaves
  // them, so no two consecutive pages of a head are adjacent (the BM_attend_scattered cases).
  uint32_t append_tokens;
  kvsift_dtype dtype;
  bool operator==(const CaseKey&) const = default;
};

// The filled cache of the case that ran last. Google Benchmark calls a case's function several
// times (iteration estimate, repetitions); building a multi-GiB cache once per case, and holding
// only one at a time, keeps a filtered run short and the process within memory.
struct Filled {
  CaseKey key{};
  kvsift::cache cache;
  std::vector<int32_t> seq_ids;
  std::vector<float> q, out;
};

Filled& held_case() {
  static Filled held;
  return held;
}

// Builds the case's cache unless it is the one held; "" on success, else the failing call's error.
std::string fill_case(const CaseKey& key) {
  Filled& held = held_case();
  if (held.cache && held.key == key) return "";
  held = Filled{};  // frees the previous cache first
  const Shape& shape = *key.shape;
  const uint32_t H = shape.n_kv_heads, d = shape.head_dim;
  const kvsift_cache_params params =
      cache_params(shape, key.context, key.batch, key.threads, key.dtype);
  kvsift::cache cache;
  if (std::string error = create_cache(params, cache); !error.empty()) return error;

  Random random(kSeed);
  std::vector<float> k(std::size_t{key.append_tokens} * H * d), v(k.size());
  std::vector<int32_t> seq_ids(key.batch);
  for (int32_t& id : seq_ids) {
    if (kvsift_sequence_create(cache.get(), &id) != KVSIFT_STATUS_OK) return kvsift_last_error();
    for (uint64_t done = 0; done < key.context; done += key.append_tokens) {
      const auto n =
          static_cast<uint32_t>(std::min<uint64_t>(key.append_tokens, key.context - done));
      random.fill(k);
      random.fill(v);
      if (kvsift_append(cache.get(), id, 0, n, k.data(), v.data()) != KVSIFT_STATUS_OK)
        return kvsift_last_error();
    }
  }
  held.q.resize(std::size_t{key.batch} * H * shape.group_size * d);
  held.out.resize(held.q.size());
  random.fill(held.q);
  held.key = key;
  held.cache = std::move(cache);
  held.seq_ids = std::move(seq_ids);
  return "";
}

void BM_attend_dense(benchmark::State& state, CaseKey key) {
  if (const std::string error = fill_case(key); !error.empty()) {
    state.SkipWithError(error.c_str());
    return;
  }
  Filled& held = held_case();
  kvsift_cache* cache = held.cache.get();
  const float* probe = probe_buffer().data();
  if (probe == nullptr) {
    state.SkipWithError("cannot map the 1 GiB probe buffer");
    return;
  }
  auto attend = [&] {
    return kvsift_attend(cache, 0, key.batch, held.seq_ids.data(), held.q.data(), held.out.data(),
                         nullptr);
  };
  // One untimed call: fails early, starts the thread pool, and gives the bytes a call reads.
  kvsift_cache_stats stats;
  if (attend() != KVSIFT_STATUS_OK || kvsift_cache_get_stats(cache, &stats) != KVSIFT_STATUS_OK) {
    state.SkipWithError(kvsift_last_error());
    return;
  }
  // The machine's bandwidth drifts with its neighbours' load, so the probe runs around this
  // repetition's timed loop (passes before and after), not once per process.
  float sink = 0.0f;
  std::vector<double> probe_seconds;
  for (int i = 0; i < kProbePassesBefore; ++i)
    probe_seconds.push_back(read_pass_seconds(probe, key.threads, &sink));
  const auto start = std::chrono::steady_clock::now();
  for (auto _ : state) {
    if (attend() != KVSIFT_STATUS_OK) {
      state.SkipWithError(kvsift_last_error());
      break;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int i = 0; i < kProbePassesAfter; ++i)
    probe_seconds.push_back(read_pass_seconds(probe, key.threads, &sink));
  benchmark::DoNotOptimize(sink);
  const double read_bps = median_bandwidth(probe_seconds);
  benchmark::DoNotOptimize(held.out.data());
  const double bytes = static_cast<double>(state.iterations()) * stats.last_bytes_read;
  state.SetBytesProcessed(static_cast<int64_t>(bytes));
  state.SetLabel(kvsift_isa_name(kvsift_cache_isa(cache)));
  // Plain numbers from the loop's own clock (the same real time the benchmark measures), so that
  // bw_ratio prints as a ratio rather than as a rate.
  const double achieved_bps = seconds > 0.0 ? bytes / seconds : 0.0;
  state.counters["GBps"] = achieved_bps * 1e-9;
  state.counters["read_GBps"] = read_bps * 1e-9;
  state.counters["bw_ratio"] = achieved_bps / read_bps;
  state.counters["threads"] = key.threads;
}

// ---- One kernel call on hot data ---------------------------------------------------------------
// The attention kernel of one level over one (sequence, KV head) of the llama8b shape (G 4, d 128,
// pages of 16) whose pages fit in L2, on the calling thread: the compute side of
// BM_attend_dense, without DRAM. Its CPU time is this thread's own, so it holds when neighbours
// load the machine (bw_ratio does not); cycles_per_token, when KVSIFT_BENCH_GHZ gives the clock,
// counts it in cycles. Against BM_attend_dense, one token of one KV head streams
// kv_bytes_per_token bytes: the kernel keeps up with a thread's share of the read bandwidth while
// that over its ns_per_token is above it.
void BM_attend_kernel(benchmark::State& state, simd::Level level, simd::Dtype dtype) {
  if (!simd::cpu_has(level)) {
    state.SkipWithError("this CPU lacks the level");
    return;
  }
  const simd::Kernels& k = simd::kernels_for(level);
  const uint32_t G = kLlama8b.group_size, d = kLlama8b.head_dim, B = kPageTokens;
  const uint64_t tokens = static_cast<uint64_t>(state.range(0));
  const simd::PageLayout layout{B, d, dtype};
  const auto pages = static_cast<uint32_t>((tokens + B - 1) / B);
  AlignedVector<std::byte> pool(layout.slot_bytes() * pages, std::byte{0});
  std::vector<float> row(d), q(std::size_t{G} * d);
  Random random(kSeed);
  for (uint64_t t = 0; t < tokens; ++t)
    for (simd::SlotPart part : {simd::SlotPart::key, simd::SlotPart::value}) {
      random.fill(row);
      simd::store_rows(k, layout, layout.slot(pool.data(), t / B), part,
                       static_cast<uint32_t>(t % B), 1, row.data(), d);
    }
  random.fill(q);
  for (float& x : q) x /= std::sqrt(static_cast<float>(d));
  AlignedVector<float> m(G), l(G), acc(std::size_t{G} * d), scratch(std::size_t{G} * B);
  simd::AttendJob job{};
  job.q = q.data();
  job.group = G;
  job.layout = layout;
  job.pool = pool.data();
  job.count = pages;
  job.seq_tokens = tokens;
  job.m = m.data();
  job.l = l.data();
  job.acc = acc.data();
  job.scratch = scratch.data();
  for (auto _ : state) {
    k.attend(job);
    benchmark::DoNotOptimize(acc.data());
  }
  const double calls = static_cast<double>(state.iterations());
  state.SetItemsProcessed(static_cast<int64_t>(calls * tokens));
  state.SetBytesProcessed(static_cast<int64_t>(calls * tokens * layout.token_bytes()));
  const auto per_token = benchmark::Counter::kIsRate | benchmark::Counter::kInvert;
  state.counters["ns_per_token"] = benchmark::Counter(calls * tokens * 1e-9, per_token);
  if (const char* ghz = std::getenv("KVSIFT_BENCH_GHZ"); ghz != nullptr && std::atof(ghz) > 0.0)
    state.counters["cycles_per_token"] =
        benchmark::Counter(calls * tokens * 1e-9 / std::atof(ghz), per_token);
  state.counters["kv_bytes_per_token"] = static_cast<double>(layout.token_bytes());
  state.SetLabel(simd::level_name(level));
}

void register_benchmarks() {
  for (simd::Level level : simd::kLevels)
    for (simd::Dtype dtype : {simd::Dtype::f16, simd::Dtype::q8}) {
      const std::string name = std::string("BM_attend_kernel/llama8b/") + simd::level_name(level) +
                               (dtype == simd::Dtype::q8 ? "/kv:q8" : "/kv:f16");
      benchmark::RegisterBenchmark(name.c_str(), BM_attend_kernel, level, dtype)->Arg(2048);
    }

  for (int threads : kThreadCounts) {
    const std::string name = "BM_read_bandwidth/threads:" + std::to_string(threads);
    benchmark::RegisterBenchmark(name.c_str(), BM_read_bandwidth, threads)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  auto add = [](const char* family, const Shape& shape, uint64_t context, uint32_t batch,
                int threads, uint32_t append_tokens) {
    for (kvsift_dtype dtype : {KVSIFT_DTYPE_F16, KVSIFT_DTYPE_Q8}) {
      const std::string name =
          std::string(family) + "/" + shape.name + "/ctx:" + std::to_string(context) +
          "/batch:" + std::to_string(batch) + "/threads:" + std::to_string(threads) +
          (dtype == KVSIFT_DTYPE_Q8 ? "/kv:q8" : "");
      benchmark::RegisterBenchmark(name.c_str(), BM_attend_dense,
                                   CaseKey{&shape, context, batch, threads, append_tokens, dtype})
          ->UseRealTime()
          ->Unit(benchmark::kMillisecond);
    }
  };
  for (const Shape& shape : kShapes)
    for (uint64_t context : kContexts)
      for (uint32_t batch : kBatches) {
        if (kv_bytes(shape, context, batch) > kMaxKvBytes) continue;
        for (int threads : kThreadCounts)
          add("BM_attend_dense", shape, context, batch, threads, kAppendTokens);
      }
  // The same attention over pages scattered through the pool: what a decoded (not prefilled)
  // context reads, and what a selector's page lists read.
  for (const Shape& shape : kShapes)
    for (uint64_t context : {uint64_t{32768}, uint64_t{131072}})
      for (int threads : kThreadCounts)
        add("BM_attend_scattered", shape, context, 1, threads, kPageTokens);
}

// The ISA a default cache picks (the CPU's best under KVSIFT_MAX_ISA), for the context block.
std::string default_isa() {
  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  params.max_pages = 1;
  kvsift_cache* cache = nullptr;
  if (kvsift_cache_create(&params, &cache) != KVSIFT_STATUS_OK)
    return std::string("error: ") + kvsift_last_error();
  const std::string name = kvsift_isa_name(kvsift_cache_isa(cache));
  kvsift_cache_free(cache);
  return name;
}

std::string env_or(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  register_benchmarks();
  benchmark::AddCustomContext("kvsift_version", kvsift_version_string());
  benchmark::AddCustomContext("kvsift_isa", default_isa());
  benchmark::AddCustomContext("kvsift_isa_supported", kvsift_isa_name(kvsift_isa_supported()));
  benchmark::AddCustomContext("omp_max_threads", std::to_string(omp_get_max_threads()));
  benchmark::AddCustomContext("threads", "per case: kvsift_cache_params.n_threads (name suffix)");
  benchmark::AddCustomContext("KVSIFT_MAX_ISA", env_or("KVSIFT_MAX_ISA", "(unset)"));
  benchmark::AddCustomContext("OMP_PROC_BIND", env_or("OMP_PROC_BIND", "(unset)"));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
