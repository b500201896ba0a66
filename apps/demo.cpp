// kvsift-demo, for now: a synthetic long context in the paged host cache, dense decode attention
// over it, checked against the float64 reference, with the cache's statistics. Uses the C API
// only, as an embedding application would.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "kvsift/kvsift.h"

namespace {

// Exact attention in float64 for one query head over float K/V rows [n, d].
void reference(const float* q, const std::vector<float>& k, const std::vector<float>& v, uint64_t n,
               uint32_t d, std::vector<double>& out) {
  std::vector<double> logits(n);
  double m = -INFINITY;
  for (uint64_t t = 0; t < n; ++t) {
    double dot = 0;
    for (uint32_t c = 0; c < d; ++c) dot += double(q[c]) * k[t * d + c];
    logits[t] = dot / std::sqrt(double(d));
    m = std::max(m, logits[t]);
  }
  out.assign(d, 0.0);
  double sum = 0;
  for (uint64_t t = 0; t < n; ++t) {
    const double p = std::exp(logits[t] - m);
    sum += p;
    for (uint32_t c = 0; c < d; ++c) out[c] += p * v[t * d + c];
  }
  for (double& x : out) x /= sum;
}

int check(kvsift_status status) {
  if (status == KVSIFT_STATUS_OK) return 0;
  std::fprintf(stderr, "kvsift-demo: %s: %s\n", kvsift_status_string(status), kvsift_last_error());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvsift-demo: dense decode attention over a synthetic long context in host memory"};
  uint64_t tokens = 65536;
  uint32_t kv_heads = 8, group = 4, head_dim = 128;
  int threads = 0, steps = 10;
  app.add_option("--tokens", tokens, "context length in tokens")->check(CLI::Range(1, 1 << 24));
  app.add_option("--kv-heads", kv_heads, "KV heads")->check(CLI::Range(1, 64));
  app.add_option("--group", group, "query heads per KV head")->check(CLI::Range(1, 64));
  app.add_option("--head-dim", head_dim, "64, 128 or 256");
  app.add_option("--threads", threads, "OpenMP threads (0: default)")->check(CLI::Range(0, 1024));
  app.add_option("--steps", steps, "decode steps to time")->check(CLI::Range(1, 100000));
  CLI11_PARSE(app, argc, argv);

  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  params.n_kv_heads = kv_heads;
  params.group_size = group;
  params.head_dim = head_dim;
  params.n_threads = threads;
  params.max_pages = (tokens + steps + params.page_tokens - 1) / params.page_tokens * kv_heads + kv_heads;
  kvsift_cache* cache = nullptr;
  int32_t seq = -1;
  if (check(kvsift_cache_create(&params, &cache)) || check(kvsift_sequence_create(cache, &seq))) return 1;

  const std::size_t row = std::size_t{kv_heads} * head_dim, qsize = row * group;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> k(tokens * row), v(tokens * row), q(qsize), out(qsize);
  for (float& x : k) x = normal(rng);
  for (float& x : v) x = normal(rng);
  for (float& x : q) x = normal(rng);
  if (check(kvsift_append(cache, seq, 0, static_cast<uint32_t>(tokens), k.data(), v.data()))) return 1;

  std::vector<double> times;
  for (int s = 0; s < steps; ++s) {
    const auto start = std::chrono::steady_clock::now();
    if (check(kvsift_attend(cache, 0, 1, &seq, q.data(), out.data(), nullptr))) return 1;
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(times.begin(), times.end());

  // Check query head 0 against float64 on the stored (rounded) keys and values of KV head 0.
  std::vector<float> k0(tokens * head_dim), v0(tokens * head_dim);
  if (check(kvsift_read_tokens(cache, seq, 0, 0, 0, tokens, k0.data(), v0.data()))) return 1;
  std::vector<double> ref;
  reference(q.data(), k0, v0, tokens, head_dim, ref);
  double err = 0, norm = 0;
  for (uint32_t c = 0; c < head_dim; ++c) {
    err += (out[c] - ref[c]) * (out[c] - ref[c]);
    norm += ref[c] * ref[c];
  }

  kvsift_cache_stats stats;
  if (check(kvsift_cache_get_stats(cache, &stats))) return 1;
  const double median_ms = times[times.size() / 2];
  std::printf("kvsift %s, isa %s\n", kvsift_version_string(), kvsift_isa_name(kvsift_cache_isa(cache)));
  std::printf("context: %llu tokens, %u KV heads x %u query heads each, head_dim %u, fp16 pages of %u tokens\n",
              static_cast<unsigned long long>(tokens), kv_heads, group, head_dim, params.page_tokens);
  std::printf("cache: %llu pages in use (%.1f MiB), %llu reserved\n",
              static_cast<unsigned long long>(stats.pages_in_use), stats.bytes_in_use / 1048576.0,
              static_cast<unsigned long long>(stats.pages_capacity));
  std::printf("dense attention: %.3f ms median of %d steps (min %.3f, max %.3f), %.1f MiB read, %.1f GB/s\n",
              median_ms, steps, times.front(), times.back(), stats.last_bytes_read / 1048576.0,
              stats.last_bytes_read / median_ms / 1e6);
  std::printf("relative error against float64 (query head 0): %.2e\n", std::sqrt(err / norm));
  kvsift_cache_free(cache);
  return 0;
}
