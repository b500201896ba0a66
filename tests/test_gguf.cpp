// GGUF reader: files built in memory by a small writer (below), hostile variants of them, seeded
// mutations through the fuzz target, and the real SmolLM2 file when it is present.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "lib/core/error.hpp"
#include "lib/model/dequantize.hpp"
#include "lib/model/gguf_file.hpp"
#include "simd/half.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);  // tests/fuzz_gguf.cpp

using namespace kvsift;
using namespace kvsift::model;

namespace {

// ---- Writer -------------------------------------------------------------------------------------

// Little-endian GGUF bytes. Remembers where its u32 and u64 fields are, for the mutation test.
struct Writer {
  std::vector<uint8_t> bytes;
  std::vector<std::size_t> u32_fields;
  std::vector<std::size_t> u64_fields;
  std::vector<std::size_t> tensor_info_at;
  std::size_t data_at = 0;

  template <class T>
  void put(T value) {
    uint8_t raw[sizeof(T)];
    std::memcpy(raw, &value, sizeof(T));
    bytes.insert(bytes.end(), raw, raw + sizeof(T));
  }
  void u32(uint32_t v) {
    u32_fields.push_back(bytes.size());
    put(v);
  }
  void u64(uint64_t v) {
    u64_fields.push_back(bytes.size());
    put(v);
  }
  void string(std::string_view s) {
    u64(s.size());
    bytes.insert(bytes.end(), s.begin(), s.end());
  }
  void type(GgufValueType t) { u32(static_cast<uint32_t>(t)); }
  void value(const GgufValue& v) {
    type(v.type);
    payload(v);
  }
  void payload(const GgufValue& v) {
    switch (v.type) {
      case GgufValueType::u8: put(static_cast<uint8_t>(std::get<uint64_t>(v.value))); break;
      case GgufValueType::i8: put(static_cast<int8_t>(std::get<int64_t>(v.value))); break;
      case GgufValueType::u16: put(static_cast<uint16_t>(std::get<uint64_t>(v.value))); break;
      case GgufValueType::i16: put(static_cast<int16_t>(std::get<int64_t>(v.value))); break;
      case GgufValueType::u32: put(static_cast<uint32_t>(std::get<uint64_t>(v.value))); break;
      case GgufValueType::i32: put(static_cast<int32_t>(std::get<int64_t>(v.value))); break;
      case GgufValueType::u64: put(std::get<uint64_t>(v.value)); break;
      case GgufValueType::i64: put(std::get<int64_t>(v.value)); break;
      case GgufValueType::f32: put(static_cast<float>(std::get<double>(v.value))); break;
      case GgufValueType::f64: put(std::get<double>(v.value)); break;
      case GgufValueType::boolean: put(static_cast<uint8_t>(std::get<bool>(v.value))); break;
      case GgufValueType::string: string(std::get<std::string>(v.value)); break;
      case GgufValueType::array: {
        const GgufArray& a = std::get<GgufArray>(v.value);
        type(a.element_type);
        u64(a.items.size());
        for (const GgufValue& item : a.items) payload(item);
        break;
      }
    }
  }
  void pad_to(std::size_t alignment) {
    while (bytes.size() % alignment != 0) bytes.push_back(0);
  }
};

namespace v {
GgufValue u8(uint8_t x) {
  return {GgufValueType::u8, uint64_t{x}};
}
GgufValue i8(int8_t x) {
  return {GgufValueType::i8, int64_t{x}};
}
GgufValue u16(uint16_t x) {
  return {GgufValueType::u16, uint64_t{x}};
}
GgufValue i16(int16_t x) {
  return {GgufValueType::i16, int64_t{x}};
}
GgufValue u32(uint32_t x) {
  return {GgufValueType::u32, uint64_t{x}};
}
GgufValue i32(int32_t x) {
  return {GgufValueType::i32, int64_t{x}};
}
GgufValue u64(uint64_t x) {
  return {GgufValueType::u64, x};
}
GgufValue i64(int64_t x) {
  return {GgufValueType::i64, x};
}
GgufValue f32(float x) {
  return {GgufValueType::f32, double{x}};
}
GgufValue f64(double x) {
  return {GgufValueType::f64, x};
}
GgufValue boolean(bool x) {
  return {GgufValueType::boolean, x};
}
GgufValue str(std::string x) {
  return {GgufValueType::string, std::move(x)};
}
GgufValue array(GgufValueType element, std::vector<GgufValue> items) {
  return {GgufValueType::array, GgufArray{element, std::move(items)}};
}
}  // namespace v

struct TestTensor {
  std::string name;
  std::vector<uint64_t> dims;
  uint32_t type;
  std::vector<uint8_t> data;
  std::optional<uint64_t> offset = {};  // default: packed after the previous tensor, aligned
};

struct TestFile {
  uint32_t version = 3;
  std::vector<std::pair<std::string, GgufValue>> metadata;
  std::vector<std::function<void(Writer&)>> raw_entries;  // hand-written entries after metadata
  std::vector<TestTensor> tensors;
  std::size_t alignment = 32;  // layout only: put general.alignment in metadata when not 32
  std::optional<uint64_t> tensor_count = {};  // header overrides
  std::optional<uint64_t> metadata_count = {};
};

// Header, metadata, tensor infos, zero padding to the alignment, then each tensor's data at its
// offset. No padding after the last tensor, so every proper prefix of the file is invalid.
Writer write(const TestFile& f) {
  Writer w;
  w.bytes = {'G', 'G', 'U', 'F'};
  w.u32(f.version);
  w.u64(f.tensor_count.value_or(f.tensors.size()));
  w.u64(f.metadata_count.value_or(f.metadata.size() + f.raw_entries.size()));
  for (const auto& [key, value] : f.metadata) {
    w.string(key);
    w.value(value);
  }
  for (const auto& entry : f.raw_entries) entry(w);
  std::vector<uint64_t> offsets;
  uint64_t next = 0;
  for (const TestTensor& t : f.tensors) {
    offsets.push_back(t.offset.value_or(next));
    if (!t.offset) next = (next + t.data.size() + f.alignment - 1) / f.alignment * f.alignment;
  }
  for (std::size_t i = 0; i < f.tensors.size(); ++i) {
    const TestTensor& t = f.tensors[i];
    w.tensor_info_at.push_back(w.bytes.size());
    w.string(t.name);
    w.u32(static_cast<uint32_t>(t.dims.size()));
    for (uint64_t d : t.dims) w.u64(d);
    w.u32(t.type);
    w.u64(offsets[i]);
  }
  w.pad_to(f.alignment);
  w.data_at = w.bytes.size();
  for (std::size_t i = 0; i < f.tensors.size(); ++i) {
    if (f.tensors[i].offset) continue;
    w.bytes.resize(w.data_at + offsets[i], 0);
    w.bytes.insert(w.bytes.end(), f.tensors[i].data.begin(), f.tensors[i].data.end());
  }
  return w;
}

std::vector<uint8_t> random_bytes(std::size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

uint32_t id(GgmlType t) {
  return static_cast<uint32_t>(t);
}

TestTensor tensor(std::string name, std::vector<uint64_t> dims, GgmlType type, uint32_t seed = 1) {
  uint64_t elements = 1;
  for (uint64_t d : dims) elements *= d;
  const std::size_t bytes = elements / block_elements(type) * block_bytes(type);
  return {std::move(name), std::move(dims), id(type), random_bytes(bytes, seed)};
}

// Every value type, nested arrays, a non-default alignment and one tensor of each readable type.
TestFile small_file() {
  TestFile f;
  f.alignment = 64;
  f.metadata = {
      {"general.architecture", v::str("llama")},
      {"general.alignment", v::u32(64)},
      {"test.u8", v::u8(200)},
      {"test.i8", v::i8(-100)},
      {"test.u16", v::u16(60000)},
      {"test.i16", v::i16(-30000)},
      {"test.u32", v::u32(4000000000u)},
      {"test.i32", v::i32(-2000000000)},
      {"test.f32", v::f32(0.25f)},
      {"test.bool", v::boolean(true)},
      {"test.string", v::str("h\xc3\xa9llo")},
      {"test.empty_string", v::str("")},
      {"test.u64", v::u64((uint64_t{1} << 40) + 3)},
      {"test.i64", v::i64(-(int64_t{1} << 40))},
      {"test.f64", v::f64(1e-300)},
      {"test.array.i32", v::array(GgufValueType::i32, {v::i32(1), v::i32(-2), v::i32(3)})},
      {"test.array.string",
       v::array(GgufValueType::string, {v::str("a"), v::str(""), v::str("ccc")})},
      {"test.array.bool", v::array(GgufValueType::boolean, {v::boolean(true), v::boolean(false)})},
      {"test.array.empty", v::array(GgufValueType::f64, {})},
      {"test.array.nested",
       v::array(GgufValueType::array,
                {v::array(GgufValueType::u8, {v::u8(1), v::u8(2)}), v::array(GgufValueType::u8, {}),
                 v::array(GgufValueType::u8, {v::u8(3)})})},
      {"test.array.deep",
       v::array(GgufValueType::array,
                {v::array(GgufValueType::array,
                          {v::array(GgufValueType::string, {v::str("x"), v::str("yz")})})})},
  };
  f.tensors = {
      tensor("norm.weight", {8}, GgmlType::f32, 1),
      tensor("half.weight", {4, 2}, GgmlType::f16, 2),
      tensor("bf.weight", {6}, GgmlType::bf16, 3),
      tensor("q8.weight", {32, 2}, GgmlType::q8_0, 4),
      tensor("q40.weight", {64}, GgmlType::q4_0, 5),
      tensor("q41.weight", {32, 1, 2}, GgmlType::q4_1, 6),
      tensor("q4k.weight", {256}, GgmlType::q4_k, 7),
      tensor("q6k.weight", {256, 1, 1, 1}, GgmlType::q6_k, 8),
  };
  return f;
}

// One Q4_1 tensor after one string entry "k" = "abc":
//   0 magic, 4 version, 8 tensor count, 16 metadata count,
//   24 key length, 32 "k", 33 value type, 37 string length, 45 "abc",
//   48 tensor name length, 56 "t", 57 n_dims, 61 dims[0], 69 type, 73 offset, 81..95 padding,
//   96 data (20 bytes).
TestFile one_tensor_file() {
  TestFile f;
  f.metadata = {{"k", v::str("abc")}};
  f.tensors = {tensor("t", {32}, GgmlType::q4_1)};
  return f;
}

GgufFile parse(const std::vector<uint8_t>& bytes) {
  return GgufFile::parse(bytes.data(), bytes.size());
}

void patch_u64(std::vector<uint8_t>& bytes, std::size_t at, uint64_t value) {
  std::memcpy(bytes.data() + at, &value, 8);
}
void patch_u32(std::vector<uint8_t>& bytes, std::size_t at, uint32_t value) {
  std::memcpy(bytes.data() + at, &value, 4);
}

std::string at_byte(std::size_t offset) {
  return "at byte " + std::to_string(offset) + " ";
}

// Parsing must throw Error(invalid_file) whose message contains every one of `parts`.
void expect_invalid(const std::vector<uint8_t>& bytes, const std::vector<std::string>& parts) {
  try {
    parse(bytes);
    ADD_FAILURE() << "parsed; expected an error containing '" << parts.front() << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::invalid_file) << e.what();
    for (const std::string& part : parts)
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "message: " << e.what() << "\nmissing: " << part;
  }
}

void expect_same(const GgufValue& got, const GgufValue& want, const std::string& where) {
  ASSERT_EQ(got.type, want.type) << where;
  ASSERT_EQ(got.value.index(), want.value.index()) << where;
  if (want.type == GgufValueType::array) {
    const auto& g = std::get<GgufArray>(got.value);
    const auto& w = std::get<GgufArray>(want.value);
    ASSERT_EQ(g.element_type, w.element_type) << where;
    ASSERT_EQ(g.items.size(), w.items.size()) << where;
    for (std::size_t i = 0; i < w.items.size(); ++i)
      expect_same(g.items[i], w.items[i], where + "[" + std::to_string(i) + "]");
  } else if (const auto* s = std::get_if<std::string>(&want.value)) {
    EXPECT_EQ(std::get<std::string>(got.value), *s) << where;
  } else if (const auto* d = std::get_if<double>(&want.value)) {
    EXPECT_EQ(std::get<double>(got.value), *d) << where;
  } else if (const auto* u = std::get_if<uint64_t>(&want.value)) {
    EXPECT_EQ(std::get<uint64_t>(got.value), *u) << where;
  } else if (const auto* i = std::get_if<int64_t>(&want.value)) {
    EXPECT_EQ(std::get<int64_t>(got.value), *i) << where;
  } else {
    EXPECT_EQ(std::get<bool>(got.value), std::get<bool>(want.value)) << where;
  }
}

void expect_matches(const GgufFile& file, const TestFile& spec, const Writer& w) {
  EXPECT_EQ(file.version(), spec.version);
  EXPECT_EQ(file.alignment(), spec.alignment);
  ASSERT_EQ(file.metadata().size(), spec.metadata.size());
  for (std::size_t i = 0; i < spec.metadata.size(); ++i) {
    EXPECT_EQ(file.metadata()[i].first, spec.metadata[i].first);
    expect_same(file.metadata()[i].second, spec.metadata[i].second, spec.metadata[i].first);
    EXPECT_EQ(file.find(spec.metadata[i].first), &file.metadata()[i].second);
  }
  ASSERT_EQ(file.tensors().size(), spec.tensors.size());
  uint64_t expected_offset = 0;
  for (std::size_t i = 0; i < spec.tensors.size(); ++i) {
    const TestTensor& want = spec.tensors[i];
    const GgufTensor& got = file.tensors()[i];
    SCOPED_TRACE(want.name);
    EXPECT_EQ(got.name, want.name);
    EXPECT_EQ(got.n_dims, want.dims.size());
    for (std::size_t d = 0; d < 4; ++d)
      EXPECT_EQ(got.dims[d], d < want.dims.size() ? want.dims[d] : 1u);
    EXPECT_EQ(static_cast<uint32_t>(got.type), want.type);
    EXPECT_EQ(got.offset, expected_offset);
    EXPECT_EQ(got.bytes, want.data.size());
    EXPECT_EQ(reinterpret_cast<const uint8_t*>(got.data), w.bytes.data() + w.data_at + got.offset);
    EXPECT_EQ(std::memcmp(got.data, want.data.data(), want.data.size()), 0);
    EXPECT_EQ(file.tensor(want.name), &got);
    EXPECT_EQ(&file.require_tensor(want.name), &got);
    expected_offset += (want.data.size() + spec.alignment - 1) / spec.alignment * spec.alignment;
  }
}

}  // namespace

