#include "sample.hpp"

#include <algorithm>
#include <cctype>

namespace kvsift::eval {

std::string render_prompt(const model::Tokenizer& tokenizer, const Sample& sample) {
  const model::ChatMessage user{
      "user", sample.question.empty() ? sample.context : sample.context + "\n" + sample.question};
  return tokenizer.apply_chat_template({&user, 1}, true) + sample.answer_prefix;
}

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view strip(std::string_view s) {
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

}  // namespace

double score_output(const Sample& sample, std::string_view output) {
  if (sample.answers.empty()) return 0.0;
  std::string text = lower(strip(output));
  for (char& c : text)
    if (static_cast<unsigned char>(c) < 0x20) c = '\n';
  text = std::string(strip(text));
  const auto found = static_cast<double>(std::count_if(
      sample.answers.begin(), sample.answers.end(),
      [&](const std::string& answer) { return text.find(lower(answer)) != std::string::npos; }));
  if (sample.match_all) return found / static_cast<double>(sample.answers.size());
  return found > 0 ? 1.0 : 0.0;
}

}  // namespace kvsift::eval
