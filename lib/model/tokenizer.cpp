// Byte-level BPE after llama.cpp (src/llama-vocab.cpp: tokenizer_st_partition,
// llm_tokenizer_bpe_session; src/unicode.cpp: unicode_regex_split_custom_gpt2). The pre-tokenizer
// regexes are written out by hand over code points: std::regex has no \p{..} classes, and the
// hand-written GPT-2 matcher is the one llama.cpp itself runs, so edge cases agree by construction.
#include "lib/model/tokenizer.hpp"

#include <unicode/uchar.h>
#include <unicode/utf8.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>

#include "lib/core/error.hpp"
#include "lib/model/gguf_file.hpp"

namespace kvsift::model {
namespace {

// ---- GPT-2 bytes_to_unicode ---------------------------------------------------------------------
// Printable Latin-1 bytes stand for themselves; the other 68 bytes map, in byte order, to U+0100..
// U+0143 (so ' ' is 'Ġ' U+0120 and '\n' is 'Ċ' U+010A).
constexpr bool is_printable_byte(int b) {
  return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

constexpr std::array<UChar32, 256> make_byte_to_code_point() {
  std::array<UChar32, 256> table{};
  UChar32 next = 256;
  for (int b = 0; b < 256; ++b) table[b] = is_printable_byte(b) ? b : next++;
  return table;
}
constexpr std::array<UChar32, 256> kByteToCodePoint = make_byte_to_code_point();
constexpr UChar32 kByteCodePointEnd = 256 + 68;

constexpr std::array<int16_t, kByteCodePointEnd> make_code_point_to_byte() {
  std::array<int16_t, kByteCodePointEnd> table{};
  for (auto& b : table) b = -1;
  for (int b = 0; b < 256; ++b) table[kByteToCodePoint[b]] = int16_t(b);
  return table;
}
constexpr std::array<int16_t, kByteCodePointEnd> kCodePointToByte = make_code_point_to_byte();

void append_utf8(std::string& out, UChar32 c) {
  char buffer[U8_MAX_LENGTH];
  int32_t length = 0;
  U8_APPEND_UNSAFE(buffer, length, c);
  out.append(buffer, std::size_t(length));
}

// The bytes a byte-level token text stands for; false when a character is outside the table
// (HF's ByteLevel decoder then keeps the token's raw bytes).
bool byte_level_decode(std::string_view text, std::string& bytes) {
  bytes.clear();
  int32_t i = 0;
  const auto length = int32_t(text.size());
  while (i < length) {
    UChar32 c;
    U8_NEXT(text.data(), i, length, c);
    if (c < 0 || c >= kByteCodePointEnd || kCodePointToByte[c] < 0) return false;
    bytes.push_back(char(kCodePointToByte[c]));
  }
  return true;
}

// ---- Code point classes -------------------------------------------------------------------------
enum : uint8_t {
  kLetter = 1,  // \p{L}
  kNumber = 2,  // \p{N}
  kSpace = 4,   // \s: Unicode White_Space, as llama.cpp's unicode_set_whitespace and Rust/onig \s
  kPunct = 8,   // \p{P} or one of $+<=>^~| (llama.cpp's "default" first pass)
};

constexpr std::array<uint8_t, 128> make_ascii_classes() {
  std::array<uint8_t, 128> table{};
  for (int c = 0; c < 128; ++c) {
    uint8_t f = 0;
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z')) f = kLetter;
    if (c >= '0' && c <= '9') f = kNumber;
    if (c == ' ' || (c >= '\t' && c <= '\r')) f = kSpace;
    // All ASCII punctuation and symbols are P or in $+<=>^~|, except '`' (Sk).
    const bool graphic = c > ' ' && c < 0x7F;
    if (graphic && f == 0 && c != '`') f = kPunct;
    table[c] = f;
  }
  return table;
}
constexpr std::array<uint8_t, 128> kAsciiClasses = make_ascii_classes();

uint8_t classify(UChar32 c) {
  if (c < 0x80) return kAsciiClasses[c];
  const uint32_t mask = U_GET_GC_MASK(c);
  uint8_t f = 0;
  if (mask & U_GC_L_MASK) f |= kLetter;
  if (mask & U_GC_N_MASK) f |= kNumber;
  if (mask & U_GC_P_MASK) f |= kPunct;
  if (u_isUWhiteSpace(c)) f |= kSpace;
  return f;
}

// ---- Pre-tokenizer passes -----------------------------------------------------------------------
// A piece is a half-open range of code point indices. Each pass refines a list of pieces; the
// regex passes keep the text between matches as pieces of their own (llama.cpp
// unicode_regex_split_stl), so a later pass never crosses an earlier boundary.
struct Piece {
  uint32_t begin;
  uint32_t end;
};

// Splits every piece at the matches of a pattern; match_length(pos, end) is the length of the
// match starting at pos (0 for none). Matches are found leftmost first and never empty.
template <class MatchLength>
void split_at_matches(const std::vector<Piece>& in, std::vector<Piece>& out,
                      MatchLength match_length) {
  out.clear();
  for (const Piece piece : in) {
    uint32_t gap = piece.begin;
    uint32_t pos = piece.begin;
    while (pos < piece.end) {
      const uint32_t length = match_length(pos, piece.end);
      if (length == 0) {
        ++pos;
        continue;
      }
      if (pos > gap) out.push_back({gap, pos});
      out.push_back({pos, pos + length});
      pos += length;
      gap = pos;
    }
    if (piece.end > gap) out.push_back({gap, piece.end});
  }
}

// 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ within each piece,
// step for step as llama.cpp's unicode_regex_split_custom_gpt2 (the lookahead sees only the
// piece: whitespace at a piece's end is kept whole).
void split_gpt2(const std::vector<UChar32>& cps, const std::vector<uint8_t>& classes,
                const std::vector<Piece>& in, std::vector<Piece>& out) {
  out.clear();
  for (const Piece piece : in) {
    const uint32_t end = piece.end;
    uint32_t pos = piece.begin;
    uint32_t emitted = piece.begin;
    const auto emit = [&](uint32_t to) {
      if (to > emitted) out.push_back({emitted, to});
      emitted = to;
    };
    const auto run_of = [&](uint32_t p, auto in_class) {
      while (p < end && in_class(classes[p])) ++p;
      return p;
    };
    while (pos < end) {
      const UChar32 c = cps[pos];
      if (c == '\'' && pos + 1 < end) {
        const UChar32 c1 = cps[pos + 1];
        if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
          pos += 2;
          emit(pos);
          continue;
        }
        if (pos + 2 < end) {
          const UChar32 c2 = cps[pos + 2];
          if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
            pos += 3;
            emit(pos);
            continue;
          }
        }
      }
      const uint32_t head = pos + (c == ' ' ? 1 : 0);  // the optional leading space
      if (head < end) {
        const uint8_t f = classes[head];
        if (f & kLetter) {
          pos = run_of(head, [](uint8_t g) { return (g & kLetter) != 0; });
          emit(pos);
          continue;
        }
        if (f & kNumber) {
          pos = run_of(head, [](uint8_t g) { return (g & kNumber) != 0; });
          emit(pos);
          continue;
        }
        if (!(f & (kLetter | kNumber | kSpace))) {
          pos = run_of(head, [](uint8_t g) { return !(g & (kLetter | kNumber | kSpace)); });
          emit(pos);
          continue;
        }
      }
      const uint32_t spaces_end = run_of(pos, [](uint8_t g) { return (g & kSpace) != 0; });
      const uint32_t spaces = spaces_end - pos;
      if (spaces > 1 && spaces_end < end) {  // \s+(?!\S): leave the last space to the next word
        pos = spaces_end - 1;
        emit(pos);
        continue;
      }
      pos = spaces > 0 ? spaces_end : pos + 1;  // \s+, or a lone unmatched code point
      emit(pos);
    }
  }
}

// ---- BPE ----------------------------------------------------------------------------------------
// Symbol id of a byte the vocabulary has no token for: it takes part in no merge and is left out
// of the output (llama.cpp llm_tokenizer_bpe_session keeps such a symbol and drops it at the end).
constexpr int32_t kNoToken = -2;

struct Symbol {
  int32_t id;  // token, kNoToken, or -1 once merged into its left neighbour
  int32_t prev;
  int32_t next;
};

struct Bigram {
  int32_t rank;
  int32_t left;
  int32_t right;
  int32_t left_id;
  int32_t right_id;
  int32_t result;
};

// Heap order: lowest rank first, then leftmost (llama.cpp llm_bigram_bpe::comparator).
struct BigramAfter {
  bool operator()(const Bigram& a, const Bigram& b) const noexcept {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  }
};

uint64_t merge_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}

