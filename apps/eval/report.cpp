#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>

namespace kvsift::eval {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double ratio(double num, double den) {
  return den > 0 ? num / den : kNaN;
}

std::string fixed(double x, int digits) {
  if (std::isnan(x)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

std::string general(double x) {
  if (std::isnan(x)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

std::string significant(double x) {
  if (std::isnan(x)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3g", x);
  return buf;
}

std::string length_label(uint32_t length) {
  return length % 1024 == 0 ? std::to_string(length / 1024) + "K" : std::to_string(length);
}

std::string budget_label(const Config& c) {
  if (c.policy.kind == select::Kind::dense) return "all";
  return c.budget <= 1.0 ? general(c.budget) : general(c.budget) + " tok";
}

// The budget as a share of the context, the plots' x axis.
double budget_fraction(const Config& c, uint32_t length) {
  return c.budget <= 1.0 ? c.budget : c.budget / length;
}

std::string mib(double bytes) {
  return fixed(bytes / (1024.0 * 1024.0), 2);
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (const char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

void write_file(const std::string& path, const std::string& text) {
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) throw std::runtime_error("cannot write " + path);
}

}  // namespace

Report::Report(std::vector<Config> configs, double min_dense)
    : configs_(std::move(configs)), min_dense_(min_dense) {}

void Report::add(const Sample& sample, uint64_t prompt_tokens,
                 const std::vector<ConfigResult>& results) {
  auto it = std::find(tasks_.begin(), tasks_.end(), sample.task);
  if (it == tasks_.end()) it = tasks_.insert(tasks_.end(), sample.task);
  std::vector<Cell>& cells = cells_[{sample.length, static_cast<std::size_t>(it - tasks_.begin())}];
  cells.resize(configs_.size());
  for (std::size_t c = 0; c < configs_.size(); ++c) {
    const ConfigResult& r = results[c];
    if (!r.ran) continue;
    Cell& cell = cells[c];
    cell.samples += 1;
    cell.score_sum += r.score;
    cell.agreements += r.agrees ? 1 : 0;
    if (c > 0 && results.front().ran) {
      cell.below_dense += r.score < results.front().score ? 1 : 0;
      cell.above_dense += r.score > results.front().score ? 1 : 0;
    }
    cell.steps += r.steps;
    cell.decode_seconds += r.decode_seconds;
    cell.kv_bytes += r.kv_bytes;
    cell.tokens_per_pair += r.tokens_per_pair;
    cell.index_bytes += r.index_bytes;
    cell.prompt_tokens_sum += static_cast<double>(prompt_tokens);
    cell.probe_failures += r.probe_failed ? 1 : 0;
    ProbeTotals& p = cell.probe;
    p.heads += r.probe.heads;
    p.recall_sum += r.probe.recall_sum;
    p.recall_min = std::min(p.recall_min, r.probe.recall_min);
    p.rel_err_sum += r.probe.rel_err_sum;
    p.pairs += r.probe.pairs;
    p.estimated_dropped_sum += r.probe.estimated_dropped_sum;
    p.bounded_pairs += r.probe.bounded_pairs;
    p.bound_sum += r.probe.bound_sum;
    p.bound_violations += r.probe.bound_violations;
    p.seconds += r.probe.seconds;
  }
}

std::vector<Record> Report::records() const {
  std::vector<Record> out;
  for (const auto& [key, cells] : cells_) {
    const double dense_accuracy = cells.front().score_sum / cells.front().samples;
    for (std::size_t c = 0; c < configs_.size(); ++c) {
      const Cell& cell = cells[c];
      const ProbeTotals& p = cell.probe;
      Record r;
      r.task = tasks_[key.second];
      r.length = key.first;
      r.selector = configs_[c].selector;
      r.budget = configs_[c].budget;
      r.samples = cell.samples;
      r.accuracy = ratio(cell.score_sum, cell.samples);
      r.accuracy_vs_dense = ratio(r.accuracy, dense_accuracy);
      r.agreement = ratio(cell.agreements, cell.samples);
      r.below_dense = cell.below_dense;
      r.above_dense = cell.above_dense;
      r.mass_recall = ratio(p.recall_sum, static_cast<double>(p.heads));
      r.mass_recall_min = p.heads > 0 ? p.recall_min : kNaN;
      r.out_rel_err = ratio(p.rel_err_sum, static_cast<double>(p.heads));
      r.kv_bytes_per_step =
          ratio(static_cast<double>(cell.kv_bytes), static_cast<double>(cell.steps));
      r.tokens_per_step = ratio(cell.tokens_per_pair, static_cast<double>(cell.steps));
      r.index_bytes_per_step =
          ratio(static_cast<double>(cell.index_bytes), static_cast<double>(cell.steps));
      r.decode_tok_s = ratio(static_cast<double>(cell.steps), cell.decode_seconds);
      r.dropped_measured = 1.0 - r.mass_recall;
      r.dropped_estimate = ratio(p.estimated_dropped_sum, static_cast<double>(p.pairs));
      r.dropped_bound = ratio(p.bound_sum, static_cast<double>(p.bounded_pairs));
      r.bound_violations =
          ratio(static_cast<double>(p.bound_violations), static_cast<double>(p.bounded_pairs));
      r.steps = cell.steps;
      r.prompt_tokens = ratio(cell.prompt_tokens_sum, cell.samples);
      r.dense_accuracy = dense_accuracy;
      r.compared = dense_accuracy >= min_dense_;
      r.probe_failures = cell.probe_failures;
      out.push_back(std::move(r));
    }
  }
  return out;
}

std::string Report::markdown() const {
  const std::vector<Record> records = this->records();
  const std::size_t n_configs = configs_.size();
  std::ostringstream md;

  md << "### Dense baseline\n\n"
     << "A (task, length) enters the selector comparison when dense attention reaches accuracy "
     << general(min_dense_) << " on it; below that the model cannot do the task at that length.\n\n"
     << "| task | length | samples | prompt tokens | accuracy | out rel err | KV MiB/step | "
        "tok/s | compared |\n"
     << "|---|---|---|---|---|---|---|---|---|\n";
  std::vector<std::string> dropped;
  for (std::size_t i = 0; i < records.size(); i += n_configs) {
    const Record& d = records[i];
    md << "| " << d.task << " | " << length_label(d.length) << " | " << d.samples << " | "
       << fixed(d.prompt_tokens, 0) << " | " << fixed(d.accuracy, 2) << " | "
       << significant(d.out_rel_err) << " | " << mib(d.kv_bytes_per_step) << " | "
       << fixed(d.decode_tok_s, 1) << " | "
       << (d.compared ? "yes"
           : n_configs > 1 && records[i + 1].samples == 0
               ? "no: dense cannot do it (selectors not run)"
               : "no: dense cannot do it")
       << " |\n";
    if (!d.compared) dropped.push_back(d.task + " at " + length_label(d.length));
  }

  md << "\n### Selectors against dense\n\n";
  if (n_configs == 1) {
    md << "Only dense was run.\n";
  } else {
    md << "dropped mass: measured (1 - mass recall) / the selector's estimate / its proven bound "
          "(- where it gives none); violations: share of (step, layer, KV head) whose measured "
          "drop exceeds the bound.\n\n"
       << "| task | length | selector | budget | accuracy | vs dense | samples below / above dense "
          "| agreement | mass recall | out rel err | tokens/step | KV MiB/step | tok/s | dropped: "
          "measured / est. / bound | violations |\n"
       << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for (std::size_t i = 0; i < records.size(); i += n_configs) {
      if (!records[i].compared) continue;
      for (std::size_t c = 1; c < n_configs; ++c) {
        const Record& r = records[i + c];
        md << "| " << r.task << " | " << length_label(r.length) << " | " << r.selector << " | "
           << budget_label(configs_[c]) << " | " << fixed(r.accuracy, 2) << " | "
           << fixed(r.accuracy_vs_dense, 2) << " | " << r.below_dense << " / " << r.above_dense
           << " | " << fixed(r.agreement, 2) << " | " << fixed(r.mass_recall, 4) << " | "
           << significant(r.out_rel_err) << " | " << fixed(r.tokens_per_step, 0) << " | "
           << mib(r.kv_bytes_per_step) << " | " << fixed(r.decode_tok_s, 1) << " | "
           << fixed(r.dropped_measured, 4) << " / " << fixed(r.dropped_estimate, 4) << " / "
           << fixed(r.dropped_bound, 4) << " | " << fixed(r.bound_violations, 3) << " |\n";
      }
    }
    if (!dropped.empty()) {
      md << "\nLeft out because dense cannot do them: ";
      for (std::size_t i = 0; i < dropped.size(); ++i) md << (i ? ", " : "") << dropped[i];
      md << ".\n";
    }

    // Means over the compared (task, length) pairs, each pair weighing the same.
    md << "\n### Summary over the compared (task, length) pairs\n\n"
       << "| selector | budget | pairs | accuracy | vs dense | samples below / above dense | "
          "agreement | mass recall | out rel err |\n"
       << "|---|---|---|---|---|---|---|---|---|\n";
    for (std::size_t c = 0; c < n_configs; ++c) {
      double acc = 0, vs = 0, agree = 0, recall = 0, err = 0;
      uint32_t pairs = 0, vs_pairs = 0, recall_pairs = 0, below = 0, above = 0;
      for (std::size_t i = 0; i < records.size(); i += n_configs) {
        const Record& r = records[i + c];
        if (!r.compared) continue;
        ++pairs;
        acc += r.accuracy;
        agree += r.agreement;
        below += r.below_dense;
        above += r.above_dense;
        if (!std::isnan(r.accuracy_vs_dense)) vs += r.accuracy_vs_dense, ++vs_pairs;
        if (!std::isnan(r.mass_recall))
          recall += r.mass_recall, err += r.out_rel_err, ++recall_pairs;
      }
      md << "| " << configs_[c].selector << " | " << budget_label(configs_[c]) << " | " << pairs
         << " | " << fixed(ratio(acc, pairs), 3) << " | " << fixed(ratio(vs, vs_pairs), 3) << " | "
         << below << " / " << above << " | " << fixed(ratio(agree, pairs), 3) << " | "
         << fixed(ratio(recall, recall_pairs), 4) << " | " << significant(ratio(err, recall_pairs))
         << " |\n";
    }
  }
  return md.str();
}

void Report::write_json(const std::string& path, const RunInfo& info) const {
  const auto number = [](double x) {
    return std::isnan(x) ? nlohmann::ordered_json() : nlohmann::ordered_json(x);
  };
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const Record& r : records()) {
    nlohmann::ordered_json o = nlohmann::ordered_json::object();
    o["task"] = r.task;
    o["length"] = r.length;
    o["selector"] = r.selector;
    o["budget"] = r.budget;
    o["samples"] = r.samples;
    o["accuracy"] = number(r.accuracy);
    o["accuracy_vs_dense"] = number(r.accuracy_vs_dense);
    o["agreement"] = number(r.agreement);
    o["samples_below_dense"] = r.below_dense;
    o["samples_above_dense"] = r.above_dense;
    o["mass_recall"] = number(r.mass_recall);
    o["out_rel_err"] = number(r.out_rel_err);
    o["kv_bytes_per_step"] = number(r.kv_bytes_per_step);
    o["tokens_per_step"] = number(r.tokens_per_step);
    o["decode_tok_s"] = number(r.decode_tok_s);
    o["mass_recall_min"] = number(r.mass_recall_min);
    o["index_bytes_per_step"] = number(r.index_bytes_per_step);
    o["dropped_measured"] = number(r.dropped_measured);
    o["dropped_estimate"] = number(r.dropped_estimate);
    o["dropped_bound"] = number(r.dropped_bound);
    o["bound_violations"] = number(r.bound_violations);
    o["steps"] = r.steps;
    o["prompt_tokens"] = number(r.prompt_tokens);
    o["dense_accuracy"] = r.dense_accuracy;
    o["compared"] = r.compared;
    o["probe_failures"] = r.probe_failures;
    out.push_back(std::move(o));
  }
  nlohmann::ordered_json provenance = nlohmann::ordered_json::object();
  provenance["kvsift_version"] = info.kvsift_version;
  provenance["source"] = info.source;
  provenance["model"] = info.model;
  provenance["model_sha256"] = info.model_sha256;
  provenance["command"] = info.command;
  provenance["cpu"] = info.cpu;
  provenance["logical_cpus"] = info.logical_cpus;
  provenance["isa"] = info.isa;
  provenance["machine"] = info.machine;
  provenance["date"] = info.date_iso;
  nlohmann::ordered_json document = nlohmann::ordered_json::object();
  document["provenance"] = std::move(provenance);
  document["records"] = std::move(out);
  write_file(path, document.dump(1) + "\n");
}

void Report::write_plots(const std::string& dir) const {
  const std::vector<Record> records = this->records();
  const std::size_t n_configs = configs_.size();
  std::set<uint32_t> lengths;
  for (const Record& r : records) lengths.insert(r.length);
  // Selectors in order of first appearance after dense; each keeps one colour in every plot.
  std::vector<std::string> selectors;
  for (std::size_t c = 1; c < n_configs; ++c)
    if (std::find(selectors.begin(), selectors.end(), configs_[c].selector) == selectors.end())
      selectors.push_back(configs_[c].selector);

  // Per length and configuration: (sum, count) of a record field over the (task, length) pairs
  // that pass `keep`, for accuracy and recall; KV bytes are summed per step over all pairs.
  struct Series {
    double sum = 0;
    uint32_t n = 0;
  };
  std::map<std::pair<uint32_t, std::size_t>, Series> accuracy, recall;
  std::map<std::pair<uint32_t, std::size_t>, std::pair<double, double>> bytes;  // bytes, steps
  std::map<uint32_t, uint32_t> compared_tasks, measured_tasks, all_tasks;
  for (std::size_t i = 0; i < records.size(); ++i) {
    const Record& r = records[i];
    const std::size_t c = i % n_configs;
    if (c == 0) {
      all_tasks[r.length] += 1;
      if (r.compared) compared_tasks[r.length] += 1;
      if (n_configs > 1 && records[i + 1].samples > 0) measured_tasks[r.length] += 1;
    }
    if (r.compared) {
      accuracy[{r.length, c}].sum += r.accuracy;
      accuracy[{r.length, c}].n += 1;
    }
    if (!std::isnan(r.mass_recall)) {
      recall[{r.length, c}].sum += r.mass_recall;
      recall[{r.length, c}].n += 1;
    }
    if (r.steps > 0) {
      bytes[{r.length, c}].first += r.kv_bytes_per_step * static_cast<double>(r.steps);
      bytes[{r.length, c}].second += static_cast<double>(r.steps);
    }
  }

  std::ostringstream gp;
  gp << "# Written by kvsift-eval; run `gnuplot plots.gp` in this folder to redraw.\n"
     << "set terminal pngcairo size " << 420 * std::max<std::size_t>(1, lengths.size()) + 80
     << ",440 font 'sans,10' noenhanced\n"  // noenhanced: "locks_certified" keeps its "_"
     << "set grid\nset key bottom right\nset style data linespoints\n";
  // The budget axis spans every budget run, at every length, with a margin.
  double x_lo = n_configs > 1 ? 1e9 : 0.01 * 1.3, x_hi = n_configs > 1 ? 0.0 : 1.0 / 1.3;
  for (std::size_t c = 1; c < n_configs; ++c)
    for (const uint32_t length : lengths) {
      x_lo = std::min(x_lo, budget_fraction(configs_[c], length));
      x_hi = std::max(x_hi, budget_fraction(configs_[c], length));
    }
  x_lo /= 1.3;
  x_hi *= 1.3;
  const auto colour = [&](const std::string& selector) {
    return std::find(selectors.begin(), selectors.end(), selector) - selectors.begin() + 1;
  };

  // Accuracy and mass recall against budget: one panel per length, one line per selector.
  const auto budget_plot =
      [&](const std::string& name, const std::string& title, const std::string& ylabel,
          const std::map<std::pair<uint32_t, std::size_t>, Series>& data, bool compared_only) {
        std::vector<uint32_t> panels;
        for (const uint32_t length : lengths)
          if (data.count({length, 1}) || data.count({length, 0})) panels.push_back(length);
        for (const uint32_t length : panels)
          for (const std::string& selector : selectors) {
            gp << "$" << name << "_" << length << "_" << colour(selector) << " << EOD\n";
            for (std::size_t c = 1; c < n_configs; ++c) {
              const auto it = data.find({length, c});
              if (configs_[c].selector == selector && it != data.end())
                gp << budget_fraction(configs_[c], length) << " " << it->second.sum / it->second.n
                   << "\n";
            }
            gp << "EOD\n";
          }
        gp << "set output '" << name << ".png'\n"
           << "set multiplot layout 1," << std::max<std::size_t>(1, panels.size()) << " title '"
           << title << "'\n"
           << "set logscale x\nset xrange [" << x_lo << ":" << x_hi
           << "]\nset xlabel 'budget (share of context tokens)'\nset ylabel '" << ylabel
           << "'\nset yrange [0:1.05]\n";
        if (panels.empty())
          gp << "set label 1 'no (task, length) pair that dense can do' at graph 0.5,0.5 center\n"
             << "plot 2 notitle\nunset label 1\n";
        for (const uint32_t length : panels) {
          // A tick at every budget run (token budgets fall elsewhere at each length).
          std::set<double> ticks;
          for (std::size_t c = 1; c < n_configs; ++c)
            ticks.insert(budget_fraction(configs_[c], length));
          gp << "set xtics (";
          for (auto it = ticks.begin(); it != ticks.end(); ++it)
            gp << (it == ticks.begin() ? "" : ", ") << "'" << general(*it) << "' " << *it;
          gp << ")\n";
          gp << "set title '" << length_label(length)
             << " context: " << (compared_only ? compared_tasks[length] : measured_tasks[length])
             << " of " << all_tasks[length] << " tasks'\nplot ";
          for (const std::string& selector : selectors)
            gp << "$" << name << "_" << length << "_" << colour(selector) << " lc "
               << colour(selector) << " pt 7 title '" << selector << "', ";
          const auto dense = data.find({length, 0});
          gp << (dense == data.end() ? 0.0 : dense->second.sum / dense->second.n)
             << " with lines dt 2 lw 2 lc 'black' title 'dense'\n";
        }
        gp << "unset multiplot\nunset logscale x\nset autoscale xy\n";
      };
  budget_plot("accuracy", "Task accuracy against budget (mean over the tasks dense can do)",
              "accuracy", accuracy, true);
  budget_plot("mass_recall",
              "Attention-mass recall against budget (mean over the tasks whose selectors ran: "
              "steps, layers, "
              "heads)",
              "mass recall", recall, false);

  // KV bytes per step against context: one panel per selector, one line per budget.
  const std::vector<uint32_t> length_list(lengths.begin(), lengths.end());
  std::string xtics;
  for (const uint32_t length : length_list) {
    if (!xtics.empty()) xtics += ", ";
    xtics.append("'").append(length_label(length)).append("' ").append(std::to_string(length));
  }
  const auto bytes_block = [&](const std::string& block, std::size_t c) {
    gp << "$" << block << " << EOD\n";
    for (const uint32_t length : length_list) {
      const auto it = bytes.find({length, c});
      if (it != bytes.end() && it->second.second > 0)
        gp << length << " " << it->second.first / it->second.second / (1024.0 * 1024.0) << "\n";
    }
    gp << "EOD\n";
  };
  bytes_block("kv_dense", 0);
  for (std::size_t c = 1; c < n_configs; ++c) bytes_block("kv_" + std::to_string(c), c);
  gp << "set terminal pngcairo size " << 420 * std::max<std::size_t>(1, selectors.size()) + 80
     << ",440 font 'sans,10' noenhanced\n"
     << "set output 'kv_bytes.png'\n"
     << "set multiplot layout 1," << std::max<std::size_t>(1, selectors.size())
     << " title 'K/V bytes read per decode step, all layers (mean over tasks and steps)'\n"
     << "set logscale xy 2\nset xtics (" << xtics << ")\nset xrange [" << length_list.front() / 1.3
     << ":" << length_list.back() * 1.3 << "]\nset xlabel 'context length (tokens)'\n"
     << "set ylabel 'MiB per step'\nset key top left\n";
  if (selectors.empty()) gp << "set title 'dense'\nplot $kv_dense lc 'black' title 'dense'\n";
  for (const std::string& selector : selectors) {
    gp << "set title '" << selector << "'\nplot $kv_dense with linespoints dt 2 lc 'black' "
       << "title 'dense'";
    int shade = 0;
    for (std::size_t c = 1; c < n_configs; ++c)
      if (configs_[c].selector == selector)
        gp << ", $kv_" << c << " lc " << colour(selector) << " dt " << 1 + shade++ % 4 << " pt "
           << 4 + 2 * (c % 4) << " title 'budget " << budget_label(configs_[c]) << "'";
    gp << "\n";
  }
  gp << "unset multiplot\n";

  std::filesystem::create_directories(dir);
  write_file((std::filesystem::path(dir) / "plots.gp").string(), gp.str());
  const std::string command = "cd " + shell_quote(dir) + " && gnuplot plots.gp";
  if (std::system(command.c_str()) != 0)
    throw std::runtime_error("gnuplot failed drawing " + dir +
                             "/plots.gp (is gnuplot installed? scripts/setup.sh installs "
                             "gnuplot-nox)");
}

void Report::write_results(const std::string& path, const RunInfo& info,
                           const std::string& plots_dir) const {
  const std::filesystem::path results(path);
  const std::filesystem::path base =
      results.has_parent_path() ? results.parent_path() : std::filesystem::path(".");
  const std::string plots = plots_dir.empty()
                                ? std::string()
                                : std::filesystem::relative(std::filesystem::absolute(plots_dir),
                                                            std::filesystem::absolute(base))
                                      .string();
  std::ostringstream md;
  md << "# kvsift evaluation results\n\n"
     << "Written by `kvsift-eval` from the run described below; it is regenerated by running the "
        "command again, never edited by hand.\n\n"
     << "- Command: `" << info.command << "`\n"
     << "- Date: " << info.date << "\n"
     << "- Machine: " << info.machine << "\n"
     << "- Model: " << info.model << "\n"
     << "- Source: " << info.source << "\n"
     << "- Suite: " << info.suite << "\n"
     << "- Wall time: " << fixed(info.wall_seconds / 60.0, 1) << " min (prefill "
     << fixed(info.prefill_seconds, 0) << " s, forks and selector set-up "
     << fixed(info.setup_seconds, 0) << " s, decode " << fixed(info.decode_seconds, 0)
     << " s, exact attention for the metrics " << fixed(info.probe_seconds, 0) << " s)\n\n"
     << markdown();
  if (!plots.empty())
    md << "\n### Plots\n\n![accuracy against budget](" << plots << "/accuracy.png)\n\n"
       << "![mass recall against budget](" << plots << "/mass_recall.png)\n\n"
       << "![KV bytes per step against context](" << plots << "/kv_bytes.png)\n";
  write_file(path, md.str());
}

}  // namespace kvsift::eval
