/*
 * kvsift: sparse decode attention over a KV cache that lives in host memory.
 *
 * This is the only public header. It is C11 and C++ compatible.
 *
 * Data conventions, fixed once for the whole API:
 *   - Vectors are float32, row-major, densely packed. "[a, b, d]" means element (i, j, c) sits at
 *     index (i * b + j) * d + c.
 *   - Query heads are grouped: query head h belongs to KV head h / group_size (GQA, the Llama
 *     convention), so a layer has n_kv_heads * group_size query heads.
 *   - Keys are given after RoPE (what an inference engine has in hand after its projections).
 *   - Storage is fp16 (default) or bf16; all arithmetic is float32; outputs are float32.
 *
 * Enums: each ends with a *_MAX_ENUM value that only widens the type to 32 bits. kvsift reads every
 * enum argument and field as a 32-bit integer before comparing it, so any value a C caller stores
 * (a negative one, a struct memset to 0xFF) is safe to pass; unknown values are rejected with
 * INVALID_ARGUMENT. Enums whose values run 0, 1, ... without gaps also have a *_COUNT value (not
 * a valid value itself): the number of values, for loops and range checks.
 *
 * Errors: every call that can fail returns a kvsift_status. On failure, kvsift_last_error() gives
 * a message naming the offending argument. No call aborts, throws or prints. A call that returns
 * an error leaves every handle as it was before the call: lengths, sequences, selector policies,
 * statistics and generator states are unchanged, and later calls give what they would have given
 * had the failed call never been made. (Output buffers may have been written; the two-call size
 * queries set the size they report.) Non-finite numbers (NaN, infinities) in queries, keys,
 * values, logits and policy fields are refused with INVALID_ARGUMENT, except where a function
 * documents a meaning for them.
 *
 * Thread safety (the one rule): a handle (kvsift_cache) is used by one thread at a time; distinct
 * handles may be used from distinct threads concurrently. The process-wide settings
 * (kvsift_set_log_callback, kvsift_set_max_isa) are meant to be set once at start-up, before
 * handles are created; calling them concurrently with other kvsift calls is a data race.
 * kvsift_last_error() is per thread. Internally a call may use several OpenMP threads.
 */
#ifndef KVSIFT_KVSIFT_H
#define KVSIFT_KVSIFT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define KVSIFT_API
#else
#define KVSIFT_API __attribute__((visibility("default")))
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Version */

#define KVSIFT_VERSION_MAJOR 0
#define KVSIFT_VERSION_MINOR 1
#define KVSIFT_VERSION_PATCH 0
/* Single number for compile-time comparisons: major * 10000 + minor * 100 + patch. */
#define KVSIFT_VERSION \
  (KVSIFT_VERSION_MAJOR * 10000 + KVSIFT_VERSION_MINOR * 100 + KVSIFT_VERSION_PATCH)

/* The version of the library actually linked, as KVSIFT_VERSION computes it. */
KVSIFT_API int kvsift_version(void);
/* The same as "major.minor.patch". Static storage; never free it. */
KVSIFT_API const char* kvsift_version_string(void);

/* ---------------------------------------------------------------------------------------------- */
/* Status and errors */

typedef enum kvsift_status {
  KVSIFT_STATUS_OK = 0,
  KVSIFT_STATUS_INVALID_ARGUMENT = 1,  /* a NULL, zero, mismatched or out-of-range argument */
  KVSIFT_STATUS_UNSUPPORTED = 2,       /* valid request this build or machine cannot serve */
  KVSIFT_STATUS_OUT_OF_MEMORY = 3,     /* the system refused an allocation */
  KVSIFT_STATUS_CAPACITY_EXCEEDED = 4, /* the cache's page capacity would be exceeded */
  KVSIFT_STATUS_NOT_FOUND = 5,         /* unknown sequence id (or other named object) */
  KVSIFT_STATUS_IO_ERROR = 6,          /* a file could not be read */
  KVSIFT_STATUS_INVALID_FILE = 7,      /* a file's content is malformed or out of bounds */
  KVSIFT_STATUS_INTERNAL = 8,          /* a bug in kvsift: please report the message */
  KVSIFT_STATUS_BUFFER_TOO_SMALL =
      9, /* an output buffer is too small; the size needed is returned */
  KVSIFT_STATUS_MAX_ENUM = 0x7fffffff /* not a status: makes every int32 value a valid enum */
} kvsift_status;

/* A short constant name for a status ("invalid argument"). Never NULL; static storage. */
KVSIFT_API const char* kvsift_status_string(kvsift_status status);

/* The message of the last failed call on this thread, or "" if none failed yet. The pointer is
 * valid until the next kvsift call on this thread. */
KVSIFT_API const char* kvsift_last_error(void);

/* ---------------------------------------------------------------------------------------------- */
/* Logging: silent unless the host installs a callback */

typedef enum kvsift_log_level {
  KVSIFT_LOG_DEBUG = 0,
  KVSIFT_LOG_INFO = 1,
  KVSIFT_LOG_WARN = 2,
  KVSIFT_LOG_ERROR = 3,
  KVSIFT_LOG_MAX_ENUM = 0x7fffffff
} kvsift_log_level;

/* message: NUL-terminated, valid only during the call. user: the pointer given at installation. */
typedef void (*kvsift_log_fn)(kvsift_log_level level, const char* message, void* user);

/* Installs a log callback (NULL removes it: kvsift then logs nothing). Messages below min_level
 * are dropped. The callback may be called from any thread that calls into kvsift. */
KVSIFT_API void kvsift_set_log_callback(kvsift_log_fn fn, void* user, kvsift_log_level min_level);

/* ---------------------------------------------------------------------------------------------- */
/* Instruction sets */

/* Kernel levels: each is a set of CPU features and one table of kernels built for them (README,
 * "Instruction sets"). A handle runs one level, chosen when it is created. */
