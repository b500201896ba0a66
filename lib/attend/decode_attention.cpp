#include "lib/attend/decode_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "lib/core/error.hpp"

namespace kvsift {

namespace {

// Work per task: enough tasks for dynamic scheduling to balance threads whose bandwidth differs
// (the dev box's two vCPUs are not equal), and no task so small that its merge costs more than
// its pages. 16 pages of d=128 are 128 KiB of K+V.
constexpr uint32_t kTasksPerThread = 4;
constexpr uint32_t kMinPagesPerTask = 16;

}  // namespace

DecodeAttention::DecodeAttention(const CacheGeometry& geometry, uint32_t max_batch, int n_threads,
                                 const simd::Kernels& kernels)
    : geometry_(geometry), kernels_(&kernels), max_batch_(max_batch) {
  geometry_.validate();
  require(max_batch >= 1 && max_batch <= 65536, "max_batch=", max_batch, " is not in 1..65536");
  pool_ = std::make_unique<ThreadPool>(n_threads);
  n_threads_ = pool_->size();
  const std::size_t G = geometry_.group_size, d = geometry_.head_dim, H = geometry_.n_kv_heads;
  const std::size_t pairs = std::size_t{max_batch} * H;
  // Splitting rounds up once per pair for its pages and once for its row chunks.
  const std::size_t max_tasks = std::size_t{kTasksPerThread} * n_threads_ + 2 * pairs;
  acc_offset_ = round_to_lines<float>(2 * G);
  partial_stride_ = acc_offset_ + G * d;
  tasks_.resize(max_tasks);
  pair_tasks_.resize(pairs + 1);
  q_scaled_.resize(std::size_t{max_batch} * H * G * d);
  partials_.resize(max_tasks * partial_stride_);
  scratch_.resize(static_cast<std::size_t>(n_threads_) *
                  round_to_lines<float>(G * geometry_.page_tokens));
}

void DecodeAttention::validate_sequences(const KvCache& cache, const AttendCall& call) const {
  const CacheGeometry& g = cache.geometry();
  require(call.layer < g.n_layers, "layer=", call.layer, " is out of range (n_layers=", g.n_layers,
          ")");
  require(call.n_seqs >= 1 && call.n_seqs <= max_batch_, "n_seqs=", call.n_seqs, " is not in 1..",
          max_batch_, " (max_batch)");
  require(call.seq_ids != nullptr, "seq_ids is NULL");
  require(call.q != nullptr, "q is NULL");
  require(call.out != nullptr, "out is NULL");
  const std::size_t elems = std::size_t{call.n_seqs} * g.n_query_heads() * g.head_dim;
  const auto q_begin = reinterpret_cast<std::uintptr_t>(call.q);
  const auto out_begin = reinterpret_cast<std::uintptr_t>(call.out);
  const std::size_t bytes = elems * sizeof(float);
  require(q_begin + bytes <= out_begin || out_begin + bytes <= q_begin, "out overlaps q");
  for (uint32_t i = 0; i < call.n_seqs; ++i) {
    if (!cache.has_sequence(call.seq_ids[i]))
      fail(Status::not_found, "seq_ids[", i, "]=", call.seq_ids[i], " is not a live sequence");
    for (uint32_t j = 0; j < i; ++j)
      require(call.seq_ids[j] != call.seq_ids[i], "seq_ids[", j, "] and seq_ids[", i, "] are both ",
              call.seq_ids[i]);
  }
}

void DecodeAttention::validate(const KvCache& cache, const AttendCall& call) const {
  if (call.latent != nullptr)
    fail(Status::unsupported,
         "latent rows (S4R coefficients) are reconstructed by the offload backend; on the CPU the "
         "selector hands rows as values");
  validate_lists(cache, call);
}

void DecodeAttention::validate_lists(const KvCache& cache, const AttendCall& call) const {
  validate_sequences(cache, call);
  const CacheGeometry& g = cache.geometry();
  const uint32_t pairs = call.n_seqs * g.n_kv_heads;
  if (call.pages == nullptr)
    for (uint32_t i = 0; i < call.n_seqs; ++i) {
      require(cache.all_pages_readable(call.seq_ids[i], call.layer), "sequence ", call.seq_ids[i],
              " layer ", call.layer,
              " has pages that cannot be read (released: a compressing selector holds their"
              " tokens): attend it through its selector's page lists");
    }
  if (call.rows != nullptr) {
    const RowChunks& rows = *call.rows;
    require(rows.chunk_offsets != nullptr, "rows->chunk_offsets is NULL");
    require(rows.row_counts != nullptr, "rows->row_counts is NULL");
    require(rows.chunk_offsets[0] == 0, "rows->chunk_offsets[0]=", rows.chunk_offsets[0],
            " is not 0");
    require(rows.chunks != nullptr || call.latent != nullptr || rows.chunk_offsets[pairs] == 0,
            "rows->chunks is NULL");
    for (uint32_t pair = 0; pair < pairs; ++pair) {
      const uint32_t begin = rows.chunk_offsets[pair], end = rows.chunk_offsets[pair + 1];
      require(begin <= end && end - begin == geometry_.pages_for(rows.row_counts[pair]),
              "rows: pair ", pair, " has ", rows.row_counts[pair], " rows in ",
              end >= begin ? end - begin : 0, " chunks of ", g.page_tokens);
    }
  }
  if (call.pages == nullptr) return;
  const PageLists& lists = *call.pages;
  require(lists.offsets != nullptr, "pages->offsets is NULL");
  require(lists.offsets[0] == 0, "pages->offsets[0]=", lists.offsets[0], " is not 0");
  require(lists.page_ids != nullptr || lists.offsets[pairs] == 0, "pages->page_ids is NULL");
  for (uint32_t pair = 0; pair < pairs; ++pair) {
    const uint32_t begin = lists.offsets[pair], end = lists.offsets[pair + 1];
    require(begin <= end, "pages->offsets decreases at ", pair + 1);
    const int32_t seq = call.seq_ids[pair / g.n_kv_heads];
    const uint64_t n_pages = geometry_.pages_for(cache.length_unchecked(seq, call.layer));
    for (uint32_t i = begin; i < end; ++i) {
      const uint32_t id = lists.page_ids[i];
      require(id < n_pages, "pages->page_ids[", i, "]=", id, " is out of range: sequence ", seq,
              " has ", n_pages, " pages in layer ", call.layer);
      require(cache.page_readable(seq, call.layer, id), "pages->page_ids[", i, "]=", id,
              " cannot be read (released: a compressing selector holds its tokens) in sequence ",
              seq, " layer ", call.layer);
      require(i == begin || lists.page_ids[i - 1] < id, "pages->page_ids[", i, "]=", id,
              " is not above the previous id of its (sequence, KV head) pair");
    }
  }
}

uint32_t DecodeAttention::plan(const KvCache& cache, const AttendCall& call) noexcept {
  const uint32_t H = geometry_.n_kv_heads, B = geometry_.page_tokens;
  const uint32_t pairs = call.n_seqs * H;
  auto pair_pages = [&](uint32_t pair) -> uint64_t {
    if (call.pages) return call.pages->offsets[pair + 1] - call.pages->offsets[pair];
    return geometry_.pages_for(cache.length_unchecked(call.seq_ids[pair / H], call.layer));
  };
  auto pair_chunks = [&](uint32_t pair) -> uint64_t {
    if (!call.rows) return 0;
    return call.rows->chunk_offsets[pair + 1] - call.rows->chunk_offsets[pair];
  };
  uint64_t total = 0;
  for (uint32_t pair = 0; pair < pairs; ++pair) total += pair_pages(pair) + pair_chunks(pair);
  const uint64_t target = std::uint64_t{kTasksPerThread} * n_threads_;
  const uint64_t chunk = std::max<uint64_t>(kMinPagesPerTask, (total + target - 1) / target);

  stats_ = AttendStats{};
  uint32_t n_tasks = 0;
  auto split = [&](uint32_t pair, uint64_t n, bool rows) {
    const uint64_t splits = (n + chunk - 1) / chunk;
    for (uint64_t s = 0; s < splits; ++s) {
      const uint64_t first = n * s / splits, last = n * (s + 1) / splits;
      tasks_[n_tasks++] =
          Task{pair, static_cast<uint32_t>(first), static_cast<uint32_t>(last - first), rows};
    }
  };
  for (uint32_t pair = 0; pair < pairs; ++pair) {
    pair_tasks_[pair] = n_tasks;
    const uint64_t n = pair_pages(pair);
    split(pair, n, false);
    split(pair, pair_chunks(pair), true);
    const uint64_t length = cache.length_unchecked(call.seq_ids[pair / H], call.layer);
    uint64_t tokens = length;
    if (call.pages) {
      // Every listed page is full but the one holding the last token.
      const bool has_open =
          n > 0 && uint64_t{call.pages->page_ids[call.pages->offsets[pair + 1] - 1]} + 1 ==
                       geometry_.pages_for(length);
      tokens = n * B - (has_open ? geometry_.pages_for(length) * B - length : 0);
    }
    stats_.pages_read += n;
    stats_.tokens_read += tokens + (call.rows ? call.rows->row_counts[pair] : 0);
  }
  pair_tasks_[pairs] = n_tasks;
  stats_.bytes_read = stats_.tokens_read * geometry_.token_bytes();
  return n_tasks;
}

void DecodeAttention::run(const KvCache& cache, const AttendCall& call) noexcept {
  const uint32_t H = geometry_.n_kv_heads, G = geometry_.group_size, d = geometry_.head_dim;
  const uint32_t B = geometry_.page_tokens;
  const std::size_t head_elems = std::size_t{G} * d;
  const std::size_t q_elems = std::size_t{call.n_seqs} * H * head_elems;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (std::size_t i = 0; i < q_elems; ++i) q_scaled_[i] = call.q[i] * scale;

  const uint32_t n_tasks = plan(cache, call);
  const uint32_t pairs = call.n_seqs * H;
  const simd::Kernels& kernels = *kernels_;
  const std::size_t scratch_stride = round_to_lines<float>(std::size_t{G} * B);

  pool_->parallel_for(n_tasks, 1, [&](uint64_t i, uint64_t, int thread) noexcept {
    float* scratch = scratch_.data() + scratch_stride * static_cast<std::size_t>(thread);
    const Task& task = tasks_[i];
    const uint32_t seq_index = task.pair / H, head = task.pair % H;
    const int32_t seq = call.seq_ids[seq_index];
    float* partial = partials_.data() + partial_stride_ * i;
    simd::AttendJob job{};
    job.q = q_scaled_.data() + std::size_t{task.pair} * head_elems;
    job.group = G;
    job.layout = geometry_.layout();
    if (task.rows) {
      job.pool = job.layout.slot(call.rows->chunks, call.rows->chunk_offsets[task.pair]);
      job.table = nullptr;
      job.logical = nullptr;
      job.seq_tokens = call.rows->row_counts[task.pair];
    } else {
      job.pool = cache.pool().base();
      job.table = cache.page_table(seq, call.layer, head);
      job.logical = call.pages ? call.pages->page_ids + call.pages->offsets[task.pair] : nullptr;
      job.seq_tokens = cache.length_unchecked(seq, call.layer);
    }
    job.first = task.first;
    job.count = task.count;
    job.m = partial;
    job.l = partial + G;
    job.acc = partial + acc_offset_;
    job.scratch = scratch;
    kernels.attend(job);
  });
  // Split-K merge: rescale each split's partial sums to the common max, then normalise.
  pool_->parallel_static(pairs * G, [&](uint64_t first, uint64_t last, int) noexcept {
    for (uint64_t i = first; i < last; ++i) {
      const uint32_t pair = static_cast<uint32_t>(i / G), g = static_cast<uint32_t>(i % G);
      float* out = call.out + std::size_t{pair} * head_elems + std::size_t{g} * d;
      float m = -std::numeric_limits<float>::infinity();
      for (uint32_t t = pair_tasks_[pair]; t < pair_tasks_[pair + 1]; ++t)
        m = std::max(m, partials_[partial_stride_ * t + g]);
      for (uint32_t c = 0; c < d; ++c) out[c] = 0.0f;
      if (m == -std::numeric_limits<float>::infinity()) continue;  // no pages: zeros
      float l = 0.0f;
      for (uint32_t t = pair_tasks_[pair]; t < pair_tasks_[pair + 1]; ++t) {
        const float* partial = partials_.data() + partial_stride_ * t;
        const float w = std::exp(partial[g] - m);
        l += partial[G + g] * w;
        const float* acc = partial + acc_offset_ + std::size_t{g} * d;
        for (uint32_t c = 0; c < d; ++c) out[c] += acc[c] * w;
      }
      const float inv = 1.0f / l;
      for (uint32_t c = 0; c < d; ++c) out[c] *= inv;
    }
  });
}

}  // namespace kvsift
