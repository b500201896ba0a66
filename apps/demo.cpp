// kvsift-demo: a long document and a question about a fact planted in it, answered by a real
// model (SmolLM2-135M-Instruct by default) whose KV cache lives in kvsift's paged host cache.
// Uses only the public C API, as an embedding application would.
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/command_line.hpp"
#include "common/devils_dictionary.hpp"
#include "common/exit_codes.hpp"
#include "common/model_path.hpp"
#include "common/progress.hpp"
#include "common/selector_names.hpp"
#include "kvsift/kvsift.hpp"

namespace {

// The built-in document: the start of Ambrose Bierce's The Devil's Dictionary (public domain,
// apps/common/devils_dictionary.txt), with one invented fact planted halfway through.
constexpr std::size_t kDocumentChars = 20000;  // about 4.5K SmolLM2 tokens
constexpr const char* kPlantedFact =
    "Editor's note: the lighthouse keeper on Gull Island keeps a grey cat named Marmalade.";
constexpr const char* kDefaultQuestion =
    "According to the editor's note in the text above, what is the name of the lighthouse keeper's "
    "cat?";

// The budget of a sparse selector when --budget is not given: a tenth of the context, which
// keeps the built-in question answered with every selector (README, the demo's table).
constexpr double kDefaultSparseBudget = 0.1;
constexpr uint32_t kMostContext = 1u << 20;  // the model's own limit is checked when it loads

struct Failure {
  std::string message;
  int exit_code = kvsift::apps::kExitFailure;
};

void check(kvsift_status status, const char* what) {
  if (status != KVSIFT_STATUS_OK)
    throw Failure{std::string(what) + ": " + kvsift_status_string(status) + ": " +
                  kvsift_last_error()};
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Failure{"cannot read the prompt file " + path, kvsift::apps::kExitInputUnreadable};
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string builtin_document() {
  std::string text;
  try {
    text = kvsift::apps::read_devils_dictionary();
  } catch (const std::runtime_error& e) {
    throw Failure{std::string(e.what()) + " (the built-in document; or pass --prompt-file)"};
  }
  std::string doc = text.substr(0, kDocumentChars);
  doc = doc.substr(0, doc.rfind("\n\n"));  // end at a paragraph
  const std::size_t middle = doc.find("\n\n", doc.size() / 2);
  return doc.substr(0, middle) + "\n\n" + kPlantedFact + doc.substr(middle);
}

template <class Fill>
std::string two_call(Fill fill) {
  std::size_t length = 0;
  std::string out(256, '\0');
  kvsift_status status = fill(out.data(), out.size(), &length);
  if (status == KVSIFT_STATUS_BUFFER_TOO_SMALL) {
    out.resize(length);
    status = fill(out.data(), out.size(), &length);
  }
  check(status, "text output");
  out.resize(length);
  return out;
}

struct Options {
  std::string model = kvsift::apps::default_model_path();
  std::string prompt_file;
  std::string question = kDefaultQuestion;
  uint32_t ctx = 8192;
  uint32_t max_new = 48;
  std::string selector = "dense";
  double budget = 0.0;  // 0: none given (validate() sets the sparse default)
  int threads = 0;
  std::string device = "cpu";
  uint32_t batch = 1;
  bool ignore_end = false;
  bool print_tokens = false;
  std::string select_on = "cpu";
  uint64_t seed = 0;
  float temperature = 0.0f;
  float top_p = 1.0f;
  double epsilon = 1e-3;
  double compression = 2.5;
};

int run(const Options& o) {
  kvsift_selector_policy policy;
  kvsift_selector_policy_init(&policy);
  check(kvsift_selector_from_name(o.selector.c_str(), &policy.selector), "--selector");
  policy.budget = o.budget;
  policy.locks.epsilon = o.epsilon;
  policy.s4r.compression = o.compression;
  policy.device = kvsift::apps::device_index(o.select_on);
  kvsift_model_params params;
  kvsift_model_params_init(&params);
  params.device = kvsift::apps::device_index(o.device);
  params.max_seqs = o.batch;
  params.n_ctx = o.ctx;
  params.n_threads = o.threads;
  kvsift_model* model = nullptr;
  std::fprintf(stderr, "loading %s\n", o.model.c_str());
  const auto t_load = std::chrono::steady_clock::now();
  if (const kvsift_status loaded = kvsift_model_load(o.model.c_str(), &params, &model);
      loaded != KVSIFT_STATUS_OK)
    throw Failure{std::string("loading the model: ") + kvsift_status_string(loaded) + ": " +
                      kvsift_last_error(),
                  // The parameters come from the options: the library's refusal of one (--ctx
                  // beyond the model's context) is a usage error, found before the weights load.
                  loaded == KVSIFT_STATUS_INVALID_ARGUMENT ? kvsift::apps::kExitUsage
                  : loaded == KVSIFT_STATUS_IO_ERROR || loaded == KVSIFT_STATUS_INVALID_FILE
                      ? kvsift::apps::kExitInputUnreadable
                      : kvsift::apps::kExitFailure};
  const kvsift::model_runner owner(model);  // frees the model on every way out
  const double load_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_load).count();
  kvsift_model_info info;
  check(kvsift_model_get_info(model, &info), "model info");
  check(kvsift_model_set_selector(model, &policy), "--selector/--budget");

  const std::string document =
      o.prompt_file.empty() ? builtin_document() : read_file(o.prompt_file);
  const std::string user = document + "\n\n" + o.question;
  const kvsift_chat_message messages[] = {{"user", user.c_str()}};
  const std::string prompt = two_call([&](char* out, std::size_t cap, std::size_t* len) {
    return kvsift_chat_template(model, messages, 1, 1, out, cap, len);
  });
  std::size_t n_prompt = 0;
  kvsift_status status =
      kvsift_tokenize(model, prompt.data(), prompt.size(), 1, nullptr, 0, &n_prompt);
  std::vector<int32_t> tokens(n_prompt);
  if (status == KVSIFT_STATUS_BUFFER_TOO_SMALL || status == KVSIFT_STATUS_OK)
    status = kvsift_tokenize(model, prompt.data(), prompt.size(), 1, tokens.data(), tokens.size(),
                             &n_prompt);
  check(status, "tokenizing the prompt");
  if (n_prompt + o.max_new > info.n_ctx)
    throw Failure{"the prompt (" + std::to_string(n_prompt) + " tokens) plus --max-new " +
                  std::to_string(o.max_new) + " exceeds the context of " +
                  std::to_string(info.n_ctx) + " positions"};
  std::fprintf(stderr,
               "model: %u layers, %u query / %u KV heads, head_dim %u, %u-token vocabulary (loaded "
               "in %.2f s)\n",
               info.n_layers, info.n_heads, info.n_kv_heads, info.head_dim, info.n_vocab, load_s);
  std::fprintf(stderr, "prompt: %zu tokens (document %zu bytes); selector: %s\n", n_prompt,
               document.size(), o.selector.c_str());

  // --batch N decodes N sequences of the same prompt together (one prefill, forked); the answer
  // printed is the first one's, and the others must agree with it under greedy decoding.
  std::vector<int32_t> seqs(o.batch, -1);
  check(kvsift_model_sequence_create(model, &seqs[0]), "creating the sequence");
  kvsift::apps::Progress progress("prefill");
  check(kvsift_model_prefill(model, seqs[0], tokens.data(), tokens.size(), nullptr,
                             kvsift::apps::Progress::callback, &progress),
        "prefill");
  for (uint32_t b = 1; b < o.batch; ++b)
    check(kvsift_model_sequence_fork(model, seqs[0], &seqs[b]), "forking the sequence");

  kvsift_sampler_params sp;
  kvsift_sampler_params_init(&sp);
  sp.temperature = o.temperature;
  sp.top_p = o.top_p;
  sp.seed = o.seed;
  kvsift_sampler* sampler = nullptr;
  check(kvsift_sampler_create(&sp, &sampler), "sampler");
  const kvsift::sampler sampler_owner(sampler);

  std::printf("\nQ: %s\nA: ", o.question.c_str());
  std::fflush(stdout);
  std::vector<int32_t> answer, next(o.batch);
  std::size_t printed = 0;
  for (uint32_t i = 0; i < o.max_new; ++i) {
    for (uint32_t b = 0; b < o.batch; ++b) {
      const float* logits = nullptr;
      std::size_t n_vocab = 0;
      check(kvsift_model_logits(model, seqs[b], &logits, &n_vocab), "logits");
      check(kvsift_sampler_sample(sampler, logits, n_vocab, &next[b]), "sampling");
    }
    if (!o.ignore_end && kvsift_token_is_end(model, next[0])) break;
    answer.push_back(next[0]);
    const std::string text = two_call([&](char* out, std::size_t cap, std::size_t* len) {
      return kvsift_detokenize(model, answer.data(), answer.size(), out, cap, len);
    });
    std::fwrite(text.data() + printed, 1, text.size() - printed, stdout);
    std::fflush(stdout);
    printed = text.size();
    check(kvsift_model_decode(model, o.batch, seqs.data(), next.data()), "decode");
  }
  std::printf("\n\n");

  kvsift_model_stats stats;
  check(kvsift_model_get_stats(model, &stats), "stats");
  const bool sparse = policy.selector != KVSIFT_SELECTOR_DENSE;
  std::printf("context tokens:         %zu prompt + %zu generated", n_prompt, answer.size());
  if (o.batch > 1) std::printf(", %u sequences", o.batch);
  std::printf("\nattention on:           %s\n", o.device.c_str());
  if (o.print_tokens) {
    std::printf("answer token ids:      ");
    for (int32_t t : answer) std::printf(" %d", t);
    std::printf("\n");
  }
  std::printf("prefill:                %.1f tokens/s (%.2f s)\n",
              stats.prefill_tokens / stats.prefill_seconds, stats.prefill_seconds);
  if (stats.decode_tokens > 0) {
    std::printf("decode:                 %.1f tokens/s (%llu tokens over %u sequences)\n",
                stats.decode_tokens / stats.decode_seconds,
                static_cast<unsigned long long>(stats.decode_tokens), o.batch);
    std::printf("attention share:        %.1f%% of decode time\n",
                100.0 * stats.decode_attention_seconds / stats.decode_seconds);
  }
  // What a dense step over the same context reads (and a dense cache holds): every K and V of
  // every layer.
  const double dense_bytes = static_cast<double>(n_prompt + answer.size()) * o.batch *
                             info.n_layers * info.n_kv_heads * info.head_dim * 2 /* K, V */ *
                             2 /* fp16 */;
  std::printf("KV held in host memory: %.1f MiB", stats.kv_bytes_held / 1048576.0);
  if (stats.selector_bytes_held > 0)
    std::printf(
        " in pages + %.1f MiB of selector data = %.1f%% of a dense cache's %.1f MiB",
        stats.selector_bytes_held / 1048576.0,
        100.0 * static_cast<double>(stats.kv_bytes_held + stats.selector_bytes_held) / dense_bytes,
        dense_bytes / 1048576.0);
  std::printf("\n");
  const double read =
      static_cast<double>(stats.last_step_kv_bytes_read + stats.last_step_index_bytes_read);
  std::printf("selector:               %s", o.selector.c_str());
  if (sparse) std::printf(", budget %g", policy.budget);
  if (policy.selector == KVSIFT_SELECTOR_LOCKS_CERTIFIED) std::printf(", epsilon %g", o.epsilon);
  if (policy.selector == KVSIFT_SELECTOR_S4R) std::printf(", compression %g", o.compression);
  std::printf("\n");
  // Dense reads every K and V: its share of dense, its selection costs and its kept or dropped
  // mass say nothing, so only a sparse selector prints them.
  if (!sparse)
    std::printf("KV read per step:       %.2f MiB K/V (every position of every layer)\n",
                stats.last_step_kv_bytes_read / 1048576.0);
  else
    std::printf(
        "KV read per step:       %.2f MiB K/V + %.2f MiB index = %.1f%% of dense (%.2f MiB)\n",
        stats.last_step_kv_bytes_read / 1048576.0, stats.last_step_index_bytes_read / 1048576.0,
        100.0 * read / dense_bytes, dense_bytes / 1048576.0);
  if (sparse && stats.summary_bytes_per_page > 0)
    std::printf("summary per page:       %llu bytes per (page, KV head)\n",
                static_cast<unsigned long long>(stats.summary_bytes_per_page));
  if (sparse && !std::isnan(stats.last_step_kept_estimate))
    std::printf("kept mass (estimate):   %.4f (last step, mean over layers and KV heads)\n",
                stats.last_step_kept_estimate);
  if (sparse && !std::isnan(stats.last_step_dropped_bound))
    std::printf("dropped mass (proven):  <= %.4g (last step, worst layer and head)\n",
                stats.last_step_dropped_bound);
  if (stats.decode_tokens > 0) {
    std::printf("last step, per token:   ");
    if (sparse) std::printf("select %.0f us, ", stats.last_step_select_us);
    if (params.device >= 0) std::printf("transfer %.0f us, ", stats.last_step_transfer_us);
    std::printf("attend %.0f us (summed over layers)\n", stats.last_step_attend_us);
    if (params.device >= 0) {
      const uint64_t lookups = stats.last_step_cache_hits + stats.last_step_cache_misses;
      std::printf(
          "PCIe host to device:    %.2f MiB (last step); device cache hit rate %.3f "
          "(%llu of %llu pages)\n",
          stats.last_step_h2d_bytes / 1048576.0,
          lookups > 0 ? static_cast<double>(stats.last_step_cache_hits) / lookups : 1.0,
          static_cast<unsigned long long>(stats.last_step_cache_hits),
          static_cast<unsigned long long>(lookups));
    }
  }
  return kvsift::apps::kExitOk;
}

// The rules no single option's validator can state, and the files the run reads: checked right
// after parsing, before the model loads. Fills in the sparse selectors' default budget.
void validate(Options& o, const CLI::App& app) {
  using kvsift::apps::UsageError;
  const bool dense = o.selector == "dense";
  const bool budget_given = app.count("--budget") > 0;
  if (dense && budget_given)
    throw UsageError("--budget: --selector dense attends every position and takes no budget");
  if (!dense && !budget_given) o.budget = kDefaultSparseBudget;
  if (o.budget > 1 && o.budget > o.ctx)
    throw UsageError("--budget " + std::to_string(static_cast<uint64_t>(o.budget)) +
                     " tokens: more than --ctx " +
                     std::to_string(o.ctx) + " (give a count <= --ctx, or a fraction in (0, 1])");
  if (app.count("--epsilon") > 0 && o.selector != "locks_certified")
    throw UsageError("--epsilon: only --selector locks_certified reads it (not " + o.selector +
                     ")");
  if (app.count("--compression") > 0 && o.selector != "s4r")
    throw UsageError("--compression: only --selector s4r reads it (not " + o.selector + ")");
  if (o.max_new >= o.ctx)
    throw UsageError("--max-new " + std::to_string(o.max_new) + ": must be less than --ctx " +
                     std::to_string(o.ctx) + " (the prompt needs positions too)");
  if ((app.count("--top-p") > 0 || app.count("--seed") > 0) && o.temperature == 0.0f)
    throw UsageError("--top-p and --seed sample: give --temperature > 0 (0, the default, is "
                     "greedy and ignores them)");
  for (const std::string* device : {&o.device, &o.select_on}) {
    if (*device == "cpu") continue;
    int n_devices = 0;
    const std::string option = device == &o.device ? "--device " : "--select-on ";
    if (kvsift_gpu_device_count(&n_devices) != KVSIFT_STATUS_OK)
      throw UsageError(option + *device + ": " + kvsift_last_error());
    if (kvsift::apps::device_index(*device) >= n_devices)
      throw UsageError(option + *device + ": " + std::to_string(n_devices) +
                       " CUDA device(s) here (cuda:0 to cuda:" + std::to_string(n_devices - 1) +
                       ")");
  }
  kvsift::apps::require_readable_file("--model", o.model);
  if (!o.prompt_file.empty()) kvsift::apps::require_readable_file("--prompt-file", o.prompt_file);
}

}  // namespace

