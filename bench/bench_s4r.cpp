// S4R against dense attention in the same run, and its prefill overhead on the real model.
//
// BM_s4r_decode/<compression>/ctx:<tokens>/window:<W>: one layer of the Llama-3.1-8B shape (8 KV
// heads, 4 query heads each, d = 128) holding `ctx` tokens of structured keys
// (bench/key_maker.hpp), appended before RoPE to two caches that rotate them: one attended densely,
// one through the S4R selector (budget 10%, query window W). The first S4R step compresses
// (compress_s); then every iteration times one dense kvsift_attend and one S4R
// kvsift_attend_selected back to back:
//   dense_ms, s4r_ms   medians over the iterations (min and max beside); s4r_vs_dense = their ratio
//   held_vs_dense      (pages in use + the selector's bytes) / the dense cache's bytes
// BM_s4r_project/<compression> and BM_s4r_reconstruct/<compression>: S4R's two dense products
// alone, at the same layer shape (D' = 1024) and the rank solve_rank gives a 32K context at that
// compression, on kThreads threads: the projection of one prefill block of 4096 keys (the product
// and the rounding to bf16), and the reconstruction of a 10% budget of that context (3277 tokens:
// decoding their coefficients and the product). GFLOPS counts 2 M K N per product.
// BM_s4r_fit_basis/llama8b/threads:<n>: the basis fit of one such layer's K (D' = 1024, 20,480
// sampled rows), on the calling thread (0) and with its Gram spread over kThreads threads.
// BM_s4r_prefill_overhead: the real model (KVSIFT_MODEL; skipped without it) prefills an 8K-token
// prompt, then one decode step under S4R at 2.5x compresses every layer:
//   prefill_s, compress_s, share = compress_s / prefill_s (8191 prompt tokens: the model has 8192)
//
//   kvsift-bench-s4r   (about 5 minutes; the 10 iterations of each case give its spread)
//   kvsift-bench-s4r --benchmark_filter='project|reconstruct' --benchmark_repetitions=9
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/bench_util.hpp"
#include "bench/key_maker.hpp"
#include "kvsift/kvsift.h"
#include "lib/core/kernel_runtime.hpp"
#include "lib/core/thread_pool.hpp"
#include "lib/model/llama_model.hpp"
#include "lib/select/s4r_core.hpp"
#include "lib/select/s4r_selector.hpp"

