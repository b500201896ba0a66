// Byte-level BPE tokenizer (GPT-2 family) read from GGUF metadata, matching llama.cpp's
// `llama_tokenize` / `llama_token_to_piece` for the pre-tokenizers listed below, and the model's
// ChatML chat template.
//
// Pipeline of encode(): special-token partition (llama.cpp `tokenizer_st_partition`) ->
// pre-tokenizer passes over Unicode code points -> each piece's UTF-8 bytes as byte tokens ->
// merges by rank. Supported pre-tokenizers (`tokenizer.ggml.pre`):
//   "smollm"          every \p{N} code point is its own piece, then the GPT-2 pattern on the rest
//                     (SmolLM/SmolLM2; llama.cpp maps starcoder, refact, command-r, codeshell,
//                     exaone and minerva-7b to the same regexes, but those are not accepted here);
//   "gpt-2", "gpt2"   the GPT-2 pattern alone;
//   "default", ""     llama.cpp's fallback for BPE files without a known name: runs of
//                     [\p{P}$+<=>^~|], then the GPT-2 pattern, then runs of \p{N}, then [0-9]{3}.
// The GPT-2 pattern is 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// with \s = Unicode White_Space and categories from ICU 72 (Unicode 15.0; llama.cpp's generated
// tables may differ for code points assigned later). Anything else (llama3, qwen2, deepseek,
// tekken, ...) throws unsupported, as do SentencePiece/WordPiece/UGM/RWKV vocabularies. Not
// implemented: per-token lstrip/rstrip attributes (llama.cpp sets them only for a few named
// models), `ignore_merges`, add_bos/add_eos (encode never adds BOS or EOS), the decoder's
// clean_spaces.
//
// Thread safety: a Tokenizer is immutable after construction; all const member functions may be
// called concurrently (encode keeps its scratch on the stack, there is no cache).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace kvsift::model {

class GgufFile;

// One turn of a conversation for apply_chat_template. `role` is used verbatim ("system", "user",
// "assistant", ...); `content` is UTF-8 and is not escaped.
struct ChatMessage {
  std::string role;
  std::string content;
};

// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
enum class TokenType : int32_t {
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6,
};

class Tokenizer {
 public:
  // Reads tokenizer.ggml.{model, pre, tokens, token_type, merges, bos_token_id, eos_token_id} and
  // tokenizer.chat_template from `file` (copied; the Tokenizer does not reference the file).
  // Absent pre means "default" (as llama.cpp); absent bos/eos ids mean none (-1); an absent chat
  // template makes apply_chat_template throw.
  // Throws Error: unsupported (tokenizer.ggml.model is not "gpt2", or a pre-tokenizer name not
  // listed at the top of this file), invalid_file (tokens, token_type or merges missing or of the
  // wrong element type, and everything the constructor rejects).
  static Tokenizer from_gguf(const GgufFile& file);

  // tokens[i] is the vocabulary string of id i (byte-level encoded for normal tokens, plain UTF-8
  // for control and user-defined ones); token_types[i] its TokenType value; merges in rank order,
  // each "left right" split at its first space after the first byte (as llama.cpp does); pre one
  // of the names above; bos/eos an id or -1 for none; chat_template the Jinja source ("" for none).
  // Throws Error: invalid_file (token_types.size() != tokens.size(), an empty vocabulary or one
  // above INT32_MAX ids, a token type outside 1..6, a printable ASCII byte with no token for its
  // byte-level character, a merge without a space or whose left, right or concatenation is not a
  // token, bos/eos outside [-1, vocab_size)), unsupported (pre-tokenizer name).
  // Other bytes may lack a token (SmolLM2 has none for 21 bytes, e.g. 0x04 and 0xF5..0xFF): encode
  // drops them, as llama.cpp and HF do. Duplicate token strings resolve to the last id and
  // duplicate merges to their first rank, as in llama.cpp.
  Tokenizer(std::vector<std::string> tokens, std::vector<int32_t> token_types,
            const std::vector<std::string>& merges, std::string pre, int32_t bos, int32_t eos,
            std::string chat_template);

  // Token ids of `utf8`, without BOS/EOS. With parse_special, occurrences of control and unknown
  // token texts (e.g. "<|im_start|>") become those tokens; user-defined token texts are always
  // matched (llama.cpp and HF tokenizers do the same). Matching follows llama.cpp: special tokens
  // are tried longest text first, each splitting every remaining text fragment at its leftmost
  // occurrences. Ill-formed UTF-8 bytes are replaced by U+FFFD one byte at a time (as llama.cpp;
  // ICU also rejects overlong and surrogate forms, which llama.cpp decodes), so only valid UTF-8
  // without bytes missing from the vocabulary round-trips through decode.
  // Throws Error(invalid_argument) for text of 2 GiB or more (and std::bad_alloc).
  std::vector<int32_t> encode(std::string_view utf8, bool parse_special) const;

