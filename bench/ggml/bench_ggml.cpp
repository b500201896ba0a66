// kvsift beside ggml's CPU kernels (the ggml that llama.cpp, kvsift's peer, vendors) in one
// process, on the same data and the same thread count; scripts/bench_vs_ggml.sh builds and runs it.
//
// Attention: decode attention at the Llama-3.1-8B layer shape (32 query heads, 8 KV heads,
// d = 128, one query token, batch 1) over f16 K/V, at each context:
//   ggml_fa_llama   ggml_flash_attn_ext over K/V as llama.cpp's KV cache holds them (one
//                   [n_kv_heads * d, kv_size] tensor each, rows of all KV heads per token, viewed
//                   4-D with strides and permuted as llama.cpp's llama_kv_cache::get_k/get_v
//                   and llm_graph_context::build_attn_mha do), with llama.cpp's f16 KQ mask and
//                   its F32 precision request;
//   ggml_fa_heads   the same operator over head-major contiguous K/V, no mask: ggml's best case;
//   kvsift_dense    kvsift_attend over every page;
//   kvsift_locks_2, kvsift_locks_5  kvsift_attend_selected with LOCKS at budgets 0.02 and 0.05.
// Keys come from bench/key_maker.hpp (structured, RoPE-rotated), values are random, queries look
// for a few stored keys (add_needle_queries): the same values, rounded once to f16, in both.
//
// Matvec: one decode-step projection y = W x with Q4_0 or Q8_0 weights at the 8B shapes:
// ggml_mul_mat (on the bytes as stored, and repacked as llama.cpp loads them: GgmlRepacked)
// against the model runner's path (quantize_vectors, then the kernel table's
// matvec_quant split over a ThreadPool, lib/model/cpu_forward_pass.cpp), both reading the same
// weights (kvsift keeps ggml's block formats, simd/kernels.hpp; Q4_0 repacked to q4_0x16 as the
// runner's loader does, and also as stored: kvsift_matvec_quant_stored), cycling through copies
// that fill 1 GiB so that weights come from DRAM as a model's do (bench_quant.cpp does the same).
//
// Each case first checks both libraries against a float64 reference over the same stored values
// (tolerances at check_attention and check_matvec) and exits non-zero if either misses. Timing:
// the variants take turns (rotating which goes first) for --reps rounds; one sample is the mean
// of enough back-to-back calls to last --min-sample-ms. A plain loop rather than Google
// Benchmark: the interleaving across libraries and the check before timing do not fit its
// per-case repetitions. JSON on stdout (or --out); tools/peer/ggml_table.py formats it.
#include <ggml-alloc.h>
#include <ggml-backend.h>
#include <ggml-cpu.h>
#include <ggml.h>
#include <sys/utsname.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_util.hpp"
#include "bench/key_maker.hpp"
#include "bench/quant_blocks.hpp"
#include "kvsift/kvsift.h"
#include "lib/core/aligned.hpp"
#include "lib/core/thread_pool.hpp"
#include "lib/model/llama_weights.hpp"
#include "simd/isa.hpp"
#include "simd/kernels.hpp"
#include "simd/quant.hpp"

namespace {

using namespace kvsift;
using namespace kvsift::bench;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// fp16's unit roundoff: round to nearest with an 11-bit significand.
constexpr double kHalfRoundoff = 0x1p-11;
constexpr double kFloatRoundoff = 0x1p-24;

struct Options {
  int threads = 2;
  int reps = 11;
  double min_sample_ms = 20.0;
  std::vector<uint64_t> contexts{8192, 32768, 131072};
  bool attention = true, matvec = true;
};

[[noreturn]] void fail(const std::string& what) {
  throw std::runtime_error(what);
}

void check_kvsift(kvsift_status status, const char* call) {
  if (status != KVSIFT_STATUS_OK) fail(std::string(call) + ": " + kvsift_last_error());
}

// ---- Timing ------------------------------------------------------------------------------------

struct Variant {
  Variant(std::string n, std::function<void()> c) : name(std::move(n)), call(std::move(c)) {}
  std::string name;
  std::function<void()> call;
  int inner = 1;           // calls per sample
  std::vector<double> ms;  // per-call milliseconds, one value per sample
};

json summary(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  auto at = [&](double quantile) {  // linear interpolation between order statistics
    const double pos = quantile * static_cast<double>(ms.size() - 1);
    const auto lo = static_cast<std::size_t>(pos);
    const std::size_t hi = std::min(lo + 1, ms.size() - 1);
    return ms[lo] + (ms[hi] - ms[lo]) * (pos - static_cast<double>(lo));
  };
  return {{"median_ms", at(0.5)}, {"q1_ms", at(0.25)},   {"q3_ms", at(0.75)},
          {"min_ms", ms.front()}, {"max_ms", ms.back()}, {"samples_ms", ms}};
}

// Warms each variant, sizes its samples, then times the variants in turns. Between samples the
// thread sleeps briefly, so that OpenMP workers still spinning after a ggml call (libgomp spins
// before it sleeps) have gone idle before the other library's sample starts.
json time_interleaved(std::vector<Variant>& variants, const Options& options) {
  const auto pause = [] { std::this_thread::sleep_for(std::chrono::milliseconds(5)); };
  for (Variant& v : variants) {
    v.call();
    pause();
    const auto start = Clock::now();
    v.call();
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    v.inner = std::max(1, static_cast<int>(std::ceil(options.min_sample_ms / std::max(ms, 1e-3))));
    pause();
  }
  for (int rep = 0; rep < options.reps; ++rep)
    for (std::size_t i = 0; i < variants.size(); ++i) {
      Variant& v = variants[(i + static_cast<std::size_t>(rep)) % variants.size()];
      const auto start = Clock::now();
      for (int j = 0; j < v.inner; ++j) v.call();
      v.ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count() /
                     v.inner);
      pause();
    }
  json out;
  for (const Variant& v : variants) {
    out[v.name] = summary(v.ms);
    out[v.name]["calls_per_sample"] = v.inner;
  }
  return out;
}

