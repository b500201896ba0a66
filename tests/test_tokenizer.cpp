// Tokenizer: byte-level BPE, the GPT-2/SmolLM pre-tokenizers, special tokens, ChatML rendering and
// the checks on malformed vocabularies; then the real SmolLM2 file against an HF reference.
#include "lib/model/tokenizer.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iterator>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lib/core/error.hpp"
#include "lib/model/gguf_file.hpp"

namespace kvsift::model {
namespace {

using Strings = std::vector<std::string>;
using Ids = std::vector<int32_t>;
using RawMerge = std::pair<std::string, std::string>;

// GPT-2's bytes_to_unicode, written out again here rather than shared, so that the library's
// table is checked against an independent copy.
std::string byte_level(std::string_view bytes) {
  std::string out;
  for (const unsigned char b : bytes) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    uint32_t c = b;
    if (!printable) {
      c = 256;
      for (int x = 0; x < b; ++x) {
        const bool p = (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
        if (!p) ++c;
      }
    }
    if (c < 0x80) {
      out.push_back(char(c));
    } else {
      out.push_back(char(0xC0 | (c >> 6)));
      out.push_back(char(0x80 | (c & 0x3F)));
    }
  }
  return out;
}

constexpr int32_t kControl = 3;
constexpr int32_t kUserDefined = 4;
constexpr int32_t kUnused = 5;

// The three ChatML specials (ids 0, 1, 2) and `extra` specials, then the 256 byte characters, then
// the result of each merge in rank order. Merges are given as raw byte strings.
struct Vocab {
  Strings tokens;
  std::vector<int32_t> types;
  Strings merges;
};

Vocab make_vocab(const std::vector<RawMerge>& raw_merges,
                 const std::vector<std::pair<std::string, int32_t>>& extra = {}) {
  Vocab v;
  for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    v.tokens.push_back(s);
    v.types.push_back(kControl);
  }
  for (const auto& [text, type] : extra) {
    v.tokens.push_back(text);
    v.types.push_back(type);
  }
  for (int b = 0; b < 256; ++b) {
    v.tokens.push_back(byte_level(std::string(1, char(b))));
    v.types.push_back(1);
  }
  for (const auto& [left, right] : raw_merges) {
    v.merges.push_back(byte_level(left) + " " + byte_level(right));
    v.tokens.push_back(byte_level(left + right));
    v.types.push_back(1);
  }
  return v;
}

// SmolLM2's template, as stored in the GGUF's tokenizer.chat_template.
const std::string kSmolTemplate =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|im_start|>assistant\n' }}{% endif %}";

Tokenizer make_tokenizer(const std::vector<RawMerge>& merges, std::string pre = "smollm",
                         std::string chat_template = kSmolTemplate,
                         const std::vector<std::pair<std::string, int32_t>>& extra = {}) {
  Vocab v = make_vocab(merges, extra);
  return Tokenizer(std::move(v.tokens), std::move(v.types), v.merges, std::move(pre), 1, 2,
                   std::move(chat_template));
}

// A few English merges, enough that words become single tokens.
const std::vector<RawMerge> kEnglishMerges = {
    {"t", "h"},   {" ", "th"}, {"e", "r"},   {" th", "e"}, {"a", "t"},  {"c", "at"},
    {" ", "cat"}, {" ", "s"},  {" s", "at"}, {"o", "n"},   {" ", "on"}, {" ", " "},
};

// Each id decoded on its own: the pieces the text was cut into.
Strings pieces(const Tokenizer& tok, const Ids& ids) {
  Strings out;
  for (const int32_t id : ids) out.push_back(tok.decode(std::span(&id, 1)));
  return out;
}

Status status_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.status();
  }
  return Status::ok;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

const Strings kVariedText = {
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Café déjà vu — naïve façade, Ångström, Übergröße.",
    "日本語のテキストです。中文，标点！한국어",
    "emoji 😀🎉👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "   leading, inner    runs,   and trailing   ",
    "tabs\tand\nnewlines\r\n\n\n\tmixed \t \n ",
    "digits 0123456789, 3.14159, 1e-9, ٣٤٥, ²³, ①②, ５６",
    "int main() {\n  return a[i] <= b ? x->y : z::w; // done\n}\n",
    "quotes 'single' \"double\" «guillemets» “curly” it's we'll I'VE",
    "e\u0301 combining, \u200b zero width, \u00a0 nbsp, \u2028 line sep, \u3000 ideographic",
    "<|im_start|>user\nnot parsed as special<|im_end|>",
    "\x01\x02\x7f control bytes and Latin-1 \xc2\xa0\xc3\xbf",
};

// ---- Encoding and decoding ----------------------------------------------------------------------

TEST(Tokenizer, decode_of_encode_returns_the_original_bytes) {
  for (const char* pre : {"smollm", "gpt2", "default"}) {
    const Tokenizer tok = make_tokenizer(kEnglishMerges, pre);
    for (const std::string& text : kVariedText) {
      for (const bool special : {false, true})
        EXPECT_EQ(tok.decode(tok.encode(text, special)), text) << pre << ": " << text;
    }
  }
}