typedef enum kvsift_isa {
  KVSIFT_ISA_SCALAR = 0,      /* portable code */
  KVSIFT_ISA_AVX2 = 1,        /* x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE */
  KVSIFT_ISA_AVX512 = 2,      /* x86-64-v4: avx2's and AVX-512 F/CD/DQ/BW/VL */
  KVSIFT_ISA_AVX512_VNNI = 3, /* avx512's and AVX-512 VNNI: int8 LOCKS queries scored on VNNI,
                               and Q8 attention in integers (q rounded to 15 bits, each page's
                               softmax weights to 8: about 1e-3 relative, docs/performance.md) */
  KVSIFT_ISA_AUTO = 255,      /* the best the CPU supports, within the process cap */
  KVSIFT_ISA_MAX_ENUM = 0x7fffffff
} kvsift_isa;

/* The best level this CPU and OS support (CPUID + XCR0), ignoring any cap. */
KVSIFT_API kvsift_isa kvsift_isa_supported(void);

/* Caps the level chosen by handles created afterwards: they get the best level whose features
 * the CPU has and the cap level has too (a cap of AVX512 leaves out AVX512_VNNI). The environment
 * variable KVSIFT_MAX_ISA (a name of kvsift_isa_name: scalar | avx2 | avx512 | avx512_vnni, or
 * best for none) sets the initial cap; this call replaces it. With any other value of the
 * variable, creating a cache or a model fails with INVALID_ARGUMENT naming it, until this call
 * sets a cap. KVSIFT_ISA_AUTO removes the cap. Existing handles keep the level they chose.
 * Errors: INVALID_ARGUMENT for an unknown value. */
KVSIFT_API kvsift_status kvsift_set_max_isa(kvsift_isa max_isa);

/* "scalar", "avx2", "avx512", "avx512_vnni" or "auto"; "unknown" for other values. Static
 * storage. */
KVSIFT_API const char* kvsift_isa_name(kvsift_isa isa);

/* ---------------------------------------------------------------------------------------------- */
/* The paged host KV cache */

typedef struct kvsift_cache kvsift_cache;

typedef enum kvsift_dtype {
  KVSIFT_DTYPE_F16 = 0,  /* IEEE half, round to nearest even on store */
  KVSIFT_DTYPE_BF16 = 1, /* bfloat16, round to nearest even on store */
  /* Symmetric int8, half the bytes of the 16-bit types: each token's K row and its V row (the
   * head_dim values of one KV head) keep one float32 scale each, scale = max|x| / 127, and codes
   * round(x / scale) (to nearest even) clamped to [-127, 127], standing for scale * code; a zero
   * row has scale 0. An element's error is at most scale / 2. */
  KVSIFT_DTYPE_Q8 = 2,
  KVSIFT_DTYPE_MAX_ENUM = 0x7fffffff
} kvsift_dtype;

typedef enum kvsift_key_form {
  KVSIFT_KEYS_POST_ROPE = 0, /* keys already rotated by the engine */
  /* Keys before RoPE; the cache rotates them at each token's position (its index in the
   * sequence), on adjacent channel pairs (2i, 2i+1) by pos * rope_theta^(-2i/head_dim), as GGUF
   * stores Llama weights. Needed by the S4R selector, which compresses keys before RoPE. */
  KVSIFT_KEYS_PRE_ROPE = 1,
  KVSIFT_KEYS_COUNT, /* not a key form: how many there are */
  KVSIFT_KEYS_MAX_ENUM = 0x7fffffff
} kvsift_key_form;

/* Cache parameters. Always fill with kvsift_cache_params_init() first, then change fields, so that
 * fields added by later versions get their defaults. */
typedef struct kvsift_cache_params {
  uint32_t n_layers;        /* >= 1. Default 1. */
  uint32_t n_kv_heads;      /* >= 1. Default 1. */
  uint32_t group_size;      /* query heads per KV head, 1..64. Default 1. */
  uint32_t head_dim;        /* 64, 128 or 256. Default 128. */
  uint32_t page_tokens;     /* tokens per page: 16, 32 or 64. Default 16. */
  kvsift_dtype dtype;       /* storage type. Default KVSIFT_DTYPE_F16. */
  kvsift_key_form key_form; /* Default KVSIFT_KEYS_POST_ROPE. */
  float rope_theta;         /* RoPE base for KVSIFT_KEYS_PRE_ROPE, > 0. Default 10000. */
  /* Capacity of the page pool, in pages. One page holds page_tokens tokens of K and of V for one
   * (layer, KV head): 2 * page_tokens * head_dim * 2 bytes. Appends that would need more pages
   * fail with CAPACITY_EXCEEDED. Host memory is reserved up front but committed lazily as pages
   * are first written (pinned pools are committed up front); so are the selectors' per-page
   * summaries and workspaces sized by it, so resident memory follows the pages in use, not
   * max_pages. Default 65536 pages. */
  uint64_t max_pages;
  int pinned;         /* nonzero: page pool in pinned (page-locked) memory for GPU transfers;
                         UNSUPPORTED when built without CUDA. Default 0. */
  uint32_t max_batch; /* most sequences in one attention call. Default 64. */
  int n_threads;      /* Threads of this cache's own pool (attention, selection), the calling
                         thread included; 0 = the CPUs in the process's affinity mask. Idle
                         threads sleep; nothing process-wide changes (README, "Threads").
                         Default 0. */
  kvsift_isa isa;     /* Level for this handle: AUTO, or a level the CPU has (one the process
                         cap leaves out falls back to the best level below it). Default AUTO. */
  /* Offload mode: a CUDA device index, or -1 (default) for attention on the CPU. With a device the
   * pool is pinned (whatever `pinned` says) and kvsift_attend / kvsift_attend_selected run on the
   * device: the pages a call lists (and a token-level selector's rows) not already held by the
   * device's page cache cross PCIe, then a sparse attention kernel attends; selection stays on the
   * CPU. UNSUPPORTED without CUDA in the build or a usable device. */
  int device;
  /* Device page cache slots per layer; a call listing more pages than this fails with
   * CAPACITY_EXCEEDED, and as many slots again are reserved per layer for token rows. 0 (default):
   * the device holds a copy of the whole pool (max_pages slots, plus max_pages / n_layers for
   * token rows), so every page stays resident and a step sends only what changed since. */
  uint32_t device_cache_pages;
} kvsift_cache_params;

