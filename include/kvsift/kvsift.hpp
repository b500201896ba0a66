// kvsift.hpp: a header-only C++ wrapper over the C API (include/kvsift/kvsift.h), in the manner of
// oneDNN's dnnl.hpp over dnnl.h. It adds no behaviour of its own: every method is one C call (two
// for the calls whose output size is known only after a size query), plus the ownership, error and
// buffer-size handling C leaves to its caller. kvsift.h stays the contract; what a function does,
// accepts and refuses is documented there, and the comments here only add what the wrapper does.
//
// Requires C++20 (std::span for buffers). Compiles warning-free with -Wall -Wextra -Wpedantic in a
// translation unit that includes only this header; link the kvsift library.
//
// Design choices:
//
// Errors are exceptions. A failed C call throws kvsift::error (a std::runtime_error) carrying the
// call's kvsift_status and, as what(), kvsift_last_error()'s message copied at the point of
// failure. Why exceptions and not an expected-like result: the C API already guarantees that a
// failed call leaves every handle as it was (kvsift.h, "Errors"), so unwinding out of a wrapper
// method never leaves a half-changed handle behind; the failures are argument, capacity and file
// errors that a host handles far from the call, not per-token outcomes on a hot path that it must
// branch on; constructors (loading a model, creating a cache) can only report failure by
// throwing; and C++20 has no std::expected, so a result type would be one more type of our own
// for every caller to learn. This is also dnnl.hpp's choice. The one status a caller does branch
// on, BUFFER_TOO_SMALL of the two-call size queries, never reaches the caller: the wrapper sizes
// the output itself and returns it in a std::vector or std::string.
//
// A span of the wrong size is refused before any C call, with kvsift::error and
// KVSIFT_STATUS_INVALID_ARGUMENT and a message naming the argument and both sizes: the C API takes
// bare pointers and trusts the caller with their lengths, the wrapper knows them and checks.
// Inputs whose length is a shape (q, k, v, out) must match it exactly, which also catches a
// mistaken shape that a longer buffer would hide.
//
// Enums and parameter structs are the C ones (kvsift_status, kvsift_isa, kvsift_cache_params,
// kvsift_selector_policy, ...), not C++ re-declarations. The parameter structs are extended by
// later versions and must be filled by their *_init function first (the wrapper's default_params()
// calls it); a C++ copy would have to list every field and would silently drop a field the C
// header gains. The structs hold C enum fields, so C++ enum classes beside them would force a
// cast at every field assignment, and a second table of values would have to be kept equal to the
// first. kvsift.h already prefixes every enumerator and fixes every enum's width, so the scoping
// an enum class would add is already there.
//
// Ownership and threads: each handle class (cache, model_runner, sampler) owns one C handle,
// frees it in its destructor, is move-only, and is empty (get() == nullptr) when default
// constructed or moved from; a call on an empty object reaches the C function with NULL, which
// refuses it (INVALID_ARGUMENT, thrown as any failure). get() lends the C handle for calls the
// wrapper does not cover; never free it. The C API's one thread rule holds unchanged: a handle is
// used by one thread at a time, distinct handles may be used concurrently, and the wrapper adds no
// locking. In particular its const methods are const because the C function takes a const handle,
// not because they may run concurrently with other calls on the same handle (the usual C++ library
// meaning of const). The process-wide settings (set_log_callback, set_max_isa) are meant for
// start-up, before handles exist.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvsift/kvsift.h"

namespace kvsift {

// ---- Errors ----------------------------------------------------------------------------------

// What every failure throws: the status of the failed C call and its kvsift_last_error()
// message, or for a buffer the wrapper refused, INVALID_ARGUMENT and the wrapper's message.
class error : public std::runtime_error {
 public:
  error(kvsift_status status, const std::string& message)
      : std::runtime_error(message), status_(status) {}
  kvsift_status status() const noexcept { return status_; }

