// The decode-step projection with weights kept in ggml's blocks (simd's matvec_quant, Q4_0 and
// Q8_0) against the bf16 matrix-vector product the runner uses for dequantized weights, at
// Llama-3.1-8B's shapes, on the runner's own path (lib/model/cpu_forward_pass.cpp): the input
// prepared (quantized per block of 32, or rounded to bf16), then the rows split over a ThreadPool.
// A decode projection reads each weight byte once, so each case reports `weight_GBps` (weight
// bytes over wall time); BM_read_bandwidth, a plain streaming read of 1 GiB over the same pool,
// is the machine's ceiling for it. Each case cycles through copies of its matrix filling 1 GiB,
// so the weights come from DRAM as a model's do (one 4096 x 4096 Q4_0 matrix, 9 MB, would sit in
// the L3).
//
// BM_matvec_l2 is each kernel's compute ceiling on one core (the matrix in L2). fmt 3 is Q4_0
// repacked to q4_0x16 as the model loader keeps it (simd/kernels.hpp), beside Q4_0 as stored
// (fmt 2) in the same run.
//
// Measured before the Q4 kernel of simd/x86/quant_avx512_vnni.cpp (AMD EPYC Zen 5, 2 vCPUs, 23.6
// GB/s read bandwidth on 2 threads, quiet; medians of 9; K=4096 -> N=4096 / 1024 / 14336 and
// K=14336 -> N=4096): bf16 21.8 / 22.5 / 24.7 / 16.9 GB/s of weights; Q8_0 26.1 / 21.6 / 26.6 /
// 21.9; Q4_0 16.5 / 14.8 / 17.3 / 14.2, 60-74% of the read bandwidth: its ceiling was 17.8 GB/s a
// core (Q8_0 41, bf16 73).
// With it (same VM, shared with other builds: load average 2-7; the previous kernel,
// quant_body.hpp's, which the avx2 table still uses, run back to back): Q4_0's ceiling 33-41 GB/s a
// core, the previous kernel 15-17 in the same runs (Q8_0 36-41, bf16 61-69). On 2 threads, K=4096
// -> N=4096 / 1024 / 14336, K=14336 -> N=4096, K=4096 -> N=128256, the median of seven runs'
// medians: Q4_0 20.7 / 16.9 / 20.2 / 15.1 / 25.0 GB/s, the previous kernel 14.8 / 13.5 / 16.1 /
// 11.2 / 15.3 (1.25-1.6x; read bandwidth 22.7 and 20.1). The busy host moved the read bandwidth
// from 15 to 32 GB/s run to run and single runs from 11 to 35 GB/s (new) and 8 to 28 (previous):
// the 2-thread figures are the contention's more than the kernels'; in the two quietest (read
// bandwidth 22.8) Q4_0 ran at 90-115% of it for K=4096 -> N=4096, 14336 and 128256, 55-80% for
// N=1024 (2.4 MB a product) and K=14336 (bf16 and Q8_0 are slower there too).
//
//   kvsift-bench-quant --benchmark_repetitions=9 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "bench/quant_blocks.hpp"
#include "lib/core/aligned.hpp"
#include "lib/core/thread_pool.hpp"
#include "lib/model/llama_weights.hpp"
#include "simd/half.hpp"
#include "simd/isa.hpp"
#include "simd/kernels.hpp"
#include "simd/quant.hpp"

namespace {

using namespace kvsift;

constexpr int kThreads = 2;
constexpr std::size_t kArenaBytes = std::size_t{1} << 30;

ThreadPool& pool() {
  static ThreadPool p(kThreads);
  return p;
}

const simd::Kernels& kernels() {
  return simd::kernels_for(simd::resolve_level(simd::Level::best));
}

// 1 GiB of anonymous memory, committed (written once, untimed) before use.
class Arena {
 public:
  Arena() {
    void* p =
        mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED) data_ = static_cast<std::byte*>(p);
  }
  ~Arena() {
    if (data_ != nullptr) munmap(data_, kArenaBytes);
  }
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  std::byte* data() const { return data_; }
  // What the arena holds: the case whose weights fill it (refilled when a case changes, not at
  // every call Google Benchmark makes to size and repeat a case).
  int64_t filled_for[3] = {-1, -1, -1};

