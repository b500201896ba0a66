// kvsift._core: the C API (include/kvsift/kvsift.h) as a nanobind extension. Only the C API is
// used here, so this file is also a check that the C API is enough for a host. The Python package
// (python/kvsift) builds its classes on these; this layer maps buffers, names and statuses:
//   - arrays come in as nb::ndarray (numpy or any DLPack producer on the CPU, read in place when
//     float32 and C-contiguous, else converted by a copy) and go out as numpy arrays owning memory
//     allocated here, or into the caller's `out`, which is never converted (a copy would be
//     written and dropped);
//   - a status other than OK becomes the Python exception the package registered for it
//     (kvsift/errors.py), carrying the status and kvsift_last_error();
//   - long calls run with the GIL released; each handle has a mutex, since the C API allows one
//     thread at a time per handle and released-GIL calls from Python threads could overlap.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvsift/kvsift.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// ---- Statuses to exceptions ---------------------------------------------------------------------

struct StatusError {
  kvsift_status status;
  std::string message;
};

// kvsift.errors.error_for(status, message) -> exception instance; set once at import.
PyObject* g_error_factory = nullptr;

void check(kvsift_status status) {
  if (status != KVSIFT_STATUS_OK) throw StatusError{status, kvsift_last_error()};
}

[[noreturn]] void invalid(const std::string& message) {
  throw StatusError{KVSIFT_STATUS_INVALID_ARGUMENT, message};
}

// Runs a C call without the GIL, one thread at a time on the handle `mutex` guards, and raises its
// status. The call may throw StatusError itself (a closed handle) or bad_alloc (a buffer here).
template <class Call>
void run(std::mutex& mutex, Call&& c) {
  kvsift_status status;
  std::string message;
  {
    nb::gil_scoped_release unlocked;
    std::lock_guard lock(mutex);
    try {
      status = c();
    } catch (const StatusError& e) {
      status = e.status;
      message = e.message;
    } catch (const std::bad_alloc&) {
      status = KVSIFT_STATUS_OUT_OF_MEMORY;
      message = "out of memory";
    }
    if (status != KVSIFT_STATUS_OK && message.empty()) message = kvsift_last_error();
  }
  if (status != KVSIFT_STATUS_OK) throw StatusError{status, message};
}

// ---- Buffers ------------------------------------------------------------------------------------

template <class T>
using In = nb::ndarray<const T, nb::c_contig, nb::device::cpu>;
template <class T>
using Out = nb::ndarray<T, nb::c_contig, nb::device::cpu>;
template <class T>
using Numpy = nb::ndarray<nb::numpy, T>;

// A new numpy array of `shape`, owning its memory (freed when the array is).
template <class T>
Numpy<T> new_array(std::initializer_list<std::size_t> shape) {
  std::size_t n = 1;
  for (std::size_t s : shape) n *= s;
  T* data = new T[n == 0 ? 1 : n]();
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return Numpy<T>(data, shape, owner);
}

