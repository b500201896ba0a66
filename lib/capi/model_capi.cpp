// The C API of the model runner and the sampler (kvsift.h, "The model runner" and "Sampling").
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvsift/kvsift.h"
#include "lib/capi/guard.hpp"
#include "lib/model/llama_model.hpp"
#include "lib/model/sampler.hpp"

using kvsift::Status;
using kvsift::capi::copy_out;
using kvsift::capi::guard;
using kvsift::capi::require_pointer;

struct kvsift_model {
  std::unique_ptr<kvsift::model::LlamaModel> model;
};

struct kvsift_sampler {
  kvsift::model::Sampler sampler;
};

extern "C" {

void kvsift_model_params_init(kvsift_model_params* params) {
  if (params == nullptr) return;
  std::memset(params, 0, sizeof(*params));
  params->n_ctx = 0;
  params->max_seqs = 1;
  params->prefill_chunk = 256;
  params->weights_f32 = 0;
  params->kv_dtype = KVSIFT_DTYPE_F16;
  params->page_tokens = 16;
  params->n_threads = 0;
  params->isa = KVSIFT_ISA_AUTO;
  params->device = -1;
  params->device_cache_pages = 0;
  params->weights = KVSIFT_WEIGHTS_BF16;
}

kvsift_status kvsift_model_load(const char* path, const kvsift_model_params* params,
                                kvsift_model** out) {
  if (out != nullptr) *out = nullptr;
  return guard(__func__, [&] {
    require_pointer(path, "path");
    require_pointer(params, "params");
    require_pointer(out, "out");
    kvsift::require(params->n_threads >= 0, "params->n_threads=", params->n_threads,
                    " is negative");
    kvsift::model::ModelOptions options;
    options.n_ctx = params->n_ctx;
    options.max_seqs = params->max_seqs;
    options.prefill_chunk = params->prefill_chunk;
    const int32_t weights = kvsift::capi::enum_in_range(params->weights, KVSIFT_WEIGHTS_COUNT,
                                                        "params->weights", "kvsift_weights");
    kvsift::require(!(params->weights_f32 && weights == KVSIFT_WEIGHTS_QUANTIZED),
                    "params->weights_f32 asks for float32 weights and params->weights for "
                    "quantized ones");
    options.weight_type = params->weights_f32 || weights == KVSIFT_WEIGHTS_F32
                              ? kvsift::MatType::f32
                              : kvsift::MatType::bf16;
    options.keep_quantized = weights == KVSIFT_WEIGHTS_QUANTIZED;
    options.kv_dtype =
        kvsift::capi::to_dtype(kvsift::capi::enum_bits(params->kv_dtype), "params->kv_dtype");
    options.page_tokens = params->page_tokens;
    options.n_threads = params->n_threads;
    options.isa =
        kvsift::capi::to_supported_level(kvsift::capi::enum_bits(params->isa), "params->isa");
    kvsift::require(params->device >= -1, "params->device=", params->device,
                    " is neither -1 (CPU) nor a device index");
    options.device = params->device;
    options.device_cache_pages = params->device_cache_pages;
    auto handle = std::make_unique<kvsift_model>();
    handle->model = kvsift::model::LlamaModel::load(path, options);
    *out = handle.release();
  });
}

void kvsift_model_free(kvsift_model* model) {
  delete model;
}

kvsift_status kvsift_model_get_info(const kvsift_model* model, kvsift_model_info* info) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    require_pointer(info, "info");
    const auto& c = model->model->config();
    *info = kvsift_model_info{c.n_layers,
                              c.n_embd,
                              c.n_heads,
                              c.n_kv_heads,
                              c.head_dim,
                              c.n_vocab,
                              c.n_ctx_train,
                              model->model->n_ctx(),
                              model->model->tokenizer().bos(),
                              model->model->tokenizer().eos()};
  });
}

kvsift_status kvsift_tokenize(const kvsift_model* model, const char* text, size_t text_len,
                              int parse_special, int32_t* tokens, size_t capacity,
                              size_t* n_tokens) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    require_pointer(n_tokens, "n_tokens");
    if (text_len > 0) require_pointer(text, "text");
    const std::vector<int32_t> ids = model->model->tokenizer().encode(
        std::string_view(text ? text : "", text_len), parse_special != 0);
    *n_tokens = ids.size();
    if (ids.size() > capacity)
      kvsift::fail(Status::buffer_too_small, "the text needs ", ids.size(), " tokens; capacity is ",
                   capacity);
    if (!ids.empty()) {
      require_pointer(tokens, "tokens");
      std::memcpy(tokens, ids.data(), ids.size() * sizeof(int32_t));
    }
  });
}

kvsift_status kvsift_detokenize(const kvsift_model* model, const int32_t* tokens, size_t n_tokens,
                                char* text, size_t capacity, size_t* text_len) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    if (n_tokens > 0) require_pointer(tokens, "tokens");
    copy_out(model->model->tokenizer().decode(std::span<const int32_t>(tokens, n_tokens)), text,
             capacity, text_len);
  });
}

