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
#include <span>
#include <string>
#include <vector>

#include "kvsift/kvsift.hpp"

namespace {

int run(const std::string& model_path, const std::string& mode, const std::vector<int32_t>& tokens,
        int threads, uint32_t ctx, uint32_t n_decode, int weights_f32) {
  kvsift_model_params params = kvsift::model_runner::default_params();
  params.n_ctx = ctx;
  params.n_threads = threads;
  params.weights_f32 = weights_f32;
  kvsift::model_runner model(model_path, params);
  const int32_t seq = model.create_sequence();

  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  model.prefill(seq, tokens);
  const double prefill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  double tok_s = tokens.size() / prefill_s;
  double attention_share = 0.0;
  if (mode == "decode") {
    const auto t1 = Clock::now();
    for (uint32_t i = 0; i < n_decode; ++i) {
      const std::span<const float> logits = model.logits(seq);
      const int32_t next =
          static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
      model.decode(std::span(&seq, 1), std::span(&next, 1));
    }
    tok_s = n_decode / std::chrono::duration<double>(Clock::now() - t1).count();
    const kvsift_model_stats stats = model.stats();
    attention_share = stats.decode_attention_seconds / stats.decode_seconds;
  }
  nlohmann::json out = {{"tok_s", tok_s},
                        {"version", "kvsift " + std::string(kvsift::linked_version_string())},
                        {"weights", weights_f32 ? "f32" : "bf16"}};
  if (mode == "decode") out["attention_share"] = attention_share;
  std::printf("%s\n", out.dump().c_str());
  return 0;
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

  const std::vector<int32_t> tokens =
      nlohmann::json::parse(std::ifstream(tokens_file)).get<std::vector<int32_t>>();
  try {
    return run(model_path, mode, tokens, threads, ctx, n_decode, weights_f32);
  } catch (const kvsift::error& e) {
    std::fprintf(stderr, "kvsift-bench-model: %s: %s\n",
                 std::string(kvsift::status_string(e.status())).c_str(), e.what());
    return 1;
  }
}