 private:
  kvsift_status status_;
};

namespace detail {

// Throws kvsift::error for a failed C call. kvsift_last_error() is read before anything else can
// call into kvsift on this thread (its pointer is valid only until the next call).
inline void check(kvsift_status status) {
  if (status != KVSIFT_STATUS_OK) throw error(status, kvsift_last_error());
}

[[noreturn]] inline void refuse(const std::string& message) {
  throw error(KVSIFT_STATUS_INVALID_ARGUMENT, "kvsift.hpp: " + message);
}

inline void require_size(std::size_t given, std::size_t needed, const char* what) {
  if (given != needed)
    refuse(std::string(what) + " has " + std::to_string(given) + " elements; the call needs " +
           std::to_string(needed));
}

// The C API counts sequences in a uint32_t.
inline uint32_t count_of(std::size_t n, const char* what) {
  if (n > std::numeric_limits<uint32_t>::max())
    refuse(std::string(what) + " has " + std::to_string(n) + " elements, more than uint32_t holds");
  return static_cast<uint32_t>(n);
}

// The owning pointer every handle class holds: frees with Free (which accepts NULL), moves by
// leaving the source NULL, never copies.
template <class Handle, void (*Free)(Handle*)>
class unique_handle {
 public:
  unique_handle() noexcept = default;
  explicit unique_handle(Handle* raw) noexcept : raw_(raw) {}
  unique_handle(unique_handle&& other) noexcept : raw_(std::exchange(other.raw_, nullptr)) {}
  unique_handle& operator=(unique_handle&& other) noexcept {
    if (this != &other) {
      Free(raw_);
      raw_ = std::exchange(other.raw_, nullptr);
    }
    return *this;
  }
  unique_handle(const unique_handle&) = delete;
  unique_handle& operator=(const unique_handle&) = delete;
  ~unique_handle() { Free(raw_); }

  Handle* get() const noexcept { return raw_; }