/* Fills *params with the defaults above. params must not be NULL (a NULL is ignored). */
KVSIFT_API void kvsift_cache_params_init(kvsift_cache_params* params);

/* Creates a cache. *out receives the handle (set to NULL on failure); free it with
 * kvsift_cache_free. Errors: INVALID_ARGUMENT (NULL pointers, counts outside the ranges above,
 * unknown enum values, KVSIFT_MAX_ISA set to a name that is not a level), UNSUPPORTED (a head_dim
 * or page_tokens kvsift has no kernels for, pinned memory without CUDA or without a usable
 * driver, a level the CPU lacks), OUT_OF_MEMORY. */
KVSIFT_API kvsift_status kvsift_cache_create(const kvsift_cache_params* params, kvsift_cache** out);

/* Frees the cache and every sequence in it. NULL is accepted and ignored. */
KVSIFT_API void kvsift_cache_free(kvsift_cache* cache);

/* The level this cache's kernels run with (never KVSIFT_ISA_AUTO). SCALAR for a NULL cache. */
KVSIFT_API kvsift_isa kvsift_cache_isa(const kvsift_cache* cache);

/* Creates an empty sequence; *seq_id receives its id (>= 0). Ids of freed sequences are reused.
 * Errors: INVALID_ARGUMENT (NULL). */
KVSIFT_API kvsift_status kvsift_sequence_create(kvsift_cache* cache, int32_t* seq_id);

/* Frees a sequence and returns its pages to the pool. Errors: NOT_FOUND (unknown id). */
KVSIFT_API kvsift_status kvsift_sequence_free(kvsift_cache* cache, int32_t seq_id);

/* *n_tokens receives the number of tokens appended to `layer` of the sequence.
 * Errors: INVALID_ARGUMENT (NULL, layer out of range), NOT_FOUND. */
KVSIFT_API kvsift_status kvsift_sequence_length(const kvsift_cache* cache, int32_t seq_id,
                                                uint32_t layer, uint64_t* n_tokens);

/* Appends n_tokens tokens of K and V to one layer of a sequence: n_tokens > 1 for a prefill chunk,
 * 1 for a decode step. Layers are appended independently (the host appends each layer as its
 * forward pass reaches it).
 *   k, v: [n_tokens, n_kv_heads, head_dim] float32, copied (and rounded to the storage dtype)
 *         before the call returns; the caller keeps ownership.
 * A page that becomes full is sealed. The append is all or nothing: on failure nothing changed.
 * Errors: INVALID_ARGUMENT (NULL, n_tokens == 0, layer out of range), NOT_FOUND,
 * CAPACITY_EXCEEDED (the pool lacks the pages this append needs). */
KVSIFT_API kvsift_status kvsift_append(kvsift_cache* cache, int32_t seq_id, uint32_t layer,
                                       uint32_t n_tokens, const float* k, const float* v);

/* Copies stored tokens [first, first + n_tokens) of one (sequence, layer, KV head) back out as
 * float32 (the stored values, after rounding), for checks and tools.
 *   k_out, v_out: [n_tokens, head_dim]; either may be NULL to skip it.
 * Errors: INVALID_ARGUMENT (range beyond the sequence, indices out of range), NOT_FOUND. */
KVSIFT_API kvsift_status kvsift_read_tokens(const kvsift_cache* cache, int32_t seq_id,
                                            uint32_t layer, uint32_t kv_head, uint64_t first,
                                            uint64_t n_tokens, float* k_out, float* v_out);

/* ---------------------------------------------------------------------------------------------- */
/* Decode attention */

/* Optional explicit page lists for one attention call, in compressed-row form over the
 * n_seqs * n_kv_heads (sequence, KV head) pairs, sequence-major:
 *   offsets: [n_seqs * n_kv_heads + 1], offsets[0] == 0, non-decreasing; the pages of pair i are
 *            page_ids[offsets[i] .. offsets[i+1]).
 *   page_ids: logical page indices within that (sequence, layer, KV head): page p holds tokens
 *            [p * page_tokens, (p+1) * page_tokens); strictly ascending; each < the number of
 *            pages the sequence has in that layer (the last one may be partial). A pair may list
 *            no pages: its output is then zero.
 * Attention runs over exactly the listed pages (callers that want the open page, sinks or a
 * recent window include them). Both arrays are read during the call only. */
typedef struct kvsift_page_list {
  const uint32_t* offsets;
  const uint32_t* page_ids;
} kvsift_page_list;

/* Exact decode attention for one layer and a batch of sequences, one query token each:
 * out = softmax(q K^T / sqrt(head_dim)) V per query head, float32 online softmax, over every
 * stored token (pages == NULL) or over the listed pages.
 *   seq_ids: [n_seqs], distinct, 1 <= n_seqs <= max_batch.
 *   q:   [n_seqs, n_kv_heads * group_size, head_dim] float32.
 *   out: [n_seqs, n_kv_heads * group_size, head_dim] float32, written by the call; must not
 *        overlap q. A sequence with no tokens in this layer gets zeros.
 * Errors: INVALID_ARGUMENT (NULL, n_seqs out of range, duplicate ids, malformed page lists),
 * NOT_FOUND (unknown sequence). Validation happens before any output is written. */
