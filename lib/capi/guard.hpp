// The C boundary's one guard: runs a body, maps kvsift::Error to its status, bad_alloc to
// OUT_OF_MEMORY and anything else to INTERNAL, and keeps the message for kvsift_last_error().
#pragma once

#include <cstdint>
#include <cstring>
#include <new>
#include <string>

#include "kvsift/kvsift.h"
#include "lib/core/error.hpp"
#include "lib/select/selector.hpp"
#include "simd/isa.hpp"
#include "simd/kernels.hpp"

namespace kvsift::capi {

kvsift_status set_error(kvsift_status status, const char* function, const char* message) noexcept;
const char* last_error() noexcept;

template <class Body>
kvsift_status guard(const char* function, Body&& body) noexcept {
  try {
    body();
    return KVSIFT_STATUS_OK;
  } catch (const Error& e) {
    return set_error(static_cast<kvsift_status>(e.status()), function, e.what());
  } catch (const std::bad_alloc&) {
    return set_error(KVSIFT_STATUS_OUT_OF_MEMORY, function, "out of memory");
  } catch (const std::exception& e) {
    return set_error(KVSIFT_STATUS_INTERNAL, function, e.what());
  } catch (...) {
    return set_error(KVSIFT_STATUS_INTERNAL, function, "unknown exception");
  }
}

template <class T>
void require_pointer(const T* p, const char* name) {
  if (p == nullptr) fail(Status::invalid_argument, name, " is NULL");
}

// Copies bytes to a caller buffer of `capacity`, reporting the size needed in *length: the
// two-call pattern of kvsift_detokenize and kvsift_chat_template.
void copy_out(const std::string& bytes, char* out, std::size_t capacity, std::size_t* length);

// The int a C caller stored in an enum field or argument. Read as bytes: loading an enum object
// whose value lies outside its enumerators' range (a -1, a struct memset to 0xFF) as the enum type
// is undefined behaviour, which UBSan reports. Every C enum is read through this before it is
// compared.
template <class Enum>
int32_t enum_bits(const Enum& value) noexcept {
  static_assert(sizeof(Enum) == sizeof(int32_t), "the C enums are 32 bits wide (*_MAX_ENUM)");
  int32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// The value of a C enum whose values run 0 .. count - 1 (count: its *_COUNT); anything else
// throws invalid_argument naming the field and its type.
template <class Enum>
int32_t enum_in_range(const Enum& value, int32_t count, const char* name, const char* type) {
  const int32_t bits = enum_bits(value);
  if (bits < 0 || bits >= count)
    fail(Status::invalid_argument, name, "=", bits, " is not a ", type);
  return bits;
}

// C enums (given as enum_bits) to their C++ twins; unknown values throw invalid_argument naming
// the field. A kvsift_isa is a level's own value (simd/isa.hpp), or AUTO for Level::best.
simd::Level to_level(int32_t isa, const char* name);
// A handle's level request: also throws unsupported for a named level the CPU lacks (AUTO is
// always fine), and invalid_argument when KVSIFT_MAX_ISA is not a level name.
simd::Level to_supported_level(int32_t isa, const char* name);
simd::Dtype to_dtype(int32_t dtype, const char* name);
// Also validates the policy (select::Policy::validate).
select::Policy to_policy(const kvsift_selector_policy& policy);
// The C form of a policy (kvsift_selector_policy_init's defaults are select::Policy's).
kvsift_selector_policy from_policy(const select::Policy& policy);

}  // namespace kvsift::capi