TEST(Tokenizer, bytes_map_through_the_gpt2_byte_table) {
  const Tokenizer tok = make_tokenizer({});
  // Without merges every byte is one token: id 3 + byte value in this vocabulary.
  EXPECT_EQ(tok.encode(" \n!\xc3\xbf", false),
            (Ids{3 + 0x20, 3 + 0x0A, 3 + 0x21, 3 + 0xC3, 3 + 0xBF}));
  EXPECT_EQ(tok.token_text(3 + ' '), "\xc4\xa0");   // 'Ġ' U+0120
  EXPECT_EQ(tok.token_text(3 + '\n'), "\xc4\x8a");  // 'Ċ' U+010A
  EXPECT_EQ(tok.token_text(3 + 'a'), "a");
  EXPECT_EQ(tok.token_text(3 + 0xAD), "\xc5\x83");  // soft hyphen, the last remapped byte: U+0143
  EXPECT_EQ(tok.decode(Ids{3 + ' ', 3 + 'a'}), " a");
  EXPECT_EQ(tok.vocab_size(), 3u + 256u);
}

TEST(Tokenizer, merges_apply_lowest_rank_first) {
  // "abc": with b+c ranked first the result is a|bc, with a+b first it is ab|c.
  const Tokenizer bc_first = make_tokenizer({{"b", "c"}, {"a", "b"}});
  EXPECT_EQ(pieces(bc_first, bc_first.encode("abc", false)), (Strings{"a", "bc"}));
  const Tokenizer ab_first = make_tokenizer({{"a", "b"}, {"b", "c"}});
  EXPECT_EQ(pieces(ab_first, ab_first.encode("abc", false)), (Strings{"ab", "c"}));
  // Equal ranks: the leftmost pair merges first.
  const Tokenizer aa = make_tokenizer({{"a", "a"}});
  EXPECT_EQ(pieces(aa, aa.encode("aaa", false)), (Strings{"aa", "a"}));
  EXPECT_EQ(pieces(aa, aa.encode("aaaa", false)), (Strings{"aa", "aa"}));
}

TEST(Tokenizer, merges_build_words_and_never_cross_pieces) {
  const Tokenizer tok = make_tokenizer(kEnglishMerges);
  EXPECT_EQ(pieces(tok, tok.encode("the cat sat on the  mat", false)),
            (Strings{"th", "e", " cat", " sat", " on", " the", " ", " ", "m", "at"}));
}

TEST(Tokenizer, invalid_utf8_becomes_one_replacement_character_per_byte) {
  const Tokenizer tok = make_tokenizer({});
  EXPECT_EQ(tok.decode(tok.encode("a\xff\xc3(b\xe2\x82", false)),
            "a\xef\xbf\xbd\xef\xbf\xbd(b\xef\xbf\xbd\xef\xbf\xbd");
}

TEST(Tokenizer, bytes_without_a_token_are_dropped_and_block_merges) {
  // SmolLM2 has no token for byte 0x04. llama.cpp keeps the byte as a symbol that merges with
  // nothing and drops it at the end, so "!\x04!" is "!", "!" even though "!!" is a merge.
  Vocab v = make_vocab({{"!", "!"}});
  const std::string missing = byte_level("\x04");
  for (std::size_t i = 0; i < v.tokens.size(); ++i)
    if (v.tokens[i] == missing) v.tokens[i] = "<unused_byte_slot>";
  const Tokenizer tok(v.tokens, v.types, v.merges, "smollm", 1, 2, "");
  EXPECT_EQ(pieces(tok, tok.encode("a\x04"
                                   "b!\x04!",
                                   false)),
            (Strings{"a", "b", "!", "!"}));
  EXPECT_EQ(pieces(tok, tok.encode("!!", false)), (Strings{"!!"}));
}

TEST(Tokenizer, decode_renders_control_tokens_as_text_and_unused_as_nothing) {
  const Tokenizer tok =
      make_tokenizer({}, "smollm", "", {{"<unused0>", kUnused}, {"<tool>", kUserDefined}});
  EXPECT_EQ(tok.decode(Ids{1, 3, 4, 2}), "<|im_start|><tool><|im_end|>");
  EXPECT_EQ(tok.token_text(3), "<unused0>");
  EXPECT_EQ(status_of([&] {
              (void)tok.decode(Ids{0, int32_t(tok.vocab_size())});
            }),
            Status::invalid_argument);
  EXPECT_EQ(status_of([&] { (void)tok.decode(Ids{-1}); }), Status::invalid_argument);
  EXPECT_EQ(status_of([&] { (void)tok.token_text(int32_t(tok.vocab_size())); }),
            Status::invalid_argument);
}