KVSIFT_API kvsift_status kvsift_attend(kvsift_cache* cache, uint32_t layer, uint32_t n_seqs,
                                       const int32_t* seq_ids, const float* q, float* out,
                                       const kvsift_page_list* pages);

/* ---------------------------------------------------------------------------------------------- */
/* Selectors */

/* Which pages each decode step attends to (per layer, sequence and KV head; the G query heads of a
 * group share one choice). Methods and their guarantees: README "Selectors". */
typedef enum kvsift_selector {
  KVSIFT_SELECTOR_DENSE = 0,           /* every stored token: exact attention */
  KVSIFT_SELECTOR_ORACLE = 1,          /* exact page log-sum-exp from all keys: the top-b ceiling */
  KVSIFT_SELECTOR_QUEST = 2,           /* per-page channel min/max, q.k upper bound, top-b */
  KVSIFT_SELECTOR_LOCKS = 3,           /* page-local rank-8 summaries, estimated page mass, top-b */
  KVSIFT_SELECTOR_LOCKS_CERTIFIED = 4, /* LOCKS grown until the proven dropped mass < epsilon */
  /* S4R: compresses each prompt's K/V to low-rank coefficients on its first selected step (its
   * exact pages go back to the pool), then reconstructs only the tokens whose latent relevance is
   * highest. Needs a cache with KVSIFT_KEYS_PRE_ROPE. */
  KVSIFT_SELECTOR_S4R = 5,
  /* Louver: an exact range-search index per (sequence, layer, KV head) returns every token with
   * q.k >= tau, tau aimed at the budget from a key sample; attends those tokens and the sink and
   * window pages. */
  KVSIFT_SELECTOR_LOUVER = 6,
  KVSIFT_SELECTOR_COUNT, /* not a selector: how many there are (the last value + 1) */
  KVSIFT_SELECTOR_MAX_ENUM = 0x7fffffff
} kvsift_selector;

/* How a group's query heads combine their page scores into one ranking. */
typedef enum kvsift_gqa_combine {
  KVSIFT_GQA_SHARE_AVG = 0, /* average of each head's estimated mass shares (the LOCKS paper) */
  KVSIFT_GQA_NRM = 1,       /* sum of exp(score - the head's best score) (the LOCKS code; the
                               default, since the paper's numbers came from that code) */
  KVSIFT_GQA_MAX = 2,       /* the best head's score */
  KVSIFT_GQA_COUNT,         /* not a mode: how many there are */
  KVSIFT_GQA_MAX_ENUM = 0x7fffffff
} kvsift_gqa_combine;

/* LOCKS's own fields (KVSIFT_SELECTOR_LOCKS and LOCKS_CERTIFIED; others ignore them). */
typedef struct kvsift_locks_policy {
  /* Round each query head to int8 before scoring, as the reference does (LOCKS_CERTIFIED scores
   * with the exact query whatever this says: its bound needs it). Default 1. */
  int32_t int8_query;
  /* LOCKS_CERTIFIED: target bound on the dropped share of softmax mass, in (0, 1). Default 1e-3. */
  double epsilon;
} kvsift_locks_policy;

/* S4R's own fields (KVSIFT_SELECTOR_S4R; others ignore them). */
typedef struct kvsift_s4r_policy {
  /* Target compression of the prompt's K/V (dense bytes over S4R bytes), >= 1; it sets the rank.
   * 1 keeps full rank (no saving: a check). Default 2.5. */
  double compression;
  /* Queries that rank the compressed tokens, and compressed tokens always reconstructed (the most
   * recent ones), 1..4096. Default 32. */
  uint32_t window;
  /* Nonzero for one basis per KV head; 0 for one per layer over all KV heads (the paper's
   * default). Default 0. */
  int32_t per_head_bases;
} kvsift_s4r_policy;

/* Fill with kvsift_selector_policy_init() first, then change fields, so that fields added by later
 * versions get their defaults. The fields every selector reads come first, then one group per
 * method that has fields of its own (Louver has none). */
typedef struct kvsift_selector_policy {
  kvsift_selector selector; /* Default KVSIFT_SELECTOR_DENSE. */
  /* Tokens per (layer, KV head) per step, sink and window pages counted inside (the papers'
   * meaning): a fraction of the context when in (0, 1], a token count when > 1. The dense
   * selector takes none (0); the others need one. For LOCKS_CERTIFIED it is the most the
   * selection grows to. Pages allowed: floor(tokens / page_tokens), never fewer than the sink and
   * window pages. Default 0. */
  double budget;
  uint32_t sink_pages; /* leading pages always attended. Default 1. */
  /* most recent pages always attended, counting the open page (which always is). Default 1. */
  uint32_t window_pages;
  /* How the page-level selectors that estimate page masses (ORACLE, LOCKS, LOCKS_CERTIFIED)
   * combine a group's heads; QUEST always takes the max, the others ignore it.
   * Default KVSIFT_GQA_NRM. */
  kvsift_gqa_combine combine;
  /* Selection on a CUDA device, or -1 (default) for the CPU. LOUVER: the device holds a copy of
   * the indexes' bounding balls and runs the filter pass (the same tokens are chosen). LOCKS: the
   * device holds a copy of the page summaries and scores and selects there (the same pages but at
   * near-ties of the score; int8 queries only). Others ignore it. UNSUPPORTED without CUDA in the
   * build or a usable device; INVALID_ARGUMENT below -1 or with LOCKS_CERTIFIED. */
  int32_t device;
  kvsift_locks_policy locks;
  kvsift_s4r_policy s4r;
} kvsift_selector_policy;

KVSIFT_API void kvsift_selector_policy_init(kvsift_selector_policy* policy);
/* The selector's name: its enumerator's, lower case, without KVSIFT_SELECTOR_ ("dense",
 * "locks_certified"), for the values 0 to KVSIFT_SELECTOR_COUNT - 1; "unknown" for other values.
 * Static storage. */
