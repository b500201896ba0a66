// kvsift-eval: RULER-style long-context tasks (or a task file) run through SmolLM2 with every
// selector at every budget, each sample prefilled once, and measured against dense decoding and
// exact attention. Writes a JSON record per configuration, Markdown tables, gnuplot PNGs and,
// with --results, docs/RESULTS.md. See README.md, "Evaluation".
#include <omp.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/command_line.hpp"
#include "common/devils_dictionary.hpp"
#include "common/exit_codes.hpp"
#include "common/kv_dtype_names.hpp"
#include "common/model_path.hpp"
#include "common/selector_names.hpp"
#include "common/sha256.hpp"
#include "kvsift/kvsift.h"
#include "lib/model/gguf_file.hpp"
#include "lib/model/llama_model.hpp"
#include "report.hpp"
#include "runner.hpp"
#include "simd/isa.hpp"
#include "source_version.hpp"
#include "task_file.hpp"
#include "tasks.hpp"

namespace kvsift::eval {
namespace {

using Clock = std::chrono::steady_clock;

// Suites: what --suite sets unless a flag says otherwise. `default` is `make eval` and stays
// within 15 minutes on the 2-core development machine; `full` is `make eval-full`.
struct Suite {
  std::vector<std::string> tasks;
  std::vector<std::string> lengths;
  uint32_t samples;
  std::vector<std::string> selectors;
  std::vector<double> budgets;
};

const std::vector<std::string> kSuiteNames = {"smoke", "default", "full"};

Suite suite_named(const std::string& name) {
  const std::vector<std::string>& all = TaskGenerator::task_names();
  if (name == "smoke") return {{"niah_single_noise"}, {"1K"}, 3, {"dense", "oracle"}, {0.1}};
  if (name == "default")
    return {all, {"1K", "2K", "4K"}, 2, {"dense", "oracle", "quest", "locks"}, {0.05, 0.2}};
  if (name == "full")
    return {all,
            {"1K", "2K", "4K", "8K"},
            10,
            {"dense", "oracle", "quest", "locks", "locks_certified"},
            {0.01, 0.02, 0.05, 0.1, 0.2}};
  throw std::invalid_argument("--suite " + name + ": not smoke, default or full");
}

struct Options {
  std::string model = apps::default_model_path();
  std::string suite = "default";
  std::string task_file;
  std::vector<std::string> tasks, lengths, selectors;
  std::vector<double> budgets;
  uint32_t samples = 0;
  uint64_t seed = 42;
  std::string json, plots, results, dump_tasks, source;
  double min_dense = 0.5;
  int threads = 0;
  uint32_t page_tokens = 16;
  std::string kv_dtype = "f16";
  uint32_t sink_pages = 1, window_pages = 1;
  double epsilon = 1e-3;
  std::vector<double> compressions = {2.5, 5.0};
  std::string s4r_bases = "layer";
  std::string combine = "nrm";
  std::string locks_query = "int8";
  bool verbose = false;
};

uint32_t parse_length(const std::string& s) {
  std::size_t used = 0;
  unsigned long n = 0;
  try {
    n = std::stoul(s, &used);
  } catch (const std::exception&) {
    throw std::invalid_argument("--lengths: '" + s + "' is not a length like 1K or 4096");
  }
  const std::string suffix = s.substr(used);
  if (suffix == "K" || suffix == "k")
    n *= 1024;
  else if (!suffix.empty())
    throw std::invalid_argument("--lengths: '" + s + "' is not a length");
  if (n == 0 || n > (1u << 20))
    throw std::invalid_argument("--lengths: '" + s + "' is out of range");
  return static_cast<uint32_t>(n);
}

// Through the C API's name table, so a selector added to the library is known here too.
select::Kind parse_selector(const std::string& name) {
  kvsift_selector selector;
  if (kvsift_selector_from_name(name.c_str(), &selector) != KVSIFT_STATUS_OK)
    throw std::invalid_argument(std::string("--selectors: ") + kvsift_last_error());
  return static_cast<select::Kind>(selector);
}

// Dense first (always run: the others are measured against it), then each other selector at
// each budget.
std::vector<Config> make_configs(const Options& o) {
  std::vector<Config> configs{{"dense", 1.0, select::Policy{}}};
  for (const std::string& name : o.selectors) {
    const select::Kind kind = parse_selector(name);
    if (kind == select::Kind::dense) continue;
    // S4R once per compression ratio, labelled with it ("s4r-2.5x"); the others once.
    const std::vector<double> compressions =
        kind == select::Kind::s4r ? o.compressions : std::vector<double>{0.0};
    for (const double compression : compressions)
      for (const double budget : o.budgets) {
        if (!(budget > 0)) throw std::invalid_argument("--budgets: budgets must be positive");
        select::Policy p;
        p.kind = kind;
        p.budget = budget;
        p.sink_pages = o.sink_pages;
        p.window_pages = o.window_pages;
        p.locks.epsilon = o.epsilon;
        for (int c = 0; c < static_cast<int>(select::GqaCombine::count); ++c)
          if (o.combine == select::combine_name(static_cast<select::GqaCombine>(c)))
            p.combine = static_cast<select::GqaCombine>(c);
        p.locks.int8_query = o.locks_query == "int8";
        std::string label = name;
        if (kind == select::Kind::s4r) {
          p.s4r.compression = compression;
          p.s4r.per_head_bases = o.s4r_bases == "head";
          std::ostringstream l;
          l << name << "-" << compression << "x" << (p.s4r.per_head_bases ? "-head" : "");
          label = l.str();
        }
        p.validate();
        configs.push_back({label, budget, p});
      }
  }
  return configs;
}

std::string read_first_line_with(const std::string& path, const std::string& prefix) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
  return {};
}

std::string cpu_model_name() {
  std::string cpu = read_first_line_with("/proc/cpuinfo", "model name");
  cpu = cpu.substr(std::min(cpu.size(), cpu.find_first_not_of(" \t:")));
  return cpu.empty() ? "unknown CPU" : cpu;
}

std::string machine_description() {
  const std::string cpu = cpu_model_name();
  std::string mem = read_first_line_with("/proc/meminfo", "MemTotal:");
  const double gib = std::strtod(mem.c_str(), nullptr) / (1024.0 * 1024.0);
  std::string os = read_first_line_with("/etc/os-release", "PRETTY_NAME=");
  if (os.size() >= 2 && os.front() == '"') os = os.substr(1, os.size() - 2);
  std::ostringstream s;
  s << cpu << ", " << std::thread::hardware_concurrency()
    << " logical CPUs, " << omp_get_max_threads() << " OpenMP threads, ";
  s.precision(1);
  s << std::fixed << gib << " GiB memory, " << (os.empty() ? "unknown OS" : os);
  if (const char* wait = std::getenv("OMP_WAIT_POLICY")) s << ", OMP_WAIT_POLICY=" << wait;
  return s.str();
}

std::string utc_now(const char* format = "%Y-%m-%d %H:%M UTC") {
  const std::time_t t = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, format, std::gmtime(&t));
  return buf;
}