TEST(Tokenizer, end_of_generation_is_eos_and_end_of_turn_markers) {
  const Tokenizer tok = make_tokenizer({}, "smollm", "", {{"<|eot_id|>", kControl}});
  EXPECT_TRUE(tok.is_end_of_generation(tok.eos()));  // <|im_end|>
  EXPECT_TRUE(tok.is_end_of_generation(0));          // <|endoftext|>
  EXPECT_TRUE(tok.is_end_of_generation(3));          // <|eot_id|>
  EXPECT_FALSE(tok.is_end_of_generation(tok.bos()));
  EXPECT_FALSE(tok.is_end_of_generation(4 + 'a'));
  EXPECT_FALSE(tok.is_end_of_generation(-1));
  EXPECT_FALSE(tok.is_end_of_generation(int32_t(tok.vocab_size())));
  EXPECT_EQ(tok.bos(), 1);
  EXPECT_EQ(tok.eos(), 2);
}

TEST(Tokenizer, encode_is_safe_from_several_threads) {
  const Tokenizer tok = make_tokenizer(kEnglishMerges);
  std::string text;
  for (const std::string& s : kVariedText) text += s;
  const Ids expected = tok.encode(text, true);
  std::vector<Ids> got(4);
  std::vector<std::thread> threads;
  for (auto& ids : got)
    threads.emplace_back([&] {
      for (int r = 0; r < 50; ++r) ids = tok.encode(text, true);
    });
  for (auto& t : threads) t.join();
  for (const Ids& ids : got) EXPECT_EQ(ids, expected);
}

// ---- Special tokens -----------------------------------------------------------------------------

TEST(Tokenizer, special_tokens_are_parsed_only_when_asked) {
  const Tokenizer tok = make_tokenizer({});
  const Ids parsed = tok.encode("<|im_start|>hi<|im_end|>", true);
  EXPECT_EQ(parsed, (Ids{1, 3 + 'h', 3 + 'i', 2}));
  const Ids plain = tok.encode("<|im_start|>hi<|im_end|>", false);
  EXPECT_EQ(plain.size(), std::strlen("<|im_start|>hi<|im_end|>"));
  EXPECT_EQ(tok.decode(plain), "<|im_start|>hi<|im_end|>");
  EXPECT_EQ(tok.encode("<|im_start|><|im_start|>", true), (Ids{1, 1}));
  EXPECT_EQ(tok.encode("<|im_sta", true).size(), 8u);  // a prefix is plain text
}

TEST(Tokenizer, text_around_special_tokens_is_pretokenized_separately) {
  // " a" before a special token keeps its space; the special token cuts the whitespace run.
  const Tokenizer tok = make_tokenizer({{" ", "a"}, {" ", " "}});
  EXPECT_EQ(pieces(tok, tok.encode("  a<|im_end|>  a", true)),
            (Strings{" ", " a", "<|im_end|>", " ", " a"}));
  EXPECT_EQ(pieces(tok, tok.encode("x  <|im_end|>", true)), (Strings{"x", "  ", "<|im_end|>"}));
}

TEST(Tokenizer, user_defined_tokens_are_matched_even_without_parse_special) {
  const Tokenizer tok = make_tokenizer({}, "smollm", "", {{"<tool>", kUserDefined}});
  EXPECT_EQ(tok.encode("<tool>", false), (Ids{3}));
  EXPECT_EQ(tok.encode("<tool>", true), (Ids{3}));
}

TEST(Tokenizer, longer_special_tokens_are_matched_first) {
  // llama.cpp tries special tokens longest text first: "<a><b>" wins over "<a>" although both
  // start at the same place, and "b><c>!!" wins over the earlier "<a><b>" it overlaps (a
  // leftmost-longest matcher such as HF's would pick "<a><b>" there).
  const Tokenizer tok = make_tokenizer(
      {}, "smollm", "", {{"<a>", kControl}, {"<a><b>", kControl}, {"b><c>!!", kControl}});
  EXPECT_EQ(tok.encode("<a><b>", true), (Ids{4}));
  EXPECT_EQ(tok.encode("<a><b><a>", true), (Ids{4, 3}));
  EXPECT_EQ(pieces(tok, tok.encode("<a><b><c>!!", true)), (Strings{"<a>", "<", "b><c>!!"}));
}

// ---- Pre-tokenizers -----------------------------------------------------------------------------
// Expected splits worked out by hand from the regex, and identical to HF tokenizers'
// pre_tokenize_str with ByteLevel(use_regex) (gpt2) and Digits(individual) + ByteLevel (smollm).

TEST(TokenizerPretokenizer, gpt2_pattern_splits_contractions_words_and_punctuation) {
  const Tokenizer tok = make_tokenizer({}, "gpt2");
  EXPECT_EQ(tok.pre_tokenize("Hello world"), (Strings{"Hello", " world"}));
  EXPECT_EQ(tok.pre_tokenize("we're I'll she'd it's I'm we've don't"),
            (Strings{"we", "'re", " I", "'ll", " she", "'d", " it", "'s", " I", "'m", " we", "'ve",
                     " don", "'t"}));
  EXPECT_EQ(tok.pre_tokenize("DON'T"), (Strings{"DON", "'", "T"}));  // contractions are lowercase
  EXPECT_EQ(tok.pre_tokenize("'s's"), (Strings{"'s", "'s"}));
  EXPECT_EQ(tok.pre_tokenize("Hello!!! ..."), (Strings{"Hello", "!!!", " ..."}));
  EXPECT_EQ(tok.pre_tokenize("naïve café"), (Strings{"naïve", " café"}));
  EXPECT_EQ(tok.pre_tokenize("日本語"), (Strings{"日本語"}));
  EXPECT_EQ(tok.pre_tokenize("hi 😀😀"), (Strings{"hi", " 😀😀"}));
  EXPECT_EQ(tok.pre_tokenize("abc 1234"), (Strings{"abc", " 1234"}));
  EXPECT_EQ(tok.pre_tokenize("٣٤ x²"), (Strings{"٣٤", " x", "²"}));
  EXPECT_EQ(tok.pre_tokenize("$100.50"), (Strings{"$", "100", ".", "50"}));
}

