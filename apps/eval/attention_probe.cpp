#include "attention_probe.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

namespace kvsift::eval {

namespace {

// One query head against tokens [0, n) of its KV head: the float64 softmax (p: [n] scratch), the
// share of its mass on the listed pages and row tokens (all of it when all_pages) and the
// relative error of `out` against the exact output. Cloned for x86-64-v3 (AVX2, FMA): it is most of
// the probe's time, and the build's baseline is plain x86-64.
__attribute__((target_clones("arch=x86-64-v3", "default"))) void exact_head(
    const float* q, const float* k, const float* v, std::size_t n, uint32_t d, uint32_t page_tokens,
    const uint32_t* pages, uint32_t n_pages, const uint32_t* row_tokens, uint32_t n_rows,
    bool all_pages, const float* out, double* p, double& recall, double& rel_err) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  double m = -std::numeric_limits<double>::infinity();
  for (std::size_t t = 0; t < n; ++t) {
    const float* kt = k + t * d;
    double dot = 0.0;
#pragma omp simd reduction(+ : dot)
    for (uint32_t c = 0; c < d; ++c) dot += double{q[c]} * double{kt[c]};
    p[t] = dot * scale;
    m = std::max(m, p[t]);
  }
  double z = 0.0;
  double o[256] = {};  // head_dim <= 256 (CacheGeometry)
  for (std::size_t t = 0; t < n; ++t) {
    p[t] = std::exp(p[t] - m);
    z += p[t];
    const float* vt = v + t * d;
    for (uint32_t c = 0; c < d; ++c) o[c] += p[t] * double{vt[c]};
  }
  double kept = 0.0;
  if (all_pages) {
    kept = z;
  } else {
    for (uint32_t i = 0; i < n_pages; ++i) {
      const std::size_t first = std::size_t{pages[i]} * page_tokens;
      const std::size_t last = std::min(n, first + page_tokens);
      for (std::size_t t = first; t < last; ++t) kept += p[t];
    }
    for (uint32_t r = 0; r < n_rows; ++r) kept += p[row_tokens[r]];
  }
  recall = kept / z;
  double diff = 0.0, norm = 0.0;
  for (uint32_t c = 0; c < d; ++c) {
    const double exact = o[c] / z;
    diff += (double{out[c]} - exact) * (double{out[c]} - exact);
    norm += exact * exact;
  }
  rel_err = norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

}  // namespace

AttentionProbe::AttentionProbe(const model::LlamaModel& model, uint32_t max_new)
    : model_(model),
      n_layers_(model.config().n_layers),
      n_kv_heads_(model.config().n_kv_heads),
      group_(model.config().n_heads / model.config().n_kv_heads),
      head_dim_(model.config().head_dim),
      page_tokens_(model.cache().geometry().page_tokens),
      max_new_(max_new) {
  k_.resize(std::size_t{n_layers_} * n_kv_heads_);
  v_.resize(k_.size());
  filled_.resize(k_.size());
  scratch_.resize(static_cast<std::size_t>(omp_get_max_threads()));
  recall_.resize(model.config().n_heads);
  rel_err_.resize(model.config().n_heads);
}

void AttentionProbe::set_prompt(int32_t seq) {
  const KvCache& cache = model_.cache();
  prompt_tokens_ = cache.length(seq, 0);
  const uint64_t capacity = prompt_tokens_ + max_new_;
  for (uint32_t layer = 0; layer < n_layers_; ++layer)
    for (uint32_t h = 0; h < n_kv_heads_; ++h) {
      const std::size_t i = std::size_t{layer} * n_kv_heads_ + h;
      k_[i].resize(capacity * head_dim_);
      v_[i].resize(capacity * head_dim_);
      cache.read_tokens(seq, layer, h, 0, prompt_tokens_, k_[i].data(), v_[i].data());
    }
  for (auto& s : scratch_) s.resize(capacity);
}

void AttentionProbe::begin(int32_t seq) {
  seq_ = seq;
  std::fill(filled_.begin(), filled_.end(), prompt_tokens_);
  totals_ = ProbeTotals{};
  failed_ = false;
}

void AttentionProbe::on_layer(uint32_t layer, std::span<const int32_t> seq_ids, const float* q,
                              const select::Selection& selection, const float* out) noexcept {
  const auto start = std::chrono::steady_clock::now();
  const KvCache& cache = model_.cache();
  const uint32_t n_heads = n_kv_heads_ * group_, d = head_dim_;
  for (std::size_t s = 0; s < seq_ids.size(); ++s) {
    if (seq_ids[s] != seq_) continue;  // only the sequence begin() named is measured
    const uint64_t n = cache.length_unchecked(seq_, layer);
    if (n > prompt_tokens_ + max_new_) {
      failed_ = true;
      break;
    }
    // Bring the copies up to the cache: the step's token (and any before it this decode).
    for (uint32_t h = 0; h < n_kv_heads_ && !failed_; ++h) {
      const std::size_t i = std::size_t{layer} * n_kv_heads_ + h;
      if (filled_[i] < n) {
        try {
          cache.read_tokens(seq_, layer, h, filled_[i], n - filled_[i],
                            k_[i].data() + filled_[i] * d, v_[i].data() + filled_[i] * d);
        } catch (...) {
          failed_ = true;
        }
        filled_[i] = n;
      }
    }
    if (failed_) break;
    const bool all_pages = selection.n_pairs == 0;  // no lists: every page was attended
    const float* q_seq = q + s * n_heads * d;
    const float* out_seq = out + s * n_heads * d;
#pragma omp parallel for schedule(dynamic) num_threads(static_cast <int>(scratch_.size()))
    for (uint32_t head = 0; head < n_heads; ++head) {
      const uint32_t h = head / group_;
      const std::size_t i = std::size_t{layer} * n_kv_heads_ + h;
      const uint32_t pair = static_cast<uint32_t>(s) * n_kv_heads_ + h;
      const uint32_t* pages =
          all_pages ? nullptr : selection.page_ids.data() + selection.offsets[pair];
      const uint32_t n_pages =
          all_pages ? 0 : selection.offsets[pair + 1] - selection.offsets[pair];
      const bool rows = !all_pages && selection.has_rows;
      const uint32_t* row_tokens =
          rows ? selection.row_tokens.data() +
                     std::size_t{selection.chunk_offsets[pair]} * page_tokens_
               : nullptr;
      const uint32_t n_rows = rows ? selection.row_counts[pair] : 0;
      exact_head(q_seq + std::size_t{head} * d, k_[i].data(), v_[i].data(), n, d, page_tokens_,
                 pages, n_pages, row_tokens, n_rows, all_pages, out_seq + std::size_t{head} * d,
                 scratch_[static_cast<std::size_t>(omp_get_thread_num())].data(), recall_[head],
                 rel_err_[head]);
    }
    for (uint32_t head = 0; head < n_heads; ++head) {
      totals_.heads += 1;
      totals_.recall_sum += recall_[head];
      totals_.recall_min = std::min(totals_.recall_min, recall_[head]);
      totals_.rel_err_sum += rel_err_[head];
    }
    if (all_pages) continue;
    for (uint32_t h = 0; h < n_kv_heads_; ++h) {
      const uint32_t pair = static_cast<uint32_t>(s) * n_kv_heads_ + h;
      double worst_dropped = 0.0;
      for (uint32_t g = 0; g < group_; ++g)
        worst_dropped = std::max(worst_dropped, 1.0 - recall_[h * group_ + g]);
      totals_.pairs += 1;
      totals_.estimated_dropped_sum += 1.0 - double{selection.kept_estimate[pair]};
      const double bound = selection.dropped_bound[pair];
      if (!std::isnan(bound)) {
        totals_.bounded_pairs += 1;
        totals_.bound_sum += bound;
        // Tolerance for the float32 bound and the fp16 keys the selector saw.
        if (worst_dropped > bound + 1e-6 + 1e-3 * bound) totals_.bound_violations += 1;
      }
    }
  }
  totals_.seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace kvsift::eval
