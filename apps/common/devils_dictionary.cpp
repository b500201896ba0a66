#include "devils_dictionary.hpp"

#include <cstddef>
#include <stdexcept>
#include <string_view>

namespace kvsift::apps {

// Defined in the source apps/common/embed_text.cmake generates from devils_dictionary.txt.
extern const char kDevilsDictionaryText[];
extern const std::size_t kDevilsDictionaryText_size;

namespace {

// What the file must hold for the slice below to be the book: its provenance header first, the
// preface within the first few KB, and most of the book after it (the full text is 383 KB).
constexpr std::string_view kHeader = "The Devil's Dictionary by Ambrose Bierce";
constexpr std::string_view kPreface = "PREFACE";
constexpr std::size_t kPrefaceWithin = 4096;
constexpr std::size_t kMinimumBookBytes = 350000;
constexpr std::string_view kLastEntry = "ZOOLOGY, n.";

}  // namespace

std::string read_devils_dictionary() {
  const std::string_view text(kDevilsDictionaryText, kDevilsDictionaryText_size);
  const auto damaged = [](const std::string& why) {
    return std::runtime_error("the embedded apps/common/devils_dictionary.txt " + why +
                              "; restore the file from git and rebuild");
  };
  if (text.substr(0, kHeader.size()) != kHeader) throw damaged("lacks its provenance header");
  const std::size_t begin = text.substr(0, kPrefaceWithin).find(kPreface);
  if (begin == std::string_view::npos)
    throw damaged("has no PREFACE in its first " + std::to_string(kPrefaceWithin) + " bytes");
  const std::string_view book = text.substr(begin);
  if (book.size() < kMinimumBookBytes || book.rfind(kLastEntry) == std::string_view::npos)
    throw damaged("is truncated (" + std::to_string(book.size()) + " bytes from the preface)");
  return std::string(book);
}

}  // namespace kvsift::apps