  // The pre-tokenizer's pieces of `utf8` as UTF-8 bytes, without special-token handling: the
  // units that BPE merges within. For tests and for diagnosing disagreements with other
  // tokenizers. Throws as encode.
  std::vector<std::string> pre_tokenize(std::string_view utf8) const;

  // Concatenated bytes of `ids`: normal and byte tokens are mapped back through GPT-2's
  // bytes_to_unicode table (a token with a character outside it is copied raw, as HF does);
  // control, unknown and user-defined tokens render as their text; unused tokens render as nothing
  // (as llama.cpp). Throws Error(invalid_argument) naming the first id outside [0, vocab_size).
  std::string decode(std::span<const int32_t> ids) const;

  // The vocabulary string of `id` (byte-level encoded for normal tokens: " the" is "Ġthe").
  // Throws Error(invalid_argument) when id is outside [0, vocab_size).
  std::string token_text(int32_t id) const;

  std::size_t vocab_size() const noexcept { return tokens_.size(); }
  int32_t bos() const noexcept { return bos_; }  // -1 when the model has none
  int32_t eos() const noexcept { return eos_; }  // -1 when the model has none

  // True for the tokens llama.cpp stops generation at (`llama_vocab_is_eog`): eos, and tokens
  // whose text is an end-of-turn marker (<|im_end|>, <|endoftext|>, <|eot_id|>, <|end|>,
  // <end_of_turn>, <|eom_id|>, <EOT>, <|end_of_text|>, ...) or a fill-in-the-middle pad/repo/
  // file-separator marker (<|fim_pad|>, <reponame>, <|file_sep|>, ...). False for ids out of range.
  bool is_end_of_generation(int32_t id) const noexcept;

  // Renders `messages` with the file's chat template. Recognised: ChatML (the template contains
  // "<|im_start|>"), rendered as HF transformers renders it:
  //   "<|im_start|>" role "\n" content "<|im_end|>\n"  per message,
  // preceded by the template's default system turn when it has one (a literal
  // '<|im_start|>system\n...<|im_end|>\n' string in the template, e.g. SmolLM2's "You are a
  // helpful AI assistant named SmolLM, trained by Hugging Face") and the first message's role is
  // not "system"; add_assistant appends "<|im_start|>assistant\n". No BOS is added: encode the
  // result with parse_special = true.
  // Roles must be "system", "user" or "assistant", and no role or content may contain the text of
  // a special token (control, unknown or user-defined, such as "<|im_end|>"): encoded with
  // parse_special, such text would end the turn or open another role, so a user's text could
  // speak for the system (prompt injection). Refused rather than rewritten: altering the user's
  // text silently would be worse than telling the application.
  // Throws Error(unsupported): no chat template in the file, or a template that is not ChatML
  // (the message quotes its first 60 characters); Error(invalid_argument): a role or content as
  // above, naming the message and the token.
  std::string apply_chat_template(std::span<const ChatMessage> messages, bool add_assistant) const;

 private:
  enum class PreTokenizer : uint8_t { gpt2, smollm, llama_default };
  struct Merge {
    int32_t rank;
    int32_t result;
  };

  struct Scratch;  // per-call buffers of encode (tokenizer.cpp)

  void split(std::string_view utf8, Scratch& scratch) const;
  void encode_text(std::string_view utf8, Scratch& scratch, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view bytes, Scratch& scratch, std::vector<int32_t>& out) const;

  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  std::vector<std::string> decoded_;            // decode() bytes of each id
  std::vector<uint8_t> end_of_generation_;      // 1 where is_end_of_generation
  std::vector<int32_t> special_tokens_;         // control/unknown/user-defined, longest text first
  std::unordered_map<uint64_t, Merge> merges_;  // key: left id << 32 | right id
  std::array<int32_t, 256> byte_tokens_{};      // token of each byte; negative: none
  PreTokenizer pre_ = PreTokenizer::gpt2;
  int32_t bos_ = -1;
  int32_t eos_ = -1;
  std::string chat_template_;
  bool chatml_ = false;
  std::string default_system_;  // text of the template's default system turn
  bool has_default_system_ = false;
};

}  // namespace kvsift::model