std::string command_line(int argc, char** argv) {
  std::string out;
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool plain = arg.find_first_not_of(
                           "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                           "0123456789-_./=,:+") == std::string::npos;
    out += (i ? " " : "") + (plain ? arg : "'" + arg + "'");
  }
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
}

// The smallest 1024 * 2^k holding `tokens`: a task file sample's length when it gives none.
uint32_t length_bucket(uint64_t tokens) {
  uint32_t length = 1024;
  while (length < tokens) length *= 2;
  return length;
}

// Prompts kept prefilled at once: a (task, length) group of at most this many samples is decided
// whole (dense first, selectors only when dense can do the task); larger groups run in chunks
// with every configuration. At 8K a prompt's fp16 K/V is 188 MB.
constexpr std::size_t kMaxPromptsKept = 16;

void print_sample(std::size_t done, std::size_t total, const Sample& s, uint64_t tokens,
                  const std::vector<Config>& configs, const std::vector<ConfigResult>& results,
                  bool verbose) {
  std::fprintf(stderr, "[%zu/%zu] %s (%llu tokens, depth %.2f): dense %.2f", done, total,
               s.id.c_str(), static_cast<unsigned long long>(tokens), s.depth,
               results.front().score);
  for (std::size_t c = 1; c < configs.size(); ++c)
    if (results[c].ran)
      std::fprintf(stderr, " %s@%g %.2f", configs[c].selector.c_str(), configs[c].budget,
                   results[c].score);
  std::fprintf(stderr, "\n");
  if (verbose)
    for (std::size_t c = 0; c < configs.size(); ++c)
      if (results[c].ran)
        std::fprintf(stderr, "    %s@%g: %s\n", configs[c].selector.c_str(), configs[c].budget,
                     results[c].text.c_str());
}