namespace {

using namespace kvsift::bench;
using Clock = std::chrono::steady_clock;

constexpr int kThreads = 2;
constexpr double kBudget = 0.1;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

// Two caches with the same `context` tokens, one sequence each, and queries.
struct Pair {
  kvsift::cache dense, s4r;
  int32_t dense_seq = -1, s4r_seq = -1;
  std::vector<float> q, out;
};

std::string fill(uint64_t context, Pair& p) {
  const Shape& shape = kLlama8b;
  const uint32_t H = shape.n_kv_heads, G = shape.group_size, d = shape.head_dim;
  kvsift_cache_params params = cache_params(shape, context + kPageTokens, 1, kThreads);
  params.key_form = KVSIFT_KEYS_PRE_ROPE;
  params.rope_theta = kRopeTheta;
  for (kvsift::cache* cache : {&p.dense, &p.s4r})
    if (std::string error = create_cache(params, *cache); !error.empty()) return error;
  if (kvsift_sequence_create(p.dense.get(), &p.dense_seq) != KVSIFT_STATUS_OK ||
      kvsift_sequence_create(p.s4r.get(), &p.s4r_seq) != KVSIFT_STATUS_OK)
    return kvsift_last_error();
  KeyMaker maker(shape, kSeed, /*rotate=*/false);
  std::vector<float> k, v;
  for (uint64_t done = 0; done < context; done += kAppendTokens) {
    const auto n = static_cast<uint32_t>(std::min<uint64_t>(kAppendTokens, context - done));
    maker.make(done, n, k, v);
    if (kvsift_append(p.dense.get(), p.dense_seq, 0, n, k.data(), v.data()) != KVSIFT_STATUS_OK ||
        kvsift_append(p.s4r.get(), p.s4r_seq, 0, n, k.data(), v.data()) != KVSIFT_STATUS_OK)
      return kvsift_last_error();
  }
  // Each query head looks for a few stored (rotated) keys of its KV head, plus noise.
  Random random(kSeed + 1);
  p.q.assign(std::size_t{H} * G * d, 0.0f);
  add_needle_queries(p.dense.get(), p.dense_seq, shape, context, random, p.q.data());
  p.out.resize(p.q.size());
  return "";
}

void BM_s4r_decode(benchmark::State& state, double compression, uint64_t context, uint32_t window) {
  Pair p;
  if (const std::string error = fill(context, p); !error.empty()) {
    state.SkipWithError(error.c_str());
    return;
  }
  kvsift_selector_policy policy;
  kvsift_selector_policy_init(&policy);
  policy.selector = KVSIFT_SELECTOR_S4R;
  policy.budget = kBudget;
  policy.s4r.compression = compression;
  policy.s4r.window = window;
  kvsift_cache_stats before{}, after{};
  kvsift_cache_get_stats(p.s4r.get(), &before);
  auto dense = [&] {
    return kvsift_attend(p.dense.get(), 0, 1, &p.dense_seq, p.q.data(), p.out.data(), nullptr);
  };
  auto s4r = [&] {
    return kvsift_attend_selected(p.s4r.get(), 0, 1, &p.s4r_seq, p.q.data(), p.out.data(), nullptr);
  };
  // The first S4R step compresses: timed apart. Dense once untimed: its threads start.
  const auto start = Clock::now();
  if (kvsift_cache_set_selector(p.s4r.get(), &policy) != KVSIFT_STATUS_OK ||
      s4r() != KVSIFT_STATUS_OK || dense() != KVSIFT_STATUS_OK) {
    state.SkipWithError(kvsift_last_error());
    return;
  }
  const double compress_s = seconds_since(start);
  kvsift_cache_get_stats(p.s4r.get(), &after);
  std::vector<double> dense_s, s4r_s;
  for (auto _ : state) {
    auto t0 = Clock::now();
    dense();
    auto t1 = Clock::now();
    s4r();
    auto t2 = Clock::now();
    dense_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    s4r_s.push_back(std::chrono::duration<double>(t2 - t1).count());
    state.SetIterationTime(s4r_s.back());
  }
  const double dense_median = median(dense_s), s4r_median = median(s4r_s);
  state.counters["dense_ms"] = dense_median * 1e3;
  state.counters["s4r_ms"] = s4r_median * 1e3;
  state.counters["s4r_vs_dense"] = s4r_median / dense_median;
  // The spread: the machine is shared.
  state.counters["dense_min_ms"] = *std::min_element(dense_s.begin(), dense_s.end()) * 1e3;
  state.counters["dense_max_ms"] = *std::max_element(dense_s.begin(), dense_s.end()) * 1e3;
  state.counters["s4r_min_ms"] = *std::min_element(s4r_s.begin(), s4r_s.end()) * 1e3;
  state.counters["s4r_max_ms"] = *std::max_element(s4r_s.begin(), s4r_s.end()) * 1e3;
  state.counters["compress_s"] = compress_s;
  state.counters["held_vs_dense"] =
      static_cast<double>(after.bytes_in_use + after.selector_bytes_held) /
      static_cast<double>(before.bytes_in_use);
}

// The layer shape and rank of BM_s4r_decode at a 32K context; the basis is random (the products do
// not depend on its being orthonormal).
struct ProductCase {
  uint32_t dim = kLlama8b.n_kv_heads * kLlama8b.head_dim;
  uint32_t rank;
  kvsift::select::s4r::Basis basis;
  explicit ProductCase(double compression)
      : rank(kvsift::select::s4r::solve_rank(dim, 32768, 0, kLlama8b.group_size, 32, compression)) {
    basis.dim = dim;
    basis.rank = rank;
    basis.columns.resize(std::size_t{dim} * rank);
    Random random(kSeed);
    random.fill(basis.columns);
  }
};

void BM_s4r_project(benchmark::State& state, double compression) {
  namespace s4r = kvsift::select::s4r;
  const ProductCase c(compression);
  constexpr uint64_t kRows = 4096;
  std::vector<float> rows(kRows * c.dim);
  Random(kSeed + 1).fill(rows);
  std::vector<uint16_t> coeffs(kRows * c.rank);
  kvsift::ThreadPool pool(kThreads);
  const kvsift::KernelRuntime runtime;
  for (auto _ : state)
    s4r::project(rows.data(), kRows, c.dim, c.basis, coeffs.data(), kvsift::simd::Dtype::bf16,
                 runtime.kernels(), &pool);
  state.counters["rank"] = c.rank;
  state.counters["GFLOPS"] = benchmark::Counter(2.0 * kRows * c.dim * c.rank * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
}

void BM_s4r_reconstruct(benchmark::State& state, double compression) {
  namespace s4r = kvsift::select::s4r;
  const ProductCase c(compression);
  constexpr uint64_t kTokens = 32768;
  constexpr auto kChosen = static_cast<uint32_t>(kTokens / 10 + 1);
  std::vector<float> floats(kTokens * c.rank);
  Random(kSeed + 1).fill(floats);
  const kvsift::KernelRuntime runtime;
  std::vector<uint16_t> coeffs(floats.size());
  runtime.kernels().encode(floats.data(), coeffs.data(), floats.size(), kvsift::simd::Dtype::bf16);
  std::vector<uint32_t> ids(kChosen);
  for (uint32_t i = 0; i < kChosen; ++i) ids[i] = static_cast<uint32_t>(i * 10 % kTokens);
  std::vector<float> out(std::size_t{kChosen} * c.dim),
      workspace(s4r::reconstruct_workspace_floats(c.basis));
  kvsift::ThreadPool pool(kThreads);
  for (auto _ : state)
    s4r::reconstruct(coeffs.data(), kvsift::simd::Dtype::bf16, c.basis, ids.data(), kChosen,
                     out.data(), runtime.kernels(), workspace.data(), &pool);
  state.counters["rank"] = c.rank;
  state.counters["GFLOPS"] = benchmark::Counter(2.0 * kChosen * c.dim * c.rank * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
}

// fit_basis at the 8B layer's D' = 1024 over 20,480 sampled rows (what a 51K-token compressed span
// samples at 2.5x), the rank of a 32K context at 2.5x: on the calling thread (threads 0) and with
// the Gram's tiles over a pool of kThreads, in the same process.
void BM_s4r_fit_basis(benchmark::State& state) {
  namespace s4r = kvsift::select::s4r;
  const ProductCase c(2.5);
  constexpr uint64_t kSample = 20480;
  std::vector<float> rows(kSample * c.dim);
  Random(kSeed + 2).fill(rows);
  std::vector<uint32_t> sample(kSample);
  for (uint32_t i = 0; i < kSample; ++i) sample[i] = i;
  const auto threads = static_cast<int>(state.range(0));
  std::unique_ptr<kvsift::ThreadPool> pool;
  if (threads > 0) pool = std::make_unique<kvsift::ThreadPool>(threads);
  for (auto _ : state)
    benchmark::DoNotOptimize(s4r::fit_basis(rows.data(), kSample, c.dim, c.dim, sample.data(),
                                            kSample, c.rank, pool.get()));
  state.counters["rank"] = c.rank;
}

// `context` positions: a prompt of all but one of them, then the one decode step.
void prefill_overhead(benchmark::State& state, const char* path, uint32_t context) {
  const uint32_t tokens = context - 1;
  kvsift::model::ModelOptions options;
  options.n_ctx = context;
  options.n_threads = kThreads;
  auto model = kvsift::model::LlamaModel::load(path, options);
  // A long document of varied text: the model's own tokenizer over generated sentences.
  std::string text;
  Random random(kSeed);
  for (uint32_t i = 0; text.size() < 6 * std::size_t{tokens}; ++i)
    text += "Log " + std::to_string(i) + ": the keeper counted " +
            std::to_string(static_cast<int>((random.uniform() + 1.0f) * 500.0f)) +
            " gulls, the tide stood at " +
            std::to_string(static_cast<int>((random.uniform() + 1.0f) * 40.0f)) +
            " feet, and the lamp burned until dawn. ";
  std::vector<int32_t> prompt = model->tokenizer().encode(text, false);
  prompt.resize(std::min<std::size_t>(prompt.size(), tokens));
  kvsift::select::Policy policy;
  policy.kind = kvsift::select::Kind::s4r;
  policy.budget = kBudget;
  policy.s4r.compression = 2.5;
  double prefill_s = 0.0, compress_s = 0.0;
  for (auto _ : state) {
    model->set_selector(kvsift::select::Policy{});
    const int32_t seq = model->create_sequence();
    const auto start = Clock::now();
    model->prefill(seq, prompt, nullptr, nullptr, nullptr);
    prefill_s = seconds_since(start);
    model->set_selector(policy);
    const int32_t next = 0;
    model->decode({&seq, 1}, {&next, 1});
    compress_s =
        dynamic_cast<const kvsift::select::S4rSelector&>(model->selector()).compress_seconds();
    model->free_sequence(seq);
    state.SetIterationTime(prefill_s);
  }
  state.counters["prompt_tokens"] = static_cast<double>(prompt.size());
  state.counters["prefill_s"] = prefill_s;
  state.counters["compress_s"] = compress_s;
  state.counters["share"] = compress_s / prefill_s;
}

void BM_s4r_prefill_overhead(benchmark::State& state) {
  const char* path = std::getenv("KVSIFT_MODEL");
  if (path == nullptr) {
    state.SkipWithError("KVSIFT_MODEL is not set");
    return;
  }
  try {
    prefill_overhead(state, path, static_cast<uint32_t>(state.range(0)));
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  // The paper's query window (32) at both ratios and lengths, and its efficiency runs' (4) once:
  // the latent relevance costs G * W * rank multiply-adds per compressed token.
  struct Decode {
    double compression;
    uint64_t context;
    uint32_t window;
  };
  for (const Decode c : {Decode{2.5, 32768, 32}, Decode{5.0, 32768, 32}, Decode{2.5, 131072, 32},
                         Decode{5.0, 131072, 32}, Decode{2.5, 131072, 4}})
    benchmark::RegisterBenchmark(
        ("BM_s4r_decode/" + std::to_string(c.compression).substr(0, 3) +
         "x/llama8b/ctx:" + std::to_string(c.context) + "/window:" + std::to_string(c.window))
            .c_str(),
        BM_s4r_decode, c.compression, c.context, c.window)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond)
        ->Iterations(10);
  for (const double compression : {2.5, 5.0}) {
    const std::string ratio = std::to_string(compression).substr(0, 3) + "x";
    benchmark::RegisterBenchmark(("BM_s4r_project/" + ratio).c_str(), BM_s4r_project, compression)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("BM_s4r_reconstruct/" + ratio).c_str(), BM_s4r_reconstruct,
                                 compression)
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("BM_s4r_fit_basis/llama8b", BM_s4r_fit_basis)
      ->ArgName("threads")
      ->Arg(0)
      ->Arg(kThreads)
      ->Unit(benchmark::kMillisecond)
      ->Iterations(3);
  benchmark::RegisterBenchmark("BM_s4r_prefill_overhead/smollm2", BM_s4r_prefill_overhead)
      ->Arg(8192)
      ->UseManualTime()
      ->Unit(benchmark::kSecond)
      ->Iterations(1);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