template <class Array>
std::string shape_of(const Array& a) {
  std::string s = "(";
  for (std::size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// Requires `a` to hold rows x (inner...) elements: shape (rows, inner...) or (rows, prod(inner)).
template <class Array>
void require_rows(const Array& a, const char* name, std::size_t rows,
                  std::initializer_list<std::size_t> inner) {
  std::size_t flat = 1;
  for (std::size_t s : inner) flat *= s;
  bool ok = a.ndim() >= 1 && a.shape(0) == rows;
  if (ok && a.ndim() == 2) {
    ok = a.shape(1) == flat;
  } else if (ok) {
    ok = a.ndim() == 1 + inner.size();
    std::size_t i = 1;
    for (std::size_t s : inner) ok = ok && a.shape(i++) == s;
  }
  if (ok) return;
  std::string want = "(" + std::to_string(rows);
  for (std::size_t s : inner) want += ", " + std::to_string(s);
  invalid(std::string(name) + " has shape " + shape_of(a) + ", expected " + want + ")");
}

std::vector<int32_t> ids_of(const std::vector<int64_t>& ids, const char* name) {
  std::vector<int32_t> out;
  out.reserve(ids.size());
  for (int64_t id : ids) {
    if (id < INT32_MIN || id > INT32_MAX)
      invalid(std::string(name) + " holds " + std::to_string(id) + ", beyond int32");
    out.push_back(static_cast<int32_t>(id));
  }
  return out;
}

// ---- Names of the C enums -----------------------------------------------------------------------

kvsift_dtype dtype_of(const std::string& name) {
  if (name == "f16" || name == "float16") return KVSIFT_DTYPE_F16;
  if (name == "bf16" || name == "bfloat16") return KVSIFT_DTYPE_BF16;
  if (name == "q8" || name == "int8") return KVSIFT_DTYPE_Q8;
  invalid("dtype '" + name + "' is not f16, bf16 or q8");
}

kvsift_weights weights_of(const std::string& name) {
  if (name == "bf16") return KVSIFT_WEIGHTS_BF16;
  if (name == "f32") return KVSIFT_WEIGHTS_F32;
  if (name == "quantized") return KVSIFT_WEIGHTS_QUANTIZED;
  invalid("weights '" + name + "' is not bf16, f32 or quantized");
}

kvsift_isa isa_of(const std::string& name) {
  if (name == "auto") return KVSIFT_ISA_AUTO;
  if (name == "scalar") return KVSIFT_ISA_SCALAR;
  if (name == "avx2") return KVSIFT_ISA_AVX2;
  if (name == "avx512") return KVSIFT_ISA_AVX512;
  if (name == "avx512_vnni") return KVSIFT_ISA_AVX512_VNNI;
  invalid("isa '" + name + "' is not auto, scalar, avx2, avx512 or avx512_vnni");
}

kvsift_key_form key_form_of(const std::string& name) {
  if (name == "post_rope") return KVSIFT_KEYS_POST_ROPE;
  if (name == "pre_rope") return KVSIFT_KEYS_PRE_ROPE;
  invalid("key_form '" + name + "' is not post_rope or pre_rope");
}

kvsift_gqa_combine combine_of(const std::string& name) {
  if (name == "share_avg") return KVSIFT_GQA_SHARE_AVG;
  if (name == "nrm") return KVSIFT_GQA_NRM;
  if (name == "max") return KVSIFT_GQA_MAX;
  invalid("combine '" + name + "' is not share_avg, nrm or max");
}

const char* combine_name(kvsift_gqa_combine c) {
  switch (c) {
    case KVSIFT_GQA_NRM: return "nrm";
    case KVSIFT_GQA_MAX: return "max";
    default: return "share_avg";
  }
}

// The policy from the keyword arguments of set_selector (kvsift/cache.py's SelectorPolicy). The
// keywords stay flat; the C struct groups LOCKS's (int8_query, epsilon) and S4R's (compression,
// s4r_window, s4r_per_head_bases) fields.
kvsift_selector_policy policy_of(const std::string& selector, double budget, uint32_t sink_pages,
                                 uint32_t window_pages, const std::string& combine, bool int8_query,
                                 double epsilon, double compression, uint32_t s4r_window,
                                 bool s4r_per_head_bases, int32_t device) {
  kvsift_selector_policy p;
  kvsift_selector_policy_init(&p);
  check(kvsift_selector_from_name(selector.c_str(), &p.selector));
  p.budget = budget;
  p.sink_pages = sink_pages;
  p.window_pages = window_pages;
  p.combine = combine_of(combine);
  p.locks.int8_query = int8_query ? 1 : 0;
  p.locks.epsilon = epsilon;
  p.s4r.compression = compression;
  p.s4r.window = s4r_window;
  p.s4r.per_head_bases = s4r_per_head_bases ? 1 : 0;
  p.device = device;
  return p;
}

nb::dict selection_stats_dict(const kvsift_selection_stats& s) {
  nb::dict d;
  d["pairs"] = s.pairs;
  d["pages_chosen"] = s.pages_chosen;
  d["pages_stored"] = s.pages_stored;
  d["index_bytes_read"] = s.index_bytes_read;
  d["kv_bytes_read"] = s.kv_bytes_read;
  d["kept_estimate"] = s.kept_estimate;
  d["dropped_bound"] = s.dropped_bound;
  return d;
}

// ---- The cache ----------------------------------------------------------------------------------

class Cache {
 public:
  Cache(uint32_t n_layers, uint32_t n_kv_heads, uint32_t group_size, uint32_t head_dim,
        uint32_t page_tokens, const std::string& dtype, const std::string& key_form,
        float rope_theta, uint64_t max_pages, bool pinned, uint32_t max_batch, int n_threads,
        const std::string& isa, int device, uint32_t device_cache_pages) {
    kvsift_cache_params p;
    kvsift_cache_params_init(&p);
    p.n_layers = n_layers;
    p.n_kv_heads = n_kv_heads;
    p.group_size = group_size;
    p.head_dim = head_dim;
    p.page_tokens = page_tokens;
    p.dtype = dtype_of(dtype);
    p.key_form = key_form_of(key_form);
    p.rope_theta = rope_theta;
    p.max_pages = max_pages;
    p.pinned = pinned ? 1 : 0;
    p.max_batch = max_batch;
    p.n_threads = n_threads;
    p.isa = isa_of(isa);
    p.device = device;
    p.device_cache_pages = device_cache_pages;
    params_ = p;
    kvsift_status status;
    {
      nb::gil_scoped_release unlocked;
      status = kvsift_cache_create(&p, &cache_);
    }
    check(status);
  }
  ~Cache() { kvsift_cache_free(cache_); }

  void close() {
    nb::gil_scoped_release unlocked;
    std::lock_guard lock(mutex_);
    kvsift_cache_free(cache_);
    cache_ = nullptr;
  }
  bool closed() const { return cache_ == nullptr; }

  const kvsift_cache_params& params() const { return params_; }
  std::string isa() const { return kvsift_isa_name(kvsift_cache_isa(live())); }

  int32_t create_sequence() {
    int32_t id = -1;
    call([&] { return kvsift_sequence_create(live(), &id); });
    return id;
  }
  void free_sequence(int64_t seq) {
    const int32_t id = ids_of({seq}, "seq")[0];
    call([&] { return kvsift_sequence_free(live(), id); });
  }
  uint64_t sequence_length(int64_t seq, uint32_t layer) {
    const int32_t id = ids_of({seq}, "seq")[0];
    uint64_t n = 0;
    call([&] { return kvsift_sequence_length(live(), id, layer, &n); });
    return n;
  }

  void append(int64_t seq, uint32_t layer, In<float> k, In<float> v) {
    const int32_t id = ids_of({seq}, "seq")[0];
    const std::size_t H = params_.n_kv_heads, d = params_.head_dim;
    if (k.ndim() == 0) invalid("k is a scalar");
    const std::size_t n = k.shape(0);
    require_rows(k, "k", n, {H, d});
    require_rows(v, "v", n, {H, d});
    if (n == 0 || n > UINT32_MAX) invalid("k holds " + std::to_string(n) + " tokens");
    call([&] {
      return kvsift_append(live(), id, layer, static_cast<uint32_t>(n), k.data(), v.data());
    });
  }

  std::pair<Numpy<float>, Numpy<float>> read_tokens(int64_t seq, uint32_t layer, uint32_t kv_head,
                                                    uint64_t first, uint64_t n_tokens) {
    const int32_t id = ids_of({seq}, "seq")[0];
    if (n_tokens > (uint64_t{1} << 32)) invalid("n_tokens=" + std::to_string(n_tokens));
    Numpy<float> k = new_array<float>({n_tokens, params_.head_dim});
    Numpy<float> v = new_array<float>({n_tokens, params_.head_dim});
    call([&] {
      return kvsift_read_tokens(live(), id, layer, kv_head, first, n_tokens, k.data(), v.data());
    });
    return {k, v};
  }

  nb::object attend(uint32_t layer, const std::vector<int64_t>& seq_ids, In<float> q,
                    std::optional<std::pair<In<uint32_t>, In<uint32_t>>> pages,
                    std::optional<Out<float>> out) {
    const std::vector<int32_t> ids = ids_of(seq_ids, "seq_ids");
    const std::size_t n = ids.size();
    require_rows(q, "q", n, {n_query_heads(), params_.head_dim});
    kvsift_page_list list{};
    if (pages) {
      const std::size_t pairs = n * params_.n_kv_heads;
      if (pages->first.ndim() != 1 || pages->first.shape(0) != pairs + 1)
        invalid("pages[0] (offsets) has shape " + shape_of(pages->first) + ", expected (" +
                std::to_string(pairs + 1) + ",)");
      if (pages->second.ndim() != 1) invalid("pages[1] (page ids) is not one-dimensional");
      // The C call reads page_ids up to offsets[pairs]: the array must hold that many.
      const uint32_t* offsets = pages->first.data();
      if (offsets[pairs] > pages->second.shape(0))
        invalid("pages[0][-1]=" + std::to_string(offsets[pairs]) + " is beyond the " +
                std::to_string(pages->second.shape(0)) + " page ids given");
      list.offsets = offsets;
      list.page_ids = pages->second.data();
    }
    auto [result, data] = output(out, n);
    call([&, data = data] {
      return kvsift_attend(live(), layer, static_cast<uint32_t>(n), ids.data(), q.data(), data,
                           pages ? &list : nullptr);
    });
    return result;
  }

  void set_selector(const std::string& selector, double budget, uint32_t sink_pages,
                    uint32_t window_pages, const std::string& combine, bool int8_query,
                    double epsilon, double compression, uint32_t s4r_window,
                    bool s4r_per_head_bases, int32_t device) {
    const kvsift_selector_policy p =
        policy_of(selector, budget, sink_pages, window_pages, combine, int8_query, epsilon,
                  compression, s4r_window, s4r_per_head_bases, device);
    call([&] { return kvsift_cache_set_selector(live(), &p); });
  }

  std::pair<nb::object, nb::dict> attend_selected(uint32_t layer,
                                                  const std::vector<int64_t>& seq_ids, In<float> q,
                                                  std::optional<Out<float>> out) {
    const std::vector<int32_t> ids = ids_of(seq_ids, "seq_ids");
    const std::size_t n = ids.size();
    require_rows(q, "q", n, {n_query_heads(), params_.head_dim});
    auto [result, data] = output(out, n);
    kvsift_selection_stats stats{};
    call([&, data = data] {
      return kvsift_attend_selected(live(), layer, static_cast<uint32_t>(n), ids.data(), q.data(),
                                    data, &stats);
    });
    return {result, selection_stats_dict(stats)};
  }

  // kvsift_select with the two-call pattern: the size query selects nothing.
  nb::dict select(uint32_t layer, const std::vector<int64_t>& seq_ids, In<float> q) {
    const std::vector<int32_t> ids = ids_of(seq_ids, "seq_ids");
    const std::size_t n = ids.size();
    require_rows(q, "q", n, {n_query_heads(), params_.head_dim});
    const std::size_t pairs = n * params_.n_kv_heads;
    Numpy<uint32_t> page_offsets = new_array<uint32_t>({pairs + 1});
    Numpy<uint32_t> token_offsets = new_array<uint32_t>({pairs + 1});
    Numpy<float> kept = new_array<float>({pairs});
    Numpy<float> bound = new_array<float>({pairs});
    kvsift_selection s{};
    s.page_offsets = page_offsets.data();
    s.token_offsets = token_offsets.data();
    s.kept_estimate = kept.data();
    s.dropped_bound = bound.data();
    std::size_t n_pages = 0, n_tokens = 0;
    kvsift_selection_stats stats{};
    kvsift_status status;
    std::string message;
    {
      nb::gil_scoped_release unlocked;
      std::lock_guard lock(mutex_);
      status = kvsift_select(live(), layer, static_cast<uint32_t>(n), ids.data(), q.data(), &s,
                             &n_pages, &n_tokens, &stats);
      if (status != KVSIFT_STATUS_OK) message = kvsift_last_error();
    }
    // OK at once: the batch stores nothing, so nothing was chosen.
    if (status != KVSIFT_STATUS_OK && status != KVSIFT_STATUS_BUFFER_TOO_SMALL)
      throw StatusError{status, message};
    // The ids and positions are copied once more into arrays of the exact length below; the
    // capacity the call asks for is every stored page and token, usually far more than chosen.
    std::unique_ptr<uint32_t[]> page_ids(new uint32_t[n_pages + 1]);
    std::unique_ptr<uint32_t[]> tokens(new uint32_t[n_tokens + 1]);
    if (status == KVSIFT_STATUS_BUFFER_TOO_SMALL) {
      s.page_ids = page_ids.get();
      s.page_capacity = n_pages;
      s.token_positions = tokens.get();
      s.token_capacity = n_tokens;
      call([&] {
        return kvsift_select(live(), layer, static_cast<uint32_t>(n), ids.data(), q.data(), &s,
                             &n_pages, &n_tokens, &stats);
      });
    }
    Numpy<uint32_t> page_out = new_array<uint32_t>({n_pages});
    Numpy<uint32_t> token_out = new_array<uint32_t>({n_tokens});
    std::memcpy(page_out.data(), page_ids.get(), n_pages * sizeof(uint32_t));
    std::memcpy(token_out.data(), tokens.get(), n_tokens * sizeof(uint32_t));
    nb::dict d;
    d["page_offsets"] = page_offsets;
    d["page_ids"] = page_out;
    d["token_offsets"] = token_offsets;
    d["token_positions"] = token_out;
    d["kept_estimate"] = kept;
    d["dropped_bound"] = bound;
    d["stats"] = selection_stats_dict(stats);
    return d;
  }

  nb::dict stats() {
    kvsift_cache_stats s{};
    call([&] { return kvsift_cache_get_stats(live(), &s); });
    nb::dict d;
    d["pages_capacity"] = s.pages_capacity;
    d["pages_in_use"] = s.pages_in_use;
    d["pages_high_water"] = s.pages_high_water;
    d["page_bytes"] = s.page_bytes;
    d["bytes_in_use"] = s.bytes_in_use;
    d["bytes_reserved"] = s.bytes_reserved;
    d["n_sequences"] = s.n_sequences;
    d["last_pages_read"] = s.last_pages_read;
    d["last_tokens_read"] = s.last_tokens_read;
    d["last_bytes_read"] = s.last_bytes_read;
    d["selector_bytes_held"] = s.selector_bytes_held;
    d["last_h2d_bytes"] = s.last_h2d_bytes;
    d["last_cache_hits"] = s.last_cache_hits;
    d["last_cache_misses"] = s.last_cache_misses;
    return d;
  }

 private:
  std::size_t n_query_heads() const { return std::size_t{params_.n_kv_heads} * params_.group_size; }
  kvsift_cache* live() const {
    if (cache_ == nullptr) invalid("the cache is closed");
    return cache_;
  }
  // The caller's out (checked) or a new array; returns the Python object and its data.
  std::pair<nb::object, float*> output(std::optional<Out<float>>& out, std::size_t n) {
    if (out) {
      require_rows(*out, "out", n, {n_query_heads(), params_.head_dim});
      return {nb::cast(*out), out->data()};
    }
    Numpy<float> fresh = new_array<float>({n, n_query_heads(), params_.head_dim});
    float* data = fresh.data();
    return {nb::cast(fresh), data};
  }
  template <class Call>
  void call(Call&& c) {
    run(mutex_, std::forward<Call>(c));
  }

  kvsift_cache* cache_ = nullptr;
  kvsift_cache_params params_{};
  std::mutex mutex_;
};

// ---- The model ----------------------------------------------------------------------------------

struct Progress {
  nb::object fn;
  bool failed = false;
};

void progress_trampoline(uint64_t done, uint64_t total, void* user) {
  auto* p = static_cast<Progress*>(user);
  nb::gil_scoped_acquire locked;
  if (p->failed) return;
  try {
    p->fn(done, total);
  } catch (nb::python_error& e) {
    // Kept pending until prefill returns (the C call cannot be interrupted from here).
    e.restore();
    p->failed = true;
  }
}

class Model {
 public:
  Model(const std::string& path, uint32_t n_ctx, uint32_t max_seqs, uint32_t prefill_chunk,
        bool weights_f32, const std::string& kv_dtype, uint32_t page_tokens, int n_threads,
        const std::string& isa, int device, uint32_t device_cache_pages,
        const std::string& weights) {
    kvsift_model_params p;
    kvsift_model_params_init(&p);
    p.n_ctx = n_ctx;
    p.max_seqs = max_seqs;
    p.prefill_chunk = prefill_chunk;
    p.weights_f32 = weights_f32 ? 1 : 0;
    p.kv_dtype = dtype_of(kv_dtype);
    p.page_tokens = page_tokens;
    p.n_threads = n_threads;
    p.isa = isa_of(isa);
    p.device = device;
    p.device_cache_pages = device_cache_pages;
    p.weights = weights_of(weights);
    call([&] { return kvsift_model_load(path.c_str(), &p, &model_); });
    call([&] { return kvsift_model_get_info(model_, &info_); });
  }
  ~Model() { kvsift_model_free(model_); }

  void close() {
    nb::gil_scoped_release unlocked;
    std::lock_guard lock(mutex_);
    kvsift_model_free(model_);
    model_ = nullptr;
  }
  bool closed() const { return model_ == nullptr; }

  nb::dict info() const {
    nb::dict d;
    d["n_layers"] = info_.n_layers;
    d["n_embd"] = info_.n_embd;
    d["n_heads"] = info_.n_heads;
    d["n_kv_heads"] = info_.n_kv_heads;
    d["head_dim"] = info_.head_dim;
    d["n_vocab"] = info_.n_vocab;
    d["n_ctx_train"] = info_.n_ctx_train;
    d["n_ctx"] = info_.n_ctx;
    d["bos"] = info_.bos;
    d["eos"] = info_.eos;
    return d;
  }

  Numpy<int32_t> tokenize(nb::bytes text, bool parse_special) {
    std::size_t n = 0;
    kvsift_status status = KVSIFT_STATUS_OK;
    std::vector<int32_t> tokens;
    call([&] {
      status =
          kvsift_tokenize(live(), text.c_str(), text.size(), parse_special ? 1 : 0, nullptr, 0, &n);
      if (status != KVSIFT_STATUS_BUFFER_TOO_SMALL) return status;
      tokens.resize(n);
      return kvsift_tokenize(live(), text.c_str(), text.size(), parse_special ? 1 : 0,
                             tokens.data(), tokens.size(), &n);
    });
    Numpy<int32_t> out = new_array<int32_t>({n});
    std::memcpy(out.data(), tokens.data(), n * sizeof(int32_t));
    return out;
  }

  nb::bytes detokenize(In<int32_t> tokens) {
    if (tokens.ndim() != 1) invalid("tokens has shape " + shape_of(tokens) + ", expected (n,)");
    std::string text;
    call([&] {
      std::size_t n = 0;
      kvsift_status status =
          kvsift_detokenize(live(), tokens.data(), tokens.shape(0), nullptr, 0, &n);
      if (status != KVSIFT_STATUS_BUFFER_TOO_SMALL) return status;
      text.resize(n);
      return kvsift_detokenize(live(), tokens.data(), tokens.shape(0), text.data(), text.size(),
                               &n);
    });
    return nb::bytes(text.data(), text.size());
  }

  std::string chat_template(const std::vector<std::pair<std::string, std::string>>& messages,
                            bool add_assistant) {
    std::vector<kvsift_chat_message> c;
    for (const auto& [role, content] : messages) {
      if (role.find('\0') != std::string::npos || content.find('\0') != std::string::npos)
        invalid("a chat message holds a NUL character");
      c.push_back({role.c_str(), content.c_str()});
    }
    std::string text;
    call([&] {
      std::size_t n = 0;
      kvsift_status status =
          kvsift_chat_template(live(), c.data(), c.size(), add_assistant ? 1 : 0, nullptr, 0, &n);
      if (status != KVSIFT_STATUS_BUFFER_TOO_SMALL) return status;
      text.resize(n);
      return kvsift_chat_template(live(), c.data(), c.size(), add_assistant ? 1 : 0, text.data(),
                                  text.size(), &n);
    });
    return text;
  }

  bool is_end(int64_t token) {
    if (token < INT32_MIN || token > INT32_MAX) return false;
    return kvsift_token_is_end(live(), static_cast<int32_t>(token)) != 0;
  }

  int32_t create_sequence() {
    int32_t id = -1;
    call([&] { return kvsift_model_sequence_create(live(), &id); });
    return id;
  }
  void free_sequence(int64_t seq) {
    const int32_t id = ids_of({seq}, "seq")[0];
    call([&] { return kvsift_model_sequence_free(live(), id); });
  }
  int32_t fork(int64_t src) {
    const int32_t id = ids_of({src}, "src")[0];
    int32_t out = -1;
    call([&] { return kvsift_model_sequence_fork(live(), id, &out); });
    return out;
  }

  nb::object prefill(int64_t seq, In<int32_t> tokens, bool all_logits,
                     std::optional<nb::callable> progress) {
    const int32_t id = ids_of({seq}, "seq")[0];
    if (tokens.ndim() != 1) invalid("tokens has shape " + shape_of(tokens) + ", expected (n,)");
    const std::size_t n = tokens.shape(0);
    std::optional<Numpy<float>> logits;
    if (all_logits) logits = new_array<float>({n, info_.n_vocab});
    Progress p{progress ? nb::object(*progress) : nb::none(), false};
    try {
      call([&] {
        return kvsift_model_prefill(live(), id, tokens.data(), n, logits ? logits->data() : nullptr,
                                    progress ? progress_trampoline : nullptr, &p);
      });
    } catch (const StatusError&) {
      if (p.failed) PyErr_Clear();  // the prefill's own failure is the one to report
      throw;
    }
    if (p.failed) throw nb::python_error();
    return logits ? nb::cast(*logits) : nb::none();
  }

  void decode(const std::vector<int64_t>& seq_ids, const std::vector<int64_t>& tokens) {
    const std::vector<int32_t> ids = ids_of(seq_ids, "seq_ids"), toks = ids_of(tokens, "tokens");
    if (ids.size() != toks.size())
      invalid("seq_ids holds " + std::to_string(ids.size()) + " ids and tokens " +
              std::to_string(toks.size()));
    call([&] {
      return kvsift_model_decode(live(), static_cast<uint32_t>(ids.size()), ids.data(),
                                 toks.data());
    });
  }

  nb::object logits(int64_t seq, std::optional<Out<float>> out) {
    const int32_t id = ids_of({seq}, "seq")[0];
    std::optional<Numpy<float>> fresh;
    float* to = nullptr;
    if (out) {
      if (out->ndim() != 1 || out->shape(0) != info_.n_vocab)
        invalid("out has shape " + shape_of(*out) + ", expected (" + std::to_string(info_.n_vocab) +
                ",)");
      to = out->data();
    } else {
      fresh = new_array<float>({info_.n_vocab});
      to = fresh->data();
    }
    // Copied: the model's buffer changes at its next prefill or decode.
    call([&] {
      const float* logits = nullptr;
      std::size_t n = 0;
      const kvsift_status status = kvsift_model_logits(live(), id, &logits, &n);
      if (status == KVSIFT_STATUS_OK) std::memcpy(to, logits, n * sizeof(float));
      return status;
    });
    return out ? nb::cast(*out) : nb::cast(*fresh);
  }

  nb::dict stats() {
    kvsift_model_stats s{};
    call([&] { return kvsift_model_get_stats(live(), &s); });
    nb::dict d;
    d["prefill_tokens"] = s.prefill_tokens;
    d["prefill_seconds"] = s.prefill_seconds;
    d["decode_tokens"] = s.decode_tokens;
    d["decode_seconds"] = s.decode_seconds;
    d["decode_attention_seconds"] = s.decode_attention_seconds;
    d["kv_bytes_held"] = s.kv_bytes_held;
    d["last_step_kv_bytes_read"] = s.last_step_kv_bytes_read;
    d["last_step_index_bytes_read"] = s.last_step_index_bytes_read;
    d["last_step_kept_estimate"] = s.last_step_kept_estimate;
    d["last_step_dropped_bound"] = s.last_step_dropped_bound;
    d["summary_bytes_per_page"] = s.summary_bytes_per_page;
    d["selector_bytes_held"] = s.selector_bytes_held;
    d["last_step_select_us"] = s.last_step_select_us;
    d["last_step_transfer_us"] = s.last_step_transfer_us;
    d["last_step_attend_us"] = s.last_step_attend_us;
    d["last_step_h2d_bytes"] = s.last_step_h2d_bytes;
    d["last_step_cache_hits"] = s.last_step_cache_hits;
    d["last_step_cache_misses"] = s.last_step_cache_misses;
    d["last_step_plan_us"] = s.last_step_plan_us;
    d["last_step_row_h2d_bytes"] = s.last_step_row_h2d_bytes;
    d["last_step_rows_equivalent_bytes"] = s.last_step_rows_equivalent_bytes;
    return d;
  }

  void set_selector(const std::string& selector, double budget, uint32_t sink_pages,
                    uint32_t window_pages, const std::string& combine, bool int8_query,
                    double epsilon, double compression, uint32_t s4r_window,
                    bool s4r_per_head_bases, int32_t device) {
    const kvsift_selector_policy p =
        policy_of(selector, budget, sink_pages, window_pages, combine, int8_query, epsilon,
                  compression, s4r_window, s4r_per_head_bases, device);
    call([&] { return kvsift_model_set_selector(live(), &p); });
  }

 private:
  kvsift_model* live() const {
    if (model_ == nullptr) invalid("the model is closed");
    return model_;
  }
  template <class Call>
  void call(Call&& c) {
    run(mutex_, std::forward<Call>(c));
  }

  kvsift_model* model_ = nullptr;
  kvsift_model_info info_{};
  std::mutex mutex_;
};

// ---- The sampler --------------------------------------------------------------------------------

class Sampler {
 public:
  Sampler(float temperature, float top_p, uint64_t seed) {
    kvsift_sampler_params p;
    kvsift_sampler_params_init(&p);
    p.temperature = temperature;
    p.top_p = top_p;
    p.seed = seed;
    check(kvsift_sampler_create(&p, &sampler_));
  }
  ~Sampler() { kvsift_sampler_free(sampler_); }

  int32_t sample(In<float> logits) {
    if (logits.ndim() != 1) invalid("logits has shape " + shape_of(logits) + ", expected (n,)");
    int32_t token = -1;
    run(mutex_,
        [&] { return kvsift_sampler_sample(sampler_, logits.data(), logits.shape(0), &token); });
    return token;
  }

 private:
  kvsift_sampler* sampler_ = nullptr;
  std::mutex mutex_;
};

// ---- Logging ------------------------------------------------------------------------------------

PyObject* g_log_fn = nullptr;

void log_trampoline(kvsift_log_level level, const char* message, void*) {
  nb::gil_scoped_acquire locked;
  if (g_log_fn == nullptr) return;
  PyObject* r = PyObject_CallFunction(g_log_fn, "is", static_cast<int>(level), message);
  if (r == nullptr)
    PyErr_WriteUnraisable(g_log_fn);  // a log callback cannot fail the kvsift call
  else
    Py_DECREF(r);
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "kvsift's C API, wrapped (the kvsift package builds its classes on this module).";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const StatusError& e) {
      if (g_error_factory == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, e.message.c_str());
        return;
      }
      PyObject* exc = PyObject_CallFunction(g_error_factory, "is", static_cast<int>(e.status),
                                            e.message.c_str());
      if (exc == nullptr) return;  // the factory's own error stays set
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc)), exc);
      Py_DECREF(exc);
    }
  });

  m.def(
      "_set_error_factory",
      [](nb::callable factory) {
        Py_XDECREF(g_error_factory);
        g_error_factory = factory.release().ptr();
      },
      "factory"_a, "Installs error_for(status, message) -> exception (kvsift/errors.py).");
  m.def(
      "version", [] { return std::string(kvsift_version_string()); },
      "The linked library's version, 'major.minor.patch'.");
  m.def(
      "status_string",
      [](int status) {
        return std::string(kvsift_status_string(static_cast<kvsift_status>(status)));
      },
      "status"_a, "A status's short name ('invalid argument').");
  m.def(
      "isa_supported", [] { return std::string(kvsift_isa_name(kvsift_isa_supported())); },
      "The best ISA this CPU supports: 'scalar', 'avx2' or 'avx512'.");
  m.def(
      "set_max_isa", [](const std::string& isa) { check(kvsift_set_max_isa(isa_of(isa))); },
      "isa"_a, "Caps the ISA of caches and models created afterwards ('auto' removes the cap).");
  m.def(
      "selector_names",
      [] {
        std::vector<std::string> names;
        for (int i = 0; i < KVSIFT_SELECTOR_COUNT; ++i)
          names.emplace_back(kvsift_selector_name(static_cast<kvsift_selector>(i)));
        return names;
      },
      "The selectors' names, in the C enum's order.");
  m.def(
      "policy_defaults",
      [] {
        kvsift_selector_policy p;
        kvsift_selector_policy_init(&p);
        nb::dict d;
        d["selector"] = std::string(kvsift_selector_name(p.selector));
        d["budget"] = p.budget;
        d["sink_pages"] = p.sink_pages;
        d["window_pages"] = p.window_pages;
        d["combine"] = std::string(combine_name(p.combine));
        d["int8_query"] = p.locks.int8_query != 0;
        d["epsilon"] = p.locks.epsilon;
        d["compression"] = p.s4r.compression;
        d["s4r_window"] = p.s4r.window;
        d["s4r_per_head_bases"] = p.s4r.per_head_bases != 0;
        d["device"] = p.device;
        return d;
      },
      "kvsift_selector_policy_init's defaults, by field name.");
  m.def(
      "gpu_device_count",
      [] {
        int n = 0;
        check(kvsift_gpu_device_count(&n));
        return n;
      },
      "Usable CUDA devices; raises UnsupportedError without CUDA in the build or a device.");
  m.def(
      "gpu_memory_info",
      [](int device) {
        uint64_t used = 0, total = 0;
        check(kvsift_gpu_memory_info(device, &used, &total));
        return nb::make_tuple(used, total);
      },
      "device"_a,
      "(used_bytes, total_bytes) of a CUDA device; used counts every process on it. Raises "
      "UnsupportedError without CUDA in the build or a device.");
  m.def(
      "set_log_callback",
      [](std::optional<nb::callable> fn, int min_level) {
        if (!fn) {
          kvsift_set_log_callback(nullptr, nullptr, KVSIFT_LOG_ERROR);
          Py_XDECREF(g_log_fn);
          g_log_fn = nullptr;
          return;
        }
        Py_XDECREF(g_log_fn);
        g_log_fn = fn->release().ptr();
        kvsift_set_log_callback(log_trampoline, nullptr, static_cast<kvsift_log_level>(min_level));
      },
      "fn"_a.none(), "min_level"_a = 1,
      "fn(level: int, message: str) receives kvsift's log lines at min_level and above (0 debug, "
      "1 info, 2 warn, 3 error); None removes it. Set it once, before creating handles.");

  kvsift_cache_params cd;
  kvsift_cache_params_init(&cd);
  nb::class_<Cache>(m, "Cache", "A paged host KV cache (kvsift_cache).")
      .def(nb::init<uint32_t, uint32_t, uint32_t, uint32_t, uint32_t, const std::string&,
                    const std::string&, float, uint64_t, bool, uint32_t, int, const std::string&,
                    int, uint32_t>(),
           nb::kw_only(), "n_layers"_a = cd.n_layers, "n_kv_heads"_a = cd.n_kv_heads,
           "group_size"_a = cd.group_size, "head_dim"_a = cd.head_dim,
           "page_tokens"_a = cd.page_tokens, "dtype"_a = "f16", "key_form"_a = "post_rope",
           "rope_theta"_a = cd.rope_theta, "max_pages"_a = cd.max_pages,
           "pinned"_a = cd.pinned != 0, "max_batch"_a = cd.max_batch, "n_threads"_a = cd.n_threads,
           "isa"_a = "auto", "device"_a = cd.device, "device_cache_pages"_a = cd.device_cache_pages,
           "Creates a cache (kvsift_cache_create); the fields are kvsift_cache_params'.")
      .def("close", &Cache::close, "Frees the cache now; later calls raise InvalidArgumentError.")
      .def_prop_ro("closed", &Cache::closed)
      .def_prop_ro("n_layers", [](const Cache& c) { return c.params().n_layers; })
      .def_prop_ro("n_kv_heads", [](const Cache& c) { return c.params().n_kv_heads; })
      .def_prop_ro("group_size", [](const Cache& c) { return c.params().group_size; })
      .def_prop_ro("head_dim", [](const Cache& c) { return c.params().head_dim; })
      .def_prop_ro("page_tokens", [](const Cache& c) { return c.params().page_tokens; })
      .def_prop_ro("max_batch", [](const Cache& c) { return c.params().max_batch; })
      .def_prop_ro("isa", &Cache::isa, "The ISA the cache's kernels run with.")
      .def("create_sequence", &Cache::create_sequence, "A new empty sequence's id.")
      .def("free_sequence", &Cache::free_sequence, "seq"_a)
      .def("sequence_length", &Cache::sequence_length, "seq"_a, "layer"_a,
           "Tokens appended to the layer of the sequence.")
      .def("append", &Cache::append, "seq"_a, "layer"_a, "k"_a, "v"_a,
           "Appends K and V, float32 [n_tokens, n_kv_heads, head_dim] (read in place, copied).")
      .def("read_tokens", &Cache::read_tokens, "seq"_a, "layer"_a, "kv_head"_a, "first"_a,
           "n_tokens"_a,
           "Stored tokens [first, first + n_tokens) as float32 (k, v), [n, head_dim].")
      .def("attend", &Cache::attend, "layer"_a, "seq_ids"_a, "q"_a, "pages"_a = nb::none(),
           "out"_a.noconvert() = nb::none(),
           "Exact attention over every stored token, or over pages=(offsets, page_ids) (uint32).")
      .def("_set_selector", &Cache::set_selector, nb::kw_only(), "selector"_a, "budget"_a,
           "sink_pages"_a, "window_pages"_a, "combine"_a, "int8_query"_a, "epsilon"_a,
           "compression"_a, "s4r_window"_a, "s4r_per_head_bases"_a, "device"_a)
      .def("_attend_selected", &Cache::attend_selected, "layer"_a, "seq_ids"_a, "q"_a,
           "out"_a.noconvert() = nb::none())
      .def("_select", &Cache::select, "layer"_a, "seq_ids"_a, "q"_a)
      .def("_stats", &Cache::stats);

  kvsift_model_params md;
  kvsift_model_params_init(&md);
  nb::class_<Model>(m, "Model", "A Llama-family GGUF model with its KV cache (kvsift_model).")
      .def(nb::init<const std::string&, uint32_t, uint32_t, uint32_t, bool, const std::string&,
                    uint32_t, int, const std::string&, int, uint32_t, const std::string&>(),
           "path"_a, nb::kw_only(), "n_ctx"_a = md.n_ctx, "max_seqs"_a = md.max_seqs,
           "prefill_chunk"_a = md.prefill_chunk, "weights_f32"_a = md.weights_f32 != 0,
           "kv_dtype"_a = "f16", "page_tokens"_a = md.page_tokens, "n_threads"_a = md.n_threads,
           "isa"_a = "auto", "device"_a = md.device, "device_cache_pages"_a = md.device_cache_pages,
           "weights"_a = "bf16",
           "Loads a GGUF file (kvsift_model_load); the fields are kvsift_model_params'.")
      .def("close", &Model::close, "Frees the model now; later calls raise InvalidArgumentError.")
      .def_prop_ro("closed", &Model::closed)
      .def("_info", &Model::info)
      .def("_tokenize", &Model::tokenize, "text"_a, "parse_special"_a)
      .def("_detokenize", &Model::detokenize, "tokens"_a)
      .def("_chat_template", &Model::chat_template, "messages"_a, "add_assistant"_a)
      .def("is_end", &Model::is_end, "token"_a,
           "Whether the token ends generation (end of sequence, end of turn).")
      .def("create_sequence", &Model::create_sequence, "A new empty sequence's id.")
      .def("free_sequence", &Model::free_sequence, "seq"_a)
      .def("fork", &Model::fork, "src"_a,
           "A new sequence holding a copy of src's tokens, K/V and logits.")
      .def("_prefill", &Model::prefill, "seq"_a, "tokens"_a, "all_logits"_a, "progress"_a.none())
      .def("_decode", &Model::decode, "seq_ids"_a, "tokens"_a)
      .def("logits", &Model::logits, "seq"_a, "out"_a.noconvert() = nb::none(),
           "The sequence's next-token logits, float32 [n_vocab], copied into out or a new array.")
      .def("_stats", &Model::stats)
      .def("_set_selector", &Model::set_selector, nb::kw_only(), "selector"_a, "budget"_a,
           "sink_pages"_a, "window_pages"_a, "combine"_a, "int8_query"_a, "epsilon"_a,
           "compression"_a, "s4r_window"_a, "s4r_per_head_bases"_a, "device"_a);

  kvsift_sampler_params sd;
  kvsift_sampler_params_init(&sd);
  nb::class_<Sampler>(m, "Sampler", "Greedy or nucleus sampling over logits (kvsift_sampler).")
      .def(nb::init<float, float, uint64_t>(), nb::kw_only(), "temperature"_a = sd.temperature,
           "top_p"_a = sd.top_p, "seed"_a = sd.seed,
           "temperature 0 is greedy; top_p in (0, 1]; the same seed repeats a run.")
      .def("sample", &Sampler::sample, "logits"_a,
           "The chosen token among float32 logits [n]; -inf excludes a token.");
}
