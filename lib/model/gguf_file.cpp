#include "lib/model/gguf_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <ostream>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "lib/core/error.hpp"
#include "lib/model/dequantize.hpp"

namespace kvsift::model {

namespace {

static_assert(std::endian::native == std::endian::little, "GGUF fields are read with memcpy");

// Bounds on what a header may declare. Real files are far below them (SmolLM2: 272 tensors, ~40
// keys, ~150k array values; the largest vocabularies have ~262k tokens and ~500k merges). They cap
// what a hostile file can make us allocate: a value costs sizeof(GgufValue) = 48 bytes in memory
// for as little as 1 byte in the file, so kMaxValues bounds that blow-up at ~200 MB.
constexpr uint64_t kMaxTensors = uint64_t{1} << 20;
constexpr uint64_t kMaxKeys = uint64_t{1} << 20;
constexpr uint64_t kMaxValues = uint64_t{1} << 22;  // array elements in the whole file
constexpr int kMaxArrayDepth = 8;
constexpr uint64_t kMaxKeyLength = 65535;  // gguf.md: keys are at most 2^16 - 1 bytes
constexpr uint64_t kMaxNameLength = 256;   // gguf.md says 64; lenient for long converter names
constexpr std::size_t kDefaultAlignment = 32;
constexpr uint32_t kLastValueType = static_cast<uint32_t>(GgufValueType::f64);

// Smallest encodings, used to reject counts the remaining bytes cannot hold before reserving.
// Entry: key length, 1-byte key, value type, u8. Tensor info: name length, 1-byte name, n_dims,
// one dimension, type, offset.
constexpr uint64_t kMinEntryBytes = 8 + 1 + 4 + 1;
constexpr uint64_t kMinTensorInfoBytes = 8 + 1 + 4 + 8 + 4 + 8;

uint64_t min_value_bytes(GgufValueType type) noexcept {
  switch (type) {
    case GgufValueType::u8:
    case GgufValueType::i8:
    case GgufValueType::boolean: return 1;
    case GgufValueType::u16:
    case GgufValueType::i16: return 2;
    case GgufValueType::u32:
    case GgufValueType::i32:
    case GgufValueType::f32: return 4;
    case GgufValueType::u64:
    case GgufValueType::i64:
    case GgufValueType::f64: return 8;
    case GgufValueType::string: return 8;     // length
    case GgufValueType::array: return 4 + 8;  // element type, count
  }
  return 1;
}

struct Mapping {
  void* address = nullptr;
  std::size_t bytes = 0;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (address != nullptr) ::munmap(address, bytes);
  }
};

struct FileDescriptor {
  int fd;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

struct Contents {
  uint32_t version = 0;
  std::size_t alignment = kDefaultAlignment;
  std::vector<std::pair<std::string, GgufValue>> metadata;
  std::unordered_map<std::string_view, std::size_t> key_index;  // views into metadata keys
  std::vector<GgufTensor> tensors;
  std::unordered_map<std::string_view, std::size_t> tensor_index;  // views into tensor names
};

class Parser {
 public:
  Parser(const std::byte* data, std::size_t size, Contents& out)
      : data_(data), size_(size), out_(out) {}

  void run() {
    read_header();
    read_metadata();
    read_tensor_infos();
    place_tensor_data();
  }

 private:
  // Prints where the parser is ("metadata entry 3 'general.name'[2]") after the byte offset.
  struct Where {
    const Parser& parser;
    void print(std::ostream& os) const {  // a member, so it may read the parser's privates
      os << " (" << parser.section_;
      if (parser.entry_ != kNoEntry) os << ' ' << parser.entry_;
      if (parser.entry_name_ != nullptr) os << " '" << *parser.entry_name_ << '\'';
      for (int d = 0; d < parser.depth_; ++d) os << '[' << parser.element_[d] << ']';
      os << ')';
    }
    friend std::ostream& operator<<(std::ostream& os, const Where& where) {
      where.print(os);
      return os;
    }
  };
  static constexpr uint64_t kNoEntry = std::numeric_limits<uint64_t>::max();

  template <class... Parts>
  [[noreturn]] void bad(std::size_t at, const Parts&... parts) const {
    fail(Status::invalid_file, "invalid GGUF at byte ", at, Where{*this}, ": ", parts...);
  }

  std::size_t remaining() const noexcept { return size_ - pos_; }