 private:
  Handle* raw_ = nullptr;
};

// Runs a two-call size query (kvsift_tokenize, kvsift_detokenize, kvsift_chat_template):
// call(data, capacity, &needed) with `guess` elements first, then again with exactly `needed`
// when the guess was too small; returns the output cut to its length.
template <class Container, class Call>
Container fill_sized(std::size_t guess, const Call& call) {
  Container out(guess, typename Container::value_type{});
  std::size_t needed = 0;
  kvsift_status status = call(out.data(), out.size(), &needed);
  if (status == KVSIFT_STATUS_BUFFER_TOO_SMALL) {
    out.resize(needed);
    status = call(out.data(), out.size(), &needed);
  }
  check(status);
  out.resize(needed);
  return out;
}

}  // namespace detail

// ---- Version, statuses, process-wide settings --------------------------------------------------

// The version this code was compiled against (kvsift.h's KVSIFT_VERSION: major * 10000 +
// minor * 100 + patch) and the version of the library actually linked; a host that loads kvsift
// as a shared library compares the two at start-up.
inline constexpr int compiled_version = KVSIFT_VERSION;
inline int linked_version() noexcept {
  return kvsift_version();
}
// "major.minor.patch" of the linked library.
inline std::string_view linked_version_string() noexcept {
  return kvsift_version_string();
}

// "invalid argument", ...: static storage.
inline std::string_view status_string(kvsift_status status) noexcept {
  return kvsift_status_string(status);
}

// Process-wide: set once at start-up, before handles are created (kvsift.h, "Thread safety").
// The callback may be called from any thread that calls into kvsift; it must not throw (it is
// called from C).
inline void set_log_callback(kvsift_log_fn fn, void* user, kvsift_log_level min_level) noexcept {
  kvsift_set_log_callback(fn, user, min_level);
}

inline kvsift_isa isa_supported() noexcept {
  return kvsift_isa_supported();
}
// Process-wide, as set_log_callback; caps the level of handles created afterwards.
inline void set_max_isa(kvsift_isa max_isa) {
  detail::check(kvsift_set_max_isa(max_isa));
}
inline std::string_view isa_name(kvsift_isa isa) noexcept {
  return kvsift_isa_name(isa);
}

// The number of usable CUDA devices; throws UNSUPPORTED without CUDA in the build or a device.
inline int gpu_device_count() {
  int n = 0;
  detail::check(kvsift_gpu_device_count(&n));
  return n;
}

// kvsift_gpu_memory_info: bytes in use on the device (every process) and its total.
struct GpuMemory {
  uint64_t used_bytes = 0;
  uint64_t total_bytes = 0;
};
inline GpuMemory gpu_memory_info(int device) {
  GpuMemory m;
  detail::check(kvsift_gpu_memory_info(device, &m.used_bytes, &m.total_bytes));
  return m;
}

// ---- Selector policies -------------------------------------------------------------------------

// kvsift_selector_policy_init's defaults: change fields from here.
inline kvsift_selector_policy default_selector_policy() noexcept {
  kvsift_selector_policy policy;
  kvsift_selector_policy_init(&policy);
  return policy;
}
inline std::string_view selector_name(kvsift_selector selector) noexcept {
  return kvsift_selector_name(selector);
}
// Throws NOT_FOUND for an unknown name (the message lists the known ones).
inline kvsift_selector selector_from_name(const std::string& name) {
  kvsift_selector selector = KVSIFT_SELECTOR_DENSE;
  detail::check(kvsift_selector_from_name(name.c_str(), &selector));
  return selector;
}

// ---- The paged KV cache ------------------------------------------------------------------------

// What cache::select chose, per (sequence, KV head) pair, sequence-major, in kvsift_select's
// layout: the pages of pair i are page_ids[page_offsets[i] .. page_offsets[i + 1]), its single
// tokens token_positions[token_offsets[i] .. token_offsets[i + 1]). page_offsets and page_ids
// together are the page list cache::attend takes.
struct selection {
  std::vector<uint32_t> page_offsets;     // [pairs + 1]
  std::vector<uint32_t> page_ids;         // [page_offsets.back()]
  std::vector<uint32_t> token_offsets;    // [pairs + 1]
  std::vector<uint32_t> token_positions;  // [token_offsets.back()]
  std::vector<float> kept_estimate;       // [pairs]; NaN where the selector makes no estimate
  std::vector<float> dropped_bound;       // [pairs]; NaN where no bound is proven
  kvsift_selection_stats stats{};
};

// Owns a kvsift_cache. Sequences are int32_t ids owned by the cache: they live until
// free_sequence or until the cache is destroyed, which frees them all.
class cache {
 public:
  // kvsift_cache_params_init's defaults: change fields from here.
  static kvsift_cache_params default_params() noexcept {
    kvsift_cache_params params;
    kvsift_cache_params_init(&params);
    return params;
  }

  cache() noexcept = default;  // empty, to be assigned a cache later
  // kvsift_cache_create. The wrapper keeps a copy of params: the C API has no call that returns
  // a cache's geometry, and the buffer checks need it.
  explicit cache(const kvsift_cache_params& params) : params_(params) {
    kvsift_cache* raw = nullptr;
    detail::check(kvsift_cache_create(&params, &raw));
    handle_ = detail::unique_handle<kvsift_cache, kvsift_cache_free>(raw);
  }

  // The C handle, still owned by this object (NULL once moved from).
  kvsift_cache* get() const noexcept { return handle_.get(); }
  explicit operator bool() const noexcept { return get() != nullptr; }
  friend bool operator==(const cache& c, std::nullptr_t) noexcept { return c.get() == nullptr; }