TEST(TokenizerPretokenizer, whitespace_run_gives_its_last_space_to_the_next_word) {
  const Tokenizer tok = make_tokenizer({}, "gpt2");
  EXPECT_EQ(tok.pre_tokenize("a  b"), (Strings{"a", " ", " b"}));
  EXPECT_EQ(tok.pre_tokenize("a   b"), (Strings{"a", "  ", " b"}));
  EXPECT_EQ(tok.pre_tokenize("  lead"), (Strings{" ", " lead"}));
  EXPECT_EQ(tok.pre_tokenize("x  \n  y"), (Strings{"x", "  \n ", " y"}));
  EXPECT_EQ(tok.pre_tokenize("a\n\nb"), (Strings{"a", "\n", "\n", "b"}));  // '\n' is not ' ?'
  EXPECT_EQ(tok.pre_tokenize("tab\there"), (Strings{"tab", "\t", "here"}));
  EXPECT_EQ(tok.pre_tokenize("a\u00a0b"), (Strings{"a", "\u00a0", "b"}));  // NBSP is \s
  EXPECT_EQ(tok.pre_tokenize("trailing   "), (Strings{"trailing", "   "}));
  EXPECT_EQ(tok.pre_tokenize("a  1"), (Strings{"a", " ", " 1"}));
}

TEST(TokenizerPretokenizer, smollm_splits_every_digit_first) {
  const Tokenizer tok = make_tokenizer({}, "smollm");
  EXPECT_EQ(tok.pre_tokenize("abc 1234"), (Strings{"abc", " ", "1", "2", "3", "4"}));
  EXPECT_EQ(tok.pre_tokenize("a 12 b"), (Strings{"a", " ", "1", "2", " b"}));
  // The digit pieces cut the text first, so a space run before a digit stays whole.
  EXPECT_EQ(tok.pre_tokenize("a  1"), (Strings{"a", "  ", "1"}));
  EXPECT_EQ(tok.pre_tokenize("$100.50"), (Strings{"$", "1", "0", "0", ".", "5", "0"}));
  EXPECT_EQ(tok.pre_tokenize("٣٤ x²"), (Strings{"٣", "٤", " x", "²"}));  // all of \p{N}
  EXPECT_EQ(tok.pre_tokenize("we're 2"), (Strings{"we", "'re", " ", "2"}));
}

TEST(TokenizerPretokenizer, default_is_llama_cpps_four_pass_fallback) {
  const Tokenizer tok = make_tokenizer({}, "default");
  // Punctuation runs first (so no contractions), then GPT-2, then \p{N}+, then 3-digit groups.
  EXPECT_EQ(tok.pre_tokenize("don't"), (Strings{"don", "'", "t"}));
  EXPECT_EQ(tok.pre_tokenize("abc 12345"), (Strings{"abc", " ", "123", "45"}));
  EXPECT_EQ(tok.pre_tokenize("hello, world!"), (Strings{"hello", ",", " world", "!"}));
}

// ---- Chat template (expected strings rendered by Python jinja2 from the GGUF's template) --------