double median_of(const json& timings, const std::string& name) {
  return timings.at(name).at("median_ms").get<double>();
}

// ---- ggml --------------------------------------------------------------------------------------

// A ggml context that holds tensor metadata and graphs only: tensor data lives in buffers this
// program owns, or in a backend buffer allocated for the context's tensors (GgmlRepacked).
class GgmlContext {
 public:
  GgmlContext(std::size_t n_tensors, std::size_t n_graphs,
              std::size_t graph_nodes = GGML_DEFAULT_GRAPH_SIZE) {
    const ggml_init_params params{n_tensors * ggml_tensor_overhead() +
                                      n_graphs * ggml_graph_overhead_custom(graph_nodes, false),
                                  nullptr, true};
    ctx_ = ggml_init(params);
    if (ctx_ == nullptr) fail("ggml_init failed");
  }
  ~GgmlContext() { ggml_free(ctx_); }
  GgmlContext(const GgmlContext&) = delete;
  GgmlContext& operator=(const GgmlContext&) = delete;
  ggml_context* get() const { return ctx_; }

 private:
  ggml_context* ctx_ = nullptr;
};

// One output tensor's graph with its compute plan and work buffer, made once: each run is then
// exactly ggml_graph_compute, as the CPU backend runs a graph it has planned.
class GgmlGraph {
 public:
  GgmlGraph(ggml_context* ctx, ggml_tensor* result, int threads,
            std::size_t nodes = GGML_DEFAULT_GRAPH_SIZE) {
    graph_ = ggml_new_graph_custom(ctx, nodes, false);
    ggml_build_forward_expand(graph_, result);
    plan_ = ggml_graph_plan(graph_, threads, nullptr);
    work_.resize(plan_.work_size);
    plan_.work_data = work_.data();
  }
  void run() {
    if (ggml_graph_compute(graph_, &plan_) != GGML_STATUS_SUCCESS) fail("ggml_graph_compute");
  }

 private:
  ggml_cgraph* graph_ = nullptr;
  ggml_cplan plan_{};
  AlignedVector<uint8_t> work_;
};

// ---- Attention ---------------------------------------------------------------------------------

// The token positions each KV head attends to, as whole pages [first, last) in ascending order.
using PageRuns = std::vector<std::vector<std::pair<uint64_t, uint64_t>>>;

PageRuns all_pages(uint32_t n_kv_heads, uint64_t context) {
  return PageRuns(n_kv_heads, {{0, context}});
}

struct Reference {
  std::vector<double> out;        // [n_heads, d]
  std::vector<double> tolerance;  // [n_heads, d]: how far ggml's output may be from out
};

// Float64 attention of each query head over the runs of its KV head, from the f16 values stored
// head-major ([n_kv_heads, kv_size, d]), with how far a float kernel may be from it. ggml's CPU
// flash-attention kernel (its f16 V path) rounds q to f16 (checked against a reference given the
// same rounded q) and keeps the running sum of p_i v_i in f16: each multiply-add and each rescale
// rounds by up to u = 2^-11 times the new magnitude. Summed as worst cases those bounds grow with
// the context past any use (beyond 1 at 8K tokens), so the tolerance is 6 standard deviations of
// their sum taken as independent roundings, uniform in +-u|acc| (variance (u acc)^2 / 3), carried
// through the online recurrence in the same scale as the sum. Both libraries sum the softmax
// denominator in float32, which adds n * 2^-24 of the output.
double rounding_variance(double value) {
  const double half_step = kHalfRoundoff * value;
  return half_step * half_step / 3.0;
}

Reference attention_reference(const Shape& shape, uint64_t kv_size, const uint16_t* k,
                              const uint16_t* v, const float* q, const PageRuns& runs) {
  const uint32_t d = shape.head_dim, G = shape.group_size;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Reference ref;
  ref.out.assign(std::size_t{shape.n_kv_heads} * G * d, 0.0);
  ref.tolerance.assign(ref.out.size(), 0.0);
  std::vector<double> acc(d), var(d);
  for (uint32_t h = 0; h < shape.n_kv_heads; ++h)
    for (uint32_t g = 0; g < G; ++g) {
      const std::size_t head = std::size_t{h} * G + g;
      const float* qh = q + head * d;
      double m = -INFINITY, sum = 0.0;
      uint64_t n = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      std::fill(var.begin(), var.end(), 0.0);
      for (const auto& [first, last] : runs[h])
        for (uint64_t t = first; t < last; ++t, ++n) {
          const uint16_t* kt = k + (std::size_t{h} * kv_size + t) * d;
          const uint16_t* vt = v + (std::size_t{h} * kv_size + t) * d;
          double s = 0.0;
          for (uint32_t c = 0; c < d; ++c) s += double{qh[c]} * simd::f16_to_f32(kt[c]);
          s *= scale;
          double w = 1.0;
          if (s > m) {
            const double factor = std::exp(m - s);
            for (uint32_t c = 0; c < d; ++c) {
              acc[c] *= factor;
              var[c] = var[c] * factor * factor + rounding_variance(acc[c]);
            }
            sum *= factor;
            m = s;
          } else {
            w = std::exp(s - m);
          }
          sum += w;
          for (uint32_t c = 0; c < d; ++c) {
            acc[c] += w * simd::f16_to_f32(vt[c]);
            var[c] += rounding_variance(acc[c]);
          }
        }
      for (uint32_t c = 0; c < d; ++c) {
        const double o = sum > 0.0 ? acc[c] / sum : 0.0;
        ref.out[head * d + c] = o;
        ref.tolerance[head * d + c] = (sum > 0.0 ? 6.0 * std::sqrt(var[c]) / sum : 0.0) +
                                      static_cast<double>(n) * kFloatRoundoff * std::fabs(o);
      }
    }
  return ref;
}

