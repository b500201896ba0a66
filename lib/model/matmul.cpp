#include "lib/model/matmul.hpp"

#include <omp.h>

#include <dnnl.hpp>

#include <algorithm>
#include <exception>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "lib/core/aligned.hpp"
#include "lib/core/error.hpp"

#if DNNL_VERSION_MAJOR != 2
#error "kvsift's matmul is written against the oneDNN 2.x API (Debian 12 ships 2.6)"
#endif

namespace kvsift {

namespace {

// Column slices are whole 16-float vectors (one AVX-512 register of y), so no thread's kernel
// works on a fraction of a vector.
constexpr int64_t kSliceColumns = 16;

// oneDNN's primitive cache is process-wide and its locking lives in the uninstrumented library,
// so a ThreadSanitizer build sees two handles creating primitives at once as a race on the cache's
// entries (without this lock, tests/test_thread_stress.cpp reports a reader-writer lock one thread
// allocated inside libdnnl being taken by another with no order between them). Creation is a cold
// path (once per shape and handle): one lock orders it for TSan at no measurable cost.
std::mutex& creation_mutex() {
  static std::mutex mutex;
  return mutex;
}

// The calling thread's OpenMP thread count is 1 while this lives. oneDNN reads it when it creates
// a primitive (the thread count is part of its plan) and when it executes; at 1 it runs on the
// calling thread and never starts an OpenMP team. For a thread OpenMP did not create the setting
// is the thread's own, so the host's other threads are unaffected, and it is restored after.
class OneOpenMpThread {
 public:
  OneOpenMpThread() noexcept : saved_(omp_get_max_threads()) {
    if (saved_ != 1) omp_set_num_threads(1);
  }
  ~OneOpenMpThread() {
    if (saved_ != 1) omp_set_num_threads(saved_);
  }
  OneOpenMpThread(const OneOpenMpThread&) = delete;
  OneOpenMpThread& operator=(const OneOpenMpThread&) = delete;

 private:
  int saved_;
};

}  // namespace

struct Matmul::Impl {
  ThreadPool* pool;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  // type, M, K, N (the full product), slice columns, layout
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int64_t, int>;
  struct Entry {
    dnnl::matmul::primitive_desc pd;
    dnnl::matmul prim;
  };
  std::map<Key, Entry> primitives;
  // Per thread: its stream and its scratchpad (the primitives are shared, so oneDNN's own
  // scratchpad, tied to the thread that created a primitive, is not used).
  std::vector<dnnl::stream> streams;
  std::vector<AlignedVector<std::byte>> scratch;
  std::vector<Entry*> slice_entry;         // per part of the call in progress
  std::vector<std::exception_ptr> errors;  // per part: what it threw, rethrown by run()

  explicit Impl(ThreadPool* p) : pool(p) {
    const int threads = p != nullptr ? p->size() : 1;
    for (int t = 0; t < threads; ++t) streams.emplace_back(engine);
    scratch.resize(static_cast<std::size_t>(threads));
    slice_entry.resize(static_cast<std::size_t>(threads));
    errors.resize(static_cast<std::size_t>(threads));
  }

  Entry& primitive(MatType type, int64_t M, int64_t K, int64_t N, int64_t columns,
                   WeightLayout layout) {
    const Key key{static_cast<int>(type), M, K, N, columns, static_cast<int>(layout)};
    auto it = primitives.find(key);
    if (it != primitives.end()) return it->second;
    using dt = dnnl::memory::data_type;
    const dt in = type == MatType::f32 ? dt::f32 : dt::bf16;
    // A slice of columns of W and y keeps the full product's row strides.
    const dnnl::memory::desc x_md({M, K}, in, {K, 1});
    const dnnl::memory::desc w_md = layout == WeightLayout::rows_are_outputs
                                        ? dnnl::memory::desc({K, columns}, in, {1, K})
                                        : dnnl::memory::desc({K, columns}, in, {N, 1});
    const dnnl::memory::desc y_md({M, columns}, dt::f32, {N, 1});
    dnnl::primitive_attr attr;
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    try {
      const std::lock_guard<std::mutex> lock(creation_mutex());
      const OneOpenMpThread one;
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x_md, w_md, y_md), attr, engine);
      Entry& entry = primitives.emplace(key, Entry{pd, dnnl::matmul(pd)}).first->second;
      const std::size_t bytes = pd.scratchpad_desc().get_size();
      for (auto& s : scratch)
        if (s.size() < bytes) s.resize(bytes);
      return entry;
    } catch (const dnnl::error& e) {
      fail(Status::internal, "oneDNN matmul ", M, "x", K, "x", columns, ": ", e.what());
    }
  }
};

