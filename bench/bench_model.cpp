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
#include <memory>
#include <string>
#include <vector>

#include "kvsift/kvsift.h"

namespace {

void check(kvsift_status status, const char* what) {
  if (status == KVSIFT_STATUS_OK) return;
  std::fprintf(stderr, "kvsift-bench-model: %s: %s\n", what, kvsift_last_error());
  std::exit(1);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvsift-bench-model: timed prefill or decode, JSON on the last line"};
  std::string model_path, mode = "decode", tokens_file;
  int threads = 0;
  uint32_t ctx = 8192, n_decode = 64;
  int weights_f32 = 0;
  app.add_option("--model", model_path, "GGUF file")->required();
  app.add_option("--mode", mode, "prefill or decode")->check(CLI::IsMember({"prefill", "decode"}));
  app.add_option("--tokens", tokens_file, "JSON list of prompt token ids")->required();
  app.add_option("--threads", threads, "threads (0: all)");
  app.add_option("--ctx", ctx, "context positions to allocate");
  app.add_option("--n-decode", n_decode, "decode steps to time");
  app.add_option("--weights-f32", weights_f32, "1: float32 weights instead of bf16");
  CLI11_PARSE(app, argc, argv);

  std::vector<int32_t> tokens =
      nlohmann::json::parse(std::ifstream(tokens_file)).get<std::vector<int32_t>>();
  kvsift_model_params params;
  kvsift_model_params_init(&params);
  params.n_ctx = ctx;
  params.n_threads = threads;
  params.weights_f32 = weights_f32;
  kvsift_model* model = nullptr;
  check(kvsift_model_load(model_path.c_str(), &params, &model), "load");
  std::unique_ptr<kvsift_model, decltype(&kvsift_model_free)> owner(model, kvsift_model_free);
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
  return 0;
}
