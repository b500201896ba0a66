// kvsift-bench-decode: decode throughput of the model runner over a matrix of contexts, batch
// sizes and selectors, on the CPU or in offload mode (--device cuda[:N]), through the public C
// API (through its C++ wrapper, include/kvsift/kvsift.hpp). GPU_CHECK=throughput
// scripts/gpu_check.sh runs it once per mode on the same machine and prints the table with the
// offload/CPU ratios.
//
// Per row: one sequence is prefilled with context - warmup - steps tokens of The Devil's
// Dictionary (not timed), forked to `batch` sequences, and decoded greedily for --warmup untimed
// and --steps timed steps of all sequences together, so that the last step reaches `context`
// positions. tokens/s = batch / median step time; the spread is the fastest and slowest step.
// The split (select, transfer, attend), the bytes sent host to device and the device cache's hit
// rate are the medians of the timed steps' telemetry; h2d_MB_total and hit_rate_all are over all
// timed steps. One JSON object per row on stdout, a table on stderr.
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
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "common/devils_dictionary.hpp"
#include "common/selector_names.hpp"
#include "kvsift/kvsift.hpp"

namespace {

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

int parse_device(const std::string& device) {
  if (device == "cpu") return -1;
  if (device == "cuda") return 0;
  if (device.rfind("cuda:", 0) == 0) return std::stoi(device.substr(5));
  std::fprintf(stderr, "kvsift-bench-decode: --device %s: expected cpu, cuda or cuda:N\n",
               device.c_str());
  std::exit(1);
}

}  // namespace

// A kvsift call that fails ends the run in the handler after the body, with its status and message.
int main(int argc, char** argv) try {
  CLI::App app{"kvsift-bench-decode: decode tokens/s over contexts x batches x selectors"};
  std::string model_path, device = "cpu";
  std::vector<uint32_t> contexts{1024, 8192}, batches{1, 8};
  std::vector<std::string> selectors{"dense", "locks"};
  double budget = 0.05;
  uint32_t steps = 32, warmup = 4;
  int threads = 0, busy = 0;
  app.add_option("--model", model_path, "GGUF file")->required();
  app.add_option("--device", device, "cpu or cuda[:N]")->capture_default_str();
  app.add_option("--contexts", contexts, "prompt tokens per sequence")->capture_default_str();
  app.add_option("--batches", batches, "sequences decoded together")->capture_default_str();
  app.add_option("--selectors", selectors, "selectors: " + kvsift::apps::selector_names())
      ->capture_default_str();
  app.add_option("--budget", budget, "budget of every selector but dense")->capture_default_str();
  app.add_option("--steps", steps, "timed decode steps per row")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed decode steps first")->capture_default_str();
  app.add_option("--threads", threads, "CPU threads (0: all)");
  app.add_option("--busy", busy,
                 "spinning threads in a competing process (-1: one per CPU of the affinity mask)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
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
  kvsift_model_params params = kvsift::model_runner::default_params();
  params.n_ctx = max_context;
  params.max_seqs = max_batch;
  params.n_threads = threads;
  params.device = parse_device(device);
  kvsift::model_runner model(model_path, params);

  const std::vector<int32_t> book =
      model.tokenize(kvsift::apps::read_devils_dictionary(), /*parse_special=*/false);
  if (book.size() < max_context) {
    std::fprintf(stderr, "kvsift-bench-decode: the book has %zu tokens, fewer than %u\n",
                 book.size(), max_context);
    return 1;
  }

  std::fprintf(stderr, "%-6s %-6s %7s %5s %9s %9s %9s %9s %9s %9s %8s %6s\n", "device", "select",
               "context", "batch", "tok/s", "step_ms", "min_ms", "max_ms", "select_us", "xfer_us",
               "attend_us", "MB/step");
  for (const std::string& name : selectors) {
    kvsift_selector_policy policy = kvsift::default_selector_policy();
    policy.selector = kvsift::selector_from_name(name);
    policy.budget = policy.selector == KVSIFT_SELECTOR_DENSE ? 0.0 : budget;
    for (const uint32_t context : contexts)
      for (const uint32_t batch : batches) {
        model.set_selector(policy);
        std::vector<int32_t> seqs(batch);
        seqs[0] = model.create_sequence();
        if (context <= warmup + steps) {
          std::fprintf(stderr, "kvsift-bench-decode: context %u leaves no prompt\n", context);
          return 1;
        }
        model.prefill(seqs[0], std::span(book).first(context - warmup - steps));
        for (uint32_t b = 1; b < batch; ++b) seqs[b] = model.fork_sequence(seqs[0]);
        std::vector<int32_t> next(batch);
        std::vector<double> step_s, select_us, transfer_us, attend_us, h2d, hit;
        uint64_t h2d_total = 0, hits_total = 0, lookups_total = 0;
        for (uint32_t i = 0; i < warmup + steps; ++i) {
          for (uint32_t b = 0; b < batch; ++b) {
            const std::span<const float> logits = model.logits(seqs[b]);
            next[b] = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) -
                                           logits.begin());
          }
          const auto t0 = std::chrono::steady_clock::now();
          model.decode(seqs, next);
          const double s =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (i < warmup) continue;
          const kvsift_model_stats stats = model.stats();
          step_s.push_back(s);
          select_us.push_back(stats.last_step_select_us);
          transfer_us.push_back(stats.last_step_transfer_us);
          attend_us.push_back(stats.last_step_attend_us);
          h2d.push_back(static_cast<double>(stats.last_step_h2d_bytes));
          const uint64_t lookups = stats.last_step_cache_hits + stats.last_step_cache_misses;
          h2d_total += stats.last_step_h2d_bytes;
          hits_total += stats.last_step_cache_hits;
          lookups_total += lookups;
          hit.push_back(lookups > 0 ? static_cast<double>(stats.last_step_cache_hits) / lookups
                                    : 1.0);
        }
        for (int32_t id : seqs) model.free_sequence(id);
        const double step = median(step_s);
        const auto [lo, hi] = std::minmax_element(step_s.begin(), step_s.end());
        nlohmann::json row = {
            {"device", device},
            {"selector", name},
            {"budget", policy.budget},
            {"context", context},
            {"batch", batch},
            {"tok_s", batch / step},
            {"step_ms", 1e3 * step},
            {"step_ms_min", 1e3 * *lo},
            {"step_ms_max", 1e3 * *hi},
            {"select_us", median(select_us)},
            {"transfer_us", median(transfer_us)},
            {"attend_us", median(attend_us)},
            {"h2d_MB", median(h2d) / 1e6},
            {"hit_rate", median(hit)},
            {"h2d_MB_total", h2d_total / 1e6},
            {"hit_rate_all",
             lookups_total > 0 ? static_cast<double>(hits_total) / lookups_total : 1.0},
            {"steps", steps},
            {"busy_threads", busy}};
        std::printf("%s\n", row.dump().c_str());
        std::fflush(stdout);
        std::fprintf(stderr, "%-6s %-6s %7u %5u %9.1f %9.2f %9.2f %9.2f %9.0f %9.0f %8.0f %6.2f\n",
                     device.c_str(), name.c_str(), context, batch, batch / step, 1e3 * step,
                     1e3 * *lo, 1e3 * *hi, median(select_us), median(transfer_us),
                     median(attend_us), median(h2d) / 1e6);
      }
  }
  return 0;
} catch (const kvsift::error& e) {
  std::fprintf(stderr, "kvsift-bench-decode: %s: %s\n",
               std::string(kvsift::status_string(e.status())).c_str(), e.what());
  return 1;
}