// ---- Tables of special token names (llama.cpp llama_vocab::impl::load) --------------------------
constexpr std::string_view kEndOfGenerationTexts[] = {
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
    // fill-in-the-middle pad, repository and file-separator markers also end generation there
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
};

bool is_end_of_generation_text(std::string_view text) {
  return std::find(std::begin(kEndOfGenerationTexts), std::end(kEndOfGenerationTexts), text) !=
         std::end(kEndOfGenerationTexts);
}

// ---- Chat template ------------------------------------------------------------------------------
constexpr std::string_view kImStart = "<|im_start|>";
constexpr std::string_view kImEnd = "<|im_end|>";

// The default system turn of a ChatML template: the first '<|im_start|>system\n...<|im_end|>'
// whose body is a plain string literal (no quote or brace: not an expression), with the Jinja
// escapes \n, \t and \\ undone. SmolLM2 writes real newlines; Qwen-style templates write \n.
bool find_default_system(std::string_view source, std::string& text) {
  constexpr std::string_view kHead = "<|im_start|>system";
  for (std::size_t at = source.find(kHead); at != std::string_view::npos;
       at = source.find(kHead, at + 1)) {
    std::size_t body = at + kHead.size();
    if (source.substr(body, 1) == "\n") {
      body += 1;
    } else if (source.substr(body, 2) == "\\n") {
      body += 2;
    } else {
      continue;
    }
    const std::size_t stop = source.find(kImEnd, body);
    if (stop == std::string_view::npos) return false;
    const std::string_view literal = source.substr(body, stop - body);
    if (literal.find_first_of("'\"{}") != std::string_view::npos) continue;
    text.clear();
    for (std::size_t i = 0; i < literal.size(); ++i) {
      if (literal[i] == '\\' && i + 1 < literal.size()) {
        const char e = literal[++i];
        text.push_back(e == 'n' ? '\n' : e == 't' ? '\t' : e);
      } else {
        text.push_back(literal[i]);
      }
    }
    return true;
  }
  return false;
}

