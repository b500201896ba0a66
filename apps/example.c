/* The README's C example, compiled with the build so it cannot rot: one cache, one sequence,
 * a prefill, one decode step, dense attention. */
#include <kvsift/kvsift.h>
#include <stdio.h>
#include <stdlib.h>

int main(void) {
  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  params.n_kv_heads = 3, params.group_size = 3, params.head_dim = 64; /* SmolLM2-135M */
  kvsift_cache* cache = NULL;
  int32_t seq = -1;
  enum { kTokens = 1000, kRow = 3 * 64, kQuery = 9 * 64 };
  float* kv = calloc((size_t)kTokens * kRow, sizeof(float));
  float q[kQuery] = {0}, out[kQuery];
  for (size_t i = 0; i < (size_t)kTokens * kRow; ++i)
    kv[i] = (float)((i * 2654435761u) % 1000) / 1000.0f;
  if (kvsift_cache_create(&params, &cache) != KVSIFT_STATUS_OK ||
      kvsift_sequence_create(cache, &seq) != KVSIFT_STATUS_OK ||
      kvsift_append(cache, seq, 0, kTokens, kv, kv) != KVSIFT_STATUS_OK ||  /* prefill */
      kvsift_append(cache, seq, 0, 1, kv, kv) != KVSIFT_STATUS_OK ||        /* decode step */
      kvsift_attend(cache, 0, 1, &seq, q, out, NULL) != KVSIFT_STATUS_OK) { /* dense */
    fprintf(stderr, "kvsift: %s\n", kvsift_last_error());
    kvsift_cache_free(cache), free(kv);
    return 1;
  }
  printf("out[0] = %f over %d tokens (isa %s)\n", out[0], kTokens + 1,
         kvsift_isa_name(kvsift_cache_isa(cache)));
  kvsift_cache_free(cache), free(kv);
  return 0;
}
