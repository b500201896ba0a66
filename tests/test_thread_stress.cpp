// Handles used from many threads at once give exactly what they give alone: 8 threads, each with
// its own cache (then its own model), repeat the work of a serial run, and every output is
// compared bit for bit. make test-tsan (Makefile) builds this binary and the library with
// ThreadSanitizer, where a race between two handles, or inside one handle's pool
// (lib/core/thread_pool.hpp), fails the run even when the outputs happen to agree.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "kvsift/kvsift.h"
#include "kvsift/kvsift.hpp"

namespace {

constexpr int kThreads = 8;

// Runs work(t) for t in 0..kThreads-1 on kThreads threads at once, then again one after the other
// on this thread, and compares what each t produced.
template <class Work>
void expect_parallel_equals_serial(const Work& work) {
  std::vector<std::vector<float>> parallel(kThreads), serial(kThreads);
  {
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] { parallel[static_cast<std::size_t>(t)] = work(t); });
    for (std::thread& thread : threads) thread.join();
  }
  for (int t = 0; t < kThreads; ++t) serial[static_cast<std::size_t>(t)] = work(t);
  for (std::size_t t = 0; t < kThreads; ++t) {
    ASSERT_FALSE(serial[t].empty()) << "thread " << t << " produced nothing";
    ASSERT_EQ(parallel[t].size(), serial[t].size()) << "thread " << t;
    std::size_t first = 0;
    while (first < serial[t].size() &&
           std::memcmp(&parallel[t][first], &serial[t][first], sizeof(float)) == 0)
      ++first;
    EXPECT_EQ(first, serial[t].size())
        << "thread " << t << ": output " << first << " is " << parallel[t][first]
        << " in parallel, " << serial[t][first] << " serially";
  }
}

std::vector<float> normals(std::mt19937& rng, std::size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> x(n);
  for (float& v : x) v = normal(rng);
  return x;
}

#define KVSIFT_OK(call) ASSERT_EQ((call), KVSIFT_STATUS_OK) << kvsift_last_error()

// ---- Caches ------------------------------------------------------------------------------------

constexpr uint32_t kCacheSteps = 1000;
constexpr uint32_t kLayers = 2, kKvHeads = 2, kGroup = 2, kHeadDim = 64;

// One cache with a two-thread pool (so that its pool's hand-offs run too) and LOCKS as its
// selector: each step appends a token to every layer, then attends it densely (kvsift_attend) and
// through the selector (kvsift_attend_selected). Returns every output of every step.
void cache_work(int t, std::vector<float>& outputs) {
  kvsift_cache_params params;
  kvsift_cache_params_init(&params);
  params.n_layers = kLayers;
  params.n_kv_heads = kKvHeads;
  params.group_size = kGroup;
  params.head_dim = kHeadDim;
  params.page_tokens = 16;
  params.max_pages = 2 * kLayers * kKvHeads * (kCacheSteps / 16 + 1);
  params.n_threads = 2;
  // A failed creation throws kvsift::error; on a worker thread that ends the run with its message.
  const kvsift::cache cache(params);
  kvsift_selector_policy policy;
  kvsift_selector_policy_init(&policy);
  policy.selector = KVSIFT_SELECTOR_LOCKS;
  policy.budget = 128;  // tokens: 8 of the 63 pages at the end
  KVSIFT_OK(kvsift_cache_set_selector(cache.get(), &policy));
  int32_t seq = -1;
  KVSIFT_OK(kvsift_sequence_create(cache.get(), &seq));

  const std::size_t kv = std::size_t{kKvHeads} * kHeadDim, q_size = kv * kGroup;
  std::mt19937 rng(static_cast<uint32_t>(1000 + t));
  std::vector<float> out(q_size);
  outputs.reserve(std::size_t{kCacheSteps} * kLayers * 2 * q_size);
  for (uint32_t step = 0; step < kCacheSteps; ++step)
    for (uint32_t layer = 0; layer < kLayers; ++layer) {
      const std::vector<float> k = normals(rng, kv, 1.0f), v = normals(rng, kv, 1.0f),
                               q = normals(rng, q_size, 0.5f);
      KVSIFT_OK(kvsift_append(cache.get(), seq, layer, 1, k.data(), v.data()));
      KVSIFT_OK(kvsift_attend(cache.get(), layer, 1, &seq, q.data(), out.data(), nullptr));
      outputs.insert(outputs.end(), out.begin(), out.end());
      KVSIFT_OK(kvsift_attend_selected(cache.get(), layer, 1, &seq, q.data(), out.data(), nullptr));
      outputs.insert(outputs.end(), out.begin(), out.end());
    }
}