  template <class T>
  T read(const char* what) {
    if (remaining() < sizeof(T))
      bad(pos_, "the file ends inside the ", what, " (", sizeof(T), " bytes needed, ", remaining(),
          " left)");
    T value;
    std::memcpy(&value, data_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }

  std::string read_string(const char* what, uint64_t max_length) {
    const std::size_t at = pos_;
    const auto length = read<uint64_t>(what);
    if (length > remaining())
      bad(at, what, " length ", length, " is larger than the ", remaining(),
          " bytes left in the file");
    if (length > max_length)
      bad(at, what, " length ", length, " exceeds the limit of ", max_length);
    std::string s(reinterpret_cast<const char*>(data_ + pos_), length);
    pos_ += length;
    return s;
  }

  GgufValueType read_value_type(const char* what) {
    const std::size_t at = pos_;
    const auto id = read<uint32_t>(what);
    if (id > kLastValueType)
      bad(at, what, " id ", id, " is not a GGUF value type (0..", kLastValueType, ")");
    return static_cast<GgufValueType>(id);
  }

  void read_header() {
    const std::size_t magic_at = pos_;
    const auto magic = read<std::array<unsigned char, 4>>("magic");
    if (std::memcmp(magic.data(), "GGUF", 4) != 0) {
      std::ostringstream hex;
      hex << std::hex;
      for (unsigned char c : magic) hex << ' ' << (c >> 4) << (c & 15);
      bad(magic_at, "not a GGUF file: it starts with", hex.str(), ", not 'GGUF' (47 47 55 46)");
    }
    const std::size_t version_at = pos_;
    out_.version = read<uint32_t>("version");
    if (out_.version != 2 && out_.version != 3) {
      const uint32_t swapped = __builtin_bswap32(out_.version);
      if (swapped == 2 || swapped == 3)
        bad(version_at, "big-endian GGUF (version ", swapped, ") is not supported");
      bad(version_at, "GGUF version ", out_.version, " is not supported (kvsift reads 2 and 3)");
    }
    const std::size_t counts_at = pos_;
    const auto n_tensors = read<uint64_t>("tensor count");
    const auto n_keys = read<uint64_t>("metadata count");
    if (n_tensors > kMaxTensors)
      bad(counts_at, "tensor count ", n_tensors, " exceeds kvsift's limit of ", kMaxTensors);
    if (n_keys > kMaxKeys)
      bad(counts_at + 8, "metadata count ", n_keys, " exceeds kvsift's limit of ", kMaxKeys);
    const uint64_t min_bytes = n_keys * kMinEntryBytes + n_tensors * kMinTensorInfoBytes;
    if (min_bytes > remaining())
      bad(counts_at, n_tensors, " tensors and ", n_keys, " metadata entries need at least ",
          min_bytes, " bytes but only ", remaining(), " are left in the file");
    out_.metadata.reserve(n_keys);
    out_.key_index.reserve(n_keys);
    out_.tensors.reserve(n_tensors);
    out_.tensor_index.reserve(n_tensors);
    n_keys_ = n_keys;
    n_tensors_ = n_tensors;
  }

  void read_metadata() {
    section_ = "metadata entry";
    for (uint64_t i = 0; i < n_keys_; ++i) {
      entry_ = i;
      entry_name_ = nullptr;
      const std::size_t key_at = pos_;
      std::string key = read_string("key", kMaxKeyLength);
      if (key.empty()) bad(key_at, "the key is empty");
      if (out_.key_index.count(key) != 0) bad(key_at, "key '", key, "' appears twice");
      // metadata was reserved for every entry, so the key's storage does not move after this.
      auto& [stored_key, value] = out_.metadata.emplace_back(std::move(key), GgufValue{});
      out_.key_index.emplace(stored_key, i);
      entry_name_ = &stored_key;
      const std::size_t type_at = pos_;
      const GgufValueType type = read_value_type("value type");
      const std::size_t value_at = pos_;
      value = read_value(type, 0);
      if (stored_key == "general.alignment") {
        if (type != GgufValueType::u32)
          bad(type_at, "general.alignment has type ", gguf_value_type_name(type),
              "; GGUF requires u32");
        const uint64_t alignment = std::get<uint64_t>(value.value);
        if (alignment == 0 || (alignment & (alignment - 1)) != 0)
          bad(value_at, "general.alignment ", alignment, " is not a power of two");
        out_.alignment = alignment;
      }
    }
    entry_ = kNoEntry;
    entry_name_ = nullptr;
  }

  // `level` counts the arrays around the value (0 for a metadata entry's own value).
  GgufValue read_value(GgufValueType type, int level) {
    switch (type) {
      case GgufValueType::u8: return {type, uint64_t{read<uint8_t>("u8 value")}};
      case GgufValueType::i8: return {type, int64_t{read<int8_t>("i8 value")}};
      case GgufValueType::u16: return {type, uint64_t{read<uint16_t>("u16 value")}};
      case GgufValueType::i16: return {type, int64_t{read<int16_t>("i16 value")}};
      case GgufValueType::u32: return {type, uint64_t{read<uint32_t>("u32 value")}};
      case GgufValueType::i32: return {type, int64_t{read<int32_t>("i32 value")}};
      case GgufValueType::u64: return {type, read<uint64_t>("u64 value")};
      case GgufValueType::i64: return {type, read<int64_t>("i64 value")};
      case GgufValueType::f32: return {type, double{read<float>("f32 value")}};
      case GgufValueType::f64: return {type, read<double>("f64 value")};
      case GgufValueType::boolean: {
        const std::size_t at = pos_;
        const auto byte = read<uint8_t>("bool value");
        if (byte > 1) bad(at, "bool value ", unsigned{byte}, " is neither 0 nor 1");
        return {type, byte == 1};
      }
      case GgufValueType::string:
        return {type, read_string("string", std::numeric_limits<uint64_t>::max())};
      case GgufValueType::array: return {type, read_array(level)};
    }
    bad(pos_, "value type id ", static_cast<uint32_t>(type), " is not a GGUF value type");
  }

  GgufArray read_array(int level) {
    if (level >= kMaxArrayDepth)
      bad(pos_, "arrays are nested more than ", kMaxArrayDepth, " levels deep");
    const GgufValueType element_type = read_value_type("array element type");
    const std::size_t count_at = pos_;
    const auto count = read<uint64_t>("array count");
    const uint64_t min_bytes = min_value_bytes(element_type);
    if (count > remaining() / min_bytes)
      bad(count_at, "array count ", count,
          " is larger than the file: ", gguf_value_type_name(element_type),
          " elements take at least ", min_bytes, " bytes each and ", remaining(),
          " bytes are left");
    if (count > kMaxValues - values_)
      bad(count_at, "array count ", count, " takes the file past kvsift's limit of ", kMaxValues,
          " array elements");
    values_ += count;
    GgufArray array{element_type, {}};
    array.items.reserve(count);
    depth_ = level + 1;
    for (uint64_t i = 0; i < count; ++i) {
      element_[level] = i;
      array.items.push_back(read_value(element_type, level + 1));
    }
    depth_ = level;
    return array;
  }

  void read_tensor_infos() {
    section_ = "tensor info";
    offset_fields_.reserve(n_tensors_);
    for (uint64_t i = 0; i < n_tensors_; ++i) {
      entry_ = i;
      entry_name_ = nullptr;
      const std::size_t name_at = pos_;
      std::string name = read_string("tensor name", kMaxNameLength);
      if (name.empty()) bad(name_at, "the tensor name is empty");
      if (out_.tensor_index.count(name) != 0)
        bad(name_at, "tensor name '", name, "' appears twice");
      // tensors was reserved for every entry, so the name's storage does not move after this.
      GgufTensor& t = out_.tensors.emplace_back();
      t.name = std::move(name);
      out_.tensor_index.emplace(t.name, i);
      entry_name_ = &t.name;

      const std::size_t n_dims_at = pos_;
      t.n_dims = read<uint32_t>("dimension count");
      if (t.n_dims < 1 || t.n_dims > 4)
        bad(n_dims_at, "tensor has ", t.n_dims, " dimensions; kvsift reads 1 to 4");
      t.dims = {1, 1, 1, 1};
      uint64_t elements = 1;
      for (uint32_t d = 0; d < t.n_dims; ++d) {
        const std::size_t dim_at = pos_;
        t.dims[d] = read<uint64_t>("dimension");
        if (t.dims[d] == 0) bad(dim_at, "dimension ", d, " is 0");
        if (__builtin_mul_overflow(elements, t.dims[d], &elements) ||
            elements > uint64_t{std::numeric_limits<int64_t>::max()})
          bad(dim_at, "the dimensions multiply to more than 2^63 elements");
      }

      const std::size_t type_at = pos_;
      const auto type_id = read<uint32_t>("tensor type");
      t.type = static_cast<GgmlType>(type_id);
      if (!is_supported(t.type))
        bad(type_at, "tensor '", t.name, "' has type id ", type_id, " (", ggml_type_name(t.type),
            ") which kvsift cannot read");
      const uint64_t block = block_elements(t.type);
      if (t.dims[0] % block != 0)
        bad(n_dims_at + 4, "tensor '", t.name, "' has rows of ", t.dims[0], " elements, not a ",
            "whole number of ", ggml_type_name(t.type), " blocks of ", block);
      if (__builtin_mul_overflow(t.dims[0] / block, uint64_t{block_bytes(t.type)}, &t.bytes) ||
          __builtin_mul_overflow(t.bytes, elements / t.dims[0], &t.bytes))
        bad(n_dims_at, "tensor '", t.name, "' has more than 2^64 bytes of data");

      offset_fields_.push_back(pos_);
      t.offset = read<uint64_t>("tensor data offset");
      if (t.offset % out_.alignment != 0)
        bad(offset_fields_.back(), "tensor '", t.name, "' has data offset ", t.offset,
            ", not a multiple of the alignment ", out_.alignment);
    }
  }

  void place_tensor_data() {
    const std::size_t misalignment = pos_ % out_.alignment;
    const std::size_t data_at = misalignment == 0 ? pos_ : pos_ + (out_.alignment - misalignment);
    const std::size_t data_bytes = data_at <= size_ ? size_ - data_at : 0;
    for (std::size_t i = 0; i < out_.tensors.size(); ++i) {
      GgufTensor& t = out_.tensors[i];
      entry_ = i;
      entry_name_ = &t.name;
      if (t.offset > data_bytes || t.bytes > data_bytes - t.offset)
        bad(offset_fields_[i], "tensor '", t.name, "' needs ", t.bytes, " bytes at data offset ",
            t.offset, ", past the end of the data section (", data_bytes, " bytes from byte ",
            data_at, ")");
      t.data = data_ + data_at + t.offset;
    }
  }

  const std::byte* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
  Contents& out_;
  uint64_t n_keys_ = 0;
  uint64_t n_tensors_ = 0;
  uint64_t values_ = 0;                     // array elements so far, against kMaxValues
  std::vector<std::size_t> offset_fields_;  // where each tensor's offset field sits, for messages

  // Where the parser is, for messages.
  const char* section_ = "header";
  uint64_t entry_ = kNoEntry;
  const std::string* entry_name_ = nullptr;
  std::array<uint64_t, kMaxArrayDepth> element_{};
  int depth_ = 0;
};

}  // namespace

struct GgufFile::State {
  Mapping mapping;  // empty for parse()
  Contents contents;

