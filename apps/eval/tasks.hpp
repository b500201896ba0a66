// RULER-style synthetic tasks (NVIDIA RULER, arXiv 2404.06654; docs/eval.md, The generated
// tasks), generated from a seed with no network and filled to a target length with the evaluated
// model's own tokenizer.
//
//   niah_single_noise   one key-value needle in repeated noise lines (RULER niah_single_1)
//   niah_single_prose   one needle in prose (niah_single_2; prose: The Devil's Dictionary)
//   niah_multikey       four needles with different keys in prose, one asked (niah_multikey_1)
//   niah_multivalue     four values for one key in prose, all asked (niah_multivalue)
//   niah_multiquery     four keys in prose, all four asked (niah_multiquery)
//   passkey             a 5-digit pass key in noise lines (the Landmark-attention test)
//   vt                  variable tracking: one chain of 4 hops in noise lines, one worked example
//
// Keys are "adjective-noun" pairs from word lists in tasks.cpp, values 7-digit numbers. The
// queried needle of sample i of n sits at depth (i + 0.5) / n of the haystack, so n samples spread
// it evenly over the context; other needles at depths drawn from RULER's grid of 40 points, and the
// variable-tracking chain at sorted random depths. A haystack holds as many units (noise
// lines or prose sentences) as fit: the largest count whose prompt plus max_new tokens is at most
// the length, found by bisection on the real token count.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "lib/model/tokenizer.hpp"
#include "sample.hpp"

namespace kvsift::eval {

class TaskGenerator {
 public:
  // prose: the haystack text (whitespace is collapsed and it is split into sentences here).
  // Throws std::invalid_argument when prose holds fewer than 100 sentences.
  TaskGenerator(const model::Tokenizer& tokenizer, std::string_view prose);

  static const std::vector<std::string>& task_names();

  // Sample `index` of `n_samples` of `task` at `length` tokens. Throws std::invalid_argument for
  // an unknown task and when even an empty haystack does not fit in `length`.
  Sample generate(std::string_view task, uint32_t length, uint32_t index, uint32_t n_samples,
                  uint64_t seed) const;

  std::size_t prose_sentences() const noexcept { return sentences_.size(); }

 private:
  const model::Tokenizer& tokenizer_;
  std::vector<std::string> sentences_;
};

// Splits text into sentences: after '.', '!' or '?' (and any closing quotes or brackets) when a
// space and then an upper-case letter, a digit or a quote follow, except after a one-letter word
// (initials, the dictionary's "n." and "v.") and a few abbreviations (Mr., Dr., adj., ...). Stands
// in for the NLTK punkt splitter RULER uses. Whitespace runs are collapsed to one space first.
std::vector<std::string> split_sentences(std::string_view text);

}  // namespace kvsift::eval
