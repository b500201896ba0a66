// One evaluation sample, generated (tasks.hpp) or read from a task file (task_file.hpp): the
// prompt's parts, the reference answers and how an output is scored against them.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "lib/model/tokenizer.hpp"

namespace kvsift::eval {

struct Sample {
  std::string id;
  std::string task;
  // Nominal context length in tokens: the prompt (chat template included) plus max_new fit in it.
  uint32_t length = 0;
  std::string context;
  std::string question;
  std::string answer_prefix;  // the start of the assistant's turn, continued by the model
  std::vector<std::string> answers;
  // true: the share of answers the output contains (RULER's string_match_all, for tasks that ask
  // for several values); false: 1 when it contains any (string_match_part, task files' default).
  bool match_all = false;
  uint32_t max_new = 32;
  double depth = -1.0;  // where the queried needle sits, 0 (start) .. 1 (end); -1: not recorded
};

// The prompt text: the model's chat template around one user turn, context + "\n" + question
// (the context alone when the question is empty), then the assistant opener and answer_prefix.
// Throws Error(unsupported) when the model has no ChatML template.
std::string render_prompt(const model::Tokenizer& tokenizer, const Sample& sample);

// RULER's post-processing (strip, control characters to newlines, strip) then its string match,
// case-insensitive: a score in [0, 1].
double score_output(const Sample& sample, std::string_view output);

}  // namespace kvsift::eval