  // The parameters the cache was created with.
  const kvsift_cache_params& params() const noexcept { return params_; }
  uint32_t n_query_heads() const noexcept { return params_.n_kv_heads * params_.group_size; }
  // Floats of q (and of out) for a batch of n_seqs: [n_seqs, n_query_heads, head_dim].
  std::size_t query_size(std::size_t n_seqs) const noexcept {
    return n_seqs * n_query_heads() * params_.head_dim;
  }
  // Floats of k (and of v) for n_tokens of one layer: [n_tokens, n_kv_heads, head_dim].
  std::size_t token_size(std::size_t n_tokens) const noexcept {
    return n_tokens * params_.n_kv_heads * params_.head_dim;
  }

  kvsift_isa isa() const noexcept { return kvsift_cache_isa(get()); }

  int32_t create_sequence() {
    int32_t id = -1;
    detail::check(kvsift_sequence_create(get(), &id));
    return id;
  }
  void free_sequence(int32_t seq_id) { detail::check(kvsift_sequence_free(get(), seq_id)); }
  uint64_t sequence_length(int32_t seq_id, uint32_t layer) const {
    uint64_t n = 0;
    detail::check(kvsift_sequence_length(get(), seq_id, layer, &n));
    return n;
  }

  // kvsift_append of k.size() / token_size(1) tokens: k and v are [n_tokens, n_kv_heads,
  // head_dim], copied before the call returns. All or nothing.
  void append(int32_t seq_id, uint32_t layer, std::span<const float> k, std::span<const float> v) {
    const std::size_t per_token = token_size(1);
    if (per_token == 0 || k.size() % per_token != 0)
      detail::refuse(
          "k has " + std::to_string(k.size()) +
          " elements, not a multiple of n_kv_heads * head_dim = " + std::to_string(per_token));
    detail::require_size(v.size(), k.size(), "v");
    const uint32_t n_tokens = detail::count_of(k.size() / per_token, "k's tokens");
    detail::check(kvsift_append(get(), seq_id, layer, n_tokens, k.data(), v.data()));
  }

  // kvsift_read_tokens of tokens [first, first + n_tokens) of one (sequence, layer, KV head):
  // k_out and v_out are [n_tokens, head_dim], or empty to skip that one.
  void read_tokens(int32_t seq_id, uint32_t layer, uint32_t kv_head, uint64_t first,
                   uint64_t n_tokens, std::span<float> k_out, std::span<float> v_out) const {
    const std::size_t needed = static_cast<std::size_t>(n_tokens) * params_.head_dim;
    if (!k_out.empty()) detail::require_size(k_out.size(), needed, "k_out");
    if (!v_out.empty()) detail::require_size(v_out.size(), needed, "v_out");
    detail::check(kvsift_read_tokens(get(), seq_id, layer, kv_head, first, n_tokens,
                                     k_out.empty() ? nullptr : k_out.data(),
                                     v_out.empty() ? nullptr : v_out.data()));
  }

  // kvsift_attend over every stored token: one query per sequence of seq_ids, q and out
  // [seq_ids.size(), n_query_heads, head_dim].
  void attend(uint32_t layer, std::span<const int32_t> seq_ids, std::span<const float> q,
              std::span<float> out) {
    const uint32_t n_seqs = check_batch(seq_ids, q, out);
    detail::check(
        kvsift_attend(get(), layer, n_seqs, seq_ids.data(), q.data(), out.data(), nullptr));
  }

  // kvsift_attend over the listed pages (kvsift_page_list): page_offsets has
  // seq_ids.size() * n_kv_heads + 1 entries, each at most page_ids.size().
  void attend(uint32_t layer, std::span<const int32_t> seq_ids, std::span<const float> q,
              std::span<float> out, std::span<const uint32_t> page_offsets,
              std::span<const uint32_t> page_ids) {
    const uint32_t n_seqs = check_batch(seq_ids, q, out);
    detail::require_size(page_offsets.size(), pair_count(n_seqs) + 1, "page_offsets");
    // The C call reads page_ids up to the largest offset; the order of the offsets is its check.
    for (uint32_t offset : page_offsets)
      if (offset > page_ids.size())
        detail::refuse("page_offsets holds " + std::to_string(offset) + ", beyond page_ids' " +
                       std::to_string(page_ids.size()) + " elements");
    const kvsift_page_list pages{page_offsets.data(), page_ids.data()};
    detail::check(
        kvsift_attend(get(), layer, n_seqs, seq_ids.data(), q.data(), out.data(), &pages));
  }

