#include "tasks.hpp"

#include <algorithm>
#include <cctype>
#include <stdexcept>

#include "rng.hpp"

namespace kvsift::eval {

namespace {

// Common English words for "adjective-noun" needle keys, as RULER draws them from the wonderwords
// lists (64 x 64 = 4096 keys; a sample needs at most four).
constexpr const char* kAdjectives[] = {
    "ancient", "bitter", "brave",   "bright", "broken",  "calm",   "careful", "cheap",
    "clever",  "cold",   "curious", "dark",   "deep",    "dusty",  "eager",   "early",
    "empty",   "fancy",  "fierce",  "frozen", "gentle",  "giant",  "golden",  "green",
    "happy",   "heavy",  "hidden",  "hollow", "honest",  "humble", "icy",     "lazy",
    "little",  "lonely", "loud",    "lucky",  "modern",  "narrow", "noisy",   "odd",
    "old",     "pale",   "polite",  "proud",  "purple",  "quick",  "quiet",   "rapid",
    "rare",    "red",    "rough",   "round",  "rusty",   "salty",  "shiny",   "silent",
    "silver",  "sleepy", "smooth",  "soft",   "strange", "sweet",  "tall",    "wild"};
constexpr const char* kNouns[] = {
    "anchor",  "apple",   "arrow",  "badge",  "basket", "beacon",  "bell",    "blanket",
    "bridge",  "bucket",  "cabin",  "candle", "canyon", "castle",  "cloud",   "compass",
    "cottage", "crystal", "desert", "drum",   "engine", "falcon",  "feather", "forest",
    "garden",  "glacier", "hammer", "harbor", "helmet", "island",  "jacket",  "kettle",
    "ladder",  "lantern", "meadow", "mirror", "needle", "orchard", "oyster",  "paddle",
    "parrot",  "pebble",  "pillow", "planet", "pocket", "rabbit",  "ribbon",  "river",
    "saddle",  "shadow",  "shovel", "signal", "spider", "statue",  "teapot",  "thunder",
    "tiger",   "tunnel",  "violin", "wagon",  "walnut", "window",  "wizard",  "zipper"};

// The noise line of RULER's noise haystack and of the passkey test, repeated.
constexpr std::string_view kNoise =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";

constexpr uint32_t kNeedles = 4;       // keys or values of the multi-needle tasks (RULER's 4)
constexpr uint32_t kHops = 4;          // variable tracking: assignments after the first
constexpr uint32_t kDepthGrid = 40;    // RULER's depth grid: 40 points over 0..100%
constexpr uint32_t kExampleLines = 4;  // noise lines in the variable-tracking worked example

struct Needle {
  std::string text;
  double depth;  // 0..1
};

// What a sample is before its haystack is sized: the prompt without the haystack.
struct Draft {
  Sample sample;
  std::string context_head;  // text before the haystack
  bool prose = false;
  std::size_t prose_start = 0;  // first sentence of the prose haystack
  std::vector<Needle> needles;
};

// Units (lines or sentences) with the needles inserted at floor(depth * units), joined by sep.
template <class Unit>
std::string haystack(std::size_t units, const std::vector<Needle>& needles, Unit unit,
                     std::string_view sep) {
  std::vector<std::pair<std::size_t, const Needle*>> at;
  for (const Needle& n : needles)
    at.emplace_back(std::min(units, static_cast<std::size_t>(n.depth * units)), &n);
  std::stable_sort(at.begin(), at.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string out;
  std::size_t next = 0;
  const auto append = [&](std::string_view piece) {
    if (!out.empty()) out += sep;
    out += piece;
  };
  for (std::size_t i = 0; i <= units; ++i) {
    for (; next < at.size() && at[next].first == i; ++next) append(at[next].second->text);
    if (i < units) append(unit(i));
  }
  return out;
}

std::string seven_digits(Rng& rng) {
  return std::to_string(rng.between(1000000, 9999999));
}

std::vector<std::string> distinct_keys(Rng& rng, uint32_t n) {
  constexpr std::size_t na = std::size(kAdjectives), nn = std::size(kNouns);
  std::vector<std::string> keys;
  while (keys.size() < n) {
    const uint64_t k = rng.below(na * nn);
    std::string key = std::string(kAdjectives[k / nn]) + "-" + kNouns[k % nn];
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) keys.push_back(std::move(key));
  }
  return keys;
}

std::vector<std::string> distinct_names(Rng& rng, uint32_t n, uint32_t letters) {
  std::vector<std::string> names;
  while (names.size() < n) {
    std::string name;
    for (uint32_t i = 0; i < letters; ++i) name += static_cast<char>('A' + rng.below(26));
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

double grid_depth(Rng& rng) {
  return static_cast<double>(rng.below(kDepthGrid)) / (kDepthGrid - 1);
}

// "a", "a and b", "a, b, and c": RULER's query list.
std::string join_query(const std::vector<std::string>& keys) {
  std::string out;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (i > 0) out += keys.size() == 2 ? " and " : i + 1 == keys.size() ? ", and " : ", ";
    out += keys[i];
  }
  return out;
}

std::string needle_sentence(const std::string& key, const std::string& value) {
  return "One of the special magic numbers for " + key + " is: " + value + ".";
}

// RULER's NIAH prompt; with one expected answer the text is put in the singular, as RULER does.
void niah_prompt(Draft& d, const std::string& query, bool several) {
  if (several) {
    d.context_head =
        "Some special magic numbers are hidden within the following text. Make sure to memorize "
        "it. I will quiz you about the numbers afterwards.\n";
    d.sample.question =
        "What are all the special magic numbers for " + query + " mentioned in the provided text?";
    d.sample.answer_prefix =
        "The special magic numbers for " + query + " mentioned in the provided text are";
  } else {
    d.context_head =
        "A special magic number is hidden within the following text. Make sure to memorize it. I "
        "will quiz you about the number afterwards.\n";
    d.sample.question =
        "What is the special magic number for " + query + " mentioned in the provided text?";
    d.sample.answer_prefix =
        "The special magic number for " + query + " mentioned in the provided text is";
  }
}

// niah_*: n_keys keys with n_values values each; the first n_queries keys are asked.
void niah(Draft& d, Rng& rng, double depth, uint32_t n_keys, uint32_t n_values,
          uint32_t n_queries) {
  const std::vector<std::string> keys = distinct_keys(rng, n_keys);
  for (uint32_t k = 0; k < n_keys; ++k)
    for (uint32_t v = 0; v < n_values; ++v) {
      const std::string value = seven_digits(rng);
      d.needles.push_back({needle_sentence(keys[k], value), grid_depth(rng)});
      if (k < n_queries) d.sample.answers.push_back(value);
    }
  d.needles.front().depth = depth;  // the asked needle (its first value) is the one spread
  const std::vector<std::string> asked(keys.begin(), keys.begin() + n_queries);
  niah_prompt(d, join_query(asked), d.sample.answers.size() > 1);
  d.sample.match_all = true;
}

void passkey(Draft& d, Rng& rng, double depth) {
  const std::string key = std::to_string(rng.between(10000, 99999));
  d.context_head =
      "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
      "it. I will quiz you about the important information there.\n";
  d.needles.push_back(
      {"The pass key is " + key + ". Remember it. " + key + " is the pass key.", depth});
  d.sample.question = "What is the pass key?";
  d.sample.answer_prefix = "The pass key is";
  d.sample.answers = {key};
}

constexpr std::string_view kVtIntro =
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n";

// A chain "VAR A = value", "VAR B = VAR A", ... as needles in chain order at sorted random depths.
std::vector<Needle> vt_chain(Rng& rng, const std::vector<std::string>& names,
                             const std::string& value) {
  std::vector<double> depths;
  for (std::size_t i = 0; i < names.size(); ++i) depths.push_back(rng.unit());
  std::sort(depths.begin(), depths.end());
  std::vector<Needle> chain{{"VAR " + names[0] + " = " + value, depths[0]}};
  for (std::size_t i = 1; i < names.size(); ++i)
    chain.push_back({"VAR " + names[i] + " = VAR " + names[i - 1], depths[i]});
  return chain;
}

std::string vt_question(const std::string& value) {
  return "Question: Find all variables that are assigned the value " + value +
         " in the text above.";
}

std::string vt_prefix(std::size_t n_names, const std::string& value) {
  return "Answer: According to the chain(s) of variable assignment in the text above, " +
         std::to_string(n_names) + " variables are assigned the value " + value + ", they are:";
}

// Variable tracking: the chain's statements at sorted random depths in noise lines, after one
// worked example (3-letter names, a short noise haystack) with its answer, as RULER's one-shot.
void vt(Draft& d, Rng& rng) {
  const std::vector<std::string> example_names = distinct_names(rng, kHops + 1, 3);
  const std::string example_value = std::to_string(rng.between(10000, 99999));
  std::string example_answer;
  for (const std::string& n : example_names) example_answer += " " + n;
  d.context_head = std::string(kVtIntro) +
                   haystack(
                       kExampleLines, vt_chain(rng, example_names, example_value),
                       [](std::size_t) { return kNoise; }, "\n") +
                   "\n" + vt_question(example_value) + " " +
                   vt_prefix(example_names.size(), example_value) + example_answer + "\n\n" +
                   std::string(kVtIntro);

  const std::vector<std::string> names = distinct_names(rng, kHops + 1, 5);
  const std::string value = std::to_string(rng.between(10000, 99999));
  d.needles = vt_chain(rng, names, value);
  d.sample.depth = d.needles.front().depth;
  d.sample.question = vt_question(value);
  d.sample.answer_prefix = vt_prefix(names.size(), value);
  d.sample.answers = names;
  d.sample.match_all = true;
}

bool one_letter_word_or_abbreviation(std::string_view text, std::size_t dot) {
  std::size_t b = dot;
  while (b > 0 && std::isalpha(static_cast<unsigned char>(text[b - 1]))) --b;
  const std::string_view word = text.substr(b, dot - b);
  static constexpr std::string_view kAbbreviations[] = {
      "Mr",  "Mrs",  "Dr",   "St",     "Jr",   "Sr", "Messrs", "Mt", "adj",
      "adv", "prep", "conj", "interj", "pron", "pp", "vs",     "viz"};
  return word.size() == 1 || std::find(std::begin(kAbbreviations), std::end(kAbbreviations),
                                       word) != std::end(kAbbreviations);
}

}  // namespace

std::vector<std::string> split_sentences(std::string_view text) {
  std::string flat;
  flat.reserve(text.size());
  for (const char c : text) {
    if (c == '_') continue;  // the book's italics markers
    if (std::isspace(static_cast<unsigned char>(c))) {
      if (!flat.empty() && flat.back() != ' ') flat += ' ';
    } else {
      flat += c;
    }
  }
  std::vector<std::string> out;
  std::size_t begin = 0;
  for (std::size_t i = 0; i < flat.size(); ++i) {
    const char c = flat[i];
    if (c != '.' && c != '!' && c != '?') continue;
    std::size_t j = i + 1;
    while (j < flat.size() &&
           (flat[j] == '"' || flat[j] == '\'' || flat[j] == ')' || flat[j] == ']'))
      ++j;
    if (j + 1 >= flat.size() || flat[j] != ' ') continue;
    const auto next = static_cast<unsigned char>(flat[j + 1]);
    if (!(std::isupper(next) || std::isdigit(next) || next == '"' || next == '\'')) continue;
    if (c == '.' && one_letter_word_or_abbreviation(flat, i)) continue;
    out.push_back(flat.substr(begin, j - begin));
    begin = j + 1;
    i = j;
  }
  if (begin < flat.size()) out.push_back(flat.substr(begin));
  return out;
}

TaskGenerator::TaskGenerator(const model::Tokenizer& tokenizer, std::string_view prose)
    : tokenizer_(tokenizer), sentences_(split_sentences(prose)) {
  if (sentences_.size() < 100)
    throw std::invalid_argument("the prose haystack text has only " +
                                std::to_string(sentences_.size()) + " sentences");
}

const std::vector<std::string>& TaskGenerator::task_names() {
  static const std::vector<std::string> names{"niah_single_noise",
                                              "niah_single_prose",
                                              "niah_multikey",
                                              "niah_multivalue",
                                              "niah_multiquery",
                                              "passkey",
                                              "vt"};
  return names;
}

Sample TaskGenerator::generate(std::string_view task, uint32_t length, uint32_t index,
                               uint32_t n_samples, uint64_t seed) const {
  Rng rng(sample_seed(seed, task, length, index));
  const double depth = (index + 0.5) / n_samples;  // midpoints: no sample at the very edge
  Draft d;
  d.sample.task = std::string(task);
  d.sample.length = length;
  d.sample.id = d.sample.task + "-" + std::to_string(length) + "-" + std::to_string(index);
  d.sample.depth = depth;
  d.prose_start = rng.below(sentences_.size());
  if (task == "niah_single_noise") {
    niah(d, rng, depth, 1, 1, 1);
  } else if (task == "niah_single_prose") {
    d.prose = true;
    niah(d, rng, depth, 1, 1, 1);
  } else if (task == "niah_multikey") {
    d.prose = true;
    niah(d, rng, depth, kNeedles, 1, 1);
  } else if (task == "niah_multivalue") {
    d.prose = true;
    niah(d, rng, depth, 1, kNeedles, 1);
  } else if (task == "niah_multiquery") {
    d.prose = true;
    niah(d, rng, depth, kNeedles, 1, kNeedles);
  } else if (task == "passkey") {
    passkey(d, rng, depth);
  } else if (task == "vt") {
    vt(d, rng);
  } else {
    throw std::invalid_argument("unknown task '" + std::string(task) + "'");
  }
  // Room for the answer: RULER's NIAH allows 128 new tokens and VT 30. SmolLM2 writes a digit per
  // token: one number with its lead-in fits in 16, four as a list ("- 1234567" lines) in 48, five
  // variable names in 32. Fewer steps keep the suites' time down.
  d.sample.max_new = d.sample.answers.size() > 1 ? (task == "vt" ? 32 : 48) : 16;

  const auto build = [&](std::size_t units) {
    Sample s = d.sample;
    const std::string hay = d.prose
                                ? haystack(
                                      units, d.needles,
                                      [&](std::size_t i) -> std::string_view {
                                        return sentences_[(d.prose_start + i) % sentences_.size()];
                                      },
                                      " ")
                                : haystack(
                                      units, d.needles, [](std::size_t) { return kNoise; }, "\n");
    s.context = d.context_head + hay;
    return s;
  };
  const auto fits = [&](std::size_t units) {
    const std::size_t tokens =
        tokenizer_.encode(render_prompt(tokenizer_, build(units)), true).size();
    return tokens + d.sample.max_new <= length;
  };
  if (!fits(0))
    throw std::invalid_argument("task " + d.sample.task + " does not fit in " +
                                std::to_string(length) + " tokens even without a haystack");
  std::size_t lo = 0, hi = 32;  // fits(lo); grow hi until it does not fit, then bisect
  while (fits(hi)) lo = hi, hi *= 2;
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return build(lo);
}

}  // namespace kvsift::eval
