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

simd::Level to_level(int32_t isa, const char* name) {
  if (isa == KVSIFT_ISA_AUTO) return simd::Level::best;
  // Every level of this build is a kvsift_isa: one a later build adds needs no case here.
  for (simd::Level level : simd::kLevels)
    if (isa == static_cast<int32_t>(level)) return level;
  fail(Status::invalid_argument, name, "=", isa, " is not a kvsift_isa");
}

simd::Level to_supported_level(int32_t isa, const char* name) {
  if (const std::string_view env = simd::env_max_level_error(); !env.empty())
    fail(Status::invalid_argument, env);
  const simd::Level wanted = to_level(isa, name);
  if (!simd::cpu_has(wanted))
    fail(Status::unsupported, name, "=", simd::level_name(wanted),
         " is not supported by this CPU (best: ",
         simd::level_name(simd::best_level(simd::detect_features())), ")");
  return wanted;
}

simd::Dtype to_dtype(int32_t dtype, const char* name) {
  switch (dtype) {
    case KVSIFT_DTYPE_F16: return simd::Dtype::f16;
    case KVSIFT_DTYPE_BF16: return simd::Dtype::bf16;
    case KVSIFT_DTYPE_Q8: return simd::Dtype::q8;
    default: break;
  }
  fail(Status::invalid_argument, name, "=", dtype, " is not a kvsift_dtype");
}

// The C enums run with the C++ ones (lib/select/registry.hpp lists the selectors in the C order).
static_assert(KVSIFT_SELECTOR_COUNT == static_cast<int>(select::Kind::count),
              "kvsift_selector has a value per selector of lib/select/registry.hpp");
#define KVSIFT_SELECTOR_C_VALUE(kind, c_name, level, description)                 \
  static_assert(KVSIFT_SELECTOR_##c_name == static_cast<int>(select::Kind::kind), \
                "KVSIFT_SELECTOR_" #c_name " sits where lib/select/registry.hpp lists " #kind);
KVSIFT_SELECTORS(KVSIFT_SELECTOR_C_VALUE)
#undef KVSIFT_SELECTOR_C_VALUE
static_assert(KVSIFT_GQA_COUNT == static_cast<int>(select::GqaCombine::count) &&
              KVSIFT_GQA_SHARE_AVG == static_cast<int>(select::GqaCombine::share_avg) &&
              KVSIFT_GQA_NRM == static_cast<int>(select::GqaCombine::nrm) &&
              KVSIFT_GQA_MAX == static_cast<int>(select::GqaCombine::max));

select::Policy to_policy(const kvsift_selector_policy& in) {
  select::Policy out;
  out.kind = static_cast<select::Kind>(
      enum_in_range(in.selector, KVSIFT_SELECTOR_COUNT, "policy->selector", "kvsift_selector"));
  out.budget = in.budget;
  out.sink_pages = in.sink_pages;
  out.window_pages = in.window_pages;
  out.combine = static_cast<select::GqaCombine>(
      enum_in_range(in.combine, KVSIFT_GQA_COUNT, "policy->combine", "kvsift_gqa_combine"));
  out.device = in.device;
  out.locks.int8_query = in.locks.int8_query != 0;
  out.locks.epsilon = in.locks.epsilon;
  out.s4r.compression = in.s4r.compression;
  out.s4r.window = in.s4r.window;
  out.s4r.per_head_bases = in.s4r.per_head_bases != 0;
  out.validate();
  return out;
}

kvsift_selector_policy from_policy(const select::Policy& in) {
  kvsift_selector_policy out{};
  out.selector = static_cast<kvsift_selector>(in.kind);
  out.budget = in.budget;
  out.sink_pages = in.sink_pages;
  out.window_pages = in.window_pages;
  out.combine = static_cast<kvsift_gqa_combine>(in.combine);
  out.device = in.device;
  out.locks.int8_query = in.locks.int8_query ? 1 : 0;
  out.locks.epsilon = in.locks.epsilon;
  out.s4r.compression = in.s4r.compression;
  out.s4r.window = in.s4r.window;
  out.s4r.per_head_bases = in.s4r.per_head_bases ? 1 : 0;
  return out;
}

}  // namespace kvsift::capi