int main(int argc, char** argv) {
  namespace apps = kvsift::apps;
  CLI::App app{"kvsift-demo: long-context question answering with the KV cache in host memory",
               "kvsift-demo"};
  apps::set_up_command_line(app, "kvsift-demo");
  Options o;
  app.add_option("--model", o.model, "a Llama-family GGUF file (KVSIFT_MODEL sets the default)");
  app.add_option("--prompt-file", o.prompt_file,
                 "the document (default: a Devil's Dictionary excerpt with a planted fact)");
  app.add_option("--question", o.question, "the question asked after the document");
  app.add_option("--ctx", o.ctx, "context positions (at most the model's, checked at load)")
      ->check(CLI::Range(1u, kMostContext));
  app.add_option("--max-new", o.max_new, "most tokens to generate")->check(CLI::Range(1, 8192));
  app.add_option("--selector", o.selector, "which positions decode attention reads")
      ->check(CLI::IsMember(apps::selector_list()));
  app.add_option("--budget", o.budget,
                 "tokens per layer and KV head per step: a fraction of the context (<= 1) or a "
                 "count (sinks and window inside); every selector but dense takes one")
      ->check(apps::above_and_at_most(0.0, kMostContext))
      ->default_str("none for dense, else 0.1");
  app.add_option("--epsilon", o.epsilon, "locks_certified: target bound on the dropped mass")
      ->check(apps::above_and_at_most(0.0, 0.5));
  app.add_option("--compression", o.compression,
                 "s4r: target compression of the prompt's K/V (sets the rank; 1: full rank)")
      ->check(CLI::Range(1.0, 1000.0));
  app.add_option("--threads", o.threads, "threads (0: all)")->check(CLI::Range(0, 1024));
  app.add_option("--device", o.device,
                 "cpu, or cuda[:N]: the KV cache stays in host memory and only the selected "
                 "pages go to the GPU, where decode attention runs")
      ->check(apps::device_name());
  app.add_option("--batch", o.batch, "sequences decoded together (copies of the prompt)")
      ->check(CLI::Range(1, 64));
  app.add_option("--select-on", o.select_on,
                 "cpu, or cuda[:N]: LOCKS scores and selects, and Louver filters, on the GPU over "
                 "its resident summaries (the KV stays in host memory)")
      ->check(apps::device_name());
  app.add_flag("--ignore-end", o.ignore_end, "generate --max-new tokens even past an end token");
  app.add_flag("--print-tokens", o.print_tokens, "print the answer's token ids");
  app.add_option("--seed", o.seed, "sampling seed (with --temperature > 0)");
  app.add_option("--temperature", o.temperature, "0: greedy")->check(CLI::Range(0.0, 10.0));
  app.add_option("--top-p", o.top_p, "nucleus sampling (with --temperature > 0)")
      ->check(apps::above_and_at_most(0.0, 1.0));
  if (const auto stop = apps::parse_command_line(app, argc, argv, [&] { validate(o, app); }))
    return *stop;
  try {
    return run(o);
  } catch (const Failure& f) {
    std::fprintf(stderr, "\nkvsift-demo: %s\n", f.message.c_str());
    return f.exit_code;
  }
}