Matmul::Matmul(ThreadPool* pool) : impl_(std::make_unique<Impl>(pool)) {}
Matmul::~Matmul() = default;
Matmul::Matmul(Matmul&&) noexcept = default;
Matmul& Matmul::operator=(Matmul&&) noexcept = default;

void Matmul::run(MatType type, const void* x, int64_t M, int64_t K, const void* w,
                 WeightLayout layout, int64_t N, float* y) {
  if (M <= 0 || N <= 0) return;
  Impl& impl = *impl_;
  const int64_t vectors = (N + kSliceColumns - 1) / kSliceColumns;
  const int parts = static_cast<int>(std::min<int64_t>(vectors, impl.streams.size()));
  auto slice = [&](int t) {  // [first, last) columns of part t, as parallel_static splits
    const int64_t first = std::min(N, vectors * t / parts * kSliceColumns);
    const int64_t last = std::min(N, vectors * (t + 1) / parts * kSliceColumns);
    return std::pair{first, last};
  };
  for (int t = 0; t < parts; ++t) {
    const auto [first, last] = slice(t);
    impl.slice_entry[static_cast<std::size_t>(t)] =
        &impl.primitive(type, M, K, N, last - first, layout);
  }
  const std::size_t elem = type == MatType::f32 ? 4 : 2;
  // Part `part` of the split on thread `t` (its stream and scratchpad).
  auto body = [&](uint64_t part, uint64_t, int t) noexcept {
    const auto [first, last] = slice(static_cast<int>(part));
    const Impl::Entry& entry = *impl.slice_entry[part];
    const std::byte* w_first =
        static_cast<const std::byte*>(w) +
        (layout == WeightLayout::rows_are_outputs ? first * K : first) * elem;
    try {
      const OneOpenMpThread one;
      dnnl::memory x_mem(entry.pd.src_desc(), impl.engine, const_cast<void*>(x));
      dnnl::memory w_mem(entry.pd.weights_desc(), impl.engine, const_cast<std::byte*>(w_first));
      dnnl::memory y_mem(entry.pd.dst_desc(), impl.engine, y + first);
      dnnl::memory s_mem(entry.pd.scratchpad_desc(), impl.engine,
                         impl.scratch[static_cast<std::size_t>(t)].data());
      dnnl::stream& stream = impl.streams[static_cast<std::size_t>(t)];
      entry.prim.execute(stream, {{DNNL_ARG_SRC, x_mem},
                                  {DNNL_ARG_WEIGHTS, w_mem},
                                  {DNNL_ARG_DST, y_mem},
                                  {DNNL_ARG_SCRATCHPAD, s_mem}});
      stream.wait();
    } catch (...) {
      impl.errors[part] = std::current_exception();
    }
  };
  if (impl.pool != nullptr && parts > 1)
    impl.pool->parallel_static(static_cast<uint64_t>(parts), body);
  else
    body(0, 1, 0);
  for (std::exception_ptr& error : impl.errors)
    if (error) {
      std::exception_ptr first = std::move(error);
      for (std::exception_ptr& other : impl.errors) other = nullptr;
      std::rethrow_exception(first);  // a dnnl::error or std::bad_alloc: the caller's guard maps it
    }
}

}  // namespace kvsift
