// Agreement with llama.cpp on the same GGUF: tests/data/smollm2_llamacpp.json was written by
// tools/peer/make_fixture.py (llama-cpp-python; version and settings inside). Checks token ids,
// the next-token distribution at recorded positions, and 32-token greedy continuations.
//
// The two runtimes round differently: llama.cpp multiplies Q4_1 weights with activations
// quantized to 8 bits per 32-element block (Q8_1) and keeps K/V in fp16; kvsift dequantizes the
// weights (bf16 by default, f32 on request) and keeps K/V in fp16. So logits agree to a tolerance,
// not bit for bit; the tolerances below are measured values with headroom, stated per mode. With
// quantized weights (KVSIFT_WEIGHTS_QUANTIZED) kvsift's decode runs as llama.cpp's does, Q4_1
// blocks times activations quantized per block of 32, while its prefill (the recorded positions'
// logits) multiplies bf16 tiles of the same blocks, as the bf16 mode does.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "kvsift/kvsift.h"
#include "model_handle.hpp"

namespace {

using nlohmann::json;

const json& fixture() {
  static const json data = json::parse(std::ifstream(KVSIFT_TEST_DATA "/smollm2_llamacpp.json"));
  return data;
}

using kvsift::test::Model;
using kvsift::test::model_path;

// mode: 0 bf16 weights, 1 f32 (through the older weights_f32 field), 2 the file's blocks.
Model load(int mode) {
  kvsift_model_params params;
  kvsift_model_params_init(&params);
  params.n_ctx = 2048;
  params.weights_f32 = mode == 1;
  if (mode == 2) params.weights = KVSIFT_WEIGHTS_QUANTIZED;
  kvsift_model* model = nullptr;
  EXPECT_EQ(kvsift_model_load(model_path(), &params, &model), KVSIFT_STATUS_OK)
      << kvsift_last_error();
  return Model(model);
}

double log_sum_exp(const float* logits, std::size_t n) {
  const float m = *std::max_element(logits, logits + n);
  double sum = 0.0;
  for (std::size_t i = 0; i < n; ++i) sum += std::exp(double(logits[i]) - m);
  return m + std::log(sum);
}

// The noise floor: at position 0 only the matrix products act (attention over one token is the
// identity), and there the two runtimes' log-probabilities already differ by up to 0.17 (f32
// weights) and 0.19 (bf16) -- llama.cpp's 8-bit activations. Over every recorded position the
// worst is 0.43 (bf16) and 0.46 (f32, chat prompt position 10, a token with p = 0.1).
// Tokens below p = 1e-4 are left out: their log-probabilities carry the same absolute noise on a
// scale no decision depends on (the worst, 0.64, sits at p = 3e-9).
constexpr double kMinLogProb = -9.21;  // ln(1e-4)
constexpr double kLogProbBound = 0.6;
// A greedy step decides by the gap between the two best logits. Where llama.cpp's own gap is below
// twice the noise floor, either runtime may pick either token; above it they must agree.
constexpr double kDecidedMargin = 0.35;

// Our logits at one recorded position against llama.cpp's: the greedy token must be the same, and
// the worst log-probability difference over the recorded tokens with p >= 1e-4 is kept.
struct LogProbDifference {
  double worst = 0.0;        // over every position
  double worst_first = 0.0;  // at position 0

  void add(const float* logits, std::size_t V, const json& at, const json& prompt) {
    const std::size_t pos = at["pos"];
    const double lse = log_sum_exp(logits, V);
    const double peer_lse = at["logsumexp"];
    const auto& top = at["top"];
    EXPECT_EQ(std::max_element(logits, logits + V) - logits, top[0][0].get<int32_t>())
        << prompt["name"] << " position " << pos;
    for (const auto& pair : top) {
      const double theirs = pair[1].get<double>() - peer_lse;
      if (theirs < kMinLogProb) continue;
      const double diff = std::abs(logits[pair[0].get<int32_t>()] - lse - theirs);
      worst = std::max(worst, diff);
      if (pos == 0) worst_first = std::max(worst_first, diff);
    }
  }
};

class PeerAgreement : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (model_path() == nullptr) GTEST_SKIP() << "KVSIFT_MODEL is not set (make test sets it)";
    model_ = load(GetParam());
    ASSERT_NE(model_, nullptr);
  }
  Model model_;
};

