// kvsift-bench-decode: decode throughput of the model runner over a matrix of contexts, batch
// sizes and selectors, on the CPU or in offload mode (--device cuda[:N]), through the public C
// API. GPU_CHECK=throughput scripts/gpu_check.sh runs it once per mode on the same machine and
// prints the table with the offload/CPU ratios.
//
// Per row: one sequence is filled with context - warmup - steps tokens (not timed), forked to
// `batch` sequences, and decoded greedily for --warmup untimed and --steps timed steps of all
// sequences together, so that the last step reaches `context` positions. The fill is a prefill of
// The Devil's Dictionary (--fill prompt), or (--fill synthetic) K/V put straight into the cache
// with kvsift_model_sequence_append_kv: keys of bench/key_maker.hpp (a topic mixture per page,
// outlier channels, RoPE), random values, a chunk of every layer at a time, so that a context no
// prefill could reach in reasonable time on a CPU (128K tokens through 8B) is decoded by the whole
// model all the same; its first step decodes the BOS token. tokens/s = batch / median step time;
// the spread is the fastest and slowest step. The split (select, transfer, attend, and weights:
// the rest of the step, every product, norm and append), the bytes sent host to device and the
// device cache's hit rate are the medians of the timed steps' telemetry; h2d_MB_total and
// hit_rate_all are over all timed steps; plan_us (JSON only) is the host's planning of the page
// moves, which the transfer waits for; row_h2d_MB and rows_equivalent_MB (JSON only, medians) are
// the token rows' share of h2d_MB and what those rows would have cost sent as values: for S4R in
// offload mode, where the device reconstructs the rows, coefficients against rows. Memory is read
// after the last step, before the row's sequences are freed: the process's resident and peak
// resident sizes, the KV pages held and the selector's bytes (page summaries and what it holds
// beside them). One JSON object per row on stdout, a table on stderr.
//
// --busy N: a busy host. A separate process (forked before the model loads) keeps N threads
// spinning for the whole run, as another program sharing the machine would; N = one per CPU of the
// affinity mask measures the README's "Threads" claim: kvsift's threads sleep when they wait, so
// the decode keeps its share of the cores instead of losing its time slices to its own spinners.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "bench/key_maker.hpp"
#include "common/command_line.hpp"
#include "common/devils_dictionary.hpp"
#include "common/exit_codes.hpp"
#include "common/kv_dtype_names.hpp"
#include "common/selector_names.hpp"
#include "kvsift/kvsift.hpp"

namespace {

void check(kvsift_status status, const char* what) {
  if (status == KVSIFT_STATUS_OK) return;
  std::fprintf(stderr, "kvsift-bench-decode: %s: %s: %s\n", what, kvsift_status_string(status),
               kvsift_last_error());
  std::exit(kvsift::apps::kExitFailure);
}

// Starts a process of `threads` spinning threads; returns its id (0: none).
pid_t start_busy_process(int threads) {
  if (threads <= 0) return 0;
  const pid_t pid = fork();
  if (pid != 0) return pid < 0 ? 0 : pid;  // the parent (or a failed fork: no load)
  auto spin = [] {
    for (;;) asm volatile("");  // an empty statement the compiler must keep: a pure CPU spinner
  };
  std::vector<std::thread> spinners;
  for (int t = 1; t < threads; ++t) spinners.emplace_back(spin);
  spin();
  return 0;  // never reached: the spinners run until the benchmark kills the process
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// The names --weights takes (--kv-dtype's are common/kv_dtype_names.hpp's).
const std::map<std::string, kvsift_weights> kWeights{{"bf16", KVSIFT_WEIGHTS_BF16},
                                                     {"f32", KVSIFT_WEIGHTS_F32},
                                                     {"quantized", KVSIFT_WEIGHTS_QUANTIZED}};

template <class T>
std::vector<std::string> names_of(const std::map<std::string, T>& table) {
  std::vector<std::string> names;
  for (const auto& entry : table) names.push_back(entry.first);
  return names;
}

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"; the kernel writes them in kB), 0 where
// there is none.
uint64_t status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stoull(line.substr(field.size() + 1)) * 1024;
  return 0;
}

// Tokens per append_kv call of the synthetic fill: a whole number of pages (KeyMaker draws a
// page's topics at its first token), and small enough that the fill never holds more than a few
// MB of float K/V whatever the context.
constexpr uint32_t kFillTokens = 512;

// Fills the first n_tokens positions of every layer of seq with KeyMaker's keys (one maker per
// layer, its own topics and seed) and uniform random values, chunk by chunk, every layer in turn.
// The layers' chunks are made in parallel (the RoPE and the random numbers were most of a 512K
// fill on one thread) and appended one after another (appends to one model are not concurrent).
void fill_synthetic(kvsift_model* model, const kvsift_model_info& info, int32_t seq,
                    uint64_t n_tokens) {
  namespace bench = kvsift::bench;
  const bench::Shape shape{"model", info.n_kv_heads, info.n_heads / info.n_kv_heads, info.head_dim};
  std::vector<bench::KeyMaker> makers;
  for (uint32_t l = 0; l < info.n_layers; ++l) makers.emplace_back(shape, bench::kSeed + l);
  std::vector<std::vector<float>> k(info.n_layers), v(info.n_layers);
  for (uint64_t first = 0; first < n_tokens; first += kFillTokens) {
    const auto n = static_cast<uint32_t>(std::min<uint64_t>(kFillTokens, n_tokens - first));
#pragma omp parallel for schedule(dynamic)
    for (uint32_t l = 0; l < info.n_layers; ++l) makers[l].make(first, n, k[l], v[l]);
    for (uint32_t l = 0; l < info.n_layers; ++l)
      check(kvsift_model_sequence_append_kv(model, seq, l, n, k[l].data(), v[l].data()),
            "append_kv");
  }
}

}  // namespace