KVSIFT_API const char* kvsift_selector_name(kvsift_selector selector);
/* *selector receives the selector named `name`. Errors: NOT_FOUND for an unknown name (the message
 * lists the known ones). */
KVSIFT_API kvsift_status kvsift_selector_from_name(const char* name, kvsift_selector* selector);

/* Makes kvsift_attend_selected use the policy. Summarises the pages already sealed (in parallel),
 * then every page as it seals. Errors: INVALID_ARGUMENT (a field out of range, naming it; S4R on
 * a post-RoPE cache; a cache holding sequences S4R compressed, which must be freed first). */
KVSIFT_API kvsift_status kvsift_cache_set_selector(kvsift_cache* cache,
                                                   const kvsift_selector_policy* policy);

/* Per-step telemetry of the last kvsift_attend_selected call. */
typedef struct kvsift_selection_stats {
  uint64_t pairs;            /* (sequence, KV head) pairs selected for */
  uint64_t pages_chosen;     /* summed over the pairs */
  uint64_t pages_stored;     /* summed over the pairs */
  uint64_t index_bytes_read; /* summaries (or, for the oracle, keys) the selection read */
  uint64_t kv_bytes_read;    /* K+V bytes the attention over the chosen pages read */
  double kept_estimate;      /* estimated share of softmax mass kept, mean over pairs (NaN: none) */
  double dropped_bound;      /* proven bound on the dropped share, max over pairs (NaN: none) */
} kvsift_selection_stats;

/* Selection then exact attention over the chosen pages, for one layer and a batch: the same
 * arguments and output as kvsift_attend with pages == NULL. stats may be NULL.
 * Errors: as kvsift_attend. */
KVSIFT_API kvsift_status kvsift_attend_selected(kvsift_cache* cache, uint32_t layer,
                                                uint32_t n_seqs, const int32_t* seq_ids,
                                                const float* q, float* out,
                                                kvsift_selection_stats* stats);

/* Selection without attention, for an engine that attends with its own paged kernel: runs the
 * cache's selector (kvsift_cache_set_selector; dense until set) for one layer and a batch, exactly
 * as kvsift_attend_selected would at this step, and returns what it chose instead of attending.
 *
 * Output per (sequence, KV head) pair, sequence-major (pair i = seq index * n_kv_heads + head),
 * into caller buffers (all of them written by the call only; ownership stays with the caller):
 *   page_offsets: [n_seqs * n_kv_heads + 1]; the pages of pair i are
 *                 page_ids[page_offsets[i] .. page_offsets[i+1]). Required.
 *   page_ids:     [page_capacity] logical page ids, strictly ascending per pair, in the meaning of
 *                 kvsift_page_list: the two arrays are a valid kvsift_page_list for kvsift_attend
 *                 on the same layer and batch, and for the page-level selectors (dense, oracle,
 *                 quest, locks, locks_certified) kvsift_attend over them gives the output
 *                 kvsift_attend_selected would have given, bit for bit.
 *   token_offsets, token_positions: the same form for the token-level selectors (louver, s4r),
 *                 which attend to single tokens besides their pages: token_positions are the
 *                 positions (index in the sequence) of those tokens, strictly ascending per pair,
 *                 none inside a listed page. louver: stored tokens, whose K and V
 *                 kvsift_read_tokens gives; s4r: compressed tokens whose pages went back to the
 *                 pool, which the selector attends to as reconstructions from its low-rank
 *                 coefficients (kvsift_read_tokens refuses them; an engine attends to them only
 *                 with kvsift_attend_selected). For the page-level selectors every pair has no
 *                 tokens, token_offsets is all zeros, and both pointers may be NULL.
 *   kept_estimate: [n_seqs * n_kv_heads] or NULL: the estimated share of the group's softmax mass
 *                 the choice keeps (1 when every page is chosen; s4r: the share of its latent
 *                 relevance; NaN where the selector makes no estimate: louver).
 *   dropped_bound: [n_seqs * n_kv_heads] or NULL: the proven upper bound on the share dropped
 *                 (the largest over the group's query heads; NaN where none is proven).
 * Sizes: the call needs page_capacity >= every page the batch stores in this layer (summed over
 * the pairs) and, for the token-level selectors, token_capacity >= every token it stores (the
 * most a selector can return, known before selecting). When a capacity is smaller the call
 * returns BUFFER_TOO_SMALL, selects nothing and sets *n_page_ids and *n_token_positions to the
 * capacities needed: call with 0 first, then with those. On success they receive the ids and
 * positions written.
 * Arguments otherwise as kvsift_attend_selected (q: [n_seqs, n_kv_heads * group_size, head_dim]
 * float32, finite). stats, when not NULL, receives the selection's telemetry; kv_bytes_read is 0
 * (nothing was attended).
 * State: a successful call is a selection step for the stateful selectors (s4r compresses a
 * sequence's prompt on its first step and keeps the query in its window; louver indexes the keys
 * appended since its last step), as a kvsift_attend_selected call is: per layer and step, call one
 * of the two, not both. A failed call changes nothing, as everywhere.
 * Errors: INVALID_ARGUMENT (NULL cache, seq_ids, q, selection, page_offsets or n_* pointers; a NULL
 * buffer with a nonzero capacity; as kvsift_attend_selected), NOT_FOUND, BUFFER_TOO_SMALL,
 * OUT_OF_MEMORY. */
typedef struct kvsift_selection {
  uint32_t* page_offsets;
  uint32_t* page_ids;
  size_t page_capacity;
  uint32_t* token_offsets;
  uint32_t* token_positions;
  size_t token_capacity;
  float* kept_estimate;
  float* dropped_bound;
} kvsift_selection;

KVSIFT_API kvsift_status kvsift_select(kvsift_cache* cache, uint32_t layer, uint32_t n_seqs,
                                       const int32_t* seq_ids, const float* q,
                                       const kvsift_selection* selection, size_t* n_page_ids,
                                       size_t* n_token_positions, kvsift_selection_stats* stats);