int run(const Options& o, const std::string& command) {
  const auto start = Clock::now();
  RunInfo info;
  info.command = command;
  info.date_iso = utc_now("%Y-%m-%dT%H:%M:%SZ");
  info.model = o.model;
  info.model_sha256 = apps::sha256_file_hex(o.model);  // the file as the run found it
  // The tokenizer alone first: the samples size the model's context and sequences.
  const model::Tokenizer tokenizer = model::Tokenizer::from_gguf(model::GgufFile::open(o.model));
  const uint64_t positions = model::GgufFile::open(o.model).get_uint("llama.context_length");

  std::vector<Sample> samples;
  std::string suite;
  if (!o.task_file.empty()) {
    samples = read_task_file(o.task_file);
    suite = std::to_string(samples.size()) + " samples from " + o.task_file;
  } else {
    const TaskGenerator generator(tokenizer, apps::read_devils_dictionary());
    std::vector<uint32_t> lengths;
    for (const std::string& l : o.lengths) lengths.push_back(parse_length(l));
    for (const uint32_t length : lengths)
      for (const std::string& task : o.tasks)
        for (uint32_t i = 0; i < o.samples; ++i)
          samples.push_back(generator.generate(task, length, i, o.samples, o.seed));
    suite = std::to_string(o.tasks.size()) + " generated tasks (" + join(o.tasks) + ") x lengths " +
            join(o.lengths) + " x " + std::to_string(o.samples) +
            " samples = " + std::to_string(samples.size()) + " samples, seed " +
            std::to_string(o.seed) + "; prose haystack: " + apps::kDevilsDictionarySource;
  }

  std::vector<std::vector<int32_t>> prompts;
  uint32_t max_new = 0;
  uint64_t n_ctx = 0;
  for (Sample& s : samples) {
    prompts.push_back(tokenizer.encode(render_prompt(tokenizer, s), true));
    const uint64_t needed = prompts.back().size() + s.max_new;
    if (needed > positions)
      throw std::invalid_argument("sample " + s.id + ": " + std::to_string(prompts.back().size()) +
                                  " prompt tokens + " + std::to_string(s.max_new) +
                                  " new exceed the model's " + std::to_string(positions) +
                                  " positions");
    if (s.length == 0) s.length = length_bucket(needed);
    max_new = std::max(max_new, s.max_new);
    n_ctx = std::max(n_ctx, needed);
  }
  if (!o.dump_tasks.empty()) {
    write_task_file(o.dump_tasks, samples);
    std::fprintf(stderr, "kvsift-eval: wrote %zu samples to %s\n", samples.size(),
                 o.dump_tasks.c_str());
    return apps::kExitOk;
  }

  // Groups: the samples of one (task, length), in order of first appearance.
  std::vector<std::vector<std::size_t>> groups;
  std::map<std::pair<std::string, uint32_t>, std::size_t> group_of;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const auto [it, added] =
        group_of.try_emplace({samples[i].task, samples[i].length}, groups.size());
    if (added) groups.emplace_back();
    groups[it->second].push_back(i);
  }
  std::size_t kept = 1;
  for (const auto& g : groups) kept = std::max(kept, std::min(g.size(), kMaxPromptsKept));

  const std::vector<Config> configs = make_configs(o);
  std::ostringstream budgets;
  for (std::size_t i = 0; i < o.budgets.size(); ++i) budgets << (i ? "," : "") << o.budgets[i];
  suite += "; selectors " + join(o.selectors) + " at budgets " + budgets.str() + " (" +
           std::to_string(configs.size()) + " configurations per sample, max " +
           std::to_string(max_new) + " new tokens)";
  if (o.kv_dtype != "f16") suite += "; KV cache " + o.kv_dtype;
  std::fprintf(stderr, "kvsift-eval: %s\n", suite.c_str());

  model::ModelOptions mo;
  mo.n_ctx = static_cast<uint32_t>(n_ctx);
  mo.max_seqs = static_cast<uint32_t>(kept + 1);  // the prompts kept and the fork decoding
  mo.page_tokens = o.page_tokens;
  // The public storage types and the cache's share their values (kvsift.h, simd/page_layout.hpp).
  static_assert(static_cast<int>(simd::Dtype::q8) == KVSIFT_DTYPE_Q8 &&
                static_cast<int>(simd::Dtype::bf16) == KVSIFT_DTYPE_BF16);
  mo.kv_dtype = static_cast<simd::Dtype>(apps::kv_dtype_names().at(o.kv_dtype));
  mo.n_threads = o.threads;
  std::fprintf(stderr, "kvsift-eval: loading %s (context %llu, %zu prompts kept)\n",
               o.model.c_str(), static_cast<unsigned long long>(n_ctx), kept);
  const std::unique_ptr<model::LlamaModel> model = model::LlamaModel::load(o.model, mo);

  Runner runner(*model, configs, max_new);
  Report report(configs, o.min_dense);
  std::size_t done = 0;
  for (const auto& group : groups) {
    for (std::size_t first = 0; first < group.size(); first += kept) {
      const std::vector<std::size_t> chunk(group.begin() + first,
                                           group.begin() + std::min(group.size(), first + kept));
      std::vector<Prompt> prefilled;
      std::vector<std::vector<ConfigResult>> results(chunk.size());
      double dense_score = 0.0;
      for (std::size_t j = 0; j < chunk.size(); ++j) {
        prefilled.push_back(runner.prefill(prompts[chunk[j]]));
        info.prefill_seconds += prefilled.back().prefill_seconds;
        results[j].resize(configs.size());
        results[j][0] = runner.decode(samples[chunk[j]], prefilled[j], 0, nullptr);
        dense_score += results[j][0].score;
      }
      // The dense baseline rule (report.hpp): a whole group dense cannot do skips its selectors.
      const bool whole = chunk.size() == group.size();
      if (!whole || dense_score / static_cast<double>(chunk.size()) >= o.min_dense)
        for (std::size_t j = 0; j < chunk.size(); ++j)
          for (std::size_t c = 1; c < configs.size(); ++c)
            results[j][c] = runner.decode(samples[chunk[j]], prefilled[j], c, &results[j][0]);
      for (std::size_t j = 0; j < chunk.size(); ++j) {
        runner.release(prefilled[j]);
        report.add(samples[chunk[j]], prefilled[j].tokens, results[j]);
        for (const ConfigResult& r : results[j]) {
          info.setup_seconds += r.setup_seconds;
          info.decode_seconds += r.decode_seconds;
          info.probe_seconds += r.probe.seconds;
        }
        print_sample(++done, samples.size(), samples[chunk[j]], prefilled[j].tokens, configs,
                     results[j], o.verbose);
      }
    }
  }

  info.date = utc_now();
  info.machine = machine_description();
  info.cpu = cpu_model_name();
  info.logical_cpus = std::thread::hardware_concurrency();
  info.isa = simd::level_name(simd::resolve_level(simd::Level::best));
  info.kvsift_version = kvsift_version_string();
  info.source = o.source.empty() ? source_version() : o.source;
  info.suite = suite;
  info.wall_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("%s", report.markdown().c_str());
  std::fflush(stdout);
  if (!o.json.empty()) report.write_json(o.json, info);
  if (!o.plots.empty()) report.write_plots(o.plots);
  if (!o.results.empty()) report.write_results(o.results, info, o.plots);
  std::fprintf(stderr, "kvsift-eval: %zu samples in %.1f min\n", samples.size(),
               info.wall_seconds / 60.0);
  return apps::kExitOk;
}