  const GgufValue& require_key(std::string_view key) const {
    const auto it = contents.key_index.find(key);
    if (it == contents.key_index.end())
      fail(Status::invalid_file, "metadata key '", key, "' is missing");
    return contents.metadata[it->second].second;
  }
};

GgufFile::GgufFile(std::unique_ptr<State> state) : state_(std::move(state)) {}
GgufFile::GgufFile(GgufFile&&) noexcept = default;
GgufFile& GgufFile::operator=(GgufFile&&) noexcept = default;
GgufFile::~GgufFile() = default;

GgufFile GgufFile::open(const std::string& path) {
  auto state = std::make_unique<State>();
  {
    const FileDescriptor file{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
    if (file.fd < 0) fail(Status::io_error, "cannot open '", path, "': ", std::strerror(errno));
    struct stat info {};
    if (::fstat(file.fd, &info) != 0)
      fail(Status::io_error, "cannot stat '", path, "': ", std::strerror(errno));
    if (!S_ISREG(info.st_mode)) fail(Status::io_error, "'", path, "' is not a regular file");
    const auto bytes = static_cast<std::size_t>(info.st_size);
    if (bytes > 0) {  // mmap rejects length 0; an empty file fails parsing below
      void* address = ::mmap(nullptr, bytes, PROT_READ, MAP_PRIVATE, file.fd, 0);
      if (address == MAP_FAILED)
        fail(Status::io_error, "cannot map '", path, "' (", bytes,
             " bytes): ", std::strerror(errno));
      state->mapping.address = address;
      state->mapping.bytes = bytes;
    }
  }
  try {
    Parser(static_cast<const std::byte*>(state->mapping.address), state->mapping.bytes,
           state->contents)
        .run();
  } catch (const Error& e) {
    fail(e.status(), "'", path, "': ", e.what());
  }
  return GgufFile(std::move(state));
}

GgufFile GgufFile::parse(const void* data, std::size_t size) {
  auto state = std::make_unique<State>();
  Parser(static_cast<const std::byte*>(data), size, state->contents).run();
  return GgufFile(std::move(state));
}

uint32_t GgufFile::version() const noexcept {
  return state_->contents.version;
}
void GgufFile::release(const void* data, std::size_t bytes) const noexcept {
  const auto begin = reinterpret_cast<std::uintptr_t>(data);
  const auto base = reinterpret_cast<std::uintptr_t>(state_->mapping.address);
  if (base == 0 || begin < base || bytes > state_->mapping.bytes - (begin - base)) return;
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const std::uintptr_t first = (begin + page - 1) / page * page,
                       last = (begin + bytes) / page * page;
  if (first < last) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

std::size_t GgufFile::alignment() const noexcept {
  return state_->contents.alignment;
}

const GgufValue* GgufFile::find(std::string_view key) const noexcept {
  const auto it = state_->contents.key_index.find(key);
  return it == state_->contents.key_index.end() ? nullptr
                                                : &state_->contents.metadata[it->second].second;
}

uint64_t GgufFile::get_uint(std::string_view key) const {
  const GgufValue& v = state_->require_key(key);
  switch (v.type) {
    case GgufValueType::u8:
    case GgufValueType::u16:
    case GgufValueType::u32:
    case GgufValueType::u64: return std::get<uint64_t>(v.value);
    case GgufValueType::i8:
    case GgufValueType::i16:
    case GgufValueType::i32:
    case GgufValueType::i64: {
      const int64_t value = std::get<int64_t>(v.value);
      if (value < 0)
        fail(Status::invalid_file, "metadata key '", key, "' is ", value,
             ", expected a non-negative integer");
      return static_cast<uint64_t>(value);
    }
    default:
      fail(Status::invalid_file, "metadata key '", key, "' has type ", gguf_value_type_name(v.type),
           ", expected an integer");
  }
}

double GgufFile::get_float(std::string_view key) const {
  const GgufValue& v = state_->require_key(key);
  if (v.type != GgufValueType::f32 && v.type != GgufValueType::f64)
    fail(Status::invalid_file, "metadata key '", key, "' has type ", gguf_value_type_name(v.type),
         ", expected f32 or f64");
  return std::get<double>(v.value);
}

const std::string& GgufFile::get_string(std::string_view key) const {
  const GgufValue& v = state_->require_key(key);
  if (v.type != GgufValueType::string)
    fail(Status::invalid_file, "metadata key '", key, "' has type ", gguf_value_type_name(v.type),
         ", expected string");
  return std::get<std::string>(v.value);
}

const GgufArray& GgufFile::get_array(std::string_view key) const {
  const GgufValue& v = state_->require_key(key);
  if (v.type != GgufValueType::array)
    fail(Status::invalid_file, "metadata key '", key, "' has type ", gguf_value_type_name(v.type),
         ", expected array");
  return std::get<GgufArray>(v.value);
}

const std::vector<std::pair<std::string, GgufValue>>& GgufFile::metadata() const noexcept {
  return state_->contents.metadata;
}

const std::vector<GgufTensor>& GgufFile::tensors() const noexcept {
  return state_->contents.tensors;
}

const GgufTensor* GgufFile::tensor(std::string_view name) const noexcept {
  const auto it = state_->contents.tensor_index.find(name);
  return it == state_->contents.tensor_index.end() ? nullptr
                                                   : &state_->contents.tensors[it->second];
}

const GgufTensor& GgufFile::require_tensor(std::string_view name) const {
  const GgufTensor* t = tensor(name);
  if (t == nullptr) fail(Status::invalid_file, "tensor '", name, "' is missing from the GGUF file");
  return *t;
}

const char* ggml_type_name(GgmlType type) noexcept {
  // Every id in ggml.h's enum ggml_type, so messages also name the types kvsift cannot read;
  // null where ggml retired an id.
  static constexpr const char* kNames[] = {
      "f32",     "f16",    "q4_0",    "q4_1",  nullptr,  nullptr, "q5_0",  "q5_1",
      "q8_0",    "q8_1",   "q2_K",    "q3_K",  "q4_K",   "q5_K",  "q6_K",  "q8_K",
      "iq2_xxs", "iq2_xs", "iq3_xxs", "iq1_s", "iq4_nl", "iq3_s", "iq2_s", "iq4_xs",
      "i8",      "i16",    "i32",     "i64",   "f64",    "iq1_m", "bf16",  nullptr,
      nullptr,   nullptr,  "tq1_0",   "tq2_0", nullptr,  nullptr, nullptr, "mxfp4"};
  const auto id = static_cast<uint32_t>(type);
  if (id >= std::size(kNames) || kNames[id] == nullptr) return "unknown";
  return kNames[id];
}

const char* gguf_value_type_name(GgufValueType type) noexcept {
  static constexpr const char* kNames[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                           "bool", "string", "array", "u64", "i64", "f64"};
  const auto id = static_cast<uint32_t>(type);
  return id < std::size(kNames) ? kNames[id] : "unknown";
}

}  // namespace kvsift::model