/* ---------------------------------------------------------------------------------------------- */
/* Statistics */

typedef struct kvsift_cache_stats {
  uint64_t pages_capacity;   /* max_pages */
  uint64_t pages_in_use;     /* pages held by live sequences */
  uint64_t pages_high_water; /* most pages ever in use at once */
  uint64_t page_bytes;       /* bytes of one page (K + V) */
  uint64_t bytes_in_use;     /* pages_in_use * page_bytes */
  uint64_t bytes_reserved;   /* address space of the pool */
  uint32_t n_sequences;      /* live sequences */
  /* The last kvsift_attend call: */
  uint64_t last_pages_read;  /* (page, KV head) units read, K and V */
  uint64_t last_tokens_read; /* tokens attended, summed over (sequence, KV head) */
  uint64_t last_bytes_read;  /* K and V bytes read from the cache */
  /* Bytes the selector holds for tokens whose pages it released (S4R: coefficients, bases and
   * query windows); bytes_in_use + selector_bytes_held is the cache's whole KV footprint. */
  uint64_t selector_bytes_held;
  /* Offload mode, the last attention call: bytes host to device (pages, rows, q, lists) and the
   * device page cache's hits and misses, in (page, KV head) units. Zero on the CPU. */
  uint64_t last_h2d_bytes;
  uint64_t last_cache_hits;
  uint64_t last_cache_misses;
} kvsift_cache_stats;

/* Fills *stats. Errors: INVALID_ARGUMENT (NULL). */
KVSIFT_API kvsift_status kvsift_cache_get_stats(const kvsift_cache* cache,
                                                kvsift_cache_stats* stats);

/* ---------------------------------------------------------------------------------------------- */
/* The model runner: a Llama-family GGUF model on the CPU, its KV cache in a kvsift cache */

typedef struct kvsift_model kvsift_model;

/* How the model keeps its weights (kvsift_model_params.weights). */
typedef enum kvsift_weights {
  /* Dequantized at load to bfloat16 (products in bf16 with float32 accumulation). */
  KVSIFT_WEIGHTS_BF16 = 0,
  /* Dequantized at load to float32: 2x the memory of bf16, closer to the file's values. */
  KVSIFT_WEIGHTS_F32 = 1,
  /* Linear layers stored as Q8_0, Q4_0 or Q4_1 stay in the file's blocks (4.5 bits a weight for
   * Q4_0 against 16 for bf16): Q8_0 and Q4_1 memory-mapped, not copied; Q4_0 copied once at load
   * into the same number of bytes with 16 rows interleaved, for faster decode products (the
   * mapping's pages are then released); layers of other types (a Q6_K output head, say) are
   * dequantized to bfloat16. Decode multiplies them with integer dot products against the
   * activations quantized to 8 bits per block of 32 (as llama.cpp does), prefill dequantizes
   * tiles of rows to bfloat16. CPU only (device must be -1). */
  KVSIFT_WEIGHTS_QUANTIZED = 2,
  KVSIFT_WEIGHTS_COUNT, /* not a mode: how many there are */
  KVSIFT_WEIGHTS_MAX_ENUM = 0x7fffffff
} kvsift_weights;

/* Fill with kvsift_model_params_init() first. */
typedef struct kvsift_model_params {
  uint32_t n_ctx;         /* positions per sequence; 0 = the model's training context. Default 0. */
  uint32_t max_seqs;      /* sequences decoded together in one kvsift_model_decode. Default 1. */
  uint32_t prefill_chunk; /* tokens per prefill step, 1..4096. Default 256. */
  int weights_f32;        /* nonzero: the same as weights = KVSIFT_WEIGHTS_F32 (kept for existing
                             callers; INVALID_ARGUMENT together with weights = QUANTIZED).
                             Default 0. */
  kvsift_dtype kv_dtype;  /* KV cache storage. Default KVSIFT_DTYPE_F16. */
  uint32_t page_tokens;   /* KV page size: 16, 32 or 64. Default 16. */
  int n_threads;          /* Threads of this model's own pool, the calling thread included: its
                             products (oneDNN, one slice per thread, never an OpenMP team),
                             attention and selection; 0 = the CPUs in the process's affinity
                             mask. Idle threads sleep; the process's OpenMP settings are left as
                             they are (README, "Threads"). Default 0. */
  kvsift_isa isa;         /* Default AUTO. */
  int device;             /* Offload mode: a CUDA device index, or -1 for the CPU only (default).
                             The KV cache stays in host memory (pinned), selection runs on the
                             CPU, and decode attention runs on the device over the selected pages,
                             which a device page cache per layer holds between steps. UNSUPPORTED
                             without CUDA in the build or a usable device. */
  uint32_t device_cache_pages; /* Device cache pages per layer; 0 (default): the device holds a
                                  copy of the whole KV cache (every page the max_seqs sequences
                                  can reach stays resident; a step sends what changed). */
  kvsift_weights weights; /* How the weights are kept. Default KVSIFT_WEIGHTS_BF16. */
} kvsift_model_params;

KVSIFT_API void kvsift_model_params_init(kvsift_model_params* params);

/* Loads a GGUF file (memory-mapped; weights dequantized at load). Every size and offset in the
 * file is checked before use. *out receives the handle (NULL on failure).
 * Errors: INVALID_ARGUMENT, IO_ERROR (cannot open or map), INVALID_FILE (malformed or truncated
 * file, missing tensors or metadata, inconsistent shapes), UNSUPPORTED (not a Llama-family model,
 * a tensor type or head size kvsift lacks), OUT_OF_MEMORY. */
KVSIFT_API kvsift_status kvsift_model_load(const char* path, const kvsift_model_params* params,
                                           kvsift_model** out);