// Checks ggml's output against the reference for its f16-rounded query (`half`) within that
// reference's tolerance; kvsift's (float32 scores and sums over the exact f16 values) against the
// reference for the exact query (`exact`) within its float32 part, n * 2^-24 |out|; the two
// libraries within the sum of both tolerances and the references' own difference. Each tolerance
// has 1e-5 added for float32 rounding of the output itself.
json check_attention(const std::string& what, const Reference& exact, const Reference& half,
                     const float* ggml_out, const float* kvsift_out, uint64_t n_tokens) {
  double ggml_err = 0.0, kvsift_err = 0.0, diff = 0.0, worst = 0.0, tolerance_max = 0.0;
  for (std::size_t i = 0; i < exact.out.size(); ++i) {
    const double kvsift_tol =
        static_cast<double>(n_tokens) * kFloatRoundoff * std::fabs(exact.out[i]) + 1e-5;
    const double ggml_tol = half.tolerance[i] + 1e-5;
    const double eg = std::fabs(ggml_out[i] - half.out[i]);
    const double ek = std::fabs(kvsift_out[i] - exact.out[i]);
    const double dk = std::fabs(double{ggml_out[i]} - kvsift_out[i]);
    ggml_err = std::max(ggml_err, eg);
    kvsift_err = std::max(kvsift_err, ek);
    diff = std::max(diff, dk);
    tolerance_max = std::max(tolerance_max, ggml_tol);
    const double both = ggml_tol + kvsift_tol + std::fabs(half.out[i] - exact.out[i]);
    worst = std::max({worst, eg / ggml_tol, ek / kvsift_tol, dk / both});
  }
  const json result{{"max_abs_ggml_vs_ref", ggml_err},
                    {"max_abs_kvsift_vs_ref", kvsift_err},
                    {"max_abs_ggml_vs_kvsift", diff},
                    {"max_ggml_tolerance", tolerance_max},
                    {"worst_error_over_tolerance", worst}};
  if (!(worst <= 1.0)) fail("attention check failed (" + what + "): " + result.dump());
  return result;
}

// One context's data in both libraries, and the ggml graphs over it.
class AttentionCase {
 public:
  static constexpr uint32_t kChunk = kAppendTokens;

  AttentionCase(uint64_t context, int threads) : shape_(kLlama8b), context_(context), ctx_(32, 3) {
    const uint32_t H = shape_.n_kv_heads, d = shape_.head_dim;
    const uint32_t QH = H * shape_.group_size;
    const std::size_t elems = context * H * d;
    k_tokens_.resize(elems);
    v_tokens_.resize(elems);
    k_heads_.resize(elems);
    v_heads_.resize(elems);
    const kvsift_cache_params params = cache_params(shape_, context, 1, threads);
    for (int i = 0; i < 2; ++i) {
      if (std::string error = create_cache(params, caches_[i]); !error.empty()) fail(error);
      check_kvsift(kvsift_sequence_create(caches_[i].get(), &seq_[i]), "kvsift_sequence_create");
    }
    fill();
    q_.assign(std::size_t{QH} * d, 0.0f);
    Random random(kSeed + 1);
    add_needle_queries(caches_[0].get(), seq_[0], shape_, context, random, q_.data());
    for (int i = 0; i < 2; ++i) {
      kvsift_selector_policy policy;
      kvsift_selector_policy_init(&policy);
      policy.selector = KVSIFT_SELECTOR_LOCKS;
      policy.budget = kBudgets[i];
      check_kvsift(kvsift_cache_set_selector(caches_[i].get(), &policy),
                   "kvsift_cache_set_selector");
    }
    out_kvsift_.resize(q_.size());
    // ggml's kernel converts q to f16 before its dot products (round to nearest even).
    q_half_.resize(q_.size());
    for (std::size_t i = 0; i < q_.size(); ++i)
      q_half_[i] = ggml_fp16_to_fp32(ggml_fp32_to_fp16(q_[i]));
    build_graphs(threads);
  }

  static constexpr double kBudgets[2] = {0.02, 0.05};

  json run(const Options& options) {
    json result{{"op", "attention"},
                {"shape", shape_.name},
                {"n_heads", shape_.n_kv_heads * shape_.group_size},
                {"n_kv_heads", shape_.n_kv_heads},
                {"head_dim", shape_.head_dim},
                {"context", context_},
                {"kv_dtype", "f16"}};
    result["checks"] = checks();
    std::vector<Variant> variants{
        {"ggml_fa_llama", [this] { llama_graph_->run(); }},
        {"ggml_fa_heads", [this] { heads_graph_->run(); }},
        {"kvsift_dense", [this] { attend(0, false); }},
        {"kvsift_locks_2", [this] { attend(0, true); }},
        {"kvsift_locks_5", [this] { attend(1, true); }},
    };
    const json timings = time_interleaved(variants, options);
    result["timings"] = timings;
    auto ratio = [&](const char* a, const char* b) {
      return median_of(timings, a) / median_of(timings, b);
    };
    result["ratios"] = {
        {"ggml_fa_llama/kvsift_dense", ratio("ggml_fa_llama", "kvsift_dense")},
        {"ggml_fa_heads/kvsift_dense", ratio("ggml_fa_heads", "kvsift_dense")},
        {"ggml_fa_llama/kvsift_locks_2", ratio("ggml_fa_llama", "kvsift_locks_2")},
        {"ggml_fa_llama/kvsift_locks_5", ratio("ggml_fa_llama", "kvsift_locks_5")},
        {"ggml_fa_heads/kvsift_locks_2", ratio("ggml_fa_heads", "kvsift_locks_2")},
    };
    return result;
  }