  // kvsift_cache_set_selector: the policy of attend_selected and select from now on.
  void set_selector(const kvsift_selector_policy& policy) {
    detail::check(kvsift_cache_set_selector(get(), &policy));
  }

  // kvsift_attend_selected: selection then attention, shapes as attend; returns the step's
  // telemetry.
  kvsift_selection_stats attend_selected(uint32_t layer, std::span<const int32_t> seq_ids,
                                         std::span<const float> q, std::span<float> out) {
    const uint32_t n_seqs = check_batch(seq_ids, q, out);
    kvsift_selection_stats stats{};
    detail::check(
        kvsift_attend_selected(get(), layer, n_seqs, seq_ids.data(), q.data(), out.data(), &stats));
    return stats;
  }

  // kvsift_select: the selector's choice for one layer and batch without attending, as a
  // selection step (per layer and step, call this or attend_selected, not both). Sizes the
  // buffers with kvsift_select's size query, which changes nothing, then selects.
  selection select(uint32_t layer, std::span<const int32_t> seq_ids, std::span<const float> q) {
    const uint32_t n_seqs = detail::count_of(seq_ids.size(), "seq_ids");
    detail::require_size(q.size(), query_size(n_seqs), "q");
    const std::size_t pairs = pair_count(n_seqs);
    selection s;
    s.page_offsets.resize(pairs + 1);
    s.token_offsets.resize(pairs + 1);
    s.kept_estimate.resize(pairs);
    s.dropped_bound.resize(pairs);
    kvsift_selection buffers{s.page_offsets.data(),
                             nullptr,
                             0,
                             s.token_offsets.data(),
                             nullptr,
                             0,
                             s.kept_estimate.data(),
                             s.dropped_bound.data()};
    std::size_t n_pages = 0, n_tokens = 0;
    kvsift_status status = kvsift_select(get(), layer, n_seqs, seq_ids.data(), q.data(), &buffers,
                                         &n_pages, &n_tokens, &s.stats);
    if (status == KVSIFT_STATUS_BUFFER_TOO_SMALL) {
      s.page_ids.resize(n_pages);
      s.token_positions.resize(n_tokens);
      buffers.page_ids = s.page_ids.data();
      buffers.page_capacity = s.page_ids.size();
      buffers.token_positions = s.token_positions.data();
      buffers.token_capacity = s.token_positions.size();
      status = kvsift_select(get(), layer, n_seqs, seq_ids.data(), q.data(), &buffers, &n_pages,
                             &n_tokens, &s.stats);
    }
    detail::check(status);
    s.page_ids.resize(n_pages);
    s.token_positions.resize(n_tokens);
    return s;
  }

  kvsift_cache_stats stats() const {
    kvsift_cache_stats stats{};
    detail::check(kvsift_cache_get_stats(get(), &stats));
    return stats;
  }

 private:
  std::size_t pair_count(std::size_t n_seqs) const noexcept { return n_seqs * params_.n_kv_heads; }

  // The batch size, after checking q and out against it.
  uint32_t check_batch(std::span<const int32_t> seq_ids, std::span<const float> q,
                       std::span<const float> out) const {
    const uint32_t n_seqs = detail::count_of(seq_ids.size(), "seq_ids");
    detail::require_size(q.size(), query_size(n_seqs), "q");
    detail::require_size(out.size(), query_size(n_seqs), "out");
    return n_seqs;
  }