/* Frees the model and its sequences. NULL is accepted. */
KVSIFT_API void kvsift_model_free(kvsift_model* model);

typedef struct kvsift_model_info {
  uint32_t n_layers, n_embd, n_heads, n_kv_heads, head_dim, n_vocab;
  uint32_t n_ctx_train; /* positions the model was trained for */
  uint32_t n_ctx;       /* positions per sequence in this instance */
  int32_t bos, eos;
} kvsift_model_info;

KVSIFT_API kvsift_status kvsift_model_get_info(const kvsift_model* model, kvsift_model_info* info);

/* Text to token ids with the file's own BPE vocabulary. text: UTF-8, text_len bytes. With
 * parse_special nonzero, control-token text such as "<|im_start|>" becomes that token.
 * tokens: capacity entries; *n_tokens receives the number of ids the text needs. When capacity is
 * smaller, BUFFER_TOO_SMALL is returned and tokens is not written: call again with *n_tokens. */
KVSIFT_API kvsift_status kvsift_tokenize(const kvsift_model* model, const char* text,
                                         size_t text_len, int parse_special, int32_t* tokens,
                                         size_t capacity, size_t* n_tokens);

/* Token ids to UTF-8 bytes (not NUL-terminated; a token may end inside a multi-byte character).
 * *text_len receives the bytes needed; BUFFER_TOO_SMALL as for kvsift_tokenize. */
KVSIFT_API kvsift_status kvsift_detokenize(const kvsift_model* model, const int32_t* tokens,
                                           size_t n_tokens, char* text, size_t capacity,
                                           size_t* text_len);

typedef struct kvsift_chat_message {
  const char* role;    /* "system", "user" or "assistant" */
  const char* content; /* UTF-8, NUL-terminated */
} kvsift_chat_message;

/* Renders messages with the file's chat template (ChatML is supported; the default system turn is
 * inserted when the first message is not a system message). add_assistant nonzero opens the
 * assistant's turn. Output as for kvsift_detokenize. Errors: UNSUPPORTED for other templates;
 * INVALID_ARGUMENT for a role other than "system", "user" or "assistant", and for a role or
 * content that contains the text of one of the model's special tokens (such as "<|im_end|>"),
 * which would let the text close its turn and speak as another role: such text is refused, never
 * rewritten. */
KVSIFT_API kvsift_status kvsift_chat_template(const kvsift_model* model,
                                              const kvsift_chat_message* messages,
                                              size_t n_messages, int add_assistant, char* text,
                                              size_t capacity, size_t* text_len);

/* Nonzero when the token ends generation (end of sequence, end of turn). */
KVSIFT_API int kvsift_token_is_end(const kvsift_model* model, int32_t token);

KVSIFT_API kvsift_status kvsift_model_sequence_create(kvsift_model* model, int32_t* seq_id);
KVSIFT_API kvsift_status kvsift_model_sequence_free(kvsift_model* model, int32_t seq_id);
/* A new sequence holding a copy of src's tokens, K/V and logits: one prefill, many decodes.
 * Errors: NOT_FOUND, CAPACITY_EXCEEDED (no free sequence or pages), UNSUPPORTED (src's pages were
 * released by S4R). */
KVSIFT_API kvsift_status kvsift_model_sequence_fork(kvsift_model* model, int32_t src,
                                                    int32_t* seq_id);

/* progress(done, total, user) is called after each prefill chunk, on the calling thread. */
typedef void (*kvsift_progress_fn)(uint64_t done, uint64_t total, void* user);

/* Runs n_tokens prompt tokens through the model, appending their K/V to the sequence. Afterwards
 * kvsift_model_logits gives the next-token logits. all_logits, when not NULL, receives
 * [n_tokens, n_vocab] float32 logits for every position. Errors: INVALID_ARGUMENT (token ids
 * outside the vocabulary; a sequence whose layers hold different lengths, see
 * kvsift_model_sequence_append_kv), NOT_FOUND, CAPACITY_EXCEEDED (beyond n_ctx positions). */
KVSIFT_API kvsift_status kvsift_model_prefill(kvsift_model* model, int32_t seq_id,
                                              const int32_t* tokens, size_t n_tokens,
                                              float* all_logits, kvsift_progress_fn progress,
                                              void* user);

/* One decode step: token tokens[i] for sequence seq_ids[i] (distinct), 1 <= n_seqs <= max_seqs.
 * Errors: INVALID_ARGUMENT (ids repeated, tokens outside the vocabulary, a sequence whose layers
 * hold different lengths), NOT_FOUND, CAPACITY_EXCEEDED (a sequence is full, or the cache). */
KVSIFT_API kvsift_status kvsift_model_decode(kvsift_model* model, uint32_t n_seqs,
                                             const int32_t* seq_ids, const int32_t* tokens);

/* Stores K/V computed elsewhere (a prefix another engine prefilled, say) as the next n_tokens
 * positions of one layer of a sequence, so that decoding continues from them without a prefill.
 * k, v: [n_tokens, n_kv_heads, head_dim] float32, row-major, read during the call and stored in
 * the cache's kv_dtype. Keys are after RoPE: rotated at their positions (the layer's length before
 * the call, onwards) as this model rotates its own (adjacent channel pairs (2i, 2i + 1) by
 * pos * theta^(-2i / head_dim), theta the file's llama.rope.freq_base). Layers fill in order:
 * layer l never holds more tokens than layer l - 1, so append a chunk to layers 0, 1, ... in turn,
 * or all of layer 0, then all of layer 1, and so on. Pages that fill are summarised for the
 * current selector as a prefill's are. Until every layer holds as many tokens as layer 0, prefill
 * and decode refuse the sequence; it has no logits until its next prefill or decode step (whose
 * first token follows the appended ones). All or nothing: on an error the sequence is unchanged.
 * Errors: NOT_FOUND (seq_id), INVALID_ARGUMENT (k or v NULL, n_tokens 0, layer not below
 * n_layers, a value not finite, a layer that would hold more tokens than the one before it),
 * CAPACITY_EXCEEDED (the layer would hold more than n_ctx tokens, or the cache has no free page),
 * OUT_OF_MEMORY. */