TEST(TokenizerChat, one_turn_gets_the_default_system_turn) {
  const Tokenizer tok = make_tokenizer({});
  const ChatMessage messages[] = {{"user", "What is 2+2?"}};
  EXPECT_EQ(tok.apply_chat_template(messages, true),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n");
}

TEST(TokenizerChat, two_turns_without_system_message) {
  const Tokenizer tok = make_tokenizer({});
  const ChatMessage messages[] = {
      {"user", "Hi"}, {"assistant", "Hello! How can I help?"}, {"user", "Tell me a joke."}};
  EXPECT_EQ(tok.apply_chat_template(messages, true),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can "
            "I help?<|im_end|>\n<|im_start|>user\nTell me a joke.<|im_end|>\n<|im_start|>"
            "assistant\n");
}

TEST(TokenizerChat, a_system_message_replaces_the_default) {
  const Tokenizer tok = make_tokenizer({});
  const ChatMessage one_turn[] = {{"system", "Be brief."}, {"user", "Hi"}};
  EXPECT_EQ(tok.apply_chat_template(one_turn, true),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\n");
  const ChatMessage two_turns[] = {
      {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}};
  EXPECT_EQ(tok.apply_chat_template(two_turns, false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n");
}

TEST(TokenizerChat, no_messages_renders_only_the_assistant_header) {
  const Tokenizer tok = make_tokenizer({});
  EXPECT_EQ(tok.apply_chat_template({}, true), "<|im_start|>assistant\n");
  EXPECT_EQ(tok.apply_chat_template({}, false), "");
}

TEST(TokenizerChat, plain_and_escaped_chatml_templates) {
  // Plain ChatML (no default system turn).
  const Tokenizer plain =
      make_tokenizer({}, "smollm",
                     "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                     "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}");
  const ChatMessage messages[] = {{"user", "Hi"}};
  EXPECT_EQ(plain.apply_chat_template(messages, true),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  // Qwen-style source with \n escapes inside the default system literal.
  const Tokenizer escaped = make_tokenizer(
      {}, "smollm",
      "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are Qwen.\\tOK"
      "<|im_end|>\\n' }}{%- endif %}...<|im_start|>");
  EXPECT_EQ(escaped.apply_chat_template(messages, false),
            "<|im_start|>system\nYou are Qwen.\tOK<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
}

TEST(TokenizerChat, other_templates_are_unsupported) {
  const std::string llama3 =
      "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
      "'<|start_header_id|>' + message['role'] %}";
  const Tokenizer tok = make_tokenizer({}, "smollm", llama3);
  const ChatMessage messages[] = {{"user", "Hi"}};
  EXPECT_EQ(status_of([&] { (void)tok.apply_chat_template(messages, true); }), Status::unsupported);
  const std::string message = message_of([&] { (void)tok.apply_chat_template(messages, true); });
  EXPECT_NE(message.find(llama3.substr(0, 60)), std::string::npos) << message;
  EXPECT_EQ(message.find(llama3.substr(0, 61)), std::string::npos) << message;

  const Tokenizer none = make_tokenizer({}, "smollm", "");
  EXPECT_EQ(status_of([&] { (void)none.apply_chat_template(messages, true); }),
            Status::unsupported);
}

// ---- Malformed vocabularies ---------------------------------------------------------------------

Status construct(Vocab v, std::string pre = "smollm", int32_t bos = 1, int32_t eos = 2) {
  return status_of([&] {
    Tokenizer(std::move(v.tokens), std::move(v.types), v.merges, std::move(pre), bos, eos, "");
  });
}

TEST(TokenizerErrors, malformed_vocabularies_are_invalid_files) {
  const Vocab good = make_vocab({{"a", "b"}});
  EXPECT_EQ(construct(good), Status::ok);

  Vocab v = good;
  v.types.pop_back();
  EXPECT_EQ(construct(v), Status::invalid_file) << "type count";
  v = good;
  v.types[7] = 7;
  EXPECT_EQ(construct(v), Status::invalid_file) << "type value";
  v = good;
  v.types[7] = 0;
  EXPECT_EQ(construct(v), Status::invalid_file) << "type value 0";
  EXPECT_EQ(construct(Vocab{}), Status::invalid_file) << "empty vocabulary";
  v = good;
  v.merges.push_back("ab");
  EXPECT_EQ(construct(v), Status::invalid_file) << "merge without a space";
  v = good;
  v.merges.push_back("a zz");
  EXPECT_EQ(construct(v), Status::invalid_file) << "merge naming an unknown token";
  v = good;
  v.merges.push_back("b a");
  EXPECT_EQ(construct(v), Status::invalid_file) << "merge whose result is not a token";
  v = good;
  v.merges.push_back("a ");
  EXPECT_EQ(construct(v), Status::invalid_file) << "merge with an empty side";
  v = good;
  for (auto& t : v.tokens)
    if (t == "a") t = "<not a>";
  EXPECT_EQ(construct(v), Status::invalid_file) << "printable byte without a token";
  EXPECT_EQ(construct(good, "smollm", int32_t(good.tokens.size()), 2), Status::invalid_file);
  EXPECT_EQ(construct(good, "smollm", 1, -2), Status::invalid_file);
  EXPECT_EQ(construct(good, "smollm", -1, -1), Status::ok);  // no bos/eos

  const std::string message = message_of([&] {
    Vocab bad = good;
    bad.merges.push_back("a zz");
    Tokenizer(bad.tokens, bad.types, bad.merges, "smollm", 1, 2, "");
  });
  EXPECT_NE(message.find("merge 1 'a zz'"), std::string::npos) << message;
  EXPECT_NE(message.find("'zz'"), std::string::npos) << message;
}

TEST(TokenizerErrors, unknown_pre_tokenizers_are_unsupported) {
  const Vocab good = make_vocab({});
  for (const char* pre : {"llama3", "qwen2", "deepseek-llm", "starcoder"})
    EXPECT_EQ(construct(good, pre), Status::unsupported) << pre;
  for (const char* pre : {"smollm", "gpt2", "gpt-2", "default", ""})
    EXPECT_EQ(construct(good, pre), Status::ok) << pre;
}

// GGUF v3 metadata-only files for from_gguf's checks.
struct GgufBytes {
  std::vector<uint8_t> bytes;
  uint64_t count = 0;
  template <class T>
  void put(T value) {
    uint8_t raw[sizeof(T)];
    std::memcpy(raw, &value, sizeof(T));
    bytes.insert(bytes.end(), raw, raw + sizeof(T));
  }
  void str(std::string_view s) {
    put<uint64_t>(s.size());
    bytes.insert(bytes.end(), s.begin(), s.end());
  }
  void key(std::string_view k, GgufValueType type) {
    str(k);
    put(uint32_t(type));
    ++count;
  }
  void string_value(std::string_view k, std::string_view v) {
    key(k, GgufValueType::string);
    str(v);
  }
  void u32_value(std::string_view k, uint32_t v) {
    key(k, GgufValueType::u32);
    put(v);
  }
  void strings(std::string_view k, const Strings& items) {
    key(k, GgufValueType::array);
    put(uint32_t(GgufValueType::string));
    put<uint64_t>(items.size());
    for (const auto& s : items) str(s);
  }
  void i32s(std::string_view k, const std::vector<int32_t>& items) {
    key(k, GgufValueType::array);
    put(uint32_t(GgufValueType::i32));
    put<uint64_t>(items.size());
    for (int32_t x : items) put(x);
  }
  std::vector<uint8_t> file() const {
    GgufBytes out;
    out.bytes = {'G', 'G', 'U', 'F'};
    out.put<uint32_t>(3);
    out.put<uint64_t>(0);  // tensors
    out.put<uint64_t>(count);
    out.bytes.insert(out.bytes.end(), bytes.begin(), bytes.end());
    while (out.bytes.size() % 32 != 0) out.bytes.push_back(0);
    return out.bytes;
  }
};

struct GgufSpec {
  std::string model = "gpt2";
  std::string pre = "smollm";
  bool tokens = true, types = true, merges = true, types_as_strings = false;
};

std::vector<uint8_t> tokenizer_gguf(const GgufSpec& spec) {
  const Vocab v = make_vocab(kEnglishMerges);
  GgufBytes g;
  g.string_value("tokenizer.ggml.model", spec.model);
  g.string_value("tokenizer.ggml.pre", spec.pre);
  if (spec.tokens) g.strings("tokenizer.ggml.tokens", v.tokens);
  if (spec.types && spec.types_as_strings) g.strings("tokenizer.ggml.token_type", v.tokens);
  if (spec.types && !spec.types_as_strings) g.i32s("tokenizer.ggml.token_type", v.types);
  if (spec.merges) g.strings("tokenizer.ggml.merges", v.merges);
  g.u32_value("tokenizer.ggml.bos_token_id", 1);
  g.u32_value("tokenizer.ggml.eos_token_id", 2);
  g.string_value("tokenizer.chat_template", kSmolTemplate);
  return g.file();
}

Status from_gguf_status(const GgufSpec& spec) {
  const std::vector<uint8_t> bytes = tokenizer_gguf(spec);
  const GgufFile file = GgufFile::parse(bytes.data(), bytes.size());
  return status_of([&] { (void)Tokenizer::from_gguf(file); });
}

TEST(TokenizerErrors, from_gguf_reads_metadata_and_rejects_what_it_cannot_use) {
  const std::vector<uint8_t> bytes = tokenizer_gguf({});
  const GgufFile file = GgufFile::parse(bytes.data(), bytes.size());
  const Tokenizer tok = Tokenizer::from_gguf(file);
  EXPECT_EQ(tok.vocab_size(), make_vocab(kEnglishMerges).tokens.size());
  EXPECT_EQ(tok.bos(), 1);
  EXPECT_EQ(tok.eos(), 2);
  EXPECT_EQ(pieces(tok, tok.encode("<|im_start|>the cat", true)),
            (Strings{"<|im_start|>", "th", "e", " cat"}));
  const ChatMessage messages[] = {{"system", "S"}};
  EXPECT_EQ(tok.apply_chat_template(messages, false), "<|im_start|>system\nS<|im_end|>\n");

  EXPECT_EQ(from_gguf_status({.model = "llama"}), Status::unsupported);
  EXPECT_EQ(from_gguf_status({.pre = "llama-bpe"}), Status::unsupported);
  EXPECT_EQ(from_gguf_status({.tokens = false}), Status::invalid_file);
  EXPECT_EQ(from_gguf_status({.types = false}), Status::invalid_file);
  EXPECT_EQ(from_gguf_status({.merges = false}), Status::invalid_file);
  EXPECT_EQ(from_gguf_status({.types_as_strings = true}), Status::invalid_file);
}

// ---- The real SmolLM2 file ----------------------------------------------------------------------

// KVSIFT_MODEL, else KVSIFT_MODEL_DIR or ~/.cache/kvsift/models; empty when the file is absent.
std::string model_path() {
  if (const char* env = std::getenv("KVSIFT_MODEL")) return env;
  std::filesystem::path dir;
  if (const char* env = std::getenv("KVSIFT_MODEL_DIR")) {
    dir = env;
  } else if (const char* home = std::getenv("HOME")) {
    dir = std::filesystem::path(home) / ".cache/kvsift/models";
  }
  const auto path = dir / "SmolLM2-135M-Instruct.Q4_1.gguf";
  return !dir.empty() && std::filesystem::exists(path) ? path.string() : std::string();
}

const Tokenizer* smollm2() {
  static const std::string path = model_path();
  if (path.empty()) return nullptr;
  static const Tokenizer tok = Tokenizer::from_gguf(GgufFile::open(path));
  return &tok;
}

#define SKIP_WITHOUT_MODEL()                                                                  \
  const Tokenizer* tok_ptr = smollm2();                                                       \
  if (tok_ptr == nullptr)                                                                     \
    GTEST_SKIP() << "SmolLM2 GGUF not found: set KVSIFT_MODEL or run scripts/fetch_model.sh"; \
  const Tokenizer& tok = *tok_ptr

TEST(TokenizerModelFile, metadata_matches_smollm2) {
  SKIP_WITHOUT_MODEL();
  EXPECT_EQ(tok.vocab_size(), 49152u);
  EXPECT_EQ(tok.bos(), 1);
  EXPECT_EQ(tok.eos(), 2);
  EXPECT_EQ(tok.token_text(0), "<|endoftext|>");
  EXPECT_EQ(tok.token_text(1), "<|im_start|>");
  EXPECT_EQ(tok.token_text(2), "<|im_end|>");
  EXPECT_EQ(tok.token_text(216), "\xc4\xa0");  // "Ġ": a lone space
  // llama.cpp's end-of-generation set for this file: <|endoftext|>, <|im_end|>, and <reponame>
  // (id 4, which llama.cpp takes for a fill-in-the-middle repository marker).
  for (int32_t id = 0; id < 17; ++id)
    EXPECT_EQ(tok.is_end_of_generation(id), id == 0 || id == 2 || id == 4) << id;
}

// Expected ids from an independent reference, HF `tokenizers` 0.23.3 (PyPI), built from this
// file's vocabulary and merges (read with PyPI `gguf`) the way SmolLM2's tokenizer.json sets it up:
//   python3 -m venv v && v/bin/pip install gguf numpy tokenizers
//   r = gguf.GGUFReader(path); toks, types, merges = (r.fields["tokenizer.ggml." + k].contents()
//       for k in ("tokens", "token_type", "merges"))
//   tok = Tokenizer(models.BPE({t: i for i, t in enumerate(toks)},
//                              [(m[:m.find(" ", 1)], m[m.find(" ", 1) + 1:]) for m in merges]))
//   tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
//       pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
//   tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
//                           for t, ty in zip(toks, types) if ty == 3])
//   tok.encode_special_tokens = not parse_special; tok.encode(text, add_special_tokens=False).ids
// The same reference agreed with this tokenizer on about 9,500 more random, Unicode-heavy and
// prose strings (up to 35 KB), with and without special-token parsing.
struct Expected {
  const char* text;
  bool parse_special;
  Ids ids;
};

const Expected kHfExpected[] = {
    {"Hello world", true, {19556, 905}},
    {"The capital of France is", true, {504, 3575, 282, 4649, 314}},
    {"Hello, we can use", true, {19556, 28, 392, 416, 722}},
    {"You are a helpful AI assistant named SmolLM, trained by Hugging Face",
     true,
     {2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182}},
    {"don't you're we've I'm he'll she'd it's",
     true,
     {12420, 982, 346, 2316, 392, 3543, 339, 5248, 384, 3060, 1041, 6737, 357, 506}},
    {"DON'T STOP", true, {52, 2154, 23, 68, 5022, 7627}},
    {"Hello world! 123", true, {19556, 905, 17, 216, 33, 34, 35}},
    {"The year 2024 had 366 days.",
     true,
     {504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 30}},
    {"pi = 3.14159", true, {9020, 446, 216, 35, 30, 33, 36, 33, 37, 41}},
    {"  multiple   spaces", true, {216, 2701, 256, 5600}},
    {"trailing spaces   ", true, {4861, 4966, 5600, 333}},
    {"tab\tseparated\tvalues", true, {15999, 197, 19509, 483, 197, 6347}},
    {"line one\nline two\n\nline four", true, {1311, 582, 198, 1311, 827, 198, 198, 1311, 1876}},
    {"\r\n", true, {2738}},
    {"Café déjà vu, naïve façade.",
     true,
     {51, 1939, 2756, 32564, 90, 16739, 386, 101, 28, 15486, 46494, 40852, 30}},
    {"Übergrößenträger", true, {142, 246, 5799, 98, 7466, 34878, 293, 98, 9023, 2008}},
    {"Привет, мир!", true, {155, 249, 46879, 16464, 32547, 28, 41337, 7872, 9175, 17}},
    {"日本語のテキストです。",
     true,
     {23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 7365,
      117, 39958, 19076}},
    {"中文，标点！", true, {28589, 29184, 12831, 46781, 44083, 8083, 219}},
    {"emoji 😀🎉 and 👍🏽",
     true,
     {391, 33777, 40303, 218, 10813, 232, 227, 284, 15107, 235, 231, 10813, 233, 138}},
    {"def square(x):\n    return x ** 2\n",
     true,
     {1604, 5222, 24, 104, 727, 472, 1003, 1792, 1903, 216, 34, 198}},
    {"if (a <= b && c != d) { x += 1; }",
     true,
     {342, 365, 81, 10204, 278, 1456, 22, 265, 6541, 287, 25, 1662, 1792, 4519, 216, 33, 43, 4029}},
    {"<html><body>Hi</body></html>",
     true,
     {44, 5699, 21198, 5226, 46, 26843, 9617, 5226, 29299, 5699, 46}},
    {"https://example.com/path?q=1&r=2",
     true,
     {4687, 1742, 7434, 30, 824, 31, 1537, 47, 97, 45, 33, 22, 98, 45, 34}},
    {"٣٤٥ ²³ ①②",
     true,
     {164, 113, 164, 114, 164, 115, 216, 19133, 39050, 216, 173, 235, 250, 173, 235, 111}},
    {"a\u00a0b\u3000c", true, {81, 15442, 82, 12109, 218, 83}},
    {"<|im_start|>user\nHi<|im_end|>\n", true, {1, 4093, 198, 26843, 2, 198}},
    {"<|im_start|>user\nHi<|im_end|>\n",
     false,
     {44, 108, 306, 79, 3738, 108, 46, 4093, 198, 26843, 44, 108, 306, 79, 486, 108, 46, 198}},
    {"<|endoftext|><file_sep><reponame>", true, {0, 5, 4}},
    {"<|im_", true, {44, 108, 306, 79}},
};

TEST(TokenizerModelFile, encodes_like_hugging_face_tokenizers) {
  SKIP_WITHOUT_MODEL();
  for (const Expected& e : kHfExpected) {
    EXPECT_EQ(tok.encode(e.text, e.parse_special), e.ids)
        << "\"" << e.text << "\" parse_special=" << e.parse_special;
    EXPECT_EQ(tok.decode(e.ids), e.text);
  }
}

TEST(TokenizerModelFile, chat_prompt_renders_and_encodes_like_the_reference) {
  SKIP_WITHOUT_MODEL();
  const ChatMessage messages[] = {{"user", "What is 2+2?"}};
  const std::string prompt = tok.apply_chat_template(messages, true);
  EXPECT_EQ(prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n");
  // Reference ids from the same HF setup as kHfExpected.
  EXPECT_EQ(tok.encode(prompt, true),
            (Ids{1,   9690, 198, 2683, 359,   253,  5356, 5646, 11173, 3365, 3511, 308,  34519,
                 28,  7018, 411, 407,  19712, 8182, 2,    198,  1,     4093, 198,  1780, 314,
                 216, 34,   27,  34,   47,    2,    198,  1,    520,   9531, 198}));
}

TEST(TokenizerModelFile, round_trips_varied_text) {
  SKIP_WITHOUT_MODEL();
  for (const std::string& text : kVariedText)
    EXPECT_EQ(tok.decode(tok.encode(text, false)), text) << text;
  // The file has no token for byte 0x04 (nor 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1,
  // 0xF2, 0xF5..0xFF): such bytes are dropped.
  EXPECT_EQ(tok.decode(tok.encode("a\x04"
                                  "b",
                                  false)),
            "ab");
}

// About 40 KB of English-like prose with numbers and punctuation, deterministic.
std::string prose(std::size_t bytes) {
  const char* words[] = {
      "the",       "of",      "and",        "to",        "in",      "a",       "is",      "that",
      "for",       "it",      "as",         "was",       "with",    "be",      "by",      "on",
      "not",       "he",      "this",       "are",       "or",      "his",     "from",    "at",
      "which",     "but",     "have",       "an",        "had",     "they",    "you",     "were",
      "their",     "one",     "all",        "we",        "can",     "her",     "has",     "there",
      "been",      "if",      "more",       "when",      "will",    "would",   "who",     "so",
      "history",   "people",  "government", "between",   "however", "without", "Britain", "London",
      "attention", "machine", "cache",      "retrieval", "naïve",   "café",    "don't",   "it's",
      "we'll",     "2024",    "3.14",       "100,000"};
  const char* ends[] = {" ", " ", " ", " ", " ", ", ", ". ", "; ", ".\n\n", " (", ") "};
  std::string out;
  uint32_t state = 12345;
  while (out.size() < bytes) {
    state = state * 1664525u + 1013904223u;
    out += words[(state >> 8) % std::size(words)];
    out += ends[(state >> 20) % std::size(ends)];
  }
  return out;
}

TEST(TokenizerModelFile, round_trips_40_kb_of_prose) {
  SKIP_WITHOUT_MODEL();
  const std::string text = prose(40 * 1024);
  const Ids ids = tok.encode(text, false);
  EXPECT_EQ(tok.decode(ids), text);
}

}  // namespace
}  // namespace kvsift::model