  kvsift_cache_params params_{};
  detail::unique_handle<kvsift_cache, kvsift_cache_free> handle_;
};

// ---- The model runner --------------------------------------------------------------------------

// Owns a kvsift_model: a Llama-family GGUF model on the CPU with its KV cache. Named
// model_runner, not model, because kvsift::model is the library's own namespace (lib/model), and a
// class of that name would clash with it in any translation unit that sees both. Sequences are
// int32_t ids owned by the model, freed with it.
class model_runner {
 public:
  // kvsift_model_params_init's defaults: change fields from here.
  static kvsift_model_params default_params() noexcept {
    kvsift_model_params params;
    kvsift_model_params_init(&params);
    return params;
  }

  model_runner() noexcept = default;  // empty, to be assigned a model later
  // kvsift_model_load of a GGUF file.
  explicit model_runner(const std::string& path,
                        const kvsift_model_params& params = default_params()) {
    kvsift_model* raw = nullptr;
    detail::check(kvsift_model_load(path.c_str(), &params, &raw));
    handle_ = detail::unique_handle<kvsift_model, kvsift_model_free>(raw);
  }
  // Takes ownership of a model loaded through the C API (NULL gives an empty object).
  explicit model_runner(kvsift_model* adopted) noexcept : handle_(adopted) {}

  kvsift_model* get() const noexcept { return handle_.get(); }
  explicit operator bool() const noexcept { return get() != nullptr; }
  friend bool operator==(const model_runner& m, std::nullptr_t) noexcept {
    return m.get() == nullptr;
  }

  kvsift_model_info info() const {
    kvsift_model_info info{};
    detail::check(kvsift_model_get_info(get(), &info));
    return info;
  }

  std::vector<int32_t> tokenize(std::string_view text, bool parse_special) const {
    // A token covers at least one byte of text, so this guess fits all but a BOS a vocabulary
    // adds in front; a smaller guess would cost a second tokenization.
    return detail::fill_sized<std::vector<int32_t>>(
        text.size() + 1, [&](int32_t* tokens, std::size_t capacity, std::size_t* n) {
          return kvsift_tokenize(get(), text.data(), text.size(), parse_special ? 1 : 0, tokens,
                                 capacity, n);
        });
  }

  // UTF-8 bytes; a token may end inside a multi-byte character.
  std::string detokenize(std::span<const int32_t> tokens) const {
    return detail::fill_sized<std::string>(
        tokens.size() * 8, [&](char* text, std::size_t capacity, std::size_t* n) {
          return kvsift_detokenize(get(), tokens.data(), tokens.size(), text, capacity, n);
        });
  }

  // The file's chat template over the messages (each role and content NUL-terminated).
  std::string chat_template(std::span<const kvsift_chat_message> messages,
                            bool add_assistant) const {
    return detail::fill_sized<std::string>(
        256, [&](char* text, std::size_t capacity, std::size_t* n) {
          return kvsift_chat_template(get(), messages.data(), messages.size(),
                                      add_assistant ? 1 : 0, text, capacity, n);
        });
  }

  bool token_is_end(int32_t token) const noexcept { return kvsift_token_is_end(get(), token) != 0; }

  int32_t create_sequence() {
    int32_t id = -1;
    detail::check(kvsift_model_sequence_create(get(), &id));
    return id;
  }
  void free_sequence(int32_t seq_id) { detail::check(kvsift_model_sequence_free(get(), seq_id)); }
  // A new sequence holding a copy of src's tokens, K/V and logits.
  int32_t fork_sequence(int32_t src) {
    int32_t id = -1;
    detail::check(kvsift_model_sequence_fork(get(), src, &id));
    return id;
  }

  // kvsift_model_prefill. all_logits: empty, or [tokens.size(), n_vocab] to receive every
  // position's logits. progress (may be NULL) is called on this thread after each chunk; it is
  // called from C and must not throw.
  void prefill(int32_t seq_id, std::span<const int32_t> tokens, std::span<float> all_logits = {},
               kvsift_progress_fn progress = nullptr, void* user = nullptr) {
    if (!all_logits.empty())
      detail::require_size(all_logits.size(), tokens.size() * info().n_vocab, "all_logits");
    detail::check(kvsift_model_prefill(get(), seq_id, tokens.data(), tokens.size(),
                                       all_logits.empty() ? nullptr : all_logits.data(), progress,
                                       user));
  }