// ---- Valid files --------------------------------------------------------------------------------

TEST(Gguf, reads_metadata_of_every_type_nested_arrays_and_the_tensor_table) {
  const TestFile spec = small_file();
  const Writer w = write(spec);
  const GgufFile file = parse(w.bytes);
  expect_matches(file, spec, w);
  EXPECT_EQ(w.data_at % 64, 0u);
}

TEST(Gguf, reads_version_2_like_version_3) {
  TestFile spec = small_file();
  spec.version = 2;
  const Writer w = write(spec);
  const GgufFile file = parse(w.bytes);
  EXPECT_EQ(file.version(), 2u);
  expect_matches(file, spec, w);
}

TEST(Gguf, aligns_to_32_bytes_when_general_alignment_is_absent) {
  const TestFile spec = one_tensor_file();
  const Writer w = write(spec);
  EXPECT_EQ(w.data_at, 96u);  // tensor infos end at byte 81
  const GgufFile file = parse(w.bytes);
  EXPECT_EQ(file.alignment(), 32u);
  expect_matches(file, spec, w);
}

TEST(Gguf, accepts_a_file_with_no_tensors_and_no_metadata) {
  const Writer w = write(TestFile{});
  ASSERT_EQ(w.bytes.size(), 32u);  // header and padding to the data section
  EXPECT_TRUE(GgufFile::parse(w.bytes.data(), 24).tensors().empty());  // padding may be cut
  const GgufFile file = parse(w.bytes);
  EXPECT_TRUE(file.metadata().empty());
  EXPECT_TRUE(file.tensors().empty());
  EXPECT_EQ(file.find("general.architecture"), nullptr);
}