TEST(ThreadStress, eight_caches_on_eight_threads_attend_as_they_do_serially) {
  expect_parallel_equals_serial([](int t) {
    std::vector<float> outputs;
    cache_work(t, outputs);
    return outputs;
  });
}

// ---- Models ------------------------------------------------------------------------------------

// A tiny random Llama written as a GGUF file, not SmolLM2-135M: under ThreadSanitizer on the
// 2-core development VM (load average 8), one SmolLM2 model with a two-thread pool took 11 s to
// load, 0.9 s per decode step and 2.0 GB resident, so 8 models at once plus the serial run would
// need about 16 GB and 200 steps over half an hour. The tiny model runs the same code: oneDNN
// products (prefill, and decode with float32 weights), the bf16 decode kernels, attention and
// selection on each model's own pool.
constexpr uint32_t kEmbd = 128, kHeads = 2, kModelKvHeads = 1, kFf = 384, kBlocks = 2, kVocab = 256;

class GgufWriter {
 public:
  void u32(uint32_t x) { put(x); }
  void u64(uint64_t x) { put(x); }
  void str(const std::string& s) {
    u64(s.size());
    bytes_.insert(bytes_.end(), s.begin(), s.end());
  }
  // Metadata values, by GGUF type id: 4 u32, 5 i32, 6 f32, 8 string, 9 array.
  void kv_u32(const std::string& key, uint32_t x) {
    str(key);
    u32(4);
    u32(x);
  }
  void kv_f32(const std::string& key, float x) {
    str(key);
    u32(6);
    put(x);
  }
  void kv_str(const std::string& key, const std::string& s) {
    str(key);
    u32(8);
    str(s);
  }
  void kv_strings(const std::string& key, const std::vector<std::string>& items) {
    str(key);
    u32(9);
    u32(8);
    u64(items.size());
    for (const std::string& s : items) str(s);
  }
  void kv_i32s(const std::string& key, const std::vector<int32_t>& items) {
    str(key);
    u32(9);
    u32(5);
    u64(items.size());
    for (int32_t x : items) put(x);
  }
  template <class T>
  void put(T x) {
    uint8_t raw[sizeof(T)];
    std::memcpy(raw, &x, sizeof(T));
    bytes_.insert(bytes_.end(), raw, raw + sizeof(T));
  }
  void pad() {
    while (bytes_.size() % 32 != 0) bytes_.push_back(0);
  }
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

// GPT-2's byte-level alphabet: byte b is the token whose text is this code point, in UTF-8.
std::string byte_token(int b) {
  uint32_t cp = static_cast<uint32_t>(b);
  if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))) {
    int n = 0;
    for (int c = 0; c < b; ++c)
      if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF))) ++n;
    cp = 256 + static_cast<uint32_t>(n);
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

std::string write_tiny_model() {
  struct Tensor {
    std::string name;
    uint64_t in, out;  // GGUF dims {in, out}: rows of `in` float32, one per output
  };
  std::vector<Tensor> tensors{{"token_embd.weight", kEmbd, kVocab},
                              {"output_norm.weight", kEmbd, 1}};
  const uint64_t head_dim = kEmbd / kHeads, kv_dim = head_dim * kModelKvHeads;
  for (uint32_t b = 0; b < kBlocks; ++b) {
    const std::string p = "blk." + std::to_string(b) + ".";
    tensors.push_back({p + "attn_norm.weight", kEmbd, 1});
    tensors.push_back({p + "ffn_norm.weight", kEmbd, 1});
    tensors.push_back({p + "attn_q.weight", kEmbd, kEmbd});
    tensors.push_back({p + "attn_k.weight", kEmbd, kv_dim});
    tensors.push_back({p + "attn_v.weight", kEmbd, kv_dim});
    tensors.push_back({p + "attn_output.weight", kEmbd, kEmbd});
    tensors.push_back({p + "ffn_gate.weight", kEmbd, kFf});
    tensors.push_back({p + "ffn_up.weight", kEmbd, kFf});
    tensors.push_back({p + "ffn_down.weight", kFf, kEmbd});
  }
  std::vector<std::string> vocab;
  for (int b = 0; b < 256; ++b) vocab.push_back(byte_token(b));

  GgufWriter w;
  w.u32(0x46554747);  // "GGUF"
  w.u32(3);
  w.u64(tensors.size());
  w.u64(13);
  w.kv_str("general.architecture", "llama");
  w.kv_u32("llama.block_count", kBlocks);
  w.kv_u32("llama.embedding_length", kEmbd);
  w.kv_u32("llama.feed_forward_length", kFf);
  w.kv_u32("llama.attention.head_count", kHeads);
  w.kv_u32("llama.attention.head_count_kv", kModelKvHeads);
  w.kv_u32("llama.context_length", 2048);
  w.kv_f32("llama.rope.freq_base", 10000.0f);
  w.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5f);
  w.kv_str("tokenizer.ggml.model", "gpt2");
  w.kv_strings("tokenizer.ggml.tokens", vocab);
  w.kv_i32s("tokenizer.ggml.token_type", std::vector<int32_t>(vocab.size(), 1));
  w.kv_strings("tokenizer.ggml.merges", {});
  uint64_t offset = 0;
  for (const Tensor& t : tensors) {
    w.str(t.name);
    w.u32(t.out == 1 ? 1 : 2);
    w.u64(t.in);
    if (t.out != 1) w.u64(t.out);
    w.u32(0);  // float32
    w.u64(offset);
    offset += (t.in * t.out * 4 + 31) / 32 * 32;
  }
  w.pad();
  std::mt19937 rng(7);
  for (const Tensor& t : tensors) {
    // Norm weights near 1, matrices scaled by 1/sqrt(in) so that activations stay O(1).
    const bool norm = t.out == 1;
    std::vector<float> values =
        normals(rng, t.in * t.out, norm ? 0.1f : 1.0f / std::sqrt(float(t.in)));
    if (norm)
      for (float& x : values) x += 1.0f;
    for (float x : values) w.put(x);
    w.pad();
  }
  const std::string path = (std::filesystem::temp_directory_path() /
                            ("kvsift_stress_" + std::to_string(::getpid()) + ".gguf"))
                               .string();
  std::ofstream file(path, std::ios::binary);
  file.write(reinterpret_cast<const char*>(w.bytes().data()),
             static_cast<std::streamsize>(w.bytes().size()));
  return file ? path : std::string();
}

