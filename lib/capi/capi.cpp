// The C boundary: argument checks, exceptions to statuses, handle wrappers. The only file that
// knows C exists.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <new>
#include <string>

#include "gpu/host_memory.hpp"
#include "kvsift/kvsift.h"
#include "lib/attend/decode_attention.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/capi/cache_handle.hpp"
#include "lib/capi/guard.hpp"
#include "lib/core/error.hpp"
#include "lib/core/finite.hpp"
#include "lib/core/log.hpp"
#include "lib/engine/decode_engine.hpp"
#include "lib/offload/offload_attention.hpp"
#include "simd/isa.hpp"

using kvsift::Error;
using kvsift::Status;
using kvsift::capi::guard;
using kvsift::capi::require_pointer;
using kvsift::capi::to_dtype;
using kvsift::capi::to_level;
using kvsift::capi::to_supported_level;

static_assert(static_cast<int>(Status::ok) == KVSIFT_STATUS_OK);
static_assert(static_cast<int>(Status::invalid_argument) == KVSIFT_STATUS_INVALID_ARGUMENT);
static_assert(static_cast<int>(Status::unsupported) == KVSIFT_STATUS_UNSUPPORTED);
static_assert(static_cast<int>(Status::out_of_memory) == KVSIFT_STATUS_OUT_OF_MEMORY);
static_assert(static_cast<int>(Status::capacity_exceeded) == KVSIFT_STATUS_CAPACITY_EXCEEDED);
static_assert(static_cast<int>(Status::not_found) == KVSIFT_STATUS_NOT_FOUND);
static_assert(static_cast<int>(Status::io_error) == KVSIFT_STATUS_IO_ERROR);
static_assert(static_cast<int>(Status::invalid_file) == KVSIFT_STATUS_INVALID_FILE);
static_assert(static_cast<int>(Status::internal) == KVSIFT_STATUS_INTERNAL);
static_assert(static_cast<int>(Status::buffer_too_small) == KVSIFT_STATUS_BUFFER_TOO_SMALL);
static_assert(static_cast<int>(kvsift::LogLevel::debug) == KVSIFT_LOG_DEBUG);
static_assert(static_cast<int>(kvsift::LogLevel::error) == KVSIFT_LOG_ERROR);
// A kvsift_isa is the level's own value (capi/guard.cpp: to_level).
static_assert(static_cast<int>(kvsift::simd::Level::scalar) == KVSIFT_ISA_SCALAR);
static_assert(static_cast<int>(kvsift::simd::Level::avx2) == KVSIFT_ISA_AVX2);
static_assert(static_cast<int>(kvsift::simd::Level::avx512) == KVSIFT_ISA_AVX512);
static_assert(static_cast<int>(kvsift::simd::Level::avx512_vnni) == KVSIFT_ISA_AVX512_VNNI);
static_assert(static_cast<int>(kvsift::simd::Level::best) == KVSIFT_ISA_AUTO);

namespace {

// The host's C callback, reached through lib/core's C++ sink.
struct CLogSink {
  kvsift_log_fn fn;
  void* user;
};
CLogSink g_c_log{};

void forward_log(kvsift::LogLevel level, const char* message, void* user) {
  const auto* sink = static_cast<const CLogSink*>(user);
  sink->fn(static_cast<kvsift_log_level>(level), message, sink->user);
}

// After the call's sizes were validated.
void require_finite_queries(const kvsift_cache& handle, const kvsift::AttendCall& call) {
  const kvsift::CacheGeometry& g = handle.cache.geometry();
  kvsift::require_finite(call.q, std::size_t{call.n_seqs} * g.n_query_heads() * g.head_dim, "q");
}

}  // namespace