// ---- GGUF metadata ------------------------------------------------------------------------------
bool is_integer_type(GgufValueType type) {
  switch (type) {
    case GgufValueType::u8:
    case GgufValueType::i8:
    case GgufValueType::u16:
    case GgufValueType::i16:
    case GgufValueType::u32:
    case GgufValueType::i32:
    case GgufValueType::u64:
    case GgufValueType::i64: return true;
    default: return false;
  }
}

// The value when it is an integer in the int32 range.
std::optional<int32_t> int32_value(const GgufValue& value) {
  if (!is_integer_type(value.type)) return std::nullopt;
  if (const auto* u = std::get_if<uint64_t>(&value.value)) {
    if (*u <= uint64_t(std::numeric_limits<int32_t>::max())) return int32_t(*u);
  } else if (const auto* i = std::get_if<int64_t>(&value.value)) {
    if (*i >= std::numeric_limits<int32_t>::min() && *i <= std::numeric_limits<int32_t>::max())
      return int32_t(*i);
  }
  return std::nullopt;
}

const GgufArray& array_of(const GgufFile& file, std::string_view key, bool integers) {
  const GgufArray& array = file.get_array(key);
  const bool ok =
      integers ? is_integer_type(array.element_type) : array.element_type == GgufValueType::string;
  if (!ok)
    fail(Status::invalid_file, key, " is an array of type ", uint32_t(array.element_type),
         ", not of ", integers ? "integers" : "strings");
  return array;
}

std::vector<std::string> strings_of(const GgufFile& file, std::string_view key) {
  const GgufArray& array = array_of(file, key, false);
  std::vector<std::string> out;
  out.reserve(array.items.size());
  for (const GgufValue& item : array.items) {
    const auto* text = std::get_if<std::string>(&item.value);
    if (text == nullptr) fail(Status::invalid_file, key, "[", out.size(), "] is not a string");
    out.push_back(*text);
  }
  return out;
}

int32_t optional_token_id(const GgufFile& file, std::string_view key) {
  const GgufValue* value = file.find(key);
  if (value == nullptr) return -1;
  const std::optional<int32_t> id = int32_value(*value);
  if (!id) fail(Status::invalid_file, key, " is not an integer in the int32 range");
  return *id;
}

}  // namespace

