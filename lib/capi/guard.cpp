#include "lib/capi/guard.hpp"

#include <cstring>

namespace kvsift::capi {

namespace {
thread_local std::string t_last_error;
}

kvsift_status set_error(kvsift_status status, const char* function, const char* message) noexcept {
  try {
    t_last_error = std::string(function) + ": " + message;
  } catch (...) {
    t_last_error.clear();  // keep the status; the message could not be built
  }
  return status;
}

const char* last_error() noexcept {
  return t_last_error.c_str();
}

void copy_out(const std::string& bytes, char* out, std::size_t capacity, std::size_t* length) {
  require_pointer(length, "text_len");
  *length = bytes.size();
  if (bytes.size() > capacity)
    fail(Status::buffer_too_small, "the output needs ", bytes.size(), " bytes; capacity is ",
         capacity);
  if (!bytes.empty()) {
    require_pointer(out, "text");
    std::memcpy(out, bytes.data(), bytes.size());
  }
}

simd::Isa to_isa(int32_t isa, const char* name) {
  switch (isa) {
    case KVSIFT_ISA_SCALAR: return simd::Isa::scalar;
    case KVSIFT_ISA_AVX2: return simd::Isa::avx2;
    case KVSIFT_ISA_AVX512:
    case KVSIFT_ISA_AUTO: return simd::Isa::avx512;
    default: break;
  }
  fail(Status::invalid_argument, name, "=", isa, " is not a kvsift_isa");
}

simd::Isa to_supported_isa(int32_t isa, const char* name) {
  const simd::Isa wanted = to_isa(isa, name);
  if (isa != KVSIFT_ISA_AUTO && simd::detect_isa() < wanted)
    fail(Status::unsupported, name, "=", simd::isa_name(wanted),
         " is not supported by this CPU (best: ", simd::isa_name(simd::detect_isa()), ")");
  return wanted;
}

simd::Dtype to_dtype(int32_t dtype, const char* name) {
  switch (dtype) {
    case KVSIFT_DTYPE_F16: return simd::Dtype::f16;
    case KVSIFT_DTYPE_BF16: return simd::Dtype::bf16;
    default: break;
  }
  fail(Status::invalid_argument, name, "=", dtype, " is not a kvsift_dtype");
}

select::Policy to_policy(const kvsift_selector_policy& in) {
  const int32_t selector = enum_bits(in.selector), combine = enum_bits(in.combine);
  require(selector >= KVSIFT_SELECTOR_DENSE && selector <= KVSIFT_SELECTOR_LOUVER,
          "policy->selector=", selector, " is not a kvsift_selector");
  require(combine >= KVSIFT_GQA_SHARE_AVG && combine <= KVSIFT_GQA_MAX, "policy->combine=", combine,
          " is not a kvsift_gqa_combine");
  select::Policy out;
  out.kind = static_cast<select::Kind>(selector);
  out.budget = in.budget;
  out.sink_pages = in.sink_pages;
  out.window_pages = in.window_pages;
  out.combine = static_cast<select::GqaCombine>(combine);
  out.int8_query = in.int8_query != 0;
  out.epsilon = in.epsilon;
  out.compression = in.compression;
  out.s4r_window = in.s4r_window;
  out.s4r_per_head_bases = in.s4r_per_head_bases != 0;
  out.device = in.device;
  out.validate();
  return out;
}

}  // namespace kvsift::capi