 private:
  // Makes the K/V once (bench/key_maker.hpp), appends it to both kvsift caches and stores the
  // same values rounded to f16 (round to nearest even, as kvsift stores them) in llama.cpp's
  // token-major layout and in the head-major one.
  void fill() {
    const uint32_t H = shape_.n_kv_heads, d = shape_.head_dim;
    KeyMaker maker(shape_, kSeed);
    std::vector<float> k, v;
    for (uint64_t done = 0; done < context_; done += kChunk) {
      const auto n = static_cast<uint32_t>(std::min<uint64_t>(kChunk, context_ - done));
      maker.make(done, n, k, v);
      for (int c = 0; c < 2; ++c)
        check_kvsift(kvsift_append(caches_[c].get(), seq_[c], 0, n, k.data(), v.data()),
                     "kvsift_append");
      const std::size_t row = std::size_t{H} * d;
      ggml_fp32_to_fp16_row(k.data(), k_tokens_.data() + done * row, static_cast<int64_t>(n * row));
      ggml_fp32_to_fp16_row(v.data(), v_tokens_.data() + done * row, static_cast<int64_t>(n * row));
      for (uint32_t i = 0; i < n; ++i)
        for (uint32_t h = 0; h < H; ++h) {
          const std::size_t from = ((done + i) * H + h) * d, to = (h * context_ + done + i) * d;
          std::copy_n(k_tokens_.data() + from, d, k_heads_.data() + to);
          std::copy_n(v_tokens_.data() + from, d, v_heads_.data() + to);
        }
    }
  }

  ggml_tensor* tensor(ggml_type type, std::initializer_list<int64_t> ne, void* data) {
    const std::vector<int64_t> dims(ne);
    ggml_tensor* t = ggml_new_tensor(ctx_.get(), type, static_cast<int>(dims.size()), dims.data());
    t->data = data;
    return t;
  }

  void build_graphs(int threads) {
    const int64_t H = shape_.n_kv_heads, d = shape_.head_dim, n = context_;
    const int64_t QH = H * shape_.group_size;
    const float scale = 1.0f / std::sqrt(static_cast<float>(d));
    ggml_context* ctx = ctx_.get();
    // llama.cpp: one [H d, kv_size] tensor per K and V; views [d, H, n_kv, 1] with rows of d and
    // tokens H d apart, permuted to [d, n_kv, H]; q [d, QH, 1] permuted to [d, 1, QH]; an f16
    // mask [n_kv, n_tokens] of zeros for the visible cells; F32 precision requested.
    ggml_tensor* k_all = tensor(GGML_TYPE_F16, {H * d, n}, k_tokens_.data());
    ggml_tensor* v_all = tensor(GGML_TYPE_F16, {H * d, n}, v_tokens_.data());
    auto view = [&](ggml_tensor* all) {
      ggml_tensor* t =
          ggml_view_4d(ctx, all, d, H, n, 1, ggml_row_size(all->type, d),
                       ggml_row_size(all->type, H * d), ggml_row_size(all->type, H * d * n), 0);
      return ggml_permute(ctx, t, 0, 2, 1, 3);
    };
    ggml_tensor* q = ggml_permute(ctx, tensor(GGML_TYPE_F32, {d, QH, 1}, q_.data()), 0, 2, 1, 3);
    mask_zero_.assign(static_cast<std::size_t>(n), ggml_fp32_to_fp16(0.0f));
    ggml_tensor* mask = tensor(GGML_TYPE_F16, {n, 1, 1, 1}, mask_zero_.data());
    ggml_tensor* fa =
        ggml_flash_attn_ext(ctx, q, view(k_all), view(v_all), mask, scale, 0.0f, 0.0f);
    ggml_prec_set_acc(fa, GGML_PREC_F32);
    out_llama_ = output(fa, 0);
    llama_graph_.emplace(ctx, fa, threads);
    // Head-major: K and V [d, n_kv, H] contiguous, q [d, 1, QH], no mask.
    ggml_tensor* q_heads = tensor(GGML_TYPE_F32, {d, 1, QH, 1}, q_.data());
    ggml_tensor* k_heads = tensor(GGML_TYPE_F16, {d, n, H, 1}, k_heads_.data());
    ggml_tensor* v_heads = tensor(GGML_TYPE_F16, {d, n, H, 1}, v_heads_.data());
    out_heads_ =
        output(ggml_flash_attn_ext(ctx, q_heads, k_heads, v_heads, nullptr, scale, 0.0f, 0.0f), 1);
    heads_graph_.emplace(ctx, out_heads_, threads);
    // For the check only: llama.cpp's layout with a per-head mask that hides the tokens outside
    // the pages LOCKS chose (its broadcast over heads: n_heads % mask ne[2] == 0).
    mask_selected_.assign(static_cast<std::size_t>(n * QH), ggml_fp32_to_fp16(-INFINITY));
    ggml_tensor* mask_sel = tensor(GGML_TYPE_F16, {n, 1, QH, 1}, mask_selected_.data());
    out_masked_ = output(
        ggml_flash_attn_ext(ctx, q, view(k_all), view(v_all), mask_sel, scale, 0.0f, 0.0f), 2);
    ggml_prec_set_acc(out_masked_, GGML_PREC_F32);
    masked_graph_.emplace(ctx, out_masked_, threads);
  }