std::string mode_name(const ::testing::TestParamInfo<int>& info) {
  return info.param == 2 ? "quantized_weights" : info.param ? "f32_weights" : "bf16_weights";
}

}  // namespace

TEST(PeerAgreementTokens, tokenization_is_identical_to_llama_cpp) {
  if (model_path() == nullptr) GTEST_SKIP() << "KVSIFT_MODEL is not set (make test sets it)";
  Model model = load(0);
  for (const auto& entry : fixture()["tokenize"]) {
    const std::string text = entry["text"];
    const bool special = entry["special"];
    std::vector<int32_t> ids(text.size() + 8);
    std::size_t n = 0;
    ASSERT_EQ(
        kvsift_tokenize(model.get(), text.data(), text.size(), special, ids.data(), ids.size(), &n),
        KVSIFT_STATUS_OK);
    ids.resize(n);
    EXPECT_EQ(ids, entry["ids"].get<std::vector<int32_t>>())
        << "text: " << text << " special: " << special;
  }
}

TEST_P(PeerAgreement, next_token_distributions_match_at_recorded_positions) {
  LogProbDifference difference;
  for (const auto& prompt : fixture()["logits"]) {
    const auto ids = prompt["ids"].get<std::vector<int32_t>>();
    const std::size_t V = fixture()["n_vocab"];
    std::vector<float> all(ids.size() * V);
    int32_t seq = -1;
    ASSERT_EQ(kvsift_model_sequence_create(model_.get(), &seq), KVSIFT_STATUS_OK);
    ASSERT_EQ(kvsift_model_prefill(model_.get(), seq, ids.data(), ids.size(), all.data(), nullptr,
                                   nullptr),
              KVSIFT_STATUS_OK)
        << kvsift_last_error();
    for (const auto& at : prompt["positions"])
      difference.add(all.data() + at["pos"].get<std::size_t>() * V, V, at, prompt);
    ASSERT_EQ(kvsift_model_sequence_free(model_.get(), seq), KVSIFT_STATUS_OK);
  }
  std::printf("log-probability difference, tokens with p >= 1e-4: worst %.3f; at position 0 %.3f\n",
              difference.worst, difference.worst_first);
  EXPECT_LT(difference.worst, kLogProbBound);
}

// With quantized weights the recorded positions' logits above come from prefill (bf16 tiles); here
// the same positions are reached token by token through decode, whose products are the file's
// Q4_1/Q8_0 blocks times 8-bit block-quantized activations, as llama.cpp computes them.
//
// The bound is wider than kLogProbBound, and why: quantizing activations per block of 32 to
// max|x|/127 steps is itself a noise source of that size in this model, whose activations have
// outlier channels that set a block's step. Measured on these positions and tokens (p >= 1e-4),
// kvsift's quantized decode differs from its own f32 decode by up to 0.62 in log-probability
// (bf16 decode: 0.13). llama.cpp's logits carry the same kind of noise, and the two realizations
// are largely independent: a small difference upstream (llama.cpp rounds q and the attention
// weights to f16) moves activations across rounding boundaries, each a whole step. Measured:
// 0.73 here, against 0.49 (bf16) and 0.46 (f32) for the same decode-path comparison; position 0
// (prefill) stays at 0.19. Bound 0.9: the measured worst with the headroom kLogProbBound has, and
// about sqrt(2) times the one-sided 0.62.
constexpr double kQuantizedDecodeLogProbBound = 0.9;