TEST(Gguf, accepts_a_256_byte_tensor_name_and_an_8_level_array) {
  TestFile spec = one_tensor_file();
  spec.tensors[0].name = std::string(256, 'n');
  GgufValue nested = v::array(GgufValueType::u8, {v::u8(7)});
  for (int level = 1; level < 8; ++level)
    nested = v::array(GgufValueType::array, {std::move(nested)});
  spec.metadata.emplace_back("deep", std::move(nested));
  const Writer w = write(spec);
  expect_matches(parse(w.bytes), spec, w);
}

TEST(Gguf, typed_getters_convert_and_name_missing_or_mistyped_keys) {
  const Writer w = write(small_file());
  const GgufFile file = parse(w.bytes);
  EXPECT_EQ(file.get_uint("test.u8"), 200u);
  EXPECT_EQ(file.get_uint("test.u32"), 4000000000u);
  EXPECT_EQ(file.get_uint("test.u64"), (uint64_t{1} << 40) + 3);
  EXPECT_EQ(file.get_float("test.f32"), 0.25);
  EXPECT_EQ(file.get_float("test.f64"), 1e-300);
  EXPECT_EQ(file.get_string("general.architecture"), "llama");
  EXPECT_EQ(file.get_array("test.array.i32").items.size(), 3u);
  const auto expect_error = [&](const std::function<void()>& get, const std::string& part) {
    try {
      get();
      ADD_FAILURE() << "no error; expected '" << part << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.status(), Status::invalid_file);
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error([&] { file.get_uint("no.such.key"); }, "metadata key 'no.such.key' is missing");
  expect_error([&] { file.get_float("no.such.key"); }, "'no.such.key' is missing");
  expect_error([&] { file.get_string("no.such.key"); }, "'no.such.key' is missing");
  expect_error([&] { file.get_array("no.such.key"); }, "'no.such.key' is missing");
  expect_error([&] { file.get_uint("test.i8"); }, "'test.i8' is -100, expected a non-negative");
  expect_error([&] { file.get_uint("test.f32"); }, "'test.f32' has type f32, expected an integer");
  expect_error([&] { file.get_uint("test.bool"); }, "has type bool");
  expect_error([&] { file.get_float("test.u32"); }, "'test.u32' has type u32, expected f32 or f64");
  expect_error([&] { file.get_string("test.array.string"); }, "has type array, expected string");
  expect_error([&] { file.get_array("test.string"); }, "has type string, expected array");
  expect_error([&] { file.require_tensor("output.weight"); }, "tensor 'output.weight' is missing");
  EXPECT_EQ(file.tensor("output.weight"), nullptr);
  EXPECT_EQ(file.find("test.missing"), nullptr);
}

TEST(Gguf, get_uint_accepts_non_negative_signed_integers) {
  TestFile spec;
  spec.metadata = {{"a", v::i32(5)}, {"b", v::i64(0)}, {"c", v::u16(9)}};
  const Writer w = write(spec);
  const GgufFile file = parse(w.bytes);
  EXPECT_EQ(file.get_uint("a"), 5u);
  EXPECT_EQ(file.get_uint("b"), 0u);
  EXPECT_EQ(file.get_uint("c"), 9u);
}

TEST(Gguf, open_maps_a_file_and_reads_what_parse_reads) {
  const TestFile spec = small_file();
  const Writer w = write(spec);
  const auto path = std::filesystem::temp_directory_path() /
                    ("kvsift_test_gguf_" + std::to_string(::getpid()) + ".gguf");
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(w.bytes.data()), std::streamsize(w.bytes.size()));
  }
  {
    GgufFile file = GgufFile::open(path.string());
    GgufFile moved = std::move(file);  // the mapping moves with it
    EXPECT_EQ(moved.get_string("general.architecture"), "llama");
    ASSERT_EQ(moved.tensors().size(), spec.tensors.size());
    for (std::size_t i = 0; i < spec.tensors.size(); ++i)
      EXPECT_EQ(std::memcmp(moved.tensors()[i].data, spec.tensors[i].data.data(),
                            spec.tensors[i].data.size()),
                0);
    // Released pages read back as the file's bytes; a range outside the mapping is ignored.
    const auto* first = static_cast<const std::byte*>(moved.tensors().front().data);
    const auto* end = static_cast<const std::byte*>(moved.tensors().back().data) +
                      spec.tensors.back().data.size();
    moved.release(first - 4096, std::size_t(end - first) + 8192);  // partly outside: ignored
    moved.release(first, std::size_t(end - first));
    for (std::size_t i = 0; i < spec.tensors.size(); ++i)
      EXPECT_EQ(std::memcmp(moved.tensors()[i].data, spec.tensors[i].data.data(),
                            spec.tensors[i].data.size()),
                0);
  }
  std::filesystem::resize_file(path, 10);
  try {
    GgufFile::open(path.string());
    FAIL() << "a 10-byte file opened";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::invalid_file);
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
  std::filesystem::resize_file(path, 0);
  EXPECT_THROW(GgufFile::open(path.string()), Error);
  std::filesystem::remove(path);
}