  // Gives a graph's result tensor the i-th output buffer ([n_heads, d] float32, as kvsift's).
  ggml_tensor* output(ggml_tensor* t, int i) {
    out_ggml_[i].resize(q_.size());
    t->data = out_ggml_[i].data();
    return t;
  }

  void attend(int cache, bool selected) {
    kvsift_status status = selected
                               ? kvsift_attend_selected(caches_[cache].get(), 0, 1, &seq_[cache],
                                                        q_.data(), out_kvsift_.data(), nullptr)
                               : kvsift_attend(caches_[cache].get(), 0, 1, &seq_[cache], q_.data(),
                                               out_kvsift_.data(), nullptr);
    if (status != KVSIFT_STATUS_OK) fail(std::string("kvsift attention: ") + kvsift_last_error());
  }

  // The pages LOCKS chooses for q in cache i (kvsift_select), as token runs per KV head.
  PageRuns selected_pages(int i, json& info) {
    const uint32_t H = shape_.n_kv_heads;
    std::vector<uint32_t> offsets(H + 1);
    std::vector<uint32_t> ids(context_ / kPageTokens * H + H);
    kvsift_selection sel{};
    sel.page_offsets = offsets.data();
    sel.page_ids = ids.data();
    sel.page_capacity = ids.size();
    std::size_t n_ids = 0, n_tokens = 0;
    kvsift_selection_stats stats{};
    check_kvsift(
        kvsift_select(caches_[i].get(), 0, 1, &seq_[i], q_.data(), &sel, &n_ids, &n_tokens, &stats),
        "kvsift_select");
    PageRuns runs(H);
    for (uint32_t h = 0; h < H; ++h)
      for (uint32_t j = offsets[h]; j < offsets[h + 1]; ++j) {
        const uint64_t first = uint64_t{ids[j]} * kPageTokens;
        runs[h].push_back({first, std::min<uint64_t>(first + kPageTokens, context_)});
      }
    info["pages_chosen_share"] =
        static_cast<double>(stats.pages_chosen) / static_cast<double>(stats.pages_stored);
    info["kept_estimate"] = stats.kept_estimate;
    return runs;
  }

  Reference reference(const std::vector<float>& q, const PageRuns& runs) const {
    return attention_reference(shape_, context_, k_heads_.data(), v_heads_.data(), q.data(), runs);
  }

  json checks() {
    json out;
    const uint32_t H = shape_.n_kv_heads, G = shape_.group_size;
    const PageRuns every = all_pages(H, context_);
    const Reference dense = reference(q_, every), dense_half = reference(q_half_, every);
    attend(0, false);
    llama_graph_->run();
    out["ggml_fa_llama_vs_kvsift_dense"] =
        check_attention("llama layout", dense, dense_half,
                        static_cast<const float*>(out_llama_->data), out_kvsift_.data(), context_);
    heads_graph_->run();
    out["ggml_fa_heads_vs_kvsift_dense"] =
        check_attention("head-major", dense, dense_half,
                        static_cast<const float*>(out_heads_->data), out_kvsift_.data(), context_);
    // LOCKS: ggml over the same pages (masked) and the reference over them.
    for (int i = 0; i < 2; ++i) {
      json info;
      const PageRuns runs = selected_pages(i, info);
      std::fill(mask_selected_.begin(), mask_selected_.end(), ggml_fp32_to_fp16(-INFINITY));
      uint64_t most = 0;
      for (uint32_t h = 0; h < H; ++h) {
        uint64_t n = 0;
        for (uint32_t g = 0; g < G; ++g)
          for (const auto& [first, last] : runs[h]) {
            std::fill(
                mask_selected_.begin() +
                    static_cast<std::ptrdiff_t>((h * G + g) * context_ + first),
                mask_selected_.begin() + static_cast<std::ptrdiff_t>((h * G + g) * context_ + last),
                ggml_fp32_to_fp16(0.0f));
            if (g == 0) n += last - first;
          }
        most = std::max(most, n);
      }
      const Reference sparse = reference(q_, runs), sparse_half = reference(q_half_, runs);
      attend(i, true);
      masked_graph_->run();
      const std::string name = i == 0 ? "kvsift_locks_2" : "kvsift_locks_5";
      json check =
          check_attention(name, sparse, sparse_half, static_cast<const float*>(out_masked_->data),
                          out_kvsift_.data(), most);
      check.update(info);
      out["ggml_fa_masked_vs_" + name] = check;
    }
    return out;
  }

  Shape shape_;
  uint64_t context_;
  kvsift::cache caches_[2];  // the same K/V, LOCKS at kBudgets[0] and kBudgets[1]
  int32_t seq_[2] = {-1, -1};
  AlignedVector<ggml_fp16_t> k_tokens_, v_tokens_;  // [kv_size, H, d]: llama.cpp's cache
  AlignedVector<ggml_fp16_t> k_heads_, v_heads_;    // [H, kv_size, d]
  std::vector<ggml_fp16_t> mask_zero_, mask_selected_;
  std::vector<float> q_, q_half_, out_kvsift_, out_ggml_[3];
  GgmlContext ctx_;
  ggml_tensor *out_llama_ = nullptr, *out_heads_ = nullptr, *out_masked_ = nullptr;
  std::optional<GgmlGraph> llama_graph_, heads_graph_, masked_graph_;
};

