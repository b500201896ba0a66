// GGUF files (v2 and v3): header, metadata, tensor table, memory-mapped tensor data.
//
// Every count, length, offset and dimension read from a file is untrusted: it is checked against
// the bytes that remain and against sane limits before it is used, and a violation throws
// Error(invalid_file) saying what was wrong and where (byte offset). Format reference: ggml's
// docs/gguf.md (github.com/ggml-org/ggml); summary in docs/eval.md, GGUF, briefly.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace kvsift::model {

// ggml tensor type ids (the subset kvsift reads; others are reported by name/id as unsupported).
enum class GgmlType : uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q8_0 = 8,
  q4_k = 12,
  q6_k = 14,
  bf16 = 30,
};

enum class GgufValueType : uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};

struct GgufValue;
struct GgufArray {
  GgufValueType element_type;
  std::vector<GgufValue> items;
};

// One metadata value. Integers of every width are held as int64/uint64 (their declared type is
// kept in `type`), floats as double.
struct GgufValue {
  GgufValueType type;
  std::variant<uint64_t, int64_t, double, bool, std::string, GgufArray> value;
};

struct GgufTensor {
  std::string name;
  uint32_t n_dims;
  std::array<uint64_t, 4> dims;  // dims[0] is the contiguous (row) length; unused dims are 1
  GgmlType type;
  uint64_t offset;        // relative to the data section
  uint64_t bytes;         // size of the data, from dims and type
  const std::byte* data;  // into the mapping; valid while the GgufFile lives
  uint64_t elements() const noexcept { return dims[0] * dims[1] * dims[2] * dims[3]; }
};

class GgufFile {
 public:
  // Maps and parses the file. Throws Error: io_error (cannot open/map), invalid_file.
  static GgufFile open(const std::string& path);
  // Parses bytes the caller keeps alive while the GgufFile lives (tests, fuzzing).
  static GgufFile parse(const void* data, std::size_t size);

  GgufFile(GgufFile&&) noexcept;
  GgufFile& operator=(GgufFile&&) noexcept;
  ~GgufFile();

  uint32_t version() const noexcept;
  std::size_t alignment() const noexcept;

  // Metadata. find() returns null when absent; the typed getters throw Error(invalid_file) naming
  // the key when it is absent or has another type. get_uint accepts any integer type whose value
  // is >= 0; get_float accepts f32/f64.
  const GgufValue* find(std::string_view key) const noexcept;
  uint64_t get_uint(std::string_view key) const;
  double get_float(std::string_view key) const;
  const std::string& get_string(std::string_view key) const;
  const GgufArray& get_array(std::string_view key) const;
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const noexcept;

  // Tensors. tensor() returns null when absent; require_tensor throws invalid_file naming it.
  const std::vector<GgufTensor>& tensors() const noexcept;
  const GgufTensor* tensor(std::string_view name) const noexcept;
  const GgufTensor& require_tensor(std::string_view name) const;

  // Takes the whole pages inside [data, data + bytes) of the file's mapping out of the process's
  // resident set (madvise MADV_DONTNEED: the page cache keeps them, and a later read faults them
  // back in with the file's bytes), for tensors the caller has copied. Nothing for a parsed file
  // (no mapping) or a range outside the mapping.
  void release(const void* data, std::size_t bytes) const noexcept;

 private:
  struct State;
  explicit GgufFile(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// ggml's name for any ggml type id ("q4_1", "q5_K"; also ids kvsift cannot read), or "unknown".
const char* ggml_type_name(GgmlType type) noexcept;
// "u8", "string", "array", ...; "unknown" outside 0..12.
const char* gguf_value_type_name(GgufValueType type) noexcept;

}  // namespace kvsift::model