TEST(Gguf, open_reports_io_errors_with_the_reason) {
  try {
    GgufFile::open("/nonexistent/kvsift/model.gguf");
    FAIL() << "a missing file opened";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::io_error);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/kvsift/model.gguf"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos)
        << e.what();
  }
  try {
    GgufFile::open(std::filesystem::temp_directory_path().string());
    FAIL() << "a directory opened";
  } catch (const Error& e) {
    EXPECT_EQ(e.status(), Status::io_error);
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
}

// ---- Hostile files ------------------------------------------------------------------------------

TEST(Gguf, rejects_the_file_truncated_at_every_byte_position) {
  const Writer w = write(small_file());
  for (std::size_t size = 0; size < w.bytes.size(); ++size) {
    const std::vector<uint8_t> prefix(w.bytes.begin(), w.bytes.begin() + std::ptrdiff_t(size));
    try {
      parse(prefix);
      ADD_FAILURE() << "a prefix of " << size << " of " << w.bytes.size() << " bytes parsed";
    } catch (const Error& e) {
      ASSERT_EQ(e.status(), Status::invalid_file) << size << ": " << e.what();
      ASSERT_NE(std::string(e.what()).find("at byte "), std::string::npos) << e.what();
    }
  }
}

TEST(Gguf, rejects_a_wrong_magic) {
  std::vector<uint8_t> bytes = write(one_tensor_file()).bytes;
  bytes[3] = 'G';
  expect_invalid(bytes, {at_byte(0), "not a GGUF file", "47 47 55 47"});
}

TEST(Gguf, rejects_versions_1_and_4_and_big_endian_files) {
  for (uint32_t version : {1u, 4u}) {
    TestFile spec = one_tensor_file();
    spec.version = version;
    expect_invalid(write(spec).bytes,
                   {at_byte(4), "GGUF version " + std::to_string(version) + " is not supported"});
  }
  TestFile spec = one_tensor_file();
  spec.version = 0x03000000;
  expect_invalid(write(spec).bytes, {at_byte(4), "big-endian GGUF (version 3)"});
}

