// kvsift-bench-model: one timed prefill or decode run of the model runner, for
// tools/peer/bench.py's external-runner protocol: the prompt's token ids come from a JSON file,
// and the last stdout line is a JSON object with "tok_s" for the timed part.
//   prefill: time the prefill of all the file's tokens.
//   decode:  prefill the file's tokens (not timed), then time n-decode greedy decode steps.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/command_line.hpp"
#include "common/exit_codes.hpp"
#include "kvsift/kvsift.hpp"

namespace {

void check(kvsift_status status, const char* what) {
  if (status == KVSIFT_STATUS_OK) return;
  std::fprintf(stderr, "kvsift-bench-model: %s: %s\n", what, kvsift_last_error());
  std::exit(kvsift::apps::kExitFailure);
}

}  // namespace

int main(int argc, char** argv) {
  namespace apps = kvsift::apps;
  CLI::App app{"kvsift-bench-model: timed prefill or decode, JSON on the last line",
               "kvsift-bench-model"};
  apps::set_up_command_line(app, "kvsift-bench-model");
  std::string model_path, mode = "decode", tokens_file;
  int threads = 0;
  uint32_t ctx = 8192, n_decode = 64;
  int weights_f32 = 0;
  app.add_option("--model", model_path, "GGUF file")->required();
  app.add_option("--mode", mode, "prefill or decode")->check(CLI::IsMember({"prefill", "decode"}));
  app.add_option("--tokens", tokens_file, "JSON list of prompt token ids")->required();
  app.add_option("--threads", threads, "threads (0: all)")->check(CLI::Range(0, 1024));
  app.add_option("--ctx", ctx, "context positions to allocate (at most the model's)")
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--n-decode", n_decode, "decode steps to time")->check(CLI::Range(1, 1 << 20));
  app.add_option("--weights-f32", weights_f32, "1: float32 weights instead of bf16")
      ->check(CLI::IsMember({0, 1}));
  // The token file is read here too: a malformed one, or one too long for --ctx, stops the run
  // before the model loads.
  std::vector<int32_t> tokens;
  const auto validate = [&] {
    apps::require_readable_file("--model", model_path);
    apps::require_readable_file("--tokens", tokens_file);
    try {
      tokens = nlohmann::json::parse(std::ifstream(tokens_file)).get<std::vector<int32_t>>();
    } catch (const nlohmann::json::exception& e) {
      throw apps::UsageError("--tokens " + tokens_file + ": not a JSON list of token ids (" +
                                 e.what() + ")",
                             apps::kExitInputUnreadable);
    }
    if (tokens.empty()) throw apps::UsageError("--tokens " + tokens_file + ": no tokens");
    const uint64_t needed = tokens.size() + (mode == "decode" ? n_decode : 0);
    if (needed > ctx)
      throw apps::UsageError("--ctx " + std::to_string(ctx) + ": the " +
                             std::to_string(tokens.size()) + " tokens" +
                             (mode == "decode" ? " and --n-decode steps" : "") + " need " +
                             std::to_string(needed) + " positions");
  };
  if (const auto stop = apps::parse_command_line(app, argc, argv, validate)) return *stop;
  kvsift_model_params params;
  kvsift_model_params_init(&params);
  params.n_ctx = ctx;
  params.n_threads = threads;
  params.weights_f32 = weights_f32;
  kvsift_model* model = nullptr;
  check(kvsift_model_load(model_path.c_str(), &params, &model), "load");
  const kvsift::model_runner owner(model);  // frees the model on every way out
  int32_t seq = -1;
  check(kvsift_model_sequence_create(model, &seq), "sequence");

  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  check(kvsift_model_prefill(model, seq, tokens.data(), tokens.size(), nullptr, nullptr, nullptr),
        "prefill");
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  double tok_s = tokens.size() / prefill_s;
  double attention_share = 0.0;
  if (mode == "decode") {
    const auto t1 = Clock::now();
    for (uint32_t i = 0; i < n_decode; ++i) {
      const float* logits = nullptr;
      std::size_t n = 0;
      check(kvsift_model_logits(model, seq, &logits, &n), "logits");
      const int32_t next = static_cast<int32_t>(std::max_element(logits, logits + n) - logits);
      check(kvsift_model_decode(model, 1, &seq, &next), "decode");
    }
    tok_s = n_decode / std::chrono::duration<double>(Clock::now() - t1).count();
    kvsift_model_stats stats;
    check(kvsift_model_get_stats(model, &stats), "stats");
    attention_share = stats.decode_attention_seconds / stats.decode_seconds;
  }
  nlohmann::json out = {{"tok_s", tok_s},
                        {"version", std::string("kvsift ") + kvsift_version_string()},
                        {"weights", weights_f32 ? "f32" : "bf16"}};
  if (mode == "decode") out["attention_share"] = attention_share;
  std::printf("%s\n", out.dump().c_str());
  return apps::kExitOk;
}
