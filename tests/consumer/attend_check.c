/* A program outside kvsift's tree, built against an installed kvsift (tests/consumer/run.cmake):
 * one cache, one sequence, dense attention, checked against attention computed here in double.
 * It uses only the cache part of the C API, so it links libkvsift_core as well as libkvsift.
 * Exit status: 0 when the outputs agree, 1 otherwise (with the reason on stderr). */
#include <kvsift/kvsift.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* A name a host program may well use for itself: the library must not define it globally. */
int set_selector(int selector) {
  return selector;
}

enum { kKvHeads = 2, kGroup = 2, kDim = 64, kTokens = 173 };
enum { kRow = kKvHeads * kDim, kQueryHeads = kKvHeads * kGroup };

/* Values k/256 with |k| < 256: exact in float16, so the stored cache equals the input. */
static float next_value(uint32_t* state) {
  *state = *state * 1664525u + 1013904223u;
  return (float)((int)(*state >> 23) - 256) / 256.0f;
}

int main(void) {
  static float k[kTokens * kRow], v[kTokens * kRow], q[kQueryHeads * kDim], out[kQueryHeads * kDim];
  uint32_t state = 12345u;
  for (int i = 0; i < kTokens * kRow; ++i) k[i] = next_value(&state), v[i] = next_value(&state);
  for (int i = 0; i < kQueryHeads * kDim; ++i) q[i] = next_value(&state);

  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  params.n_kv_heads = kKvHeads, params.group_size = kGroup, params.head_dim = kDim;
  params.n_threads = 1;
  kvsift_cache* cache = NULL;
  int32_t seq = -1;
  if (kvsift_cache_create(&params, &cache) != KVSIFT_STATUS_OK ||
      kvsift_sequence_create(cache, &seq) != KVSIFT_STATUS_OK ||
      kvsift_append(cache, seq, 0, kTokens, k, v) != KVSIFT_STATUS_OK ||
      kvsift_attend(cache, 0, 1, &seq, q, out, NULL) != KVSIFT_STATUS_OK) {
    fprintf(stderr, "attend_check: %s\n", kvsift_last_error());
    kvsift_cache_free(cache);
    return 1;
  }
  kvsift_cache_free(cache);

  double worst = 0.0;
  for (int h = 0; h < kQueryHeads; ++h) {
    const int kv_head = h / kGroup;
    double logits[kTokens], max_logit = -INFINITY, sum = 0.0;
    for (int t = 0; t < kTokens; ++t) {
      double dot = 0.0;
      for (int d = 0; d < kDim; ++d)
        dot += (double)q[h * kDim + d] * k[t * kRow + kv_head * kDim + d];
      logits[t] = dot / sqrt((double)kDim);
      if (logits[t] > max_logit) max_logit = logits[t];
    }
    for (int t = 0; t < kTokens; ++t) sum += logits[t] = exp(logits[t] - max_logit);
    for (int d = 0; d < kDim; ++d) {
      double expected = 0.0;
      for (int t = 0; t < kTokens; ++t)
        expected += logits[t] / sum * v[t * kRow + kv_head * kDim + d];
      const double error = fabs(expected - out[h * kDim + d]);
      if (error > worst) worst = error;
    }
  }
  /* float32 online softmax over 173 tokens against double: a few float32 ulps of values <= 1. */
  if (!(worst <= 1e-5)) {
    fprintf(stderr, "attend_check: largest error %g against the double reference\n", worst);
    return 1;
  }
  printf("attend_check: kvsift %s, largest error %.3g\n", kvsift_version_string(), worst);
  return set_selector(0);
}