TEST(Gguf, rejects_a_string_longer_than_the_file) {
  std::vector<uint8_t> bytes = write(one_tensor_file()).bytes;
  patch_u64(bytes, 37, 1000);
  expect_invalid(bytes, {at_byte(37), "metadata entry 0 'k'", "string length 1000 is larger than",
                         std::to_string(bytes.size() - 45) + " bytes left"});
  patch_u64(bytes, 37, ~uint64_t{0});
  expect_invalid(bytes, {at_byte(37), "string length 18446744073709551615"});
  bytes = write(one_tensor_file()).bytes;
  patch_u64(bytes, 24, uint64_t{1} << 62);  // the key's length
  expect_invalid(bytes, {at_byte(24), "key length 4611686018427387904 is larger than"});
}

TEST(Gguf, rejects_an_array_count_larger_than_the_file) {
  TestFile spec;
  spec.metadata = {{"a", v::array(GgufValueType::u32, {v::u32(1), v::u32(2)})}};
  // 24 key length, 32 "a", 33 value type, 37 element type, 41 count.
  std::vector<uint8_t> bytes = write(spec).bytes;
  // 49 the two elements, 57..63 padding: 15 bytes follow the count, room for 3 u32 at most.
  patch_u64(bytes, 41, 4);
  expect_invalid(bytes, {at_byte(41), "array count 4 is larger than the file",
                         "u32 elements take at least 4 bytes each and 15 bytes are left"});
  patch_u64(bytes, 41, uint64_t{1} << 60);
  expect_invalid(bytes, {at_byte(41), "array count 1152921504606846976"});
}

TEST(Gguf, reports_the_array_element_where_a_nested_value_goes_wrong) {
  TestFile spec;
  spec.metadata = {
      {"x", v::u8(1)},
      {"names", v::array(GgufValueType::array,
                         {v::array(GgufValueType::string, {v::str("a")}),
                          v::array(GgufValueType::string, {v::str("b"), v::str("c")})})}};
  Writer w = write(spec);
  // The length of "c" is the last u64 field written.
  const std::size_t at = w.u64_fields.back();
  patch_u64(w.bytes, at, 99);
  expect_invalid(w.bytes, {at_byte(at), "(metadata entry 1 'names'[1][1])", "string length 99"});
}

TEST(Gguf, rejects_huge_tensor_and_metadata_counts_before_allocating) {
  TestFile spec = one_tensor_file();
  spec.tensor_count = uint64_t{1} << 40;
  expect_invalid(write(spec).bytes, {at_byte(8), "tensor count 1099511627776 exceeds"});
  spec = one_tensor_file();
  spec.tensor_count = ~uint64_t{0};
  expect_invalid(write(spec).bytes, {at_byte(8), "exceeds kvsift's limit"});
  spec = one_tensor_file();
  spec.metadata_count = uint64_t{1} << 63;
  expect_invalid(write(spec).bytes, {at_byte(16), "metadata count 9223372036854775808 exceeds"});
  spec = one_tensor_file();
  spec.tensor_count = 100000;  // under the limit, but 100000 infos cannot fit in 92 bytes
  expect_invalid(write(spec).bytes,
                 {at_byte(8), "100000 tensors and 1 metadata entries need at least"});
}

TEST(Gguf, rejects_tensor_data_past_the_end_of_the_file) {
  std::vector<uint8_t> bytes = write(one_tensor_file()).bytes;
  patch_u64(bytes, 73, 32);  // 32 + 20 bytes > the 20-byte data section
  expect_invalid(bytes, {at_byte(73), "tensor 't' needs 20 bytes at data offset 32",
                         "past the end of the data section (20 bytes from byte 96)"});
  patch_u64(bytes, 73, ~uint64_t{0} - 31);  // aligned; offset + bytes overflows
  expect_invalid(bytes, {at_byte(73), "past the end of the data section"});
  bytes = write(one_tensor_file()).bytes;
  patch_u64(bytes, 61, 64);  // two blocks claimed, one stored
  expect_invalid(bytes, {at_byte(73), "tensor 't' needs 40 bytes at data offset 0"});
  bytes.pop_back();  // the one block stored loses a byte
  patch_u64(bytes, 61, 32);
  expect_invalid(bytes, {at_byte(73), "needs 20 bytes", "(19 bytes from byte 96)"});
}

TEST(Gguf, rejects_a_misaligned_tensor_offset) {
  TestFile spec = one_tensor_file();
  spec.tensors[0].offset = 16;
  expect_invalid(write(spec).bytes,
                 {at_byte(73), "data offset 16, not a multiple of the alignment 32"});
  spec = small_file();  // alignment 64
  spec.tensors[1].offset = 32;
  const Writer w = write(spec);
  const std::size_t offset_field = w.tensor_info_at[2] - 8;
  expect_invalid(w.bytes, {at_byte(offset_field), "(tensor info 1 'half.weight')",
                           "not a multiple of the alignment 64"});
}

TEST(Gguf, rejects_alignment_that_is_not_a_u32_power_of_two) {
  TestFile spec = one_tensor_file();
  spec.metadata.emplace_back("general.alignment", v::u32(24));
  // 48 key length, 56 key (17 bytes), 73 value type, 77 value.
  expect_invalid(write(spec).bytes, {at_byte(77), "general.alignment 24 is not a power of two"});
  spec.metadata.back().second = v::u32(0);
  expect_invalid(write(spec).bytes, {at_byte(77), "general.alignment 0 is not a power of two"});
  spec.metadata.back().second = v::u64(64);
  expect_invalid(write(spec).bytes, {at_byte(73), "general.alignment has type u64"});
}

TEST(Gguf, rejects_tensor_types_kvsift_cannot_read_by_id_and_name) {
  TestFile spec = one_tensor_file();
  spec.tensors[0].type = 6;
  expect_invalid(write(spec).bytes,
                 {at_byte(69), "tensor 't' has type id 6 (q5_0) which kvsift cannot read"});
  spec.tensors[0].type = 13;
  expect_invalid(write(spec).bytes, {"type id 13 (q5_K) which kvsift cannot read"});
  spec.tensors[0].type = 1000;
  expect_invalid(write(spec).bytes, {"type id 1000 (unknown) which kvsift cannot read"});
}

