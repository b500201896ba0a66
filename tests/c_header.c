/* The public header compiled as C11 (-Wpedantic -Werror), and a few real calls through it, so
 * that C compatibility of kvsift.h cannot break unnoticed. test_capi.cpp runs kvsift_c_smoke(). */
#include <string.h>

#include "kvsift/kvsift.h"

int kvsift_c_smoke(void);

enum { kTokens = 5, kKvHeads = 2, kGroup = 2, kHeadDim = 64 };

/* Returns 0 on success, else the number of the first step that failed. */
int kvsift_c_smoke(void) {
  static float k[kTokens * kKvHeads * kHeadDim];
  static float v[kTokens * kKvHeads * kHeadDim];
  static float q[kKvHeads * kGroup * kHeadDim];
  static float out[kKvHeads * kGroup * kHeadDim];
  kvsift_cache_params params;
  kvsift_cache_stats stats;
  kvsift_cache* cache = NULL;
  int32_t seq = -1;
  uint64_t length = 0;
  size_t i;
  int result = 0;

  for (i = 0; i < sizeof k / sizeof k[0]; ++i) {
    k[i] = (float)((int)(i * 7 % 13) - 6) / 8.0f;
    v[i] = (float)((int)(i * 5 % 11) - 5) / 8.0f;
  }
  for (i = 0; i < sizeof q / sizeof q[0]; ++i) q[i] = (float)((int)(i % 9) - 4) / 4.0f;

  if (kvsift_version() != KVSIFT_VERSION) return 1;
  if (kvsift_version_string() == NULL || kvsift_version_string()[0] == '\0') return 2;
  if (strcmp(kvsift_status_string(KVSIFT_STATUS_NOT_FOUND), "") == 0) return 3;

  kvsift_cache_params_init(&params);
  params.n_layers = 1;
  params.n_kv_heads = kKvHeads;
  params.group_size = kGroup;
  params.head_dim = kHeadDim;
  params.page_tokens = 16;
  params.max_pages = 8;
  params.max_batch = 2;
  params.n_threads = 1;
  if (kvsift_cache_create(&params, &cache) != KVSIFT_STATUS_OK || cache == NULL) return 4;

  if (kvsift_sequence_create(cache, &seq) != KVSIFT_STATUS_OK || seq < 0) {
    result = 5;
  } else if (kvsift_append(cache, seq, 0, kTokens, k, v) != KVSIFT_STATUS_OK) {
    result = 6;
  } else if (kvsift_sequence_length(cache, seq, 0, &length) != KVSIFT_STATUS_OK ||
             length != kTokens) {
    result = 7;
  } else if (kvsift_attend(cache, 0, 1, &seq, q, out, NULL) != KVSIFT_STATUS_OK) {
    result = 8;
  } else if (!(out[0] >= -1.0f && out[0] <= 1.0f)) { /* a convex mix of v, all in [-5/8, 5/8] */
    result = 14;
  } else if (kvsift_cache_get_stats(cache, &stats) != KVSIFT_STATUS_OK ||
             stats.last_tokens_read != (uint64_t)kTokens * kKvHeads || stats.n_sequences != 1) {
    result = 9;
  } else if (kvsift_append(cache, seq, 0, 0, k, v) != KVSIFT_STATUS_INVALID_ARGUMENT ||
             strstr(kvsift_last_error(), "n_tokens") == NULL) {
    result = 10;
  } else if (kvsift_sequence_free(cache, seq) != KVSIFT_STATUS_OK) {
    result = 11;
  } else if (kvsift_sequence_free(cache, seq) != KVSIFT_STATUS_NOT_FOUND) {
    result = 12;
  } else if (kvsift_cache_isa(cache) == KVSIFT_ISA_AUTO) {
    result = 13;
  }
  kvsift_cache_free(cache);
  return result;
}