constexpr uint32_t kPromptTokens = 40;
// Decode steps per model, as many as the caches take: 200 took 12 s under ThreadSanitizer for the
// 8 parallel and 8 serial runs together (the cache test beside it, 1,000 steps, about 100 s).
constexpr uint32_t kDecodeSteps = 1000;

// One model with a two-thread pool: models with an odd t keep float32 weights (decode products
// through oneDNN; bf16 decode runs kvsift's own kernels), and t = 2, 3, 6, 7 select with LOCKS.
// A prompt prefill (oneDNN, both weight types), then greedy decode steps. Returns the logits after
// the prefill and after every step.
void model_work(const std::string& path, int t, std::vector<float>& outputs) {
  kvsift_model_params params;
  kvsift_model_params_init(&params);
  params.n_ctx = kPromptTokens + kDecodeSteps + 1;
  params.n_threads = 2;
  params.weights_f32 = t % 2;
  const kvsift::model_runner model(path, params);  // a failed load throws, as for the cache
  if (t % 4 >= 2) {
    kvsift_selector_policy policy;
    kvsift_selector_policy_init(&policy);
    policy.selector = KVSIFT_SELECTOR_LOCKS;
    policy.budget = 64;
    KVSIFT_OK(kvsift_model_set_selector(model.get(), &policy));
  }
  int32_t seq = -1;
  KVSIFT_OK(kvsift_model_sequence_create(model.get(), &seq));
  std::mt19937 rng(static_cast<uint32_t>(2000 + t));
  std::vector<int32_t> prompt(kPromptTokens);
  for (int32_t& token : prompt) token = static_cast<int32_t>(rng() % kVocab);
  KVSIFT_OK(kvsift_model_prefill(model.get(), seq, prompt.data(), prompt.size(), nullptr, nullptr,
                                 nullptr));
  for (uint32_t step = 0;; ++step) {
    const float* logits = nullptr;
    std::size_t n_vocab = 0;
    KVSIFT_OK(kvsift_model_logits(model.get(), seq, &logits, &n_vocab));
    ASSERT_EQ(n_vocab, kVocab);
    outputs.insert(outputs.end(), logits, logits + n_vocab);
    if (step == kDecodeSteps) break;
    int32_t next = 0;
    for (int32_t i = 1; i < static_cast<int32_t>(n_vocab); ++i)
      if (logits[i] > logits[next]) next = i;
    KVSIFT_OK(kvsift_model_decode(model.get(), 1, &seq, &next));
  }
}

TEST(ThreadStress, eight_models_on_eight_threads_decode_as_they_do_serially) {
  const std::string path = write_tiny_model();
  ASSERT_FALSE(path.empty()) << "cannot write the tiny model to the temporary directory";
  expect_parallel_equals_serial([&](int t) {
    std::vector<float> outputs;
    model_work(path, t, outputs);
    return outputs;
  });
  std::remove(path.c_str());
}

}  // namespace