TEST(Gguf, rejects_unknown_value_types) {
  std::vector<uint8_t> bytes = write(one_tensor_file()).bytes;
  patch_u32(bytes, 33, 13);
  expect_invalid(bytes, {at_byte(33), "value type id 13 is not a GGUF value type (0..12)"});
  TestFile spec;
  spec.metadata = {{"a", v::array(GgufValueType::u8, {v::u8(1)})}};
  bytes = write(spec).bytes;
  patch_u32(bytes, 37, 0xffffffff);
  expect_invalid(bytes, {at_byte(37), "array element type id 4294967295 is not a GGUF value type"});
}

TEST(Gguf, rejects_a_bool_that_is_neither_0_nor_1) {
  TestFile spec;
  spec.metadata = {{"b", v::boolean(true)}};
  std::vector<uint8_t> bytes = write(spec).bytes;
  bytes[37] = 2;
  expect_invalid(bytes, {at_byte(37), "bool value 2 is neither 0 nor 1"});
}

TEST(Gguf, rejects_five_dimensions_and_zero_dimensions) {
  TestFile spec = one_tensor_file();
  spec.tensors[0].dims = {32, 1, 1, 1, 1};
  expect_invalid(write(spec).bytes, {at_byte(57), "tensor has 5 dimensions; kvsift reads 1 to 4"});
  spec.tensors[0].dims = {};
  expect_invalid(write(spec).bytes, {at_byte(57), "tensor has 0 dimensions"});
}

TEST(Gguf, rejects_a_zero_dimension) {
  TestFile spec = one_tensor_file();
  spec.tensors[0].dims = {32, 0};
  expect_invalid(write(spec).bytes, {at_byte(69), "(tensor info 0 't')", "dimension 1 is 0"});
}

TEST(Gguf, rejects_dimensions_whose_product_overflows) {
  TestFile spec = one_tensor_file();
  spec.tensors[0].dims = {32, uint64_t{1} << 32, uint64_t{1} << 32};
  expect_invalid(write(spec).bytes, {at_byte(77), "the dimensions multiply to more than 2^63"});
  spec.tensors[0].dims = {uint64_t{1} << 62};  // 2^62 elements but 2^64 bytes of f32
  spec.tensors[0].type = id(GgmlType::f32);
  expect_invalid(write(spec).bytes, {"tensor 't' has more than 2^64 bytes of data"});
}

TEST(Gguf, rejects_rows_that_are_not_a_whole_number_of_blocks) {
  TestFile spec = one_tensor_file();
  spec.tensors[0].dims = {48, 2};
  expect_invalid(write(spec).bytes,
                 {at_byte(61),
                  "tensor 't' has rows of 48 elements, not a whole number of q4_1 "
                  "blocks of 32"});
}

TEST(Gguf, rejects_duplicate_tensor_names_and_metadata_keys) {
  TestFile spec = small_file();
  spec.tensors[3].name = "half.weight";
  Writer w = write(spec);
  expect_invalid(w.bytes,
                 {at_byte(w.tensor_info_at[3]), "tensor name 'half.weight' appears twice"});
  spec = one_tensor_file();
  spec.metadata.emplace_back("k", v::u8(1));
  expect_invalid(write(spec).bytes, {at_byte(48), "(metadata entry 1)", "key 'k' appears twice"});
}

TEST(Gguf, rejects_arrays_nested_deeper_than_8_levels) {
  GgufValue nested = v::array(GgufValueType::u8, {});
  for (int level = 1; level < 9; ++level)
    nested = v::array(GgufValueType::array, {std::move(nested)});
  TestFile spec;
  spec.metadata = {{"deep", std::move(nested)}};
  expect_invalid(write(spec).bytes, {"(metadata entry 0 'deep'[0][0][0][0][0][0][0][0])",
                                     "arrays are nested more than 8 levels deep"});
}

TEST(Gguf, rejects_long_or_empty_tensor_names_and_empty_keys) {
  TestFile spec = one_tensor_file();
  spec.tensors[0].name = std::string(257, 'n');
  expect_invalid(write(spec).bytes,
                 {at_byte(48), "tensor name length 257 exceeds the limit of 256"});
  spec.tensors[0].name = "";
  expect_invalid(write(spec).bytes, {at_byte(48), "the tensor name is empty"});
  spec = one_tensor_file();
  spec.metadata[0].first = "";
  expect_invalid(write(spec).bytes, {at_byte(24), "the key is empty"});
}

// ---- Fuzzing ------------------------------------------------------------------------------------

namespace {

// One to three of: bit flips, boundary bytes, truncation, boundary values in u64 length/count/
// dimension/offset fields and u32 type fields, chunks copied over other places, bytes inserted or
// erased (which shifts every later field).
std::vector<uint8_t> mutate(const Writer& base, std::mt19937_64& rng) {
  std::vector<uint8_t> b = base.bytes;
  const auto below = [&](std::size_t n) {
    return n == 0 ? std::size_t{0} : std::size_t(rng() % n);
  };
  const int mutations = 1 + int(rng() % 3);
  for (int m = 0; m < mutations && !b.empty(); ++m) {
    switch (rng() % 8) {
      case 0: b[below(b.size())] ^= uint8_t(1u << (rng() % 8)); break;
      case 1: {
        static constexpr uint8_t kBoundary[] = {0, 0xff, 0x7f, 0x80, 1};
        b[below(b.size())] = kBoundary[rng() % 5];
        break;
      }
      case 2: b.resize(below(b.size())); break;
      case 3:
      case 4: {
        const std::size_t at = base.u64_fields[below(base.u64_fields.size())];
        if (at + 8 > b.size()) break;
        uint64_t old;
        std::memcpy(&old, b.data() + at, 8);
        const uint64_t choices[] = {0,
                                    1,
                                    2,
                                    7,
                                    31,
                                    32,
                                    33,
                                    64,
                                    255,
                                    b.size(),
                                    b.size() - at,
                                    b.size() - at - 8,
                                    old + 1,
                                    old - 1,
                                    old * 2,
                                    old + 32,
                                    uint64_t{1} << 31,
                                    uint64_t{1} << 32,
                                    uint64_t{1} << 62,
                                    uint64_t{1} << 63,
                                    ~uint64_t{0},
                                    ~uint64_t{0} - 31,
                                    rng()};
        patch_u64(b, at, choices[below(std::size(choices))]);
        break;
      }
      case 5: {
        const std::size_t at = base.u32_fields[below(base.u32_fields.size())];
        if (at + 4 > b.size()) break;
        const uint32_t choices[] = {
            uint32_t(rng() % 16), 0,         1, 4, 5, 9, 12, 13, 14, 30, 31, 39, 40, 1000,
            0x7fffffff,           0xffffffff};
        patch_u32(b, at, choices[below(std::size(choices))]);
        break;
      }
      case 6: {
        const std::size_t length = 1 + below(32);
        if (length > b.size()) break;
        const std::size_t from = below(b.size() - length + 1), to = below(b.size() - length + 1);
        std::memmove(b.data() + to, b.data() + from, length);
        break;
      }
      case 7: {
        const std::size_t at = below(b.size() + 1), length = 1 + below(8);
        if (rng() % 2 == 0)
          b.insert(b.begin() + std::ptrdiff_t(at), length, uint8_t(rng()));
        else
          b.erase(b.begin() + std::ptrdiff_t(at),
                  b.begin() + std::ptrdiff_t(std::min(b.size(), at + length)));
        break;
      }
    }
  }
  return b;
}

}  // namespace

