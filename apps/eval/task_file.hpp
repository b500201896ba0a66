// Task files: JSON Lines, one sample per line.
//
//   {"id": "...", "context": "...", "question": "...", "answers": ["..."], "max_new": 32}
//
// required: id, context, question (may be empty), answers (at least one string); optional:
// max_new (default 32), task (default: the file name without its extension), length (the
// nominal context length; default: the smallest 1024 * 2^k holding the prompt and max_new),
// answer_prefix (default empty), match ("any", the default: the output scores 1 when it contains
// any answer; "all": the share of answers it contains). Other fields are ignored; blank lines are
// skipped. The prompt is built as sample.hpp's render_prompt says.
#pragma once

#include <string>
#include <vector>

#include "sample.hpp"

namespace kvsift::eval {

// Throws std::runtime_error "FILE:LINE: what is wrong" for unreadable files, malformed JSON and
// missing or mistyped fields. Samples without a length have length 0.
std::vector<Sample> read_task_file(const std::string& path);

// Writes samples in the same format, every optional field included, so that reading the file
// back gives the same prompts. Throws std::runtime_error when the file cannot be written.
void write_task_file(const std::string& path, const std::vector<Sample>& samples);

}  // namespace kvsift::eval