// ---- Tokenizer ----------------------------------------------------------------------------------
struct Tokenizer::Scratch {
  std::vector<UChar32> cps;
  std::vector<uint8_t> classes;
  std::vector<Piece> pieces;
  std::vector<Piece> pieces_next;
  std::string bytes;
  std::vector<Symbol> symbols;
  std::vector<Bigram> heap;
};

Tokenizer Tokenizer::from_gguf(const GgufFile& file) {
  const std::string& model = file.get_string("tokenizer.ggml.model");
  if (model != "gpt2")
    fail(Status::unsupported, "tokenizer.ggml.model '", model,
         "' is not supported: only 'gpt2' (byte-level BPE) is");
  std::string pre;
  if (file.find("tokenizer.ggml.pre") != nullptr) pre = file.get_string("tokenizer.ggml.pre");

  std::vector<std::string> tokens = strings_of(file, "tokenizer.ggml.tokens");
  const GgufArray& types = array_of(file, "tokenizer.ggml.token_type", true);
  std::vector<int32_t> token_types;
  token_types.reserve(types.items.size());
  for (const GgufValue& item : types.items) {
    const std::optional<int32_t> type = int32_value(item);
    if (!type)
      fail(Status::invalid_file, "tokenizer.ggml.token_type[", token_types.size(),
           "] is not an integer in the int32 range");
    token_types.push_back(*type);
  }
  const std::vector<std::string> merges = strings_of(file, "tokenizer.ggml.merges");

  const int32_t bos = optional_token_id(file, "tokenizer.ggml.bos_token_id");
  const int32_t eos = optional_token_id(file, "tokenizer.ggml.eos_token_id");
  std::string chat_template;
  if (file.find("tokenizer.chat_template") != nullptr)
    chat_template = file.get_string("tokenizer.chat_template");
  return Tokenizer(std::move(tokens), std::move(token_types), merges, std::move(pre), bos, eos,
                   std::move(chat_template));
}