 private:
  std::byte* data_ = nullptr;
};

// One arena for the whole run: the bandwidth probe and every case share it.
Arena& arena() {
  static Arena a;
  return a;
}

// ---- The read-bandwidth baseline ---------------------------------------------------------------

// Sums the arena as 64-bit integers (integer sums vectorize without reassociation concerns), its
// halves on the pool's two threads.
void BM_read_bandwidth(benchmark::State& state) {
  Arena& a = arena();
  if (a.data() == nullptr) return state.SkipWithError("mmap failed");
  if (a.filled_for[0] != -2) {
    std::memset(a.data(), 1, kArenaBytes);
    a.filled_for[0] = -2;
  }
  const auto* words = reinterpret_cast<const uint64_t*>(a.data());
  const std::size_t n = kArenaBytes / sizeof(uint64_t);
  uint64_t sums[kThreads] = {};
  for (auto _ : state) {
    pool().parallel_static(kThreads, [&](uint64_t first, uint64_t, int) noexcept {
      const uint64_t* p = words + n / kThreads * first;
      uint64_t s = 0;
      for (std::size_t i = 0; i < n / kThreads; ++i) s += p[i];
      sums[first] += s;
    });
    benchmark::DoNotOptimize(sums);
  }
  state.counters["read_GBps"] = benchmark::Counter(
      static_cast<double>(kArenaBytes) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_read_bandwidth)
    ->Name("read_bandwidth/threads:2")
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

// ---- The products ------------------------------------------------------------------------------

// q4_0x16: Q4_0 repacked as the model loader does (lib/model/llama_weights.cpp), against Q4_0 in
// the same run.
enum Format { bf16 = 0, q8_0 = 1, q4_0 = 2, q4_0x16 = 3 };

simd::BlockFormat block_format(Format f) {
  return f == q8_0   ? simd::BlockFormat::q8_0
         : f == q4_0 ? simd::BlockFormat::q4_0
                     : simd::BlockFormat::q4_0x16;
}

std::size_t weight_bytes(Format f, std::size_t rows, std::size_t cols) {
  if (f == bf16) return rows * cols * 2;
  return rows * cols / simd::kQuantBlock * simd::block_format_bytes(block_format(f));
}

// Fills the arena with valid weights of the format, copies of a [rows, cols] matrix: random codes,
// fp16 scales near 0.01 (bf16: random values near 0.01).
void fill(Format f, std::byte* data, std::size_t bytes, std::size_t rows, std::size_t cols) {
  if (f == bf16) {
    std::mt19937 rng(7);
    auto* w = reinterpret_cast<uint16_t*>(data);
    std::normal_distribution<float> dist(0.0f, 0.01f);
    for (std::size_t i = 0; i < 4096; ++i) w[i] = simd::f32_to_bf16(dist(rng));
    for (std::size_t i = 4096; i < bytes / 2; ++i) w[i] = w[i % 4096 ^ (i / 4096 % 7)];
    return;
  }
  if (f != q4_0x16) return bench::fill_quant_blocks(block_format(f), data, bytes);
  const std::size_t matrix = weight_bytes(f, rows, cols);
  std::vector<std::byte> plain(matrix);
  bench::fill_quant_blocks(simd::BlockFormat::q4_0, plain.data(), matrix);
  for (std::size_t at = 0; at + matrix <= bytes; at += matrix)
    simd::repack_q4_0x16(plain.data(), rows, cols, data + at);
}

// Args: format, K (cols), N (rows).
void BM_matvec(benchmark::State& state) {
  const auto f = static_cast<Format>(state.range(0));
  const std::size_t K = static_cast<std::size_t>(state.range(1));
  const std::size_t N = static_cast<std::size_t>(state.range(2));
  const std::size_t bytes = weight_bytes(f, N, K);
  const std::size_t copies = kArenaBytes / bytes;
  Arena& arena = ::arena();
  if (arena.data() == nullptr || copies == 0) return state.SkipWithError("no arena");
  if (arena.filled_for[0] != state.range(0) || arena.filled_for[1] != state.range(1) ||
      arena.filled_for[2] != state.range(2)) {
    fill(f, arena.data(), copies * bytes, N, K);
    arena.filled_for[0] = state.range(0);
    arena.filled_for[1] = state.range(1);
    arena.filled_for[2] = state.range(2);
  }
  const simd::Kernels& k = kernels();
  bench::MatvecInput input(K);
  AlignedVector<float> y(N), x_rounded(K);
  AlignedVector<uint16_t> x_bf16(K);
  const simd::BlockFormat bf = block_format(f);
  const std::size_t row_bytes = bytes / N;
  std::size_t copy = 0;
  for (auto _ : state) {
    const std::byte* w = arena.data() + copy * bytes;
    copy = copy + 1 == copies ? 0 : copy + 1;
    if (f == bf16) {
      k.encode(input.x.data(), x_bf16.data(), K, simd::Dtype::bf16);
      k.decode(x_bf16.data(), x_rounded.data(), K, simd::Dtype::bf16);
      const auto* wb = reinterpret_cast<const uint16_t*>(w);
      pool().parallel_static(N, [&](uint64_t first, uint64_t last, int) noexcept {
        k.matvec_bf16(wb + first * K, last - first, K, x_rounded.data(), 1, y.data() + first, N);
      });
    } else {
      const simd::QuantizedVectors xq = input.quantize();
      model::parallel_row_groups(pool(), N, [&](uint64_t first, uint64_t last, int) noexcept {
        k.matvec_quant(bf, w + first * row_bytes, last - first, K, xq, 1, y.data() + first, N);
      });
    }
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["weight_GBps"] = benchmark::Counter(
      static_cast<double>(bytes) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.counters["weight_MB"] = static_cast<double>(bytes) / 1e6;
  state.SetLabel(simd::level_name(k.level));
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"fmt", "K", "N"});
  for (int f : {bf16, q8_0, q4_0, q4_0x16}) {
    b->Args({f, 4096, 4096});   // q, o
    b->Args({f, 4096, 1024});   // k, v
    b->Args({f, 4096, 14336});  // gate, up
    b->Args({f, 14336, 4096});  // down
  }
  // The output projection (vocabulary 128256): 1.05 GB in bf16, more than the arena holds.
  for (int f : {q8_0, q4_0, q4_0x16}) b->Args({f, 4096, 128256});
}
BENCHMARK(BM_matvec)
    ->Name("matvec/threads:2")
    ->Apply(shapes)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// The kernels' compute ceiling: one thread, one 4096 x 64 matrix read over and over from L2
// (bf16 512 KB, Q8_0 279 KB, Q4_0 147 KB), no input preparation. Args: format.
void BM_matvec_l2(benchmark::State& state) {
  const auto f = static_cast<Format>(state.range(0));
  constexpr std::size_t K = 4096, N = 64;
  const std::size_t bytes = weight_bytes(f, N, K);
  AlignedVector<std::byte> w(bytes);
  fill(f, w.data(), bytes, N, K);
  const simd::Kernels& k = kernels();
  std::vector<float> x(K, 0.5f);
  AlignedVector<float> y(N);
  AlignedVector<int8_t> codes(K);
  AlignedVector<float> scales(K / simd::kQuantBlock);
  AlignedVector<int32_t> sums(K / simd::kQuantBlock);
  simd::quantize_vectors(x.data(), 1, K, codes.data(), scales.data(), sums.data());
  const simd::QuantizedVectors xq{codes.data(), scales.data(), sums.data()};
  const simd::BlockFormat bf = block_format(f);
  for (auto _ : state) {
    if (f == bf16)
      k.matvec_bf16(reinterpret_cast<const uint16_t*>(w.data()), N, K, x.data(), 1, y.data(), N);
    else
      k.matvec_quant(bf, w.data(), N, K, xq, 1, y.data(), N);
    benchmark::DoNotOptimize(y.data());
    benchmark::ClobberMemory();
  }
  state.counters["weight_GBps"] = benchmark::Counter(
      static_cast<double>(bytes) * state.iterations() / 1e9, benchmark::Counter::kIsRate);
  state.SetLabel(simd::level_name(k.level));
}
BENCHMARK(BM_matvec_l2)
    ->Name("matvec_l2/threads:1")
    ->ArgName("fmt")
    ->Arg(bf16)
    ->Arg(q8_0)
    ->Arg(q4_0)
    ->Arg(q4_0x16)
    ->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