TEST(PeerAgreementQuantized, decode_logits_match_at_recorded_positions) {
  if (model_path() == nullptr) GTEST_SKIP() << "KVSIFT_MODEL is not set (make test sets it)";
  Model model = load(2);
  LogProbDifference difference;
  for (const auto& prompt : fixture()["logits"]) {
    const auto ids = prompt["ids"].get<std::vector<int32_t>>();
    std::size_t last = 0;
    for (const auto& at : prompt["positions"]) last = std::max<std::size_t>(last, at["pos"]);
    int32_t seq = -1;
    ASSERT_EQ(kvsift_model_sequence_create(model.get(), &seq), KVSIFT_STATUS_OK);
    ASSERT_EQ(kvsift_model_prefill(model.get(), seq, ids.data(), 1, nullptr, nullptr, nullptr),
              KVSIFT_STATUS_OK);
    for (std::size_t pos = 0; pos <= last; ++pos) {
      if (pos > 0) {
        ASSERT_EQ(kvsift_model_decode(model.get(), 1, &seq, &ids[pos]), KVSIFT_STATUS_OK)
            << kvsift_last_error();
      }
      for (const auto& at : prompt["positions"]) {
        if (at["pos"].get<std::size_t>() != pos) continue;
        const float* logits = nullptr;
        std::size_t V = 0;
        ASSERT_EQ(kvsift_model_logits(model.get(), seq, &logits, &V), KVSIFT_STATUS_OK);
        difference.add(logits, V, at, prompt);
      }
    }
    ASSERT_EQ(kvsift_model_sequence_free(model.get(), seq), KVSIFT_STATUS_OK);
  }
  std::printf(
      "decode, quantized weights: log-probability difference, tokens with p >= 1e-4: "
      "worst %.3f; at position 0 %.3f\n",
      difference.worst, difference.worst_first);
  EXPECT_LT(difference.worst, kQuantizedDecodeLogProbBound);
}

TEST_P(PeerAgreement, greedy_continuations_match_llama_cpp) {
  for (const auto& run : fixture()["greedy"]) {
    const auto prompt = run["prompt_ids"].get<std::vector<int32_t>>();
    const auto peer = run["generated_ids"].get<std::vector<int32_t>>();
    // Teacher-forced: at each step both runtimes see the same prefix (llama.cpp's continuation),
    // so one near-tie cannot derail the rest of the comparison.
    int32_t seq = -1;
    ASSERT_EQ(kvsift_model_sequence_create(model_.get(), &seq), KVSIFT_STATUS_OK);
    ASSERT_EQ(kvsift_model_prefill(model_.get(), seq, prompt.data(), prompt.size(), nullptr,
                                   nullptr, nullptr),
              KVSIFT_STATUS_OK);
    int same = 0;
    std::size_t free_running = 0;
    bool diverged = false;
    for (std::size_t i = 0; i < peer.size(); ++i) {
      const float* logits = nullptr;
      std::size_t V = 0;
      ASSERT_EQ(kvsift_model_logits(model_.get(), seq, &logits, &V), KVSIFT_STATUS_OK);
      const int32_t ours = static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
      same += ours == peer[i];
      const double peer_margin = run["top1_top2_margin"][i];
      if (ours != peer[i]) {
        std::printf(
            "  %s step %zu: kvsift %d, llama.cpp %d; llama.cpp's top-2 margin %.3f, kvsift's "
            "%.3f\n",
            run["name"].get<std::string>().c_str(), i, ours, peer[i], peer_margin,
            logits[ours] - logits[peer[i]]);
        EXPECT_LT(peer_margin, kDecidedMargin)
            << run["name"] << " step " << i << ": a decided step differs";
      }
      diverged = diverged || ours != peer[i];
      free_running += diverged ? 0 : 1;
      ASSERT_EQ(kvsift_model_decode(model_.get(), 1, &seq, &peer[i]), KVSIFT_STATUS_OK);
    }
    std::printf("%s: %d of %zu greedy tokens agree; identical free-running prefix %zu\n",
                run["name"].get<std::string>().c_str(), same, peer.size(), free_running);
    // 30 of 32 per prompt. Near-ties make this a property of the prompt as much as of the
    // runtime: a continuation with several steps below the noise floor (an earlier "dragon story"
    // prompt had four, with llama.cpp margins of 0.03-0.13) cannot promise it to any runtime that
    // rounds differently; the decided steps above are the strict check.
    EXPECT_GE(same, static_cast<int>(peer.size()) - 2) << run["name"];
    ASSERT_EQ(kvsift_model_sequence_free(model_.get(), seq), KVSIFT_STATUS_OK);
  }
}

INSTANTIATE_TEST_SUITE_P(Weights, PeerAgreement, ::testing::Values(0, 1, 2), mode_name);