Tokenizer::Tokenizer(std::vector<std::string> tokens, std::vector<int32_t> token_types,
                     const std::vector<std::string>& merges, std::string pre, int32_t bos,
                     int32_t eos, std::string chat_template)
    : tokens_(std::move(tokens)), bos_(bos), eos_(eos), chat_template_(std::move(chat_template)) {
  if (pre == "smollm") {
    pre_ = PreTokenizer::smollm;
  } else if (pre == "gpt-2" || pre == "gpt2") {
    pre_ = PreTokenizer::gpt2;
  } else if (pre == "default" || pre.empty()) {
    pre_ = PreTokenizer::llama_default;
  } else {
    fail(Status::unsupported, "pre-tokenizer '", pre,
         "' is not supported (supported: smollm, gpt-2, gpt2, default)");
  }

  const std::size_t n = tokens_.size();
  if (n == 0) fail(Status::invalid_file, "the tokenizer vocabulary is empty");
  if (n > std::size_t(std::numeric_limits<int32_t>::max()))
    fail(Status::invalid_file, "the tokenizer vocabulary has ", n, " tokens, more than int32 ids");
  if (token_types.size() != n)
    fail(Status::invalid_file, "the tokenizer has ", n, " tokens but ", token_types.size(),
         " token types");
  types_.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (token_types[i] < 1 || token_types[i] > 6)
      fail(Status::invalid_file, "token ", i, " has type ", token_types[i], ", not 1..6");
    types_[i] = TokenType(token_types[i]);
  }
  for (const auto& [name, id] : {std::pair{"bos", bos_}, std::pair{"eos", eos_}})
    if (id < -1 || id >= int32_t(n))
      fail(Status::invalid_file, name, " token id ", id, " is outside [0, ", n, ")");

  // Views into tokens_, which is not modified again.
  std::unordered_map<std::string_view, int32_t> ids;
  ids.reserve(n);
  for (std::size_t i = 0; i < n; ++i) ids[tokens_[i]] = int32_t(i);  // last one wins, as llama.cpp

  // SmolLM2's vocabulary lacks 21 bytes (C0, C1, F5..FF, a few C0 controls); llama.cpp and HF
  // drop such bytes from the output. Printable ASCII must be there, or this is no byte-level vocab.
  for (int b = 0; b < 256; ++b) {
    std::string text;
    append_utf8(text, kByteToCodePoint[b]);
    const auto it = ids.find(text);
    if (it == ids.end() && b >= ' ' && b <= '~')
      fail(Status::invalid_file, "the vocabulary has no token for byte ", b, " ('", text,
           "'): not a byte-level BPE vocabulary");
    byte_tokens_[b] = it == ids.end() ? kNoToken : it->second;
  }

  if (merges.size() > std::size_t(std::numeric_limits<int32_t>::max()))
    fail(Status::invalid_file, "the tokenizer has ", merges.size(), " merges, too many");
  merges_.reserve(merges.size());
  std::string joined;
  for (std::size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string_view merge = merges[rank];
    const std::size_t space = merge.find(' ', 1);
    if (space == std::string_view::npos)
      fail(Status::invalid_file, "merge ", rank, " '", merge,
           "' is not two tokens separated by a space");
    const std::string_view left = merge.substr(0, space);
    const std::string_view right = merge.substr(space + 1);
    joined.assign(left).append(right);
    int32_t found[3];
    const std::string_view parts[3] = {left, right, joined};
    for (int p = 0; p < 3; ++p) {
      const auto it = ids.find(parts[p]);
      if (it == ids.end())
        fail(Status::invalid_file, "merge ", rank, " '", merge, "' needs '", parts[p],
             "', which is not a token");
      found[p] = it->second;
    }
    // emplace keeps the first (lowest) rank of a repeated merge, as llama.cpp's bpe_ranks does.
    merges_.emplace(merge_key(found[0], found[1]), Merge{int32_t(rank), found[2]});
  }

  decoded_.resize(n);
  end_of_generation_.assign(n, 0);
  std::string bytes;
  for (std::size_t i = 0; i < n; ++i) {
    switch (types_[i]) {
      case TokenType::normal:
      case TokenType::byte:
        decoded_[i] = byte_level_decode(tokens_[i], bytes) ? bytes : tokens_[i];
        break;
      case TokenType::control:
      case TokenType::unknown:
      case TokenType::user_defined:
        decoded_[i] = tokens_[i];
        if (!tokens_[i].empty()) special_tokens_.push_back(int32_t(i));
        break;
      case TokenType::unused: break;
    }
    if (is_end_of_generation_text(tokens_[i])) end_of_generation_[i] = 1;
  }
  if (eos_ >= 0) end_of_generation_[std::size_t(eos_)] = 1;
  // Longest text first, as llama.cpp's cache_special_tokens (ties by id, which llama.cpp leaves
  // unspecified).
  std::stable_sort(special_tokens_.begin(), special_tokens_.end(), [&](int32_t a, int32_t b) {
    return tokens_[std::size_t(a)].size() > tokens_[std::size_t(b)].size();
  });

  chatml_ = chat_template_.find(kImStart) != std::string::npos;
  if (chatml_) has_default_system_ = find_default_system(chat_template_, default_system_);
}

std::vector<int32_t> Tokenizer::encode(std::string_view utf8, bool parse_special) const {
  require(utf8.size() < std::size_t(std::numeric_limits<int32_t>::max()), "text to encode is ",
          utf8.size(), " bytes, 2 GiB or more");
  struct Fragment {
    std::size_t begin;
    std::size_t length;
    int32_t token;  // -1: text still to tokenize
  };
  std::vector<Fragment> fragments;
  std::vector<Fragment> next;
  if (!utf8.empty()) fragments.push_back({0, utf8.size(), -1});
  for (const int32_t id : special_tokens_) {
    if (!parse_special && types_[std::size_t(id)] != TokenType::user_defined) continue;
    const std::string_view text = tokens_[std::size_t(id)];
    bool split = false;
    next.clear();
    for (const Fragment& fragment : fragments) {
      if (fragment.token >= 0) {
        next.push_back(fragment);
        continue;
      }
      const std::string_view view = utf8.substr(fragment.begin, fragment.length);
      std::size_t from = 0;
      for (std::size_t at = view.find(text); at != std::string_view::npos;
           at = view.find(text, from)) {
        if (at > from) next.push_back({fragment.begin + from, at - from, -1});
        next.push_back({0, 0, id});
        from = at + text.size();
        split = true;
      }
      if (from < view.size()) next.push_back({fragment.begin + from, view.size() - from, -1});
    }
    if (split) fragments.swap(next);
  }

  std::vector<int32_t> out;
  out.reserve(utf8.size() / 3 + 8);
  Scratch scratch;
  for (const Fragment& fragment : fragments) {
    if (fragment.token >= 0) {
      out.push_back(fragment.token);
    } else {
      encode_text(utf8.substr(fragment.begin, fragment.length), scratch, out);
    }
  }
  return out;
}

