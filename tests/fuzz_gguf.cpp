// Fuzz target for the GGUF reader: parse arbitrary bytes, read every metadata value through the
// typed getters, and dequantize the first row of every tensor. Only Error(invalid_file) may come
// out; anything else (a crash, a sanitizer report, a broken invariant below) is a bug.
//
// Runs two ways:
//  * inside kvsift_tests: Gguf.survives_seeded_mutations_of_a_valid_file (tests/test_gguf.cpp)
//    drives it over fixed mutations of a small valid file, in the release and sanitizer builds;
//  * as a libFuzzer binary: configure with -DKVSIFT_FUZZ=ON (needs clang++-14 and
//    libclang-rt-14-dev), `ninja fuzz_gguf`, then e.g.
//      KVSIFT_FUZZ_SEED_DIR=/tmp/seeds build/tests/kvsift_tests --gtest_filter='Gguf.surv*'
//      build/tests/gguf_fuzzer -max_len=4096 -max_total_time=60 /tmp/corpus /tmp/seeds
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "lib/core/error.hpp"
#include "lib/model/dequantize.hpp"
#include "lib/model/gguf_file.hpp"

namespace {

using namespace kvsift::model;

void check(bool holds, const char* invariant) {
  if (holds) return;
  std::fprintf(stderr, "fuzz_gguf: broken invariant: %s\n", invariant);
  std::abort();
}

uint64_t touch(const GgufValue& value) {
  switch (value.type) {
    case GgufValueType::string: return std::get<std::string>(value.value).size();
    case GgufValueType::array: {
      const GgufArray& array = std::get<GgufArray>(value.value);
      uint64_t sum = array.items.size();
      for (const GgufValue& item : array.items) {
        check(item.type == array.element_type, "array items have the element type");
        sum += touch(item);
      }
      return sum;
    }
    case GgufValueType::f32:
    case GgufValueType::f64: return std::isnan(std::get<double>(value.value)) ? 1 : 0;
    case GgufValueType::boolean: return std::get<bool>(value.value);
    case GgufValueType::i8:
    case GgufValueType::i16:
    case GgufValueType::i32:
    case GgufValueType::i64: return static_cast<uint64_t>(std::get<int64_t>(value.value));
    default: return std::get<uint64_t>(value.value);
  }
}

template <class Get>
uint64_t try_get(Get get) {
  try {
    get();
    return 1;
  } catch (const kvsift::Error& e) {
    check(e.status() == kvsift::Status::invalid_file, "getters throw invalid_file");
    return 0;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const GgufFile file = GgufFile::parse(data, size);
    check(file.version() == 2 || file.version() == 3, "version is 2 or 3");
    check(file.alignment() > 0 && (file.alignment() & (file.alignment() - 1)) == 0,
          "alignment is a power of two");
    uint64_t sink = 0;
    bool first = true;
    for (const auto& entry : file.metadata()) {
      const std::string& key =
          entry.first;  // not a structured binding: clang 14 cannot capture one
      const GgufValue& value = entry.second;
      check(file.find(key) == &value, "find() returns the entry");
      sink += touch(value);
      // Every getter on the first key (most throw); on the others only the one that fits, as
      // an exception per getter and key would dominate the run time.
      const GgufValueType t = value.type;
      const bool is_float = t == GgufValueType::f32 || t == GgufValueType::f64;
      const bool is_int = !is_float && t != GgufValueType::boolean && t != GgufValueType::string &&
                          t != GgufValueType::array;
      if (first || is_int) sink += try_get([&] { return file.get_uint(key); });
      if (first || is_float) sink += try_get([&] { return file.get_float(key); });
      if (first || t == GgufValueType::string)
        sink += try_get([&] { return file.get_string(key); });
      if (first || t == GgufValueType::array) sink += try_get([&] { return file.get_array(key); });
      first = false;
    }
    std::vector<float> row;
    for (const GgufTensor& t : file.tensors()) {
      check(file.tensor(t.name) == &t, "tensor() returns the entry");
      check(t.n_dims >= 1 && t.n_dims <= 4 && t.elements() > 0, "dims are 1..4 and non-empty");
      check(is_supported(t.type), "tensor types are supported");
      check(t.offset % file.alignment() == 0, "offsets are aligned");
      check(t.bytes == row_bytes(t.type, t.dims[0]) * (t.elements() / t.dims[0]),
            "bytes matches dims and type");
      const auto* begin = reinterpret_cast<const uint8_t*>(t.data);
      check(begin >= data && t.bytes <= size && begin <= data + (size - t.bytes),
            "tensor data lies inside the input");
      row.resize(t.dims[0]);
      dequantize(t.type, t.data, row.data(), t.dims[0]);
      for (float x : row) sink += std::isfinite(x) ? 0 : 1;
    }
    volatile uint64_t keep = sink;
    (void)keep;
  } catch (const kvsift::Error& e) {
    check(e.status() == kvsift::Status::invalid_file, "parse throws invalid_file");
  }
  return 0;
}