// A --lengths entry: the same parse the run uses, as a CLI11 check.
CLI::Validator length_value() {
  return CLI::Validator(
      [](std::string& input) -> std::string {
        try {
          parse_length(input);
        } catch (const std::invalid_argument& e) {
          return std::string(e.what()).substr(std::string("--lengths: ").size());
        }
        return {};
      },
      "LENGTH like 1K or 4096, at most 1024K");
}

// The rules across options and the paths the run reads and writes: checked right after parsing,
// before the model loads, so that a typo does not cost a run. Fills in the suite's values for
// the options not given.
void validate(Options& o, const CLI::App& app) {
  using apps::UsageError;
  const Suite suite = suite_named(o.suite);
  if (app.count("--task-names") == 0) o.tasks = suite.tasks;
  if (app.count("--lengths") == 0) o.lengths = suite.lengths;
  if (app.count("--samples") == 0) o.samples = suite.samples;
  if (app.count("--selectors") == 0) o.selectors = suite.selectors;
  if (app.count("--budgets") == 0) o.budgets = suite.budgets;
  if (!o.task_file.empty() && app.count("--task-names") + app.count("--lengths") +
                                      app.count("--samples") > 0)
    throw UsageError("--tasks reads its samples from the file: --task-names, --lengths and "
                     "--samples shape generated tasks only");
  if (!o.dump_tasks.empty() && (!o.json.empty() || !o.plots.empty() || !o.results.empty()))
    throw UsageError("--dump-tasks writes the samples and stops: --json, --plots and --results "
                     "would stay unwritten");
  apps::require_readable_file("--model", o.model);
  if (!o.task_file.empty()) apps::require_readable_file("--tasks", o.task_file);
  std::vector<std::pair<std::string, std::string>> outputs;  // (option, path)
  for (const auto& [option, path] : {std::pair<std::string, const std::string*>{"--json", &o.json},
                                     {"--results", &o.results},
                                     {"--dump-tasks", &o.dump_tasks}})
    if (!path->empty()) {
      apps::require_writable_file(option, *path);
      outputs.emplace_back(option, *path);
    }
  if (!o.plots.empty()) {
    apps::require_writable_folder("--plots", o.plots);
    outputs.emplace_back("--plots", o.plots);
  }
  for (std::size_t i = 0; i < outputs.size(); ++i)
    for (std::size_t j = i + 1; j < outputs.size(); ++j)
      if (std::filesystem::weakly_canonical(outputs[i].second) ==
          std::filesystem::weakly_canonical(outputs[j].second))
        throw UsageError(outputs[i].first + " and " + outputs[j].first + " name the same path " +
                             outputs[i].second,
                         apps::kExitOutputUnwritable);
}

}  // namespace
}  // namespace kvsift::eval