// Fills s.cps with the code points of utf8 and s.pieces with the pre-tokenizer's pieces.
void Tokenizer::split(std::string_view utf8, Scratch& s) const {
  s.cps.clear();
  s.classes.clear();
  const std::size_t length = utf8.size();
  for (std::size_t i = 0; i < length;) {
    const std::size_t start = i;
    UChar32 c;
    U8_NEXT(utf8.data(), i, length, c);
    if (c < 0) {  // ill-formed: one U+FFFD per byte, as llama.cpp's unicode_cpts_from_utf8
      c = 0xFFFD;
      i = start + 1;
    }
    s.cps.push_back(c);
    s.classes.push_back(classify(c));
  }

  s.pieces.assign(1, Piece{0, uint32_t(s.cps.size())});
  const auto split_gpt2_pass = [&] {
    split_gpt2(s.cps, s.classes, s.pieces, s.pieces_next);
    s.pieces.swap(s.pieces_next);
  };
  const auto split_pass = [&](auto match_length) {
    split_at_matches(s.pieces, s.pieces_next, match_length);
    s.pieces.swap(s.pieces_next);
  };
  const auto run_of = [&](uint8_t cls) {
    return [&s, cls](uint32_t pos, uint32_t end) {
      uint32_t p = pos;
      while (p < end && (s.classes[p] & cls)) ++p;
      return p - pos;
    };
  };
  switch (pre_) {
    case PreTokenizer::smollm:  // \p{N}, then GPT-2
      split_pass([&](uint32_t pos, uint32_t) { return (s.classes[pos] & kNumber) ? 1u : 0u; });
      split_gpt2_pass();
      break;
    case PreTokenizer::gpt2: split_gpt2_pass(); break;
    case PreTokenizer::llama_default:  // [\p{P}\$\+<=>\^~\|]+, GPT-2, \p{N}+, [0-9][0-9][0-9]
      split_pass(run_of(kPunct));
      split_gpt2_pass();
      split_pass(run_of(kNumber));
      split_pass([&](uint32_t pos, uint32_t end) {
        if (end - pos < 3) return 0u;
        for (uint32_t k = pos; k < pos + 3; ++k)
          if (s.cps[k] < '0' || s.cps[k] > '9') return 0u;
        return 3u;
      });
      break;
  }
}

void Tokenizer::encode_text(std::string_view utf8, Scratch& s, std::vector<int32_t>& out) const {
  split(utf8, s);
  for (const Piece piece : s.pieces) {
    s.bytes.clear();
    for (uint32_t k = piece.begin; k < piece.end; ++k) append_utf8(s.bytes, s.cps[k]);
    encode_piece(s.bytes, s, out);
  }
}

