#include "task_file.hpp"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <type_traits>

namespace kvsift::eval {

namespace {

using nlohmann::json;

template <class T>
T field(const json& object, const char* name, const T* fallback, const std::string& where) {
  const auto it = object.find(name);
  if (it == object.end()) {
    if (fallback != nullptr) return *fallback;
    throw std::runtime_error(where + ": missing field \"" + name + "\"");
  }
  if constexpr (std::is_unsigned_v<T>) {
    if (!it->is_number_unsigned())
      throw std::runtime_error(where + ": field \"" + name + "\" is not a non-negative integer");
  }
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    throw std::runtime_error(where + ": field \"" + name + "\" has the wrong type (" +
                             it->type_name() + ")");
  }
}

}  // namespace

std::vector<Sample> read_task_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read the task file " + path);
  const std::string stem = std::filesystem::path(path).stem().string();
  std::vector<Sample> samples;
  std::string line;
  for (std::size_t number = 1; std::getline(in, line); ++number) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(number);
    json object;
    try {
      object = json::parse(line);
    } catch (const json::parse_error& e) {
      throw std::runtime_error(where + ": not JSON (" + e.what() + ")");
    }
    if (!object.is_object()) throw std::runtime_error(where + ": not a JSON object");
    Sample s;
    const std::string empty;
    const uint32_t default_max_new = 32, no_length = 0;
    s.id = field<std::string>(object, "id", nullptr, where);
    s.context = field<std::string>(object, "context", nullptr, where);
    s.question = field<std::string>(object, "question", nullptr, where);
    s.answers = field<std::vector<std::string>>(object, "answers", nullptr, where);
    s.max_new = field<uint32_t>(object, "max_new", &default_max_new, where);
    s.task = field<std::string>(object, "task", &stem, where);
    s.length = field<uint32_t>(object, "length", &no_length, where);
    s.answer_prefix = field<std::string>(object, "answer_prefix", &empty, where);
    const std::string any = "any";
    const std::string match = field<std::string>(object, "match", &any, where);
    if (match != "any" && match != "all")
      throw std::runtime_error(where + ": \"match\" is \"" + match + "\", not \"any\" or \"all\"");
    s.match_all = match == "all";
    if (s.answers.empty()) throw std::runtime_error(where + ": \"answers\" is empty");
    if (s.max_new == 0) throw std::runtime_error(where + ": \"max_new\" is 0");
    samples.push_back(std::move(s));
  }
  if (samples.empty()) throw std::runtime_error(path + " holds no samples");
  return samples;
}

void write_task_file(const std::string& path, const std::vector<Sample>& samples) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  for (const Sample& s : samples) {
    const json object = {{"id", s.id},
                         {"task", s.task},
                         {"length", s.length},
                         {"context", s.context},
                         {"question", s.question},
                         {"answer_prefix", s.answer_prefix},
                         {"answers", s.answers},
                         {"match", s.match_all ? "all" : "any"},
                         {"max_new", s.max_new}};
    out << object.dump() << "\n";
  }
  if (!out) throw std::runtime_error("cannot write " + path);
}

}  // namespace kvsift::eval