int main(int argc, char** argv) {
  namespace apps = kvsift::apps;
  using kvsift::eval::Options;
  CLI::App app{
      "kvsift-eval: long-context tasks through every selector, against dense and exact "
      "attention",
      "kvsift-eval"};
  apps::set_up_command_line(app, "kvsift-eval");
  Options o;
  app.add_option("--model", o.model, "a Llama-family GGUF file (KVSIFT_MODEL sets the default)");
  app.add_option("--suite", o.suite, "smoke, default (make eval) or full (make eval-full)")
      ->check(CLI::IsMember(kvsift::eval::kSuiteNames));
  app.add_option("--tasks", o.task_file, "a JSONL task file instead of the generated tasks");
  // Options a suite fills when they are not given (suite_named): their default is the suite's.
  const std::string suites = "the --suite's";
  app.add_option("--task-names", o.tasks, "generated tasks to run")
      ->default_str(suites)
      ->delimiter(',')
      ->check(CLI::IsMember(kvsift::eval::TaskGenerator::task_names()));
  app.add_option("--lengths", o.lengths, "context lengths, e.g. 1K,2K,4K")
      ->default_str(suites)
      ->delimiter(',')
      ->check(kvsift::eval::length_value());
  app.add_option("--samples", o.samples, "samples per (task, length)")
      ->default_str(suites)
      ->check(CLI::Range(1, 100000));
  app.add_option("--selectors", o.selectors, "selectors to compare (dense always runs)")
      ->default_str(suites)
      ->delimiter(',')
      ->check(CLI::IsMember(apps::selector_list()));
  app.add_option("--budgets", o.budgets,
                 "budgets: fractions of the context (<= 1) or token counts")
      ->default_str(suites)
      ->delimiter(',')
      ->check(apps::above_and_at_most(0.0, 1 << 20));
  app.add_option("--seed", o.seed, "task generator seed");
  app.add_option("--json", o.json,
                 "write the provenance and one JSON record per configuration to this file");
  app.add_option("--plots", o.plots, "draw the PNG plots (gnuplot) into this folder");
  app.add_option("--results", o.results, "write the run's Markdown report here (docs/RESULTS.md)");
  app.add_option("--source", o.source,
                 "the source version the report records (default: git describe at configure, " +
                     std::string(kvsift::eval::source_version()) + ")");
  app.add_option("--dump-tasks", o.dump_tasks, "write the samples as a JSONL task file and stop");
  app.add_option("--min-dense", o.min_dense,
                 "dense accuracy a (task, length) needs to enter the selector comparison")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--threads", o.threads, "threads (0: all)")->check(CLI::Range(0, 1024));
  app.add_option("--page-tokens", o.page_tokens, "tokens per KV page")
      ->check(CLI::IsMember({16u, 32u, 64u}));
  app.add_option("--kv-dtype", o.kv_dtype, "KV cache storage: f16, bf16 or q8 (int8)")
      ->check(CLI::IsMember(apps::kv_dtype_list()));
  app.add_option("--sink-pages", o.sink_pages, "first pages every selection keeps")
      ->check(CLI::Range(0, 1024));
  app.add_option("--window-pages", o.window_pages, "last pages every selection keeps")
      ->check(CLI::Range(1, 1024));
  app.add_option("--epsilon", o.epsilon, "locks_certified: bound on the dropped mass")
      ->check(apps::above_and_at_most(0.0, 0.5));
  app.add_option("--compressions", o.compressions,
                 "s4r: target compressions of the prompt's K/V, each a configuration")
      ->delimiter(',')
      ->check(CLI::Range(1.0, 1000.0));
  app.add_option("--s4r-bases", o.s4r_bases,
                 "s4r: one basis per layer over all KV heads (the paper's) or one per KV head")
      ->check(CLI::IsMember({"layer", "head"}));
  app.add_option("--combine", o.combine,
                 "how a group's query heads share one page ranking: nrm (the LOCKS authors' code, "
                 "which the paper's numbers came from), share_avg (the LOCKS paper's text) or max")
      ->check(CLI::IsMember({"share_avg", "nrm", "max"}));
  app.add_option("--locks-query", o.locks_query,
                 "locks: score with each query head rounded to int8 (the reference) or in float")
      ->check(CLI::IsMember({"int8", "float"}));
  app.add_flag("--verbose", o.verbose, "print every output");
  // A single-valued option given twice takes the last: make eval's EVAL_ARGS can override it.
  for (CLI::Option* option : app.get_options())
    if (option->get_items_expected_max() == 1)
      option->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  if (const auto stop =
          apps::parse_command_line(app, argc, argv, [&] { kvsift::eval::validate(o, app); }))
    return *stop;
  try {
    return kvsift::eval::run(o, kvsift::eval::command_line(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvsift-eval: %s\n", e.what());
    return apps::kExitFailure;
  }
}
