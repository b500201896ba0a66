// The Devil's Dictionary (Ambrose Bierce, 1911, public domain): the long public-domain English
// text the demo, the evaluation and the decode benchmark read. The text is
// apps/common/devils_dictionary.txt (its first lines say where it came from), compiled into each
// binary by apps/common/embed_text.cmake, so that a binary copied elsewhere (scripts/gpu_check.sh)
// needs no file beside it.
#pragma once

#include <string>

namespace kvsift::apps {

// Where the text comes from, for reports that name their inputs.
inline constexpr const char* kDevilsDictionarySource =
    "apps/common/devils_dictionary.txt (The Devil's Dictionary, Ambrose Bierce, 1911)";

// The book from its PREFACE to the end (about 380 KB of ASCII with the file's line breaks; the
// provenance header and the title page before the preface are dropped). Throws std::runtime_error
// when the embedded text does not hold the book (a damaged or truncated file at build time).
std::string read_devils_dictionary();

}  // namespace kvsift::apps