TEST(Gguf, survives_seeded_mutations_of_a_valid_file) {
  const Writer base = write(small_file());
  if (const char* dir = std::getenv("KVSIFT_FUZZ_SEED_DIR")) {  // seeds for the libFuzzer binary
    std::ofstream(std::filesystem::path(dir) / "small.gguf", std::ios::binary)
        .write(reinterpret_cast<const char*>(base.bytes.data()),
               std::streamsize(base.bytes.size()));
  }
  std::mt19937_64 rng(20240611);
  constexpr int kMutations = 20000;
  constexpr int kSampleEvery = 10;  // how often to also parse here, to count the outcomes
  int sampled = 0, parsed = 0;
  for (int i = 0; i < kMutations; ++i) {
    const std::vector<uint8_t> input = mutate(base, rng);
    LLVMFuzzerTestOneInput(input.data(), input.size());
    if (i % kSampleEvery != 0) continue;
    ++sampled;
    try {
      parse(input);
      ++parsed;
    } catch (const Error&) {
    }
  }
  // Both outcomes must be common, or the mutations are not exploring anything.
  EXPECT_GT(parsed, sampled / 20);
  EXPECT_LT(parsed, sampled - sampled / 20);
}

// ---- The real model -----------------------------------------------------------------------------

namespace {

// KVSIFT_MODEL, else where scripts/fetch_model.sh puts the file; empty when neither exists.
std::string model_path() {
  if (const char* env = std::getenv("KVSIFT_MODEL")) return env;
  std::filesystem::path dir;
  if (const char* env = std::getenv("KVSIFT_MODEL_DIR"))
    dir = env;
  else if (const char* home = std::getenv("HOME"))
    dir = std::filesystem::path(home) / ".cache/kvsift/models";
  const auto path = dir / "SmolLM2-135M-Instruct.Q4_1.gguf";
  return !dir.empty() && std::filesystem::exists(path) ? path.string() : std::string();
}

const GgufFile* smollm2() {
  static const std::string path = model_path();
  if (path.empty()) return nullptr;
  static const GgufFile file = GgufFile::open(path);
  return &file;
}

#define SKIP_WITHOUT_MODEL()                                                                  \
  const GgufFile* model_ptr = smollm2();                                                      \
  if (model_ptr == nullptr)                                                                   \
    GTEST_SKIP() << "SmolLM2 GGUF not found: set KVSIFT_MODEL or run scripts/fetch_model.sh"; \
  const GgufFile& model = *model_ptr

double norm(const std::vector<float>& x) {
  double sum = 0;
  for (float v : x) sum += double(v) * v;
  return std::sqrt(sum);
}

}  // namespace