// ---- Matvec ------------------------------------------------------------------------------------

constexpr std::size_t kArenaBytes = std::size_t{1} << 30;

struct MatvecShape {
  const char* name;
  uint64_t k, n;  // input size K (columns), output size N (rows)
};

// Llama-3.1-8B's decode projections: q and o, k and v, gate and up, down, the output head.
constexpr MatvecShape kMatvecShapes[] = {{"attn_q/o", 4096, 4096},
                                         {"attn_k/v", 4096, 1024},
                                         {"ffn_gate/up", 4096, 14336},
                                         {"ffn_down", 14336, 4096},
                                         {"output", 4096, 128256}};

// Checks each library's y (N outputs) against float64 over the dequantized weights and the exact
// input. All of them quantize x per block of 32 to int8 codes with scale dx = max|x| / 127, so each
// input value moves by at most dx / 2; ggml also stores dx in f16, which moves a code's value by
// up to 127 dx u more (u = 2^-11, 0.062 dx). Bound per row: 0.6 sum_c |w_c| dx(c) (covering both),
// plus float32 summation over the K / 32 block terms. With the same codes the libraries differ
// from each other only by ggml's f16 scales and the summation order: within 0.07 sum_c |w_c| dx(c)
// and twice the summation term of the first output (kvsift's).
json check_matvec(const std::string& what, ggml_type type, const std::byte* w, uint64_t K,
                  uint64_t N, const float* x,
                  const std::vector<std::pair<std::string, const float*>>& outputs) {
  const auto* traits = ggml_get_type_traits(type);
  std::vector<float> row(K), dx(K / simd::kQuantBlock);
  for (std::size_t b = 0; b < dx.size(); ++b) {
    float amax = 0.0f;
    for (std::size_t c = 0; c < simd::kQuantBlock; ++c)
      amax = std::max(amax, std::fabs(x[b * simd::kQuantBlock + c]));
    dx[b] = amax / 127.0f;
  }
  const std::size_t row_bytes = ggml_row_size(type, static_cast<int64_t>(K));
  std::vector<double> errors(outputs.size(), 0.0);
  double worst = 0.0, diff = 0.0;
  for (uint64_t r = 0; r < N; ++r) {
    traits->to_float(w + r * row_bytes, row.data(), static_cast<int64_t>(K));
    double ref = 0.0, abs_sum = 0.0, quant = 0.0;
    for (uint64_t c = 0; c < K; ++c) {
      ref += double{row[c]} * x[c];
      abs_sum += std::fabs(double{row[c]} * x[c]);
      quant += std::fabs(double{row[c]}) * dx[c / simd::kQuantBlock];
    }
    const double sums = static_cast<double>(K / simd::kQuantBlock + 2) * kFloatRoundoff * abs_sum;
    const double tol = 0.6 * quant + sums + 1e-6;
    const double agree = 0.07 * quant + 2.0 * sums + 1e-6;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const double e = std::fabs(outputs[i].second[r] - ref);
      errors[i] = std::max(errors[i], e);
      worst = std::max(worst, e / tol);
      const double d = std::fabs(double{outputs[i].second[r]} - outputs[0].second[r]);
      diff = std::max(diff, d);
      worst = std::max(worst, d / agree);
    }
  }
  json result{{"worst_error_over_tolerance", worst}, {"max_abs_vs_" + outputs[0].first, diff}};
  for (std::size_t i = 0; i < outputs.size(); ++i)
    result["max_abs_" + outputs[i].first + "_vs_ref"] = errors[i];
  if (!(worst <= 1.0)) fail("matvec check failed (" + what + "): " + result.dump());
  return result;
}

// The weights as llama.cpp holds them by default on the CPU (use_extra_bufts): in the CPU
// backend's CPU_REPACK buffer type, whose ggml_backend_tensor_set interleaves the blocks of 8 rows
// for its own product kernels (ggml's CPU repack code; on x86 with AVX2 it does this for Q4_0, not
// for Q8_0). One repacked tensor and one planned graph per copy of the arena.
class GgmlRepacked {
 public:
  GgmlRepacked(ggml_type type, uint64_t K, uint64_t N, const std::byte* arena, std::size_t bytes,
               std::size_t copies, float* x, float* y, int threads)
      : weights_(copies, 0), graphs_ctx_(copies + 1, copies, kNodes) {
    ggml_backend_buffer_type_t buft = repack_buffer_type();
    if (buft == nullptr) return;
    std::vector<ggml_tensor*> w(copies);
    for (ggml_tensor*& t : w)
      t = ggml_new_tensor_2d(weights_.get(), type, static_cast<int64_t>(K),
                             static_cast<int64_t>(N));
    buffer_ = ggml_backend_alloc_ctx_tensors_from_buft(weights_.get(), buft);
    if (buffer_ == nullptr) fail("cannot allocate a CPU_REPACK buffer");
    if (w[0]->extra == nullptr) return;  // no repacked layout for this type on this CPU
    ggml_tensor* xt =
        ggml_new_tensor_2d(graphs_ctx_.get(), GGML_TYPE_F32, static_cast<int64_t>(K), 1);
    xt->data = x;
    graphs_.reserve(copies);
    for (std::size_t c = 0; c < copies; ++c) {
      ggml_backend_tensor_set(w[c], arena + c * bytes, 0, bytes);
      ggml_tensor* yt = ggml_mul_mat(graphs_ctx_.get(), w[c], xt);
      yt->data = y;
      graphs_.emplace_back(graphs_ctx_.get(), yt, threads, kNodes);
    }
  }
  ~GgmlRepacked() {
    if (buffer_ != nullptr) ggml_backend_buffer_free(buffer_);
  }
  GgmlRepacked(const GgmlRepacked&) = delete;
  GgmlRepacked& operator=(const GgmlRepacked&) = delete;

