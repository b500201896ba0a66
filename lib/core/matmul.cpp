#include "lib/core/matmul.hpp"

#include <dnnl.hpp>

#include <string>

#include "lib/core/error.hpp"

#if DNNL_VERSION_MAJOR != 2
#error "kvsift's matmul is written against the oneDNN 2.x API (Debian 12 ships 2.6)"
#endif

namespace kvsift {

struct Matmul::Impl {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  using Key = std::tuple<int, int64_t, int64_t, int64_t, int>;
  struct Entry {
    dnnl::matmul::primitive_desc pd;
    dnnl::matmul prim;
  };
  std::map<Key, Entry> primitives;

  Entry& primitive(MatType type, int64_t M, int64_t K, int64_t N, WeightLayout layout) {
    const Key key{static_cast<int>(type), M, K, N, static_cast<int>(layout)};
    auto it = primitives.find(key);
    if (it != primitives.end()) return it->second;
    using tag = dnnl::memory::format_tag;
    using dt = dnnl::memory::data_type;
    const dt in = type == MatType::f32 ? dt::f32 : dt::bf16;
    const dnnl::memory::desc x_md({M, K}, in, tag::ab);
    const dnnl::memory::desc w_md({K, N}, in,
                                  layout == WeightLayout::rows_are_outputs ? tag::ba : tag::ab);
    const dnnl::memory::desc y_md({M, N}, dt::f32, tag::ab);
    try {
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(x_md, w_md, y_md), engine);
      return primitives.emplace(key, Entry{pd, dnnl::matmul(pd)}).first->second;
    } catch (const dnnl::error& e) {
      fail(Status::internal, "oneDNN matmul ", M, "x", K, "x", N, ": ", e.what());
    }
  }
};

Matmul::Matmul() : impl_(std::make_unique<Impl>()) {}
Matmul::~Matmul() = default;
Matmul::Matmul(Matmul&&) noexcept = default;
Matmul& Matmul::operator=(Matmul&&) noexcept = default;

void Matmul::run(MatType type, const void* x, int64_t M, int64_t K, const void* w,
                 WeightLayout layout, int64_t N, float* y) {
  Impl::Entry& entry = impl_->primitive(type, M, K, N, layout);
  dnnl::memory x_mem(entry.pd.src_desc(), impl_->engine, const_cast<void*>(x));
  dnnl::memory w_mem(entry.pd.weights_desc(), impl_->engine, const_cast<void*>(w));
  dnnl::memory y_mem(entry.pd.dst_desc(), impl_->engine, y);
  entry.prim.execute(impl_->stream,
                     {{DNNL_ARG_SRC, x_mem}, {DNNL_ARG_WEIGHTS, w_mem}, {DNNL_ARG_DST, y_mem}});
  impl_->stream.wait();
}

}  // namespace kvsift