TEST(GgufSmolLM2, metadata_matches_the_published_configuration) {
  SKIP_WITHOUT_MODEL();
  EXPECT_EQ(model.version(), 3u);
  EXPECT_EQ(model.alignment(), 32u);
  EXPECT_EQ(model.get_string("general.architecture"), "llama");
  EXPECT_EQ(model.get_uint("general.file_type"), 3u);
  EXPECT_EQ(model.get_uint("general.quantization_version"), 2u);
  EXPECT_EQ(model.get_uint("llama.block_count"), 30u);
  EXPECT_EQ(model.get_uint("llama.context_length"), 8192u);
  EXPECT_EQ(model.get_uint("llama.embedding_length"), 576u);
  EXPECT_EQ(model.get_uint("llama.feed_forward_length"), 1536u);
  EXPECT_EQ(model.get_uint("llama.attention.head_count"), 9u);
  EXPECT_EQ(model.get_uint("llama.attention.head_count_kv"), 3u);
  EXPECT_EQ(model.get_uint("llama.rope.dimension_count"), 64u);
  EXPECT_EQ(model.get_uint("llama.vocab_size"), 49152u);
  EXPECT_EQ(model.get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(model.get_float("llama.attention.layer_norm_rms_epsilon"), double(1e-5f));
  EXPECT_EQ(model.get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(model.get_string("tokenizer.ggml.pre"), "smollm");
  const GgufArray& tokens = model.get_array("tokenizer.ggml.tokens");
  EXPECT_EQ(tokens.element_type, GgufValueType::string);
  ASSERT_EQ(tokens.items.size(), 49152u);
  EXPECT_EQ(std::get<std::string>(tokens.items[0].value), "<|endoftext|>");
  EXPECT_EQ(std::get<std::string>(tokens.items[1].value), "<|im_start|>");
  EXPECT_EQ(std::get<std::string>(tokens.items[2].value), "<|im_end|>");
  EXPECT_EQ(model.get_array("tokenizer.ggml.token_type").items.size(), 49152u);
  EXPECT_EQ(model.get_array("tokenizer.ggml.merges").items.size(), 48900u);
  EXPECT_EQ(model.get_uint("tokenizer.ggml.bos_token_id"), 1u);
  EXPECT_EQ(model.get_uint("tokenizer.ggml.eos_token_id"), 2u);
  EXPECT_EQ(model.get_uint("tokenizer.ggml.unknown_token_id"), 0u);
  EXPECT_EQ(model.get_uint("tokenizer.ggml.padding_token_id"), 2u);
  EXPECT_NE(model.get_string("tokenizer.chat_template").find("<|im_start|>"), std::string::npos);
}

TEST(GgufSmolLM2, has_272_tensors_of_the_expected_types_and_shapes) {
  SKIP_WITHOUT_MODEL();
  EXPECT_EQ(model.tensors().size(), 272u);
  const GgufTensor& embd = model.require_tensor("token_embd.weight");
  EXPECT_EQ(embd.type, GgmlType::q8_0);
  EXPECT_EQ(embd.n_dims, 2u);
  EXPECT_EQ(embd.dims[0], 576u);
  EXPECT_EQ(embd.dims[1], 49152u);
  EXPECT_EQ(model.tensor("output.weight"), nullptr);  // tied to token_embd
  EXPECT_EQ(model.require_tensor("output_norm.weight").type, GgmlType::f32);
  int q4_1 = 0, f32 = 0;
  for (const GgufTensor& t : model.tensors()) {
    q4_1 += t.type == GgmlType::q4_1;
    f32 += t.type == GgmlType::f32;
  }
  EXPECT_EQ(q4_1, 210);
  EXPECT_EQ(f32, 61);
  for (int layer = 0; layer < 30; ++layer) {
    const std::string blk = "blk." + std::to_string(layer) + ".";
    const auto expect = [&](const std::string& name, GgmlType type, uint64_t d0, uint64_t d1) {
      const GgufTensor& t = model.require_tensor(blk + name);
      EXPECT_EQ(t.type, type) << t.name;
      EXPECT_EQ(t.dims[0], d0) << t.name;
      EXPECT_EQ(t.dims[1], d1) << t.name;
    };
    expect("attn_q.weight", GgmlType::q4_1, 576, 576);
    expect("attn_k.weight", GgmlType::q4_1, 576, 192);
    expect("attn_v.weight", GgmlType::q4_1, 576, 192);
    expect("attn_output.weight", GgmlType::q4_1, 576, 576);
    expect("ffn_gate.weight", GgmlType::q4_1, 576, 1536);
    expect("ffn_up.weight", GgmlType::q4_1, 576, 1536);
    expect("ffn_down.weight", GgmlType::q4_1, 1536, 576);
    expect("attn_norm.weight", GgmlType::f32, 576, 1);
    expect("ffn_norm.weight", GgmlType::f32, 576, 1);
  }
}

TEST(GgufSmolLM2, embedding_and_q4_1_rows_dequantize_to_plausible_values) {
  SKIP_WITHOUT_MODEL();
  const GgufTensor& embd = model.require_tensor("token_embd.weight");
  std::vector<float> row(576);
  // Row 1000, decoded here straight from the Q8_0 bytes (d fp16, 32 int8) as a cross-check.
  const std::size_t row_size = row_bytes(embd.type, 576);
  const auto* bytes = reinterpret_cast<const uint8_t*>(embd.data) + 1000 * row_size;
  dequantize(embd.type, bytes, row.data(), 576);
  for (int i = 0; i < 576; ++i) {
    uint16_t d;
    std::memcpy(&d, bytes + 34 * (i / 32), 2);
    const auto q = static_cast<int8_t>(bytes[34 * (i / 32) + 2 + i % 32]);
    ASSERT_EQ(row[i], float(q) * simd::f16_to_f32(d)) << i;
  }
  for (std::size_t r : {std::size_t{0}, std::size_t{1000}, std::size_t{49151}}) {
    dequantize(embd.type, reinterpret_cast<const uint8_t*>(embd.data) + r * row_size, row.data(),
               576);
    for (float x : row) ASSERT_TRUE(std::isfinite(x)) << "token_embd row " << r;
    const double n = norm(row);
    EXPECT_GT(n, 0.1) << "token_embd row " << r;
    EXPECT_LT(n, 100.0) << "token_embd row " << r;
  }
  const GgufTensor& q = model.require_tensor("blk.0.attn_q.weight");
  for (std::size_t r : {std::size_t{0}, std::size_t{575}}) {
    dequantize(q.type, reinterpret_cast<const uint8_t*>(q.data) + r * row_bytes(q.type, 576),
               row.data(), 576);
    for (float x : row) ASSERT_TRUE(std::isfinite(x)) << "attn_q row " << r;
    const double n = norm(row);
    EXPECT_GT(n, 0.1) << "attn_q row " << r;
    EXPECT_LT(n, 100.0) << "attn_q row " << r;
  }
  const GgufTensor& norm_weight = model.require_tensor("output_norm.weight");
  dequantize(norm_weight.type, norm_weight.data, row.data(), 576);
  for (float x : row) ASSERT_TRUE(std::isfinite(x));
}

TEST(GgufSmolLM2, every_tensor_dequantizes_to_finite_values) {
  SKIP_WITHOUT_MODEL();
  std::vector<float> values;
  uint64_t elements = 0, not_finite = 0;
  double seconds = 0;
  for (const GgufTensor& t : model.tensors()) {
    values.resize(t.elements());
    const auto start = std::chrono::steady_clock::now();
    dequantize(t.type, t.data, values.data(), values.size());
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (float x : values) not_finite += !std::isfinite(x);
    elements += values.size();
  }
  EXPECT_EQ(elements, 134515008u);
  EXPECT_EQ(not_finite, 0u);
  RecordProperty("dequantize_seconds", std::to_string(seconds));
  std::printf("dequantized %llu elements in %.3f s\n", static_cast<unsigned long long>(elements),
              seconds);
}
