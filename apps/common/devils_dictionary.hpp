// The Devil's Dictionary (Ambrose Bierce, public domain) as installed by the Debian package
// dict-devil: the long public-domain English text the demo and the evaluation read.
#pragma once

#include <string>

namespace kvsift::apps {

// Where dict-devil installs the text: a dictzip file, which zlib reads as gzip.
inline constexpr const char* kDevilsDictionaryPath = "/usr/share/dictd/devil.dict.dz";

// The book from its PREFACE to the end (about 380 KB of UTF-8 with the file's line breaks; the
// dictd header before the preface is dropped). Throws std::runtime_error naming the file and the
// package when the file is missing or does not hold the book.
std::string read_devils_dictionary();

}  // namespace kvsift::apps