KVSIFT_API kvsift_status kvsift_model_sequence_append_kv(kvsift_model* model, int32_t seq_id,
                                                         uint32_t layer, size_t n_tokens,
                                                         const float* k, const float* v);

/* *logits receives the sequence's next-token logits ([n_vocab] float32, owned by the model, valid
 * until its next prefill or decode). Errors: NOT_FOUND; INVALID_ARGUMENT for a sequence that has
 * none: no prefill or decode step ran on it since it was created or given K/V by
 * kvsift_model_sequence_append_kv. */
KVSIFT_API kvsift_status kvsift_model_logits(const kvsift_model* model, int32_t seq_id,
                                             const float** logits, size_t* n_vocab);

typedef struct kvsift_model_stats {
  uint64_t prefill_tokens;
  double prefill_seconds;
  uint64_t decode_tokens; /* summed over sequences */
  double decode_seconds;
  double decode_attention_seconds;  /* of decode_seconds: appends and attention */
  uint64_t kv_bytes_held;           /* host memory the KV pages in use take */
  uint64_t last_step_kv_bytes_read; /* K+V bytes the last decode step's attention read */
  /* The last decode step's selection, over all layers: index bytes read, mean estimated share of
   * mass kept and largest proven bound on the share dropped (NaN where none). */
  uint64_t last_step_index_bytes_read;
  double last_step_kept_estimate;
  double last_step_dropped_bound;
  uint64_t summary_bytes_per_page; /* the selector's per-(page, KV head) data; 0 for dense */
  /* Host bytes the selector holds for tokens whose pages it released (S4R: coefficients, bases
   * and query windows); kv_bytes_held + selector_bytes_held is the whole KV footprint. */
  uint64_t selector_bytes_held;
  /* The last decode step's time split, summed over layers, in microseconds: CPU selection and
   * attention (offload mode: the device's page transfers and its kernel, event intervals). */
  double last_step_select_us;
  double last_step_transfer_us;
  double last_step_attend_us;
  /* Offload mode: the last step's bytes host to device (PCIe) and the device page cache's hits
   * and misses, in (page, KV head) units. Zero on the CPU. */
  uint64_t last_step_h2d_bytes;
  uint64_t last_step_cache_hits;
  uint64_t last_step_cache_misses;
  /* Offload mode: the host's planning of the last step's page moves (residency lookups,
   * evictions, the refresh scan), summed over layers. The moves wait for it, so where the device
   * is idle by then it is part of last_step_transfer_us. */
  double last_step_plan_us;
  /* Offload mode: of last_step_h2d_bytes, the token rows' (Louver's gathered rows; S4R's rows, or
   * where the device reconstructs them, their coefficients and positions), and what the same rows
   * would have cost sent as values. Zero on the CPU and for page-level selectors. */
  uint64_t last_step_row_h2d_bytes;
  uint64_t last_step_rows_equivalent_bytes;
} kvsift_model_stats;

KVSIFT_API kvsift_status kvsift_model_get_stats(const kvsift_model* model,
                                                kvsift_model_stats* stats);

/* Makes every later decode step of the model use the policy. Errors: INVALID_ARGUMENT (unknown
 * selector, a negative budget, a budget given to the dense selector, sequences S4R compressed
 * still live). */
KVSIFT_API kvsift_status kvsift_model_set_selector(kvsift_model* model,
                                                   const kvsift_selector_policy* policy);

/* ---------------------------------------------------------------------------------------------- */
/* Sampling */

typedef struct kvsift_sampler kvsift_sampler;

typedef struct kvsift_sampler_params {
  float temperature; /* 0: greedy (argmax). Default 0. */
  float top_p;       /* nucleus truncation in (0, 1]. Default 1. */
  uint64_t seed;     /* the generator's seed: the same seed repeats a run. Default 0. */
} kvsift_sampler_params;

KVSIFT_API void kvsift_sampler_params_init(kvsift_sampler_params* params);
KVSIFT_API kvsift_status kvsift_sampler_create(const kvsift_sampler_params* params,
                                               kvsift_sampler** out);
KVSIFT_API void kvsift_sampler_free(kvsift_sampler* sampler);
/* *token receives the chosen id among n >= 1 logits. A logit of -inf excludes its token (a mask).
 * Errors: INVALID_ARGUMENT for a NaN or +inf logit or when every logit is -inf (the generator does
 * not advance then). */
KVSIFT_API kvsift_status kvsift_sampler_sample(kvsift_sampler* sampler, const float* logits,
                                               size_t n, int32_t* token);

/* ---------------------------------------------------------------------------------------------- */
/* GPU */

/* *n_devices receives the number of usable CUDA devices. Errors: UNSUPPORTED when kvsift's CUDA
 * backend (libkvsift_cuda.so, loaded on the first device call; the environment variable
 * KVSIFT_CUDA_BACKEND may name its path) was not built or does not load, or no driver/device is
 * present (the message says which). */
KVSIFT_API kvsift_status kvsift_gpu_device_count(int* n_devices);

/* Device memory of CUDA device `device`: *used_bytes in use by every process on it (the driver's
 * total minus free, this process's CUDA context included) and *total_bytes. Errors:
 * INVALID_ARGUMENT for a NULL pointer or a device outside 0..count - 1; UNSUPPORTED as
 * kvsift_gpu_device_count. */
KVSIFT_API kvsift_status kvsift_gpu_memory_info(int device, uint64_t* used_bytes,
                                                uint64_t* total_bytes);

#ifdef __cplusplus
}
#endif

#endif /* KVSIFT_KVSIFT_H */