// Merges adjacent symbols lowest rank first (leftmost among equal ranks) until no pair is a
// merge: llama.cpp's llm_tokenizer_bpe_session and HF's BPE::merge_word. Symbols hold token ids,
// so a pair is one hash lookup; stale heap entries are skipped when popped.
void Tokenizer::encode_piece(std::string_view bytes, Scratch& s, std::vector<int32_t>& out) const {
  const auto n = int32_t(bytes.size());
  if (n == 1) {
    if (const int32_t id = byte_tokens_[uint8_t(bytes[0])]; id >= 0) out.push_back(id);
    return;
  }
  s.symbols.resize(std::size_t(n));
  for (int32_t i = 0; i < n; ++i)
    s.symbols[std::size_t(i)] = {byte_tokens_[uint8_t(bytes[std::size_t(i)])], i - 1,
                                 i + 1 < n ? i + 1 : -1};
  s.heap.clear();
  const auto candidate = [&](int32_t left) {
    if (left < 0) return;
    const Symbol& l = s.symbols[std::size_t(left)];
    if (l.next < 0) return;
    const Symbol& r = s.symbols[std::size_t(l.next)];
    const auto it = merges_.find(merge_key(l.id, r.id));
    if (it == merges_.end()) return;
    s.heap.push_back({it->second.rank, left, l.next, l.id, r.id, it->second.result});
    std::push_heap(s.heap.begin(), s.heap.end(), BigramAfter{});
  };
  for (int32_t i = 0; i + 1 < n; ++i) candidate(i);
  while (!s.heap.empty()) {
    std::pop_heap(s.heap.begin(), s.heap.end(), BigramAfter{});
    const Bigram b = s.heap.back();
    s.heap.pop_back();
    Symbol& left = s.symbols[std::size_t(b.left)];
    Symbol& right = s.symbols[std::size_t(b.right)];
    if (left.next != b.right || left.id != b.left_id || right.id != b.right_id) continue;
    left.id = b.result;
    left.next = right.next;
    right.id = -1;
    if (right.next >= 0) s.symbols[std::size_t(right.next)].prev = b.left;
    candidate(left.prev);
    candidate(b.left);
  }
  for (int32_t i = 0; i >= 0; i = s.symbols[std::size_t(i)].next)
    if (s.symbols[std::size_t(i)].id >= 0) out.push_back(s.symbols[std::size_t(i)].id);
}

std::vector<std::string> Tokenizer::pre_tokenize(std::string_view utf8) const {
  require(utf8.size() < std::size_t(std::numeric_limits<int32_t>::max()),
          "text to pre-tokenize is ", utf8.size(), " bytes, 2 GiB or more");
  Scratch scratch;
  split(utf8, scratch);
  std::vector<std::string> pieces;
  pieces.reserve(scratch.pieces.size());
  for (const Piece piece : scratch.pieces) {
    std::string& bytes = pieces.emplace_back();
    for (uint32_t k = piece.begin; k < piece.end; ++k) append_utf8(bytes, scratch.cps[k]);
  }
  return pieces;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string out;
  for (const int32_t id : ids) {
    if (id < 0 || std::size_t(id) >= tokens_.size())
      fail(Status::invalid_argument, "token id ", id, " is outside [0, ", tokens_.size(), ")");
    out += decoded_[std::size_t(id)];
  }
  return out;
}

std::string Tokenizer::token_text(int32_t id) const {
  if (id < 0 || std::size_t(id) >= tokens_.size())
    fail(Status::invalid_argument, "token id ", id, " is outside [0, ", tokens_.size(), ")");
  return tokens_[std::size_t(id)];
}

bool Tokenizer::is_end_of_generation(int32_t id) const noexcept {
  return id >= 0 && std::size_t(id) < end_of_generation_.size() &&
         end_of_generation_[std::size_t(id)] != 0;
}

std::string Tokenizer::apply_chat_template(std::span<const ChatMessage> messages,
                                           bool add_assistant) const {
  if (chat_template_.empty())
    fail(Status::unsupported, "the model has no chat template (tokenizer.chat_template)");
  if (!chatml_) {
    std::size_t cut = std::min<std::size_t>(chat_template_.size(), 60);
    while (cut > 0 && cut < chat_template_.size() && (uint8_t(chat_template_[cut]) & 0xC0) == 0x80)
      --cut;  // keep the quote valid UTF-8
    fail(Status::unsupported, "chat template \"", chat_template_.substr(0, cut),
         cut < chat_template_.size() ? "..." : "", "\" is not supported (only ChatML is)");
  }
  for (std::size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    require(m.role == "system" || m.role == "user" || m.role == "assistant", "messages[", i,
            "].role='", m.role, "' is not system, user or assistant");
    for (const int32_t id : special_tokens_) {
      const std::string& marker = tokens_[static_cast<std::size_t>(id)];
      require(m.content.find(marker) == std::string_view::npos, "messages[", i,
              "].content contains the special token '", marker, "'");
    }
  }
  std::string out;
  const auto turn = [&out](std::string_view role, std::string_view content) {
    out.append(kImStart).append(role).append("\n").append(content).append(kImEnd).append("\n");
  };
  if (has_default_system_ && !messages.empty() && messages[0].role != "system")
    turn("system", default_system_);
  for (const ChatMessage& message : messages) turn(message.role, message.content);
  if (add_assistant) out.append(kImStart).append("assistant\n");
  return out;
}

}  // namespace kvsift::model