  bool active() const { return !graphs_.empty(); }
  void run(std::size_t copy) { graphs_[copy].run(); }

 private:
  static constexpr std::size_t kNodes = 4;

  static ggml_backend_buffer_type_t repack_buffer_type() {
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    auto get_extra = reinterpret_cast<ggml_backend_dev_get_extra_bufts_t>(
        ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts"));
    if (get_extra == nullptr) return nullptr;
    for (ggml_backend_buffer_type_t* b = get_extra(ggml_backend_reg_dev_get(reg, 0)); *b; ++b)
      if (std::strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
    return nullptr;
  }

  GgmlContext weights_, graphs_ctx_;
  ggml_backend_buffer_t buffer_ = nullptr;
  std::vector<GgmlGraph> graphs_;
};

json run_matvec(ggml_type type, const MatvecShape& shape, AlignedVector<std::byte>& arena,
                ThreadPool& pool, const Options& options) {
  const simd::BlockFormat format =
      type == GGML_TYPE_Q8_0 ? simd::BlockFormat::q8_0 : simd::BlockFormat::q4_0;
  const uint64_t K = shape.k, N = shape.n;
  const std::size_t bytes = ggml_row_size(type, static_cast<int64_t>(K)) * N;
  if (bytes != N * K / simd::kQuantBlock * simd::block_format_bytes(format))
    fail("ggml's and kvsift's block sizes differ");
  const std::size_t copies = std::max<std::size_t>(1, arena.size() / bytes);
  if (bytes > arena.size()) fail("matrix larger than the arena");
  fill_quant_blocks(format, arena.data(), copies * bytes);

  MatvecInput input(K);
  std::vector<float>& x = input.x;
  AlignedVector<float> y_kvsift(N), y_ggml(N);
  const simd::Kernels& kernels = simd::kernels_for(simd::resolve_level(simd::Level::best));
  const std::size_t row_bytes = bytes / N;
  std::size_t kvsift_copy = 0, ggml_copy = 0;
  // The runner keeps Q4_0 weights repacked into q4_0x16 (lib/model/llama_weights.cpp): kvsift
  // reads its own repacked copies, as ggml's repacked variant reads its own.
  const simd::BlockFormat kvsift_format =
      format == simd::BlockFormat::q4_0 ? simd::BlockFormat::q4_0x16 : format;
  AlignedVector<std::byte> kvsift_arena;
  const std::byte* kvsift_base = arena.data();
  if (kvsift_format != format) {
    kvsift_arena.resize(copies * bytes);
    for (std::size_t c = 0; c < copies; ++c)
      simd::repack_q4_0x16(arena.data() + c * bytes, N, K, kvsift_arena.data() + c * bytes);
    kvsift_base = kvsift_arena.data();
  }
  // The runner's decode path (CpuForwardPass::matvec_quantized): quantize x, split the rows. With
  // stored = true, Q4_0 as stored (one row at a time: the kernel before the repack), for the
  // same-process comparison.
  const auto kvsift_product = [&](std::size_t copy, bool stored, float* y) {
    const std::byte* w = (stored ? arena.data() : kvsift_base) + copy * bytes;
    const simd::BlockFormat f = stored ? format : kvsift_format;
    const simd::QuantizedVectors xq = input.quantize();
    model::parallel_row_groups(pool, N, [&](uint64_t first, uint64_t last, int) noexcept {
      kernels.matvec_quant(f, w + first * row_bytes, last - first, K, xq, 1, y + first, N);
    });
  };
  auto kvsift_call = [&](std::size_t copy) { kvsift_product(copy, false, y_kvsift.data()); };
  AlignedVector<float> y_stored(N);
  std::size_t stored_copy = 0;
  auto stored_call = [&](std::size_t copy) { kvsift_product(copy, true, y_stored.data()); };
  GgmlContext ctx(4, 1);
  ggml_tensor* wt =
      ggml_new_tensor_2d(ctx.get(), type, static_cast<int64_t>(K), static_cast<int64_t>(N));
  ggml_tensor* xt = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, static_cast<int64_t>(K), 1);
  xt->data = x.data();
  ggml_tensor* yt = ggml_mul_mat(ctx.get(), wt, xt);
  yt->data = y_ggml.data();
  GgmlGraph graph(ctx.get(), yt, options.threads);
  auto ggml_call = [&](std::size_t copy) {
    wt->data = arena.data() + copy * bytes;
    graph.run();
  };

  AlignedVector<float> y_repacked(N);
  GgmlRepacked repacked(type, K, N, arena.data(), bytes, copies, x.data(), y_repacked.data(),
                        options.threads);

  kvsift_call(0);
  if (kvsift_format != format) stored_call(0);
  ggml_call(0);
  std::vector<std::pair<std::string, const float*>> outputs{
      {"kvsift_matvec_quant", y_kvsift.data()}, {"ggml_mul_mat", y_ggml.data()}};
  if (repacked.active()) {
    repacked.run(0);
    outputs.emplace_back("ggml_mul_mat_repacked", y_repacked.data());
  }
  if (kvsift_format != format) outputs.emplace_back("kvsift_matvec_quant_stored", y_stored.data());
  const std::string name = std::string(ggml_type_name(type)) + " " + shape.name;
  json result{
      {"op", "matvec"},
      {"format", ggml_type_name(type)},
      {"projection", shape.name},
      {"K", K},
      {"N", N},
      {"weight_MB", static_cast<double>(bytes) / 1e6},
      {"copies", copies},
      {"kvsift_isa", simd::level_name(kernels.level)},
      {"kvsift_format", kvsift_format == simd::BlockFormat::q4_0x16 ? "q4_0x16" : "as stored"}};
  result["checks"] = check_matvec(name, type, arena.data(), K, N, x.data(), outputs);
  // Each variant keeps its own place in the cycle through the copies.
  auto cycling = [copies](std::size_t& copy, auto call) {
    return [&copy, copies, call] {
      call(copy);
      copy = copy + 1 == copies ? 0 : copy + 1;
    };
  };
  std::size_t repacked_copy = 0;
  std::vector<Variant> variants{
      {"ggml_mul_mat", cycling(ggml_copy, ggml_call)},
      {"kvsift_matvec_quant", cycling(kvsift_copy, kvsift_call)},
  };
  if (repacked.active())
    variants.emplace_back("ggml_mul_mat_repacked",
                          cycling(repacked_copy, [&](std::size_t c) { repacked.run(c); }));
  if (kvsift_format != format)
    variants.emplace_back("kvsift_matvec_quant_stored", cycling(stored_copy, stored_call));
  const json timings = time_interleaved(variants, options);
  result["timings"] = timings;
  const double kvsift_ms = median_of(timings, "kvsift_matvec_quant");
  for (const Variant& v : variants) {
    const double ms = median_of(timings, v.name);
    result["weight_GBps"][v.name] = static_cast<double>(bytes) / ms / 1e6;
    if (v.name != "kvsift_matvec_quant")
      result["ratios"][v.name + "/kvsift_matvec_quant"] = ms / kvsift_ms;
  }
  return result;
}

// How OpenMP threads (ggml's) wait: libgomp spins first by default, which on a host whose cores are
// busy with other work stalls a thread that waits at a barrier for its descheduled partner.
json openmp_environment() {
  json env = json::object();
  for (const char* name : {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND"})
    if (const char* value = std::getenv(name)) env[name] = value;
  return env;
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

}  // namespace

int main(int argc, char** argv) {
  Options options;
  std::string out_path, only;
  CLI::App app{"kvsift beside ggml's CPU kernels: decode attention and quantized matvec"};
  app.add_option("--threads", options.threads, "threads of each library")
      ->check(CLI::Range(1, 256));
  app.add_option("--reps", options.reps, "samples per variant, taken in turns")
      ->check(CLI::Range(1, 1000));
  app.add_option("--min-sample-ms", options.min_sample_ms, "least time one sample spans")
      ->check(CLI::Range(0.0, 10000.0));
  app.add_option("--contexts", options.contexts, "attention contexts, tokens")
      ->check(CLI::Range(uint64_t{kPageTokens}, uint64_t{1} << 20));
  app.add_option("--only", only, "run one part: attention or matvec")
      ->check(CLI::IsMember({"attention", "matvec"}));
  app.add_option("--out", out_path, "JSON file (default: stdout)");
  CLI11_PARSE(app, argc, argv);
  options.attention = only.empty() || only == "attention";
  options.matvec = only.empty() || only == "matvec";
  try {
    ggml_cpu_init();
    json report{{"threads", options.threads},
                {"reps", options.reps},
                {"min_sample_ms", options.min_sample_ms},
                {"ggml_version", ggml_version()},
                {"ggml_commit", ggml_commit()},
                {"kvsift_version", kvsift_version_string()},
                {"ggml_cpu",
                 {{"avx2", ggml_cpu_has_avx2()},
                  {"avx512", ggml_cpu_has_avx512()},
                  {"avx512_vnni", ggml_cpu_has_avx512_vnni()},
                  {"avx512_bf16", ggml_cpu_has_avx512_bf16()},
                  {"f16c", ggml_cpu_has_f16c()},
                  {"llamafile", ggml_cpu_has_llamafile()}}},
                {"openmp_environment", openmp_environment()},
                {"load_average_start", load_average()}};
    json cases = json::array();
    if (options.attention)
      for (uint64_t context : options.contexts) {
        std::fprintf(stderr, "attention, context %llu\n", static_cast<unsigned long long>(context));
        AttentionCase attention(context, options.threads);
        cases.push_back(attention.run(options));
        std::fprintf(stderr, "%s\n", cases.back()["ratios"].dump().c_str());
      }
    if (options.matvec) {
      AlignedVector<std::byte> arena(kArenaBytes);
      ThreadPool pool(options.threads);
      for (ggml_type type : {GGML_TYPE_Q4_0, GGML_TYPE_Q8_0})
        for (const MatvecShape& shape : kMatvecShapes) {
          std::fprintf(stderr, "matvec %s %s\n", ggml_type_name(type), shape.name);
          cases.push_back(run_matvec(type, shape, arena, pool, options));
          std::fprintf(stderr, "%s\n", cases.back()["ratios"].dump().c_str());
        }
    }
    report["cases"] = cases;
    report["load_average_end"] = load_average();
    if (out_path.empty()) {
      std::cout << report.dump(1) << "\n";
    } else {
      std::ofstream out(out_path);
      out << report.dump(1) << "\n";
      if (!out) fail("cannot write " + out_path);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvsift-bench-ggml: %s\n", e.what());
    return 1;
  }
  return 0;
}