kvsift_status kvsift_chat_template(const kvsift_model* model, const kvsift_chat_message* messages,
                                   size_t n_messages, int add_assistant, char* text,
                                   size_t capacity, size_t* text_len) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    if (n_messages > 0) require_pointer(messages, "messages");
    std::vector<kvsift::model::ChatMessage> chat;
    for (size_t i = 0; i < n_messages; ++i) {
      kvsift::require(messages[i].role != nullptr, "messages[", i, "].role is NULL");
      kvsift::require(messages[i].content != nullptr, "messages[", i, "].content is NULL");
      chat.push_back({messages[i].role, messages[i].content});
    }
    copy_out(model->model->tokenizer().apply_chat_template(chat, add_assistant != 0), text,
             capacity, text_len);
  });
}

int kvsift_token_is_end(const kvsift_model* model, int32_t token) {
  return model != nullptr && model->model->tokenizer().is_end_of_generation(token) ? 1 : 0;
}

kvsift_status kvsift_model_sequence_create(kvsift_model* model, int32_t* seq_id) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    require_pointer(seq_id, "seq_id");
    *seq_id = model->model->create_sequence();
  });
}

kvsift_status kvsift_model_sequence_fork(kvsift_model* model, int32_t src, int32_t* seq_id) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    require_pointer(seq_id, "seq_id");
    *seq_id = model->model->fork_sequence(src);
  });
}

kvsift_status kvsift_model_sequence_free(kvsift_model* model, int32_t seq_id) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    model->model->free_sequence(seq_id);
  });
}

kvsift_status kvsift_model_prefill(kvsift_model* model, int32_t seq_id, const int32_t* tokens,
                                   size_t n_tokens, float* all_logits, kvsift_progress_fn progress,
                                   void* user) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    require_pointer(tokens, "tokens");
    model->model->prefill(seq_id, std::span<const int32_t>(tokens, n_tokens), all_logits, progress,
                          user);
  });
}

kvsift_status kvsift_model_decode(kvsift_model* model, uint32_t n_seqs, const int32_t* seq_ids,
                                  const int32_t* tokens) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    require_pointer(seq_ids, "seq_ids");
    require_pointer(tokens, "tokens");
    model->model->decode(std::span<const int32_t>(seq_ids, n_seqs),
                         std::span<const int32_t>(tokens, n_seqs));
  });
}

kvsift_status kvsift_model_sequence_append_kv(kvsift_model* model, int32_t seq_id, uint32_t layer,
                                              size_t n_tokens, const float* k, const float* v) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    require_pointer(k, "k");
    require_pointer(v, "v");
    model->model->append_kv(seq_id, layer, n_tokens, k, v);
  });
}

kvsift_status kvsift_model_logits(const kvsift_model* model, int32_t seq_id, const float** logits,
                                  size_t* n_vocab) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    require_pointer(logits, "logits");
    const auto span = model->model->logits(seq_id);
    *logits = span.data();
    if (n_vocab != nullptr) *n_vocab = span.size();
  });
}

kvsift_status kvsift_model_get_stats(const kvsift_model* model, kvsift_model_stats* stats) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    require_pointer(stats, "stats");
    const auto& s = model->model->stats();
    const auto& pool = model->model->cache().pool();
    *stats = kvsift_model_stats{s.prefill_tokens,
                                s.prefill_seconds,
                                s.decode_tokens,
                                s.decode_seconds,
                                s.decode_attention_seconds,
                                pool.in_use() * pool.slot_bytes(),
                                s.last_step.kv_bytes_read,
                                s.last_step.index_bytes_read,
                                s.last_step.kept_estimate,
                                s.last_step.dropped_bound,
                                model->model->selector().summary_bytes_per_page(),
                                model->model->selector().held_bytes(),
                                s.last_step.select_us,
                                s.last_step.transfer_us,
                                s.last_step.attend_us,
                                s.last_step.h2d_bytes,
                                s.last_step.cache_hits,
                                s.last_step.cache_misses,
                                s.last_step.plan_us,
                                s.last_step.row_h2d_bytes,
                                s.last_step.rows_equivalent_bytes};
  });
}

kvsift_status kvsift_model_set_selector(kvsift_model* model, const kvsift_selector_policy* policy) {
  return guard(__func__, [&] {
    require_pointer(model, "model");
    require_pointer(policy, "policy");
    model->model->set_selector(kvsift::capi::to_policy(*policy));
  });
}

void kvsift_sampler_params_init(kvsift_sampler_params* params) {
  if (params == nullptr) return;
  *params = kvsift_sampler_params{0.0f, 1.0f, 0};
}

kvsift_status kvsift_sampler_create(const kvsift_sampler_params* params, kvsift_sampler** out) {
  if (out != nullptr) *out = nullptr;
  return guard(__func__, [&] {
    require_pointer(params, "params");
    require_pointer(out, "out");
    *out = new kvsift_sampler{kvsift::model::Sampler(
        kvsift::model::SamplerParams{params->temperature, params->top_p, params->seed})};
  });
}

void kvsift_sampler_free(kvsift_sampler* sampler) {
  delete sampler;
}

kvsift_status kvsift_sampler_sample(kvsift_sampler* sampler, const float* logits, size_t n,
                                    int32_t* token) {
  return guard(__func__, [&] {
    require_pointer(sampler, "sampler");
    require_pointer(logits, "logits");
    require_pointer(token, "token");
    kvsift::require(n >= 1, "n must be >= 1");
    *token = sampler->sampler.sample(std::span<const float>(logits, n));
  });
}

}  // extern "C"