extern "C" {

int kvsift_version(void) {
  return KVSIFT_VERSION;
}

const char* kvsift_version_string(void) {
#define KVSIFT_STR2(x) #x
#define KVSIFT_STR(x) KVSIFT_STR2(x)
  return KVSIFT_STR(KVSIFT_VERSION_MAJOR) "." KVSIFT_STR(KVSIFT_VERSION_MINOR) "." KVSIFT_STR(
      KVSIFT_VERSION_PATCH);
#undef KVSIFT_STR
#undef KVSIFT_STR2
}

const char* kvsift_status_string(kvsift_status status) {
  switch (kvsift::capi::enum_bits(status)) {
    case KVSIFT_STATUS_OK: return "ok";
    case KVSIFT_STATUS_INVALID_ARGUMENT: return "invalid argument";
    case KVSIFT_STATUS_UNSUPPORTED: return "unsupported";
    case KVSIFT_STATUS_OUT_OF_MEMORY: return "out of memory";
    case KVSIFT_STATUS_CAPACITY_EXCEEDED: return "capacity exceeded";
    case KVSIFT_STATUS_NOT_FOUND: return "not found";
    case KVSIFT_STATUS_IO_ERROR: return "I/O error";
    case KVSIFT_STATUS_INVALID_FILE: return "invalid file";
    case KVSIFT_STATUS_INTERNAL: return "internal error";
    case KVSIFT_STATUS_BUFFER_TOO_SMALL: return "buffer too small";
    default: break;
  }
  return "unknown status";
}

const char* kvsift_last_error(void) {
  return kvsift::capi::last_error();
}

void kvsift_set_log_callback(kvsift_log_fn fn, void* user, kvsift_log_level min_level) {
  if (fn == nullptr) {
    kvsift::set_log_sink(nullptr, nullptr, kvsift::LogLevel::error);
    return;
  }
  g_c_log = CLogSink{fn, user};
  // A level beyond the known ones keeps only errors; one below them keeps everything.
  const int32_t level =
      std::clamp<int32_t>(kvsift::capi::enum_bits(min_level), KVSIFT_LOG_DEBUG, KVSIFT_LOG_ERROR);
  kvsift::set_log_sink(forward_log, &g_c_log, static_cast<kvsift::LogLevel>(level));
}

kvsift_isa kvsift_isa_supported(void) {
  return static_cast<kvsift_isa>(kvsift::simd::best_level(kvsift::simd::detect_features()));
}

kvsift_status kvsift_set_max_isa(kvsift_isa max_isa) {
  return guard(__func__, [&] {
    kvsift::simd::set_max_level(to_level(kvsift::capi::enum_bits(max_isa), "max_isa"));
  });
}

const char* kvsift_isa_name(kvsift_isa isa) {
  const int32_t bits = kvsift::capi::enum_bits(isa);
  if (bits == KVSIFT_ISA_AUTO) return "auto";
  for (kvsift::simd::Level level : kvsift::simd::kLevels)
    if (bits == static_cast<int32_t>(level)) return kvsift::simd::level_name(level);
  return "unknown";
}

void kvsift_cache_params_init(kvsift_cache_params* params) {
  if (params == nullptr) return;
  std::memset(params, 0, sizeof(*params));
  params->n_layers = 1;
  params->n_kv_heads = 1;
  params->group_size = 1;
  params->head_dim = 128;
  params->page_tokens = 16;
  params->dtype = KVSIFT_DTYPE_F16;
  params->key_form = KVSIFT_KEYS_POST_ROPE;
  params->rope_theta = 10000.0f;
  params->max_pages = 65536;
  params->pinned = 0;
  params->max_batch = 64;
  params->n_threads = 0;
  params->isa = KVSIFT_ISA_AUTO;
  params->device = -1;
  params->device_cache_pages = 0;
}

kvsift_status kvsift_cache_create(const kvsift_cache_params* params, kvsift_cache** out) {
  if (out != nullptr) *out = nullptr;
  return guard(__func__, [&] {
    require_pointer(params, "params");
    require_pointer(out, "out");
    const int32_t key_form = kvsift::capi::enum_in_range(params->key_form, KVSIFT_KEYS_COUNT,
                                                         "params->key_form", "kvsift_key_form");
    kvsift::require(key_form == KVSIFT_KEYS_POST_ROPE ||
                        (std::isfinite(params->rope_theta) && params->rope_theta > 0.0f),
                    "params->rope_theta=", params->rope_theta, " is not a positive number");
    kvsift::require(params->n_threads >= 0, "params->n_threads=", params->n_threads,
                    " is negative");
    kvsift::CacheGeometry geometry;
    geometry.n_layers = params->n_layers;
    geometry.n_kv_heads = params->n_kv_heads;
    geometry.group_size = params->group_size;
    geometry.head_dim = params->head_dim;
    geometry.page_tokens = params->page_tokens;
    geometry.dtype = to_dtype(kvsift::capi::enum_bits(params->dtype), "params->dtype");
    kvsift::CacheOptions options;
    options.max_pages = params->max_pages;
    options.key_form =
        key_form == KVSIFT_KEYS_PRE_ROPE ? kvsift::KeyForm::pre_rope : kvsift::KeyForm::post_rope;
    options.rope_theta = params->rope_theta;
    kvsift::require(params->device >= -1, "params->device=", params->device,
                    " is neither -1 (CPU) nor a device index");
    options.pinned = params->pinned != 0 || params->device >= 0;
    kvsift::EngineOptions engine;
    engine.max_batch = params->max_batch;
    engine.n_threads = params->n_threads;
    engine.device = params->device;
    engine.device_cache_pages = params->device_cache_pages;
    const kvsift::simd::Level level =
        to_supported_level(kvsift::capi::enum_bits(params->isa), "params->isa");
    auto handle = std::make_unique<kvsift_cache>(geometry, options, level, engine);
    if (kvsift::log_enabled(kvsift::LogLevel::info))
      kvsift::log(kvsift::LogLevel::info,
                  std::string("cache created: isa=") +
                      kvsift::simd::level_name(handle->runtime.level()) +
                      ", threads=" + std::to_string(handle->engine.n_threads()) +
                      ", pool bytes=" + std::to_string(handle->cache.pool().region().size()));
    *out = handle.release();
  });
}

void kvsift_cache_free(kvsift_cache* cache) {
  delete cache;
}

kvsift_isa kvsift_cache_isa(const kvsift_cache* cache) {
  if (cache == nullptr) return KVSIFT_ISA_SCALAR;
  return static_cast<kvsift_isa>(cache->runtime.level());
}

kvsift_status kvsift_sequence_create(kvsift_cache* cache, int32_t* seq_id) {
  return guard(__func__, [&] {
    require_pointer(cache, "cache");
    require_pointer(seq_id, "seq_id");
    *seq_id = cache->cache.create_sequence();
  });
}

kvsift_status kvsift_sequence_free(kvsift_cache* cache, int32_t seq_id) {
  return guard(__func__, [&] {
    require_pointer(cache, "cache");
    cache->cache.free_sequence(seq_id);
  });
}

kvsift_status kvsift_sequence_length(const kvsift_cache* cache, int32_t seq_id, uint32_t layer,
                                     uint64_t* n_tokens) {
  return guard(__func__, [&] {
    require_pointer(cache, "cache");
    require_pointer(n_tokens, "n_tokens");
    *n_tokens = cache->cache.length(seq_id, layer);
  });
}

kvsift_status kvsift_append(kvsift_cache* cache, int32_t seq_id, uint32_t layer, uint32_t n_tokens,
                            const float* k, const float* v) {
  return guard(__func__, [&] {
    require_pointer(cache, "cache");
    cache->cache.append(seq_id, layer, n_tokens, k, v);
  });
}

kvsift_status kvsift_read_tokens(const kvsift_cache* cache, int32_t seq_id, uint32_t layer,
                                 uint32_t kv_head, uint64_t first, uint64_t n_tokens, float* k_out,
                                 float* v_out) {
  return guard(__func__, [&] {
    require_pointer(cache, "cache");
    cache->cache.read_tokens(seq_id, layer, kv_head, first, n_tokens, k_out, v_out);
  });
}

kvsift_status kvsift_attend(kvsift_cache* cache, uint32_t layer, uint32_t n_seqs,
                            const int32_t* seq_ids, const float* q, float* out,
                            const kvsift_page_list* pages) {
  return guard(__func__, [&] {
    require_pointer(cache, "cache");
    kvsift::PageLists lists;
    kvsift::AttendCall call{layer, n_seqs, seq_ids, q, out, nullptr};
    if (pages != nullptr) {
      lists.offsets = pages->offsets;
      lists.page_ids = pages->page_ids;
      call.pages = &lists;
    }
    // The sizes first (the query check reads n_seqs rows of q); the engine validates the rest.
    cache->engine.validate_sequences(call);
    require_finite_queries(*cache, call);
    cache->engine.attend(call);
  });
}

void kvsift_selector_policy_init(kvsift_selector_policy* policy) {
  if (policy == nullptr) return;
  *policy = kvsift::capi::from_policy(kvsift::select::Policy{});
}

const char* kvsift_selector_name(kvsift_selector selector) {
  const int32_t bits = kvsift::capi::enum_bits(selector);
  if (bits < 0 || bits >= KVSIFT_SELECTOR_COUNT) return "unknown";
  // The registry's names are string literals: NUL-terminated.
  return kvsift::select::kind_name(static_cast<kvsift::select::Kind>(bits)).data();
}

kvsift_status kvsift_selector_from_name(const char* name, kvsift_selector* selector) {
  return guard(__func__, [&] {
    require_pointer(name, "name");
    require_pointer(selector, "selector");
    const kvsift::select::SelectorInfo* info = kvsift::select::find_selector(name);
    if (info == nullptr)
      kvsift::fail(Status::not_found, "unknown selector '", name,
                   "' (available: ", kvsift::select::selector_names(), ")");
    *selector = static_cast<kvsift_selector>(info->kind);
  });
}

kvsift_status kvsift_cache_set_selector(kvsift_cache* cache, const kvsift_selector_policy* policy) {
  return guard(__func__, [&] {
    require_pointer(cache, "cache");
    require_pointer(policy, "policy");
    cache->engine.set_selector(kvsift::capi::to_policy(*policy));
  });
}

kvsift_status kvsift_attend_selected(kvsift_cache* cache, uint32_t layer, uint32_t n_seqs,
                                     const int32_t* seq_ids, const float* q, float* out,
                                     kvsift_selection_stats* stats) {
  return guard(__func__, [&] {
    require_pointer(cache, "cache");
    const kvsift::AttendCall call{layer, n_seqs, seq_ids, q, out, nullptr};
    // The sizes first: the query check reads n_seqs rows of q.
    cache->engine.validate_sequences(call);
    require_finite_queries(*cache, call);
    cache->engine.attend_selected(call);
    if (stats == nullptr) return;
    const kvsift::LayerStepStats& step = cache->engine.last_step();
    *stats = kvsift_selection_stats{};
    stats->pairs = step.pairs;
    stats->pages_chosen = step.pages_chosen;
    for (uint32_t i = 0; i < n_seqs; ++i)
      stats->pages_stored +=
          cache->cache.geometry().n_kv_heads *
          cache->cache.geometry().pages_for(cache->cache.length_unchecked(seq_ids[i], layer));
    stats->index_bytes_read = step.index_bytes_read;
    stats->kv_bytes_read = step.attended.bytes_read;
    stats->kept_estimate =
        step.pairs > 0 ? step.kept_estimate_sum / static_cast<double>(step.pairs) : 1.0;
    stats->dropped_bound = step.dropped_bound;
  });
}

kvsift_status kvsift_cache_get_stats(const kvsift_cache* cache, kvsift_cache_stats* stats) {
  return guard(__func__, [&] {
    require_pointer(cache, "cache");
    require_pointer(stats, "stats");
    const kvsift::PagePool& pool = cache->cache.pool();
    const kvsift::AttendStats& last = cache->engine.backend().last_stats();
    *stats = kvsift_cache_stats{};
    stats->pages_capacity = pool.capacity();
    stats->pages_in_use = pool.in_use();
    stats->pages_high_water = pool.high_water();
    stats->page_bytes = pool.slot_bytes();
    stats->bytes_in_use = pool.in_use() * pool.slot_bytes();
    stats->bytes_reserved = pool.region().size();
    stats->n_sequences = cache->cache.n_sequences();
    stats->last_pages_read = last.pages_read;
    stats->last_tokens_read = last.tokens_read;
    stats->last_bytes_read = last.bytes_read;
    stats->selector_bytes_held = cache->engine.selector().held_bytes();
    if (const kvsift::OffloadAttention* offload = cache->engine.offload()) {
      const kvsift::OffloadStats& o = offload->last_step();
      stats->last_h2d_bytes = o.bytes_h2d;
      stats->last_cache_hits = o.hits;
      stats->last_cache_misses = o.misses;
    }
  });
}

kvsift_status kvsift_gpu_device_count(int* n_devices) {
  return guard(__func__, [&] {
    require_pointer(n_devices, "n_devices");
    kvsift::gpu::check(kvsift::gpu::device_count(n_devices));
  });
}

kvsift_status kvsift_gpu_memory_info(int device, uint64_t* used_bytes, uint64_t* total_bytes) {
  return guard(__func__, [&] {
    require_pointer(used_bytes, "used_bytes");
    require_pointer(total_bytes, "total_bytes");
    kvsift::gpu::check(kvsift::gpu::device_memory(device, used_bytes, total_bytes));
  });
}

}  // extern "C"
