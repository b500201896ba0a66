// Aggregates sample results per (task, length, selector, budget) and writes them: the JSON
// records, the Markdown tables, the gnuplot PNGs and docs/RESULTS.md.
//
// Dense baseline rule: a (task, length) pair whose dense accuracy is below min_dense is one the
// model cannot do even with exact attention. It is left out of the selector comparison: the
// dense table says so, and its selector records (compared: false) have samples 0 and null
// metrics when the selectors were skipped, as main.cpp does for groups it can gate whole.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "runner.hpp"
#include "sample.hpp"

namespace kvsift::eval {

// One configuration on one (task, length): the JSON record. NaN is written as null.
struct Record {
  std::string task;
  uint32_t length = 0;
  std::string selector;
  double budget = 1.0;
  uint32_t samples = 0;  // 0: not run (the pair was dropped before its selectors ran)
  double accuracy = 0.0;
  double accuracy_vs_dense = 0.0;  // accuracy / dense accuracy; NaN when dense scores 0
  double agreement = 0.0;          // share of samples with dense's exact greedy output
  // The paired view (docs/eval.md, Comparing against dense): samples below and above dense's score
  // on the same sample. With few samples these say more than the accuracies' difference.
  uint32_t below_dense = 0, above_dense = 0;
  double mass_recall = 0.0;        // mean over samples, steps, layers and query heads
  double mass_recall_min = 0.0;    // the worst (sample, step, layer, query head)
  double out_rel_err = 0.0;        // mean, same observations
  double kv_bytes_per_step = 0.0;  // K/V bytes the attention read, all layers, mean over steps
  double tokens_per_step = 0.0;    // tokens attended per (layer, KV head), mean over steps
  double index_bytes_per_step = 0.0;
  double decode_tok_s = 0.0;      // decode steps / model decode time (exact attention excluded)
  double dropped_measured = 0.0;  // 1 - mass_recall
  double dropped_estimate = 0.0;  // the selector's own: mean of 1 - kept_estimate; NaN: none
  double dropped_bound = 0.0;     // mean proven bound where one is proven; NaN: none
  double bound_violations = 0.0;  // share of bounded pairs whose measured drop exceeds the bound
  uint64_t steps = 0;
  double prompt_tokens = 0.0;  // mean
  double dense_accuracy = 0.0;
  bool compared = true;  // dense accuracy >= min_dense
  uint32_t probe_failures = 0;
};

// What RESULTS.md says about the run besides its numbers, and the JSON's provenance.
struct RunInfo {
  std::string command;
  std::string date;  // "2026-01-31 12:00 UTC"
  std::string date_iso;  // "2026-01-31T12:00:05Z"
  std::string machine;
  std::string cpu;  // /proc/cpuinfo's model name
  unsigned logical_cpus = 0;
  std::string isa;  // the kernels' instruction-set level (simd/isa.hpp), under KVSIFT_MAX_ISA
  std::string kvsift_version;
  std::string model;
  std::string model_sha256;
  std::string source;  // the source version (git describe), as the caller gives it
  std::string suite;
  double wall_seconds = 0.0;
  double prefill_seconds = 0.0;
  double setup_seconds = 0.0;
  double decode_seconds = 0.0;
  double probe_seconds = 0.0;
};

class Report {
 public:
  Report(std::vector<Config> configs, double min_dense);

  // results: per configuration, in the configurations' order; those not run count nowhere.
  void add(const Sample& sample, uint64_t prompt_tokens, const std::vector<ConfigResult>& results);

  // Ordered by length, then task (in order of first appearance), then configuration.
  std::vector<Record> records() const;
  std::string markdown() const;
  // {"provenance": {...}, "records": [one per configuration]}. Throws std::runtime_error when the
  // file cannot be written.
  void write_json(const std::string& path, const RunInfo& info) const;
  // accuracy.png, mass_recall.png, kv_bytes.png and the gnuplot script plots.gp that draws them
  // into dir (created). Throws std::runtime_error when gnuplot fails or is missing.
  void write_plots(const std::string& dir) const;
  void write_results(const std::string& path, const RunInfo& info,
                     const std::string& plots_dir) const;

 private:
  struct Cell {
    uint32_t samples = 0;
    double score_sum = 0.0;
    uint32_t agreements = 0;
    uint32_t below_dense = 0, above_dense = 0;
    uint64_t steps = 0;
    double decode_seconds = 0.0;
    uint64_t kv_bytes = 0, index_bytes = 0;
    double tokens_per_pair = 0.0;
    ProbeTotals probe;
    double prompt_tokens_sum = 0.0;
    uint32_t probe_failures = 0;
  };
  using Key = std::pair<uint32_t, std::size_t>;  // (length, task index)

  std::vector<Config> configs_;
  double min_dense_;
  std::vector<std::string> tasks_;          // in order of first appearance
  std::map<Key, std::vector<Cell>> cells_;  // per configuration
};

}  // namespace kvsift::eval
