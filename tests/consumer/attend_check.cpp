// The C++ face of tests/consumer/attend_check.c, through the header-only wrapper
// (include/kvsift/kvsift.hpp): the same cache and attention, checked against a double reference
// computed here; a refused argument must arrive as a kvsift::error carrying its status.
#include <kvsift/kvsift.hpp>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

int main() try {
  kvsift_cache_params params = kvsift::cache::default_params();
  params.n_kv_heads = 2, params.group_size = 3, params.head_dim = 128, params.n_threads = 1;
  kvsift::cache cache(params);
  const int32_t seq = cache.create_sequence();

  // Values k/256 with |k| < 256: exact in float16, so the cache holds exactly the input.
  std::mt19937 rng(2026);
  std::uniform_int_distribution<int> step(-255, 255);
  const auto fill = [&](std::vector<float>& x) {
    for (float& value : x) value = static_cast<float>(step(rng)) / 256.0f;
  };
  const std::size_t tokens = 301;
  std::vector<float> k(cache.token_size(tokens)), v(k.size()), q(cache.query_size(1));
  fill(k), fill(v), fill(q);
  cache.append(seq, 0, k, v);
  std::vector<float> out(q.size());
  cache.attend(0, {&seq, 1}, q, out);

  const uint32_t dim = params.head_dim, row = params.n_kv_heads * dim;
  double worst = 0.0;
  for (uint32_t h = 0; h < cache.n_query_heads(); ++h) {
    const uint32_t kv_head = h / params.group_size;
    std::vector<double> weight(tokens);
    double max_logit = -INFINITY, sum = 0.0;
    for (std::size_t t = 0; t < tokens; ++t) {
      double dot = 0.0;
      for (uint32_t d = 0; d < dim; ++d)
        dot += double{q[h * dim + d]} * k[t * row + kv_head * dim + d];
      weight[t] = dot / std::sqrt(double(dim));
      max_logit = std::max(max_logit, weight[t]);
    }
    for (double& w : weight) sum += w = std::exp(w - max_logit);
    for (uint32_t d = 0; d < dim; ++d) {
      double expected = 0.0;
      for (std::size_t t = 0; t < tokens; ++t)
        expected += weight[t] / sum * v[t * row + kv_head * dim + d];
      worst = std::max(worst, std::abs(expected - out[h * dim + d]));
    }
  }
  if (!(worst <= 1e-5)) {
    std::fprintf(stderr, "attend_check_cpp: largest error %g against the double reference\n",
                 worst);
    return 1;
  }

  // A wrong-sized output is refused before the library is called.
  try {
    std::vector<float> short_out(out.size() - 1);
    cache.attend(0, {&seq, 1}, q, short_out);
    std::fprintf(stderr, "attend_check_cpp: a short output buffer was accepted\n");
    return 1;
  } catch (const kvsift::error& e) {
    if (e.status() != KVSIFT_STATUS_INVALID_ARGUMENT) {
      std::fprintf(stderr, "attend_check_cpp: short output gave status %d\n", int(e.status()));
      return 1;
    }
  }
  std::printf("attend_check_cpp: kvsift %s, largest error %.3g\n",
              std::string(kvsift::linked_version_string()).c_str(), worst);
  return 0;
} catch (const kvsift::error& e) {
  std::fprintf(stderr, "attend_check_cpp: %s (%s)\n", e.what(),
               std::string(kvsift::status_string(e.status())).c_str());
  return 1;
}