int main(int argc, char** argv) {
  namespace apps = kvsift::apps;
  CLI::App app{"kvsift-bench-decode: decode tokens/s over contexts x batches x selectors",
               "kvsift-bench-decode"};
  apps::set_up_command_line(app, "kvsift-bench-decode");
  std::string model_path, device = "cpu";
  std::vector<uint32_t> contexts{1024, 8192}, batches{1, 8};
  std::vector<std::string> selectors{"dense", "locks"};
  std::vector<double> budgets{0.05};
  std::string fill = "prompt", kv_dtype = "f16", weights = "bf16", select_on = "cpu";
  uint32_t steps = 32, warmup = 4;
  int threads = 0, busy = 0;
  uint32_t device_cache_pages = 0;
  app.add_option("--model", model_path, "GGUF file")->required();
  app.add_option("--device", device, "cpu or cuda[:N]")->check(apps::device_name());
  app.add_option("--contexts", contexts, "tokens per sequence at the last step")
      ->check(CLI::Range(1u, 1u << 20))
      ->delimiter(',');
  app.add_option("--batches", batches, "sequences decoded together")
      ->check(CLI::Range(1, 256))
      ->delimiter(',');
  app.add_option("--selectors", selectors, "selectors to measure")
      ->check(CLI::IsMember(apps::selector_list()))
      ->delimiter(',');
  app.add_option("--budget,--budgets", budgets,
                 "budgets of every selector but dense, a row each: a fraction of the context "
                 "(<= 1) or a count")
      ->check(apps::above_and_at_most(0.0, 1 << 20))
      ->delimiter(',');
  app.add_option("--fill", fill,
                 "how the context is filled: prompt (a prefill of the book) or synthetic "
                 "(structured K/V appended to every layer, no prefill)")
      ->check(CLI::IsMember({"prompt", "synthetic"}));
  app.add_option("--kv-dtype", kv_dtype, "KV cache storage")
      ->check(CLI::IsMember(apps::kv_dtype_list()));
  app.add_option("--weights", weights, "how the weights are kept (kvsift_model_params.weights)")
      ->check(CLI::IsMember(names_of(kWeights)));
  app.add_option("--steps", steps, "timed decode steps per row")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", warmup, "untimed decode steps first")->check(CLI::Range(0, 100000));
  app.add_option("--threads", threads, "CPU threads (0: all)")->check(CLI::Range(0, 1024));
  app.add_option("--select-on", select_on,
                 "where LOCKS and Louver select in offload mode: cpu, or device (the --device; "
                 "kvsift_selector_policy.device)")
      ->check(CLI::IsMember({"cpu", "device"}));
  app.add_option("--device-cache-pages", device_cache_pages,
                 "offload mode: (page, KV head) slots the device caches per layer (0: the device "
                 "holds a copy of the whole cache, every page resident: the KV cache in HBM)");
  app.add_option("--busy", busy,
                 "spinning threads in a competing process (-1: one per CPU of the affinity mask)")
      ->check(CLI::Range(-1, 1024));
  // Each context holds its prompt, then the --warmup and --steps decode steps.
  const auto validate = [&] {
    for (const uint32_t context : contexts)
      if (context <= warmup + steps)
        throw apps::UsageError("--contexts " + std::to_string(context) +
                               ": leaves no prompt before --warmup " + std::to_string(warmup) +
                               " + --steps " + std::to_string(steps) + " decode steps");
    if (device != "cpu") {
      int n_devices = 0;
      if (kvsift_gpu_device_count(&n_devices) != KVSIFT_STATUS_OK)
        throw apps::UsageError("--device " + device + ": " + kvsift_last_error());
      if (apps::device_index(device) >= n_devices)
        throw apps::UsageError("--device " + device + ": " + std::to_string(n_devices) +
                               " CUDA device(s) here");
    } else if (select_on == "device") {
      throw apps::UsageError("--select-on device: selection runs on the --device, which is cpu");
    }
    apps::require_readable_file("--model", model_path);
  };
  if (const auto stop = apps::parse_command_line(app, argc, argv, validate)) return *stop;
  if (busy < 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    busy = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
  }
  // Before any kvsift call, so that the child copies no thread of ours; killed on every exit.
  static pid_t busy_pid = start_busy_process(busy);
  std::atexit([] {
    if (busy_pid > 0) {
      kill(busy_pid, SIGKILL);
      waitpid(busy_pid, nullptr, 0);
    }
  });

  const uint32_t max_context = *std::max_element(contexts.begin(), contexts.end());
  const uint32_t max_batch = *std::max_element(batches.begin(), batches.end());
  kvsift_model_params params;
  kvsift_model_params_init(&params);
  params.n_ctx = max_context;
  params.max_seqs = max_batch;
  params.n_threads = threads;
  params.device_cache_pages = device_cache_pages;
  params.device = apps::device_index(device);
  params.kv_dtype = apps::kv_dtype_names().at(kv_dtype);
  params.weights = kWeights.at(weights);
  kvsift_model* model = nullptr;
  check(kvsift_model_load(model_path.c_str(), &params, &model), "load");
  const kvsift::model_runner owner(model);  // frees the model on every way out
  const kvsift_model_info info = owner.info();
  const bool synthetic = fill == "synthetic";

  std::vector<int32_t> book;
  if (!synthetic) {
    const std::string text = kvsift::apps::read_devils_dictionary();
    book.resize(text.size());
    std::size_t n_book = 0;
    check(kvsift_tokenize(model, text.data(), text.size(), 0, book.data(), book.size(), &n_book),
          "tokenize");
    if (n_book < max_context) {
      std::fprintf(stderr, "kvsift-bench-decode: the book has %zu tokens, fewer than %u\n", n_book,
                   max_context);
      return apps::kExitUsage;  // --contexts asked for more than the book holds
    }
  }

  // Every selector but dense runs each budget; dense once.
  std::vector<std::pair<std::string, double>> rows;
  for (const std::string& name : selectors)
    if (name == "dense")
      rows.emplace_back(name, 0.0);
    else
      for (const double budget : budgets) rows.emplace_back(name, budget);

  std::fprintf(stderr,
               "%-6s %-6s %6s %7s %5s %9s %9s %9s %9s %9s %9s %9s %9s %8s %6s %8s %8s %8s %8s\n",
               "device", "select", "budget", "context", "batch", "tok/s", "step_ms", "min_ms",
               "max_ms", "weight_ms", "select_us", "xfer_us", "attend_us", "MB/step", "fill_s",
               "rss_MB", "hwm_MB", "kv_MB", "sel_MB");
  for (const auto& [name, budget] : rows) {
    kvsift_selector_policy policy;
    kvsift_selector_policy_init(&policy);
    check(kvsift_selector_from_name(name.c_str(), &policy.selector), "--selectors");
    policy.budget = budget;
    policy.device = select_on == "device" ? apps::device_index(device) : -1;
    for (const uint32_t context : contexts)
      for (const uint32_t batch : batches) {
        check(kvsift_model_set_selector(model, &policy), "selector");
        std::vector<int32_t> seqs(batch);
        check(kvsift_model_sequence_create(model, &seqs[0]), "sequence");
        const uint32_t n_fill = context - warmup - steps;
        const auto f0 = std::chrono::steady_clock::now();
        if (synthetic)
          fill_synthetic(model, info, seqs[0], n_fill);
        else
          check(
              kvsift_model_prefill(model, seqs[0], book.data(), n_fill, nullptr, nullptr, nullptr),
              "prefill");
        const double fill_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count();
        for (uint32_t b = 1; b < batch; ++b)
          check(kvsift_model_sequence_fork(model, seqs[0], &seqs[b]), "fork");
        std::vector<int32_t> next(batch);
        std::vector<double> step_s, select_us, transfer_us, plan_us, attend_us, weights_ms, h2d,
            row_h2d, rows_equivalent, hit;
        uint64_t h2d_total = 0, hits_total = 0, lookups_total = 0;
        for (uint32_t i = 0; i < warmup + steps; ++i) {
          for (uint32_t b = 0; b < batch; ++b) {
            // Appended K/V leave no logits: the first step decodes BOS.
            if (synthetic && i == 0) {
              next[b] = std::max(info.bos, 0);
              continue;
            }
            const float* logits = nullptr;
            std::size_t n = 0;
            check(kvsift_model_logits(model, seqs[b], &logits, &n), "logits");
            next[b] = static_cast<int32_t>(std::max_element(logits, logits + n) - logits);
          }
          const auto t0 = std::chrono::steady_clock::now();
          check(kvsift_model_decode(model, batch, seqs.data(), next.data()), "decode");
          const double s =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (i < warmup) continue;
          kvsift_model_stats stats;
          check(kvsift_model_get_stats(model, &stats), "stats");
          step_s.push_back(s);
          select_us.push_back(stats.last_step_select_us);
          transfer_us.push_back(stats.last_step_transfer_us);
          plan_us.push_back(stats.last_step_plan_us);
          attend_us.push_back(stats.last_step_attend_us);
          weights_ms.push_back(1e3 * s -
                               1e-3 * (stats.last_step_select_us + stats.last_step_transfer_us +
                                       stats.last_step_attend_us));
          h2d.push_back(static_cast<double>(stats.last_step_h2d_bytes));
          row_h2d.push_back(static_cast<double>(stats.last_step_row_h2d_bytes));
          rows_equivalent.push_back(static_cast<double>(stats.last_step_rows_equivalent_bytes));
          const uint64_t lookups = stats.last_step_cache_hits + stats.last_step_cache_misses;
          h2d_total += stats.last_step_h2d_bytes;
          hits_total += stats.last_step_cache_hits;
          lookups_total += lookups;
          hit.push_back(lookups > 0 ? static_cast<double>(stats.last_step_cache_hits) / lookups
                                    : 1.0);
        }
        kvsift_model_stats held;
        check(kvsift_model_get_stats(model, &held), "stats");
        const uint64_t rss = status_bytes("VmRSS"), hwm = status_bytes("VmHWM");
        // Summaries exist for sealed pages: floor(length / page_tokens) per (layer, KV head).
        const uint64_t sealed =
            uint64_t{batch} * (context / params.page_tokens) * info.n_layers * info.n_kv_heads;
        const uint64_t selector_bytes =
            held.summary_bytes_per_page * sealed + held.selector_bytes_held;
        // Offload mode: device memory in use with the sequences still held, the driver's count
        // for the whole device (weights, page caches or the whole-cache copy, selector data,
        // workspaces, this process's CUDA context; nothing else runs on the benchmark's device).
        uint64_t device_used = 0, device_total = 0;
        if (params.device >= 0)
          check(kvsift_gpu_memory_info(params.device, &device_used, &device_total),
                "device memory");
        for (int32_t id : seqs) check(kvsift_model_sequence_free(model, id), "free");
        const double step = median(step_s);
        const auto [lo, hi] = std::minmax_element(step_s.begin(), step_s.end());
        nlohmann::json row = {
            {"device", device},
            {"selector", name},
            {"select_on", select_on},
            {"budget", policy.budget},
            {"context", context},
            {"batch", batch},
            {"fill", fill},
            {"kv_dtype", kv_dtype},
            {"weights", weights},
            {"tok_s", batch / step},
            {"step_ms", 1e3 * step},
            {"step_ms_min", 1e3 * *lo},
            {"step_ms_max", 1e3 * *hi},
            {"weights_ms", median(weights_ms)},
            {"select_us", median(select_us)},
            {"transfer_us", median(transfer_us)},
            {"plan_us", median(plan_us)},
            {"attend_us", median(attend_us)},
            {"fill_s", fill_s},
            {"vm_rss_bytes", rss},
            {"vm_hwm_bytes", hwm},
            {"kv_bytes_held", held.kv_bytes_held},
            {"selector_bytes", selector_bytes},
            {"device_used_bytes", device_used},
            {"h2d_MB", median(h2d) / 1e6},
            {"row_h2d_MB", median(row_h2d) / 1e6},
            {"rows_equivalent_MB", median(rows_equivalent) / 1e6},
            {"hit_rate", median(hit)},
            {"h2d_MB_total", h2d_total / 1e6},
            {"hit_rate_all",
             lookups_total > 0 ? static_cast<double>(hits_total) / lookups_total : 1.0},
            {"device_cache_pages", device_cache_pages},
            {"steps", steps},
            {"busy_threads", busy}};
        std::printf("%s\n", row.dump().c_str());
        std::fflush(stdout);
        std::fprintf(
            stderr,
            "%-6s %-6s %6.3g %7u %5u %9.2f %9.2f %9.2f %9.2f %9.2f %9.0f %9.0f %9.0f %8.2f "
            "%6.1f %8.0f %8.0f %8.0f %8.1f\n",
            device.c_str(), name.c_str(), policy.budget, context, batch, batch / step, 1e3 * step,
            1e3 * *lo, 1e3 * *hi, median(weights_ms), median(select_us), median(transfer_us),
            median(attend_us), median(h2d) / 1e6, fill_s, rss / 1e6, hwm / 1e6,
            held.kv_bytes_held / 1e6, selector_bytes / 1e6);
      }
  }
  return apps::kExitOk;
}