  // One decode step: tokens[i] for sequence seq_ids[i].
  void decode(std::span<const int32_t> seq_ids, std::span<const int32_t> tokens) {
    detail::require_size(tokens.size(), seq_ids.size(), "tokens");
    detail::check(kvsift_model_decode(get(), detail::count_of(seq_ids.size(), "seq_ids"),
                                      seq_ids.data(), tokens.data()));
  }

  // kvsift_model_sequence_append_kv of k.size() / (n_kv_heads * head_dim) tokens: k (after RoPE)
  // and v are [n_tokens, n_kv_heads, head_dim], read before the call returns. All or nothing.
  void append_kv(int32_t seq_id, uint32_t layer, std::span<const float> k,
                 std::span<const float> v) {
    const kvsift_model_info i = info();
    const std::size_t per_token = std::size_t{i.n_kv_heads} * i.head_dim;
    if (k.size() % per_token != 0)
      detail::refuse(
          "k has " + std::to_string(k.size()) +
          " elements, not a multiple of n_kv_heads * head_dim = " + std::to_string(per_token));
    detail::require_size(v.size(), k.size(), "v");
    detail::check(kvsift_model_sequence_append_kv(get(), seq_id, layer, k.size() / per_token,
                                                  k.data(), v.data()));
  }

  // The sequence's next-token logits, [n_vocab]: owned by the model, valid until its next
  // prefill or decode; an error (INVALID_ARGUMENT) before its first.
  std::span<const float> logits(int32_t seq_id) const {
    const float* logits = nullptr;
    std::size_t n_vocab = 0;
    detail::check(kvsift_model_logits(get(), seq_id, &logits, &n_vocab));
    return {logits, n_vocab};
  }

  kvsift_model_stats stats() const {
    kvsift_model_stats stats{};
    detail::check(kvsift_model_get_stats(get(), &stats));
    return stats;
  }

  // kvsift_model_set_selector: every later decode step uses the policy.
  void set_selector(const kvsift_selector_policy& policy) {
    detail::check(kvsift_model_set_selector(get(), &policy));
  }

 private:
  detail::unique_handle<kvsift_model, kvsift_model_free> handle_;
};

// ---- Sampling ----------------------------------------------------------------------------------

// Owns a kvsift_sampler: temperature and top-p sampling with its own seeded generator.
class sampler {
 public:
  // kvsift_sampler_params_init's defaults (greedy): change fields from here.
  static kvsift_sampler_params default_params() noexcept {
    kvsift_sampler_params params;
    kvsift_sampler_params_init(&params);
    return params;
  }

  sampler() noexcept = default;  // empty, to be assigned a sampler later
  explicit sampler(const kvsift_sampler_params& params) {
    kvsift_sampler* raw = nullptr;
    detail::check(kvsift_sampler_create(&params, &raw));
    handle_ = detail::unique_handle<kvsift_sampler, kvsift_sampler_free>(raw);
  }
  // Takes ownership of a sampler created through the C API (NULL gives an empty object).
  explicit sampler(kvsift_sampler* adopted) noexcept : handle_(adopted) {}

  kvsift_sampler* get() const noexcept { return handle_.get(); }
  explicit operator bool() const noexcept { return get() != nullptr; }
  friend bool operator==(const sampler& s, std::nullptr_t) noexcept { return s.get() == nullptr; }

  // The chosen token among logits.size() >= 1 logits (-inf masks a token out).
  int32_t sample(std::span<const float> logits) {
    int32_t token = -1;
    detail::check(kvsift_sampler_sample(get(), logits.data(), logits.size(), &token));
    return token;
  }

 private:
  detail::unique_handle<kvsift_sampler, kvsift_sampler_free> handle_;
};

}  // namespace kvsift
