// The offload step end to end on one Llama-3.1-8B layer (8 KV heads, G = 4, head_dim 128, 16-token
// pages, bf16 K/V), per row (context, batch):
//   (a) ours: SparseDecodeAttention over every page, all of them already in device memory: the
//       HBM-resident speed ceiling of our kernel (tools/sdpa_baseline.py gives torch's, timed the
//       same way: back-to-back calls between events); then the same over a sweep of kernel
//       tunings (--a-tunings), one log line each, for picking the kernel's default;
//   (b) dense offload: every page moved host to device each step by the transfer engine (the
//       device cache cleared first), then the same kernel; and a plain pinned copy of the same
//       bytes, the ceiling of any dense offload;
//   (c) kvsift offload: OffloadAttention::step with a 2% LOCKS selector over decode steps that
//       append one token per sequence and drift the query, so the device cache sees hits and
//       misses; select, transfer and attend timed by the step's own telemetry; then the kernel
//       alone on the last call's lists under each tuning of --a-tunings.
// A plain driver with its own timing loop, not Google Benchmark: a row is one cache of up to
// 32 GiB filled once and measured in three ways, with per-step telemetry Google Benchmark has no
// place for. scripts/gpu_bench.sh runs it and prints the table; the columns are written to --csv,
// one line per row as soon as the row is done, so a row that fails or a run cut short keeps the
// rows before it.
//
// Keys: per KV head 256 cluster centres; each page draws one centre and a gain, and its keys are
// gain * centre plus noise; values are noise. The query of a sequence's KV-head group is built from
// three of the group's centres plus noise and drifts each step (q <- 0.9 q + 0.1 anchor + noise),
// so LOCKS finds a stable core of pages and churns at the margin of its budget.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <future>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/command_line.hpp"
#include "common/exit_codes.hpp"
#include "gpu/host_memory.hpp"
#include "gpu/offload_runtime.hpp"
#include "gpu/page_transfer.hpp"
#include "gpu/sparse_attention.hpp"
#include "lib/attend/decode_attention.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/core/error.hpp"
#include "lib/core/kernel_runtime.hpp"
#include "lib/engine/decode_engine.hpp"
#include "lib/offload/offload_attention.hpp"
#include "lib/select/page_selector.hpp"
#include "lib/select/selector.hpp"

namespace {

using namespace kvsift;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kKvHeads = 8, kGroup = 4, kHeadDim = 128, kPageTokens = 16;
constexpr uint32_t kClusters = 256;
// The query's anchor is kAnchorScale times each of its centres: the chosen 2% then holds about
// two thirds of the softmax mass (LOCKS's kept estimate, 128K), so the selection matters.
constexpr float kAnchorScale = 1.0f;
constexpr uint32_t kFillChunk = 2048;                     // tokens per append while filling
constexpr std::size_t kCopyChunk = std::size_t{1} << 30;  // plain copies go in 1 GiB pieces
constexpr uint64_t kSeed = 0x6b7673696674;

// The kernels of a handle created with the defaults (the best level under KVSIFT_MAX_ISA).
const simd::Kernels& default_kernels() {
  static const KernelRuntime runtime;
  return runtime.kernels();
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

Clock::time_point g_start;

// Progress with the run's elapsed time, flushed: the device call has a wall-clock limit, and the
// log should say where the time went even when the run is cut short.
template <class... Args>
void say(const char* format, Args... args) {
  std::printf("[%7.1f s] ", seconds_since(g_start));
  std::printf(format, args...);
  std::printf("\n");
  std::fflush(stdout);
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9;
  x = (x ^ (x >> 27)) * 0x94d049bb133111eb;
  return x ^ (x >> 31);
}

// xorshift64: two uniform floats in [-1, 1) per draw, cheap enough to make 8M tokens of K/V.
struct Noise {
  uint64_t state;
  explicit Noise(uint64_t seed) : state(splitmix(seed) | 1) {}
  void pair(float& a, float& b) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    a = static_cast<float>(state & 0xffffff) * 0x1p-23f - 1.0f;
    b = static_cast<float>((state >> 32) & 0xffffff) * 0x1p-23f - 1.0f;
  }
};

class Synth {
 public:
  Synth() : centres_(std::size_t{kKvHeads} * kClusters * kHeadDim) {
    Noise noise(kSeed);
    for (std::size_t i = 0; i < centres_.size(); i += 2) noise.pair(centres_[i], centres_[i + 1]);
  }

  // K and V [n, kKvHeads, kHeadDim] of positions [first, first + n) of sequence `seq` (an index of
  // the row, not a cache id), with `threads` OpenMP threads.
  void make(uint32_t seq, uint64_t first, uint32_t n, float* k, float* v, int threads) const {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (uint32_t t = 0; t < n; ++t) {
      const uint64_t pos = first + t;
      Noise noise(kSeed ^ (uint64_t{seq} << 44) ^ pos);
      for (uint32_t h = 0; h < kKvHeads; ++h) {
        const uint64_t page =
            splitmix(kSeed + (uint64_t{seq} << 48) + (uint64_t{h} << 40) + pos / kPageTokens);
        const float* centre = centre_of(h, static_cast<uint32_t>(page % kClusters));
        const float gain = 0.5f + 1.5f * static_cast<float>((page >> 32) & 0xffffff) * 0x1p-24f;
        float* kr = k + (std::size_t{t} * kKvHeads + h) * kHeadDim;
        float* vr = v + (std::size_t{t} * kKvHeads + h) * kHeadDim;
        for (uint32_t c = 0; c < kHeadDim; c += 2) {
          float a, b;
          noise.pair(a, b);
          kr[c] = gain * centre[c] + 0.5f * a;
          kr[c + 1] = gain * centre[c + 1] + 0.5f * b;
          noise.pair(vr[c], vr[c + 1]);
        }
      }
    }
  }

  // The anchor every query of the batch drifts around: per sequence and KV head three of the
  // head's centres, of which each of the G query heads takes two.
  std::vector<float> anchor(uint32_t batch) const {
    std::vector<float> a(std::size_t{batch} * kKvHeads * kGroup * kHeadDim, 0.0f);
    for (uint32_t s = 0; s < batch; ++s)
      for (uint32_t h = 0; h < kKvHeads; ++h) {
        uint32_t topics[3];
        for (uint32_t i = 0; i < 3; ++i)
          topics[i] = static_cast<uint32_t>(splitmix(kSeed + 977 * s + 31 * h + i) % kClusters);
        for (uint32_t g = 0; g < kGroup; ++g) {
          float* q = a.data() + ((std::size_t{s} * kKvHeads + h) * kGroup + g) * kHeadDim;
          for (uint32_t i = 0; i < 3; ++i) {
            if (i == g % 3) continue;
            const float* centre = centre_of(h, topics[i]);
            for (uint32_t c = 0; c < kHeadDim; ++c) q[c] += kAnchorScale * centre[c];
          }
        }
      }
    return a;
  }

 private:
  const float* centre_of(uint32_t h, uint32_t cluster) const {
    return centres_.data() + (std::size_t{h} * kClusters + cluster) * kHeadDim;
  }
  std::vector<float> centres_;  // [kKvHeads, kClusters, kHeadDim], entries uniform in [-1, 1)
};

// q <- 0.9 q + 0.1 anchor + noise_scale * uniform noise: stationary around the anchor, a new draw
// each step. At the default 0.6, 0.87-0.9 of a step's pages were also chosen the step before
// (--host-only, 128K, batch 1: 0.94 at 0.3, 0.83 at 0.8): the hit rate an unbounded device cache
// would reach.
void drift(std::vector<float>& q, const std::vector<float>& anchor, uint64_t step,
           float noise_scale) {
  Noise noise(kSeed + 0x51ed * (step + 1));
  for (std::size_t i = 0; i < q.size(); i += 2) {
    float a, b;
    noise.pair(a, b);
    q[i] = 0.9f * q[i] + 0.1f * anchor[i] + noise_scale * a;
    q[i + 1] = 0.9f * q[i + 1] + 0.1f * anchor[i + 1] + noise_scale * b;
  }
}

double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}
double min_of(const std::vector<double>& v) {
  return v.empty() ? std::nan("") : *std::min_element(v.begin(), v.end());
}
double max_of(const std::vector<double>& v) {
  return v.empty() ? std::nan("") : *std::max_element(v.begin(), v.end());
}

void check(const gpu::Result& r, const char* what) {
  if (!r.ok) fail(Status::internal, what, ": ", r.message);
}

struct PinnedFree {
  void operator()(void* p) const noexcept { gpu::pinned_free(p); }
};
struct DeviceFree {
  void operator()(void* p) const noexcept { gpu::device_free(p); }
};
using PinnedPtr = std::unique_ptr<void, PinnedFree>;
using DevicePtr = std::unique_ptr<void, DeviceFree>;

PinnedPtr pinned(std::size_t bytes, const char* what) {
  void* p = nullptr;
  check(gpu::pinned_alloc(bytes, &p), what);
  return PinnedPtr(p);
}
DevicePtr device(std::size_t bytes, const char* what) {
  void* p = nullptr;
  check(gpu::device_alloc(bytes, &p), what);
  return DevicePtr(p);
}

// One point of (a)'s sweep over the kernel's tuning:
// "ctas_per_sm:min_tiles_per_split:chunks[:tensor_cores[:l2_prefetch[:bulk_copies[:warp_tokens]]]]"
// (fields left out are 0).
struct TuningPoint {
  gpu::AttendTuning tuning;
  std::string text;
};

TuningPoint parse_tuning(const std::string& text) {
  uint32_t fields[7] = {};
  const std::size_t colons = static_cast<std::size_t>(std::count(text.begin(), text.end(), ':'));
  const int n_fields = static_cast<int>(std::clamp<std::size_t>(colons + 1, 3, 7));
  std::size_t at = 0;
  for (int i = 0; i < n_fields; ++i) {
    const std::size_t end = i + 1 < n_fields ? text.find(':', at) : text.size();
    std::size_t used = 0;
    const std::string field = end == std::string::npos ? "" : text.substr(at, end - at);
    try {
      fields[i] = static_cast<uint32_t>(std::stoul(field, &used));
    } catch (const std::logic_error&) {
      used = 0;
    }
    if (field.empty() || used != field.size() || field[0] == '-')
      throw kvsift::apps::UsageError(
          "--a-tunings: '" + text +
          "' is not "
          "CTAS_PER_SM:MIN_TILES:CHUNKS[:TENSOR_CORES[:L2_PREFETCH[:BULK_COPIES[:WARP_TOKENS]]]] "
          "(unsigned integers)");
    at = end + 1;
  }
  return {gpu::AttendTuning{fields[0], fields[1], fields[2], fields[3], fields[4], fields[5],
                            fields[6]},
          text};
}

struct Config {
  std::vector<uint64_t> contexts{32768, 131072, 524288, 1048576};
  std::vector<uint32_t> batches{1, 8};
  double budget = 0.02;
  float drift_noise = 0.6f;
  int a_reps = 20;
  // (a)'s sweep: 0 CTAs per multiprocessor is the kernel's occupancy; 0:2:1 is the default;
  // a 4th field of 1 runs the tensor-core inner loop, a 5th asks its copies for an L2 prefetch
  // of that many bytes, a 6th of 1 or 2 brings its rows with bulk copies, 3 with tensor-map
  // copies of whole pages' rows, a 7th of 16 or 32 gives each warp that many tokens a tile
  // (gpu::AttendTuning).
  std::vector<std::string> a_tunings{"0:2:1", "2:2:1",   "8:2:1",   "0:2:2",
                                     "8:2:2", "0:2:1:1", "2:2:1:1", "8:2:1:1"};
  std::vector<TuningPoint> a_points;  // a_tunings parsed
  int b_steps = 3;
  int c_warmup = 4;
  int c_steps = 32;
  uint64_t check_tokens = 1u << 20;
  int threads = 0;
  bool host_only = false;
  std::string csv;
  int locks_device = -1;  // (c): select on this CUDA device (policy.device), -1 the CPU
};

// One row's numbers; NaN where a phase did not run. Times in microseconds.
struct Row {
  uint64_t context = 0;
  uint32_t batch = 0;
  std::string status = "ok";
  double pool_gib = NAN, alloc_s = NAN, fill_s = NAN, build_s = NAN;
  // (a) ours: the kernel alone over every resident page.
  double a_us = NAN, a_min = NAN, a_max = NAN, a_tbps = NAN;
  // (b) dense offload: whole step wall clock; its move (event interval from before ensure() to
  // the moved pages, so the CPU's planning is inside), planning (ensure()'s own wall clock) and
  // attention; bytes moved; the plain pinned copy of the same bytes.
  double b_us = NAN, b_min = NAN, b_max = NAN, b_move_us = NAN, b_plan_us = NAN, b_attend_us = NAN;
  double b_mb = NAN, b_gbps = NAN, copy_b_us = NAN, copy_b_gbps = NAN;
  // (c) kvsift offload, medians over the timed steps (each column its own median).
  double c_us = NAN, c_min = NAN, c_max = NAN, c_select_us = NAN, c_host_us = NAN;
  double c_lists_us = NAN, c_plan_us = NAN;  // host_us's parts: page lists, residency plan
  double c_transfer_us = NAN, c_attend_us = NAN, c_out_us = NAN, c_overlap_us = NAN;
  double c_pages = NAN, c_moved = NAN, c_page_mb = NAN, c_h2d_mb = NAN, c_hit = NAN;
  double c_gbps = NAN, copy_c_gbps = NAN, c_kept = NAN;
  uint32_t c_parts = 0, c_max_pages = 0, c_cache_pages = 0;
  double check_err = NAN;  // (b)'s output against the CPU kernel, where checked
};

const char* kCsvHeader =
    "context,batch,status,pool_gib,alloc_s,fill_s,build_s,a_us,a_min,a_max,a_tbps,b_us,b_min,"
    "b_max,b_move_us,b_plan_us,b_attend_us,b_mb,b_gbps,copy_b_us,copy_b_gbps,c_us,c_min,c_max,"
    "c_select_us,c_host_us,c_transfer_us,c_attend_us,c_out_us,c_overlap_us,c_pages,c_moved,"
    "c_page_mb,c_h2d_mb,c_hit,c_gbps,copy_c_gbps,c_kept,c_parts,c_max_pages,c_cache_pages,"
    "check_err,c_lists_us,c_plan_us";

void write_csv(std::FILE* f, const Row& r) {
  if (f == nullptr) return;
  std::string status = r.status;
  std::replace(status.begin(), status.end(), ',', ';');
  std::replace(status.begin(), status.end(), '\n', ' ');
  std::replace(status.begin(), status.end(), '"', '\'');
  std::fprintf(f, "%lu,%u,\"%s\"", static_cast<unsigned long>(r.context), r.batch, status.c_str());
  for (double x :
       {r.pool_gib,    r.alloc_s,     r.fill_s,       r.build_s,     r.a_us,      r.a_min,
        r.a_max,       r.a_tbps,      r.b_us,         r.b_min,       r.b_max,     r.b_move_us,
        r.b_plan_us,   r.b_attend_us, r.b_mb,         r.b_gbps,      r.copy_b_us, r.copy_b_gbps,
        r.c_us,        r.c_min,       r.c_max,        r.c_select_us, r.c_host_us, r.c_transfer_us,
        r.c_attend_us, r.c_out_us,    r.c_overlap_us, r.c_pages,     r.c_moved,   r.c_page_mb,
        r.c_h2d_mb,    r.c_hit,       r.c_gbps,       r.copy_c_gbps, r.c_kept})
    std::fprintf(f, ",%.6g", x);
  std::fprintf(f, ",%u,%u,%u,%.3g,%.6g,%.6g\n", r.c_parts, r.c_max_pages, r.c_cache_pages,
               r.check_err, r.c_lists_us, r.c_plan_us);
  std::fflush(f);
}

// Device-side milliseconds of `bytes` from the start of the host pool copied to `dst` in 1 GiB
// pieces, back to back on the stream: the plain pinned copy the moves are compared with.
double plain_copy_ms(gpu::StepStream& stream, void* dst, const std::byte* src, std::size_t bytes) {
  check(stream.mark(10), "copy event");
  for (std::size_t at = 0; at < bytes; at += kCopyChunk)
    check(stream.copy_to_device(dst, src + at, std::min(kCopyChunk, bytes - at)), "plain copy");
  check(stream.mark(11), "copy event");
  check(stream.wait(11), "plain copy");
  return stream.elapsed_ms(10, 11);
}

struct Spread {
  double median, min, max;
};

Spread spread_of(const std::vector<double>& v) {
  return {median(v), min_of(v), max_of(v)};
}

// Microseconds of `reps` runs of the kernel over `call`, each between two events, timed as
// tools/sdpa_baseline.py times torch: enqueued back to back behind an untimed run that keeps the
// device busy meanwhile, so that no timed run includes the wait for its own launch.
Spread time_attention(gpu::SparseDecodeAttention& attention, const gpu::PageAttendCall& call,
                      gpu::StepStream& stream, int reps) {
  constexpr int kPerBatch = gpu::StepStream::kEvents / 2;
  std::vector<double> us;
  while (static_cast<int>(us.size()) < reps) {
    check(attention.run(call), "a: attention");
    const int n = std::min(kPerBatch, reps - static_cast<int>(us.size()));
    for (int i = 0; i < n; ++i) {
      check(stream.mark(2 * i), "a: event");
      check(attention.run(call), "a: attention");
      check(stream.mark(2 * i + 1), "a: event");
    }
    check(stream.wait(2 * n - 1), "a: attention");
    for (int i = 0; i < n; ++i) us.push_back(1e3 * stream.elapsed_ms(2 * i, 2 * i + 1));
  }
  return spread_of(us);
}

// Everything one row holds on the host: the cache, the selector that saw its seals, sequences.
struct Host {
  CacheGeometry geometry;
  std::unique_ptr<ThreadPool> pool;  // the selector's threads
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<select::Selector> selector;
  std::vector<int32_t> ids;
  std::vector<float> q, anchor;
};

void fill(Host& host, const Synth& synth, uint64_t tokens, int threads) {
  const std::size_t elems = std::size_t{kFillChunk} * kKvHeads * kHeadDim;
  std::vector<float> k[2] = {std::vector<float>(elems), std::vector<float>(elems)};
  std::vector<float> v[2] = {std::vector<float>(elems), std::vector<float>(elems)};
  // One thread appends chunk i (the cache is single-writer) while the others make chunk i + 1.
  const int makers = std::max(1, threads - 1);
  std::future<void> appending;
  int buffer = 0;
  for (uint32_t s = 0; s < host.ids.size(); ++s)
    for (uint64_t first = 0; first < tokens; first += kFillChunk) {
      const auto n = static_cast<uint32_t>(std::min<uint64_t>(kFillChunk, tokens - first));
      synth.make(s, first, n, k[buffer].data(), v[buffer].data(), makers);
      if (appending.valid()) appending.get();
      appending = std::async(std::launch::async,
                             [&host, id = host.ids[s], n, kp = k[buffer].data(),
                              vp = v[buffer].data()] { host.cache->append(id, 0, n, kp, vp); });
      buffer ^= 1;
    }
  if (appending.valid()) appending.get();
}

// (a) ours and (b): the transfer engine and the kernel driven directly, over every page of the
// row, with a device cache exactly as large as the pages.
void dense_phase(const Config& cfg, Host& host, Row& row, const std::vector<float>* cpu_out) {
  const CacheGeometry& g = host.geometry;
  const uint32_t batch = row.batch, pairs = batch * kKvHeads;
  const KvCache& cache = *host.cache;
  const uint64_t per_pair = g.pages_for(cache.length(host.ids[0], 0));
  const uint64_t n_pages = uint64_t{pairs} * per_pair;
  const std::size_t slot_bytes = g.slot_bytes();
  const std::size_t page_bytes = n_pages * slot_bytes;
  if (n_pages > (uint64_t{1} << 31)) fail(Status::capacity_exceeded, "dense: too many pages");

  gpu::StepStream stream;
  check(stream.init(), "dense: stream");
  gpu::PageCacheConfig config;
  config.slot_bytes = slot_bytes;
  config.capacity = static_cast<uint32_t>(n_pages);
  config.host_pool = cache.pool().base();
  config.host_slots = cache.pool().capacity();
  config.path = gpu::TransferPath::mapped;
  gpu::DevicePageCache device_cache;
  const auto t_alloc = Clock::now();
  check(device_cache.init(config), "dense: device page cache");
  gpu::SparseDecodeAttention attention;
  const gpu::AttentionShape shape{kKvHeads, kGroup, kHeadDim, kPageTokens, simd::Dtype::bf16};
  check(attention.init(shape, batch), "dense: attention workspace");
  say("  dense: device cache of %lu pages (%.2f GiB) in %.2f s",
      static_cast<unsigned long>(n_pages), page_bytes / double(1u << 30), seconds_since(t_alloc));

  // q and out [batch, 32, 128] fp32 (256-byte aligned, as OffloadAttention places them), then the
  // lists: offsets [pairs + 1], last_page_tokens [pairs], device slots [n_pages]; pinned on the
  // host, so that ensure() writes the slots where the copy reads them.
  const std::size_t qo = std::size_t{batch} * kKvHeads * kGroup * kHeadDim;
  const std::size_t qo_bytes = (qo * sizeof(float) + 255) / 256 * 256;
  const std::size_t list_words = 2 * std::size_t{pairs} + 1 + n_pages;
  const std::size_t buffer_bytes = 2 * qo_bytes + list_words * 4;
  PinnedPtr host_buffer = pinned(buffer_bytes, "dense: pinned q, out and lists");
  auto* q_host = static_cast<float*>(host_buffer.get());
  auto* out_host = reinterpret_cast<float*>(static_cast<std::byte*>(host_buffer.get()) + qo_bytes);
  auto* offsets =
      reinterpret_cast<uint32_t*>(static_cast<std::byte*>(host_buffer.get()) + 2 * qo_bytes);
  uint32_t* last = offsets + pairs + 1;
  uint32_t* slots = last + pairs;
  DevicePtr device_buffer = device(buffer_bytes, "dense: device q, out and lists");
  auto* q_dev = static_cast<float*>(device_buffer.get());
  auto* out_dev = reinterpret_cast<float*>(static_cast<std::byte*>(device_buffer.get()) + qo_bytes);
  auto* offsets_dev =
      reinterpret_cast<uint32_t*>(static_cast<std::byte*>(device_buffer.get()) + 2 * qo_bytes);
  const std::size_t copy_bytes = std::min(kCopyChunk, page_bytes);
  DevicePtr copy_dst = device(copy_bytes, "dense: plain copy buffer");

  std::vector<uint32_t> host_slots(n_pages);
  const uint64_t length = cache.length(host.ids[0], 0);
  for (uint32_t p = 0; p < pairs; ++p) {
    const uint32_t* table = cache.page_table(host.ids[p / kKvHeads], 0, p % kKvHeads);
    std::copy_n(table, per_pair, host_slots.data() + p * per_pair);
    offsets[p] = static_cast<uint32_t>(p * per_pair);
    last[p] = static_cast<uint32_t>(length - (per_pair - 1) * kPageTokens);
  }
  offsets[pairs] = static_cast<uint32_t>(n_pages);
  std::memcpy(q_host, host.q.data(), qo * sizeof(float));

  gpu::PageAttendCall call;
  call.target = {batch, device_cache.device_pool(), n_pages, q_dev, out_dev, stream.handle()};
  call.host = {offsets, slots, last};
  call.device = {offsets_dev, offsets_dev + 2 * pairs + 1, offsets_dev + pairs + 1};

  struct Timing {
    double wall_us, move_us, plan_us, attend_us;
  };
  // One dense step: q over, every page made resident (all moved when cold), the lists over, the
  // kernel, the output back. Events 0-3. The first step validates the lists (the kernel's
  // precondition) once ensure() has written the slots.
  auto step = [&](bool cold, bool validate) {
    if (cold) device_cache.clear();  // the benchmark's doing, not the step's: left out of its time
    const auto t0 = Clock::now();
    check(stream.mark(0), "dense: event");
    check(stream.copy_to_device(q_dev, q_host, qo * sizeof(float)), "dense: q");
    check(device_cache.ensure(host_slots.data(), n_pages, slots, stream.handle()), "dense: ensure");
    const double plan_us = seconds_since(t0) * 1e6;
    if (validate) check(attention.validate(call), "dense: lists");
    check(stream.copy_to_device(offsets_dev, offsets, list_words * 4), "dense: lists");
    check(stream.mark(1), "dense: event");
    check(attention.run(call), "dense: attention");
    check(stream.mark(2), "dense: event");
    check(stream.copy_to_host(out_host, out_dev, qo * sizeof(float)), "dense: out");
    check(stream.mark(3), "dense: event");
    check(stream.wait(3), "dense: step");
    return Timing{seconds_since(t0) * 1e6, 1e3 * stream.elapsed_ms(0, 1), plan_us,
                  1e3 * stream.elapsed_ms(1, 2)};
  };

  // The first step moves everything (the cache is new) and is checked; then every page stays
  // resident for (a).
  const Timing first = step(false, true);
  say("  dense: first step %.1f ms (%lu pages moved)", first.wall_us * 1e-3,
      static_cast<unsigned long>(device_cache.last_step().misses));
  if (cpu_out != nullptr) {
    double num = 0.0, den = 0.0;
    for (std::size_t i = 0; i < qo; ++i) {
      num += (double{out_host[i]} - (*cpu_out)[i]) * (double{out_host[i]} - (*cpu_out)[i]);
      den += double{(*cpu_out)[i]} * (*cpu_out)[i];
    }
    row.check_err = std::sqrt(num / std::max(den, 1e-30));
    say("  dense: output against the CPU kernel: relative error %.2e", row.check_err);
    if (!(row.check_err <= 1e-3)) row.status = "dense output differs from the CPU kernel";
  }

  const double kv_bytes = double(uint64_t{batch} * kKvHeads * length * g.token_bytes());
  const Spread a = time_attention(attention, call, stream, cfg.a_reps);
  row.a_us = a.median;
  row.a_min = a.min;
  row.a_max = a.max;
  row.a_tbps = kv_bytes / row.a_us * 1e-6;
  say("  (a) ours: %.1f us (%.1f..%.1f), %.2f TB/s of K+V", row.a_us, row.a_min, row.a_max,
      row.a_tbps);
  // The sweep over kernel tunings, each with a workspace of its own, for picking the default. A
  // tuning the kernel refuses is reported and skipped; the row goes on.
  for (const TuningPoint& point : cfg.a_points) {
    try {
      gpu::SparseDecodeAttention tuned;
      check(tuned.init(shape, batch, point.tuning), "a: tuned attention workspace");
      const Spread t = time_attention(tuned, call, stream, cfg.a_reps);
      const gpu::SplitPlan& plan = tuned.last_plan();
      say("  (a) sweep %s "
          "(ctas_per_sm:min_tiles:chunks[:tensor_cores[:l2_prefetch[:bulk[:warp_tokens]]]]): "
          "%u splits x %u tokens, %lu CTAs against %u: %.1f us (%.1f..%.1f over %d), %.2f TB/s",
          point.text.c_str(), plan.splits_per_pair, plan.tokens_per_split,
          static_cast<unsigned long>(plan.ctas), plan.device_ctas, t.median, t.min, t.max,
          cfg.a_reps, kv_bytes / t.median * 1e-6);
    } catch (const std::exception& e) {
      say("  (a) sweep %s: %s", point.text.c_str(), e.what());
    }
  }

  std::vector<double> wall, move, plan, attend;
  for (int i = 0; i < cfg.b_steps; ++i) {
    const Timing t = step(true, false);
    if (device_cache.last_step().misses != n_pages)
      fail(Status::internal, "dense: a cold step moved ", device_cache.last_step().misses, " of ",
           n_pages, " pages");
    wall.push_back(t.wall_us);
    move.push_back(t.move_us);
    plan.push_back(t.plan_us);
    attend.push_back(t.attend_us);
  }
  row.b_us = median(wall);
  row.b_min = min_of(wall);
  row.b_max = max_of(wall);
  row.b_move_us = median(move);
  row.b_plan_us = median(plan);
  row.b_attend_us = median(attend);
  row.b_mb = page_bytes * 1e-6;
  row.b_gbps = page_bytes / row.b_move_us * 1e-3;

  std::vector<double> copies;
  const int copy_reps = page_bytes > (std::size_t{4} << 30) ? 2 : 5;
  for (int i = 0; i < copy_reps; ++i)
    copies.push_back(1e3 * plain_copy_ms(stream, copy_dst.get(), cache.pool().base(), page_bytes));
  row.copy_b_us = median(copies);
  row.copy_b_gbps = page_bytes / row.copy_b_us * 1e-3;
  say("  (b) dense offload: %.1f us (%.1f..%.1f); move %.1f us of which planning %.1f us "
      "(%.1f GB/s, %.1f GB/s without the planning); attend %.1f us; plain copy of the same %.1f "
      "MB %.1f us (%.1f GB/s)",
      row.b_us, row.b_min, row.b_max, row.b_move_us, row.b_plan_us, row.b_gbps,
      page_bytes / std::max(1.0, row.b_move_us - row.b_plan_us) * 1e-3, row.b_attend_us, row.b_mb,
      row.copy_b_us, row.copy_b_gbps);
}

// (c)'s kernel alone, under each tuning of --a-tunings, on the lists of the step's last call (its
// last part: the batch's last sequences), in the device cache's slots where the step read them:
// what (c)'s attend column would be with each tuning, for picking the default of selective calls.
void selective_sweep(const Config& cfg, const Host& host, const OffloadAttention& offload,
                     uint32_t batch) {
  const auto offsets = offload.attended_offsets();
  const auto host_slots = offload.attended_host_slots();
  const auto slots = offload.attended_device_slots();
  const auto pairs = static_cast<uint32_t>(offsets.size() - 1);
  const uint32_t n_seqs = pairs / kKvHeads;
  const uint32_t first_seq = batch - n_seqs;
  // The last listed page of a pair holds the sequence's open tokens when it is the open page.
  std::vector<uint32_t> lists(offsets.begin(), offsets.end());
  for (uint32_t pair = 0; pair < pairs; ++pair) {
    const int32_t id = host.ids[first_seq + pair / kKvHeads];
    const uint64_t length = host.cache->length(id, 0);
    const uint64_t pages = host.geometry.pages_for(length);
    const uint32_t open = host.cache->page_table(id, 0, pair % kKvHeads)[pages - 1];
    const bool ends_open =
        offsets[pair + 1] > offsets[pair] && host_slots[offsets[pair + 1] - 1] == open;
    lists.push_back(ends_open ? static_cast<uint32_t>(length - (pages - 1) * kPageTokens)
                              : kPageTokens);
  }
  lists.insert(lists.end(), slots.begin(), slots.end());
  const std::size_t q_elems = std::size_t{n_seqs} * kKvHeads * kGroup * kHeadDim;
  const std::size_t q_bytes = q_elems * sizeof(float);
  DevicePtr buffer = device(2 * q_bytes + lists.size() * 4, "(c) sweep: device buffers");
  auto* q_dev = static_cast<float*>(buffer.get());
  auto* lists_dev =
      reinterpret_cast<uint32_t*>(static_cast<std::byte*>(buffer.get()) + 2 * q_bytes);
  gpu::StepStream stream;
  check(stream.init(), "(c) sweep: stream");
  check(stream.copy_to_device(q_dev, host.q.data() + std::size_t{first_seq} * q_elems / n_seqs,
                              q_bytes),
        "(c) sweep: q");
  check(stream.copy_to_device(lists_dev, lists.data(), lists.size() * 4), "(c) sweep: lists");
  const gpu::DevicePageCache& cache = offload.device_cache(0);
  gpu::PageAttendCall call;
  call.target = {n_seqs, cache.device_pool(), cache.capacity(),
                 q_dev,  q_dev + q_elems,     stream.handle()};
  call.host = {lists.data(), lists.data() + 2 * pairs + 1, lists.data() + pairs + 1};
  call.device = {lists_dev, lists_dev + 2 * pairs + 1, lists_dev + pairs + 1};
  const gpu::AttentionShape shape{kKvHeads, kGroup, kHeadDim, kPageTokens, simd::Dtype::bf16};
  for (const TuningPoint& point : cfg.a_points) {
    try {
      gpu::SparseDecodeAttention tuned;
      check(tuned.init(shape, n_seqs, point.tuning), "(c) sweep: attention workspace");
      check(tuned.validate(call), "(c) sweep: lists");
      const Spread t = time_attention(tuned, call, stream, cfg.a_reps);
      const gpu::SplitPlan& plan = tuned.last_plan();
      say("  (c) attend sweep %s "
          "(ctas_per_sm:min_tiles:chunks[:tensor_cores[:l2_prefetch[:bulk[:warp_tokens]]]]), "
          "%u pairs, %u pages: %u splits x %u tokens, %lu CTAs: %.1f us (%.1f..%.1f over %d)",
          point.text.c_str(), pairs, offsets[pairs], plan.splits_per_pair, plan.tokens_per_split,
          static_cast<unsigned long>(plan.ctas), t.median, t.min, t.max, cfg.a_reps);
    } catch (const std::exception& e) {
      say("  (c) attend sweep %s: %s", point.text.c_str(), e.what());
    }
  }
}

// (c): the library's offload step with a LOCKS selector, appending and drifting each step.
void sparse_phase(const Config& cfg, Host& host, const Synth& synth, Row& row) {
  KvCache& cache = *host.cache;
  const uint32_t batch = row.batch;
  const uint64_t max_tokens = row.context + cfg.c_warmup + cfg.c_steps + 1;
  const select::Policy& policy = host.selector->policy();
  // The pages LOCKS lists at the longest context (lib/select/page_plan.hpp); a few more for
  // margin.
  const uint64_t max_pages = policy.page_plan(kPageTokens, max_tokens).count + 4;
  // The library's decode engine, as the C API and the model runner hold it: its own LOCKS
  // selector (built over the context here) and the offload backend.
  EngineOptions options;
  options.max_batch = batch;
  options.n_threads = cfg.threads;
  options.max_pages_per_pair = cache.geometry().pages_for(max_tokens);
  options.device = 0;
  // Twice a step's pages: room for the working set and for what the drift brings in.
  options.device_cache_pages = static_cast<uint32_t>(
      std::min<uint64_t>(2 * uint64_t{batch} * kKvHeads * max_pages, (uint64_t{1} << 31) - 1));
  row.c_max_pages = static_cast<uint32_t>(max_pages);
  row.c_cache_pages = options.device_cache_pages;
  row.c_parts = std::min(options.device_step_parts, batch);
  DecodeEngine engine(cache, default_kernels(), options);
  engine.set_selector(policy);
  const OffloadAttention& offload = *engine.offload();
  say("  (c) device cache of %u pages (twice a step's), at most %lu pages per (sequence, KV head), "
      "%u part(s) per step",
      options.device_cache_pages, static_cast<unsigned long>(max_pages), row.c_parts);
  std::vector<float> out(host.q.size());
  std::vector<float> k(std::size_t{kKvHeads} * kHeadDim), v(k.size());

  std::vector<double> total, sel, hst, lists, plan, xfer, att, cout, ovl, pages, moved, page_mb,
      h2d_mb, gbps, kept;
  uint64_t hits = 0, misses = 0;
  for (int s = 0; s < cfg.c_warmup + cfg.c_steps; ++s) {
    for (uint32_t i = 0; i < batch; ++i) {
      synth.make(i, cache.length(host.ids[i], 0), 1, k.data(), v.data(), 1);
      cache.append(host.ids[i], 0, 1, k.data(), v.data());
    }
    drift(host.q, host.anchor, static_cast<uint64_t>(s), cfg.drift_noise);
    const AttendCall call{0, batch, host.ids.data(), host.q.data(), out.data()};
    engine.attend_selected(call);
    if (s < cfg.c_warmup) continue;
    const OffloadStats& st = offload.last_step();
    const LayerStepStats& step = engine.last_step();
    total.push_back(st.total_us + step.select_us);
    sel.push_back(step.select_us);
    hst.push_back(st.host_us);
    lists.push_back(st.lists_us);
    plan.push_back(st.plan_us);
    xfer.push_back(st.transfer_us);
    att.push_back(st.attend_us);
    cout.push_back(st.copy_out_us);
    ovl.push_back(step.overlap_us);
    pages.push_back(static_cast<double>(st.pages_listed));
    moved.push_back(static_cast<double>(st.misses + st.refreshed));
    page_mb.push_back(st.page_bytes_h2d * 1e-6);
    h2d_mb.push_back(st.bytes_h2d * 1e-6);
    if (st.transfer_us > 0) gbps.push_back(st.page_bytes_h2d / st.transfer_us * 1e-3);
    kept.push_back(step.pairs ? step.kept_estimate_sum / step.pairs : NAN);
    hits += st.hits;
    misses += st.misses;
  }
  for (float x : out)
    if (!std::isfinite(x)) fail(Status::internal, "(c): the step's output is not finite");
  row.c_us = median(total);
  row.c_min = min_of(total);
  row.c_max = max_of(total);
  row.c_select_us = median(sel);
  row.c_host_us = median(hst);
  row.c_lists_us = median(lists);
  row.c_plan_us = median(plan);
  row.c_transfer_us = median(xfer);
  row.c_attend_us = median(att);
  row.c_out_us = median(cout);
  row.c_overlap_us = median(ovl);
  row.c_pages = median(pages);
  row.c_moved = median(moved);
  row.c_page_mb = median(page_mb);
  row.c_h2d_mb = median(h2d_mb);
  row.c_hit = hits + misses ? double(hits) / double(hits + misses) : NAN;
  row.c_gbps = median(gbps);
  row.c_kept = median(kept);

  // The plain pinned copy of a median step's page bytes, for the share the moves reach.
  const auto bytes = static_cast<std::size_t>(row.c_page_mb * 1e6) / 16 * 16;
  if (bytes > 0) {
    gpu::StepStream stream;
    check(stream.init(), "(c): stream");
    DevicePtr dst = device(bytes, "(c): plain copy buffer");
    std::vector<double> copies;
    for (int i = 0; i < 11; ++i)
      copies.push_back(plain_copy_ms(stream, dst.get(), cache.pool().base(), bytes));
    row.copy_c_gbps = bytes / median(copies) * 1e-6;
  }
  // Medians over the timed steps, each with its spread (min..max).
  const Spread sel_s = spread_of(sel), host_s = spread_of(hst), xfer_s = spread_of(xfer),
               att_s = spread_of(att);
  say("  (c) LOCKS %.0f%% (%s selection): %.1f us (%.1f..%.1f over %zu steps): select %.1f "
      "(%.1f..%.1f; hidden %.1f), host %.1f (%.1f..%.1f; page lists %.1f, residency plan %.1f), "
      "transfer %.1f (%.1f..%.1f), attend %.1f (%.1f..%.1f), out %.1f; %.0f pages listed, %.0f "
      "moved (%.2f MB, %.2f MB in all H2D); hit rate %.3f; moves %.1f GB/s against a plain "
      "copy's %.1f; kept estimate %.3f",
      100 * policy.budget, policy.device >= 0 ? "device" : "CPU", row.c_us, row.c_min, row.c_max,
      total.size(), sel_s.median, sel_s.min, sel_s.max, row.c_overlap_us, host_s.median, host_s.min,
      host_s.max, row.c_lists_us, row.c_plan_us, xfer_s.median, xfer_s.min, xfer_s.max,
      att_s.median, att_s.min, att_s.max, row.c_out_us, row.c_pages, row.c_moved, row.c_page_mb,
      row.c_h2d_mb, row.c_hit, row.c_gbps, row.copy_c_gbps, row.c_kept);
  if (!cfg.a_points.empty()) {
    try {
      selective_sweep(cfg, host, offload, batch);
    } catch (const std::exception& e) {  // (c)'s numbers above stand
      say("  (c) attend sweep failed: %s", e.what());
    }
  }
  if (const auto* page = dynamic_cast<const select::PageSelector*>(host.selector.get());
      page != nullptr && policy.device >= 0)
    say("  (c) device selection: %lu steps fell back to the CPU",
        static_cast<unsigned long>(page->device_fallbacks()));
}

// --host-only: (c)'s host half without a device (an unpinned cache): the selection's time per step
// and how many of a step's pages the previous step also chose, the hit rate an unbounded device
// cache would see. For checking the synthetic workload and the run's time on a machine without a
// GPU.
void host_phase(const Config& cfg, Host& host, const Synth& synth, Row& row) {
  KvCache& cache = *host.cache;
  const uint32_t batch = row.batch, pairs = batch * kKvHeads;
  select::Selection selection;
  host.selector->reserve_selection(selection);
  std::vector<float> k(std::size_t{kKvHeads} * kHeadDim), v(k.size());
  std::vector<std::vector<uint32_t>> previous(pairs);
  std::vector<double> sel, pages, kept_share;
  uint64_t kept = 0, listed = 0;
  for (int s = 0; s < cfg.c_warmup + cfg.c_steps; ++s) {
    for (uint32_t i = 0; i < batch; ++i) {
      synth.make(i, cache.length(host.ids[i], 0), 1, k.data(), v.data(), 1);
      cache.append(host.ids[i], 0, 1, k.data(), v.data());
    }
    drift(host.q, host.anchor, static_cast<uint64_t>(s), cfg.drift_noise);
    const select::SelectCall call{0, batch, host.ids.data(), host.q.data()};
    const auto t = Clock::now();
    host.selector->prepare(call, selection);
    host.selector->select(call, selection);
    const double us = seconds_since(t) * 1e6;
    uint64_t step_kept = 0;
    for (uint32_t p = 0; p < pairs; ++p) {
      std::vector<uint32_t> now(selection.page_ids.data() + selection.offsets[p],
                                selection.page_ids.data() + selection.offsets[p + 1]);
      for (uint32_t id : now)
        step_kept += std::binary_search(previous[p].begin(), previous[p].end(), id) ? 1 : 0;
      previous[p] = std::move(now);
    }
    if (s < cfg.c_warmup) continue;
    sel.push_back(us);
    pages.push_back(static_cast<double>(selection.pages_chosen()));
    kept_share.push_back(selection.kept_estimate_sum() / pairs);
    kept += step_kept;
    listed += selection.pages_chosen();
  }
  row.c_select_us = median(sel);
  row.c_pages = median(pages);
  row.c_kept = median(kept_share);
  row.c_hit = listed ? double(kept) / double(listed) : NAN;
  say("  (c) host half: select %.1f us (%.1f..%.1f), %.0f pages listed, %.3f of them listed the "
      "step before, kept estimate %.3f",
      row.c_select_us, min_of(sel), max_of(sel), row.c_pages, row.c_hit, row.c_kept);
}

// (a) ours, (b) and (c) on the filled row; `phase` names the part running, for the error.
void device_phases(const Config& cfg, Host& host, const Synth& synth, Row& row, int threads,
                   const char*& phase) {
  std::vector<float> cpu_out;
  if (row.context * row.batch <= cfg.check_tokens) {
    phase = "CPU check";
    cpu_out.resize(host.q.size());
    DecodeAttention cpu(host.geometry, row.batch, threads, default_kernels());
    const AttendCall call{0, row.batch, host.ids.data(), host.q.data(), cpu_out.data()};
    cpu.validate(*host.cache, call);
    cpu.run(*host.cache, call);
  }
  phase = "(a)/(b) dense";
  try {
    dense_phase(cfg, host, row, cpu_out.empty() ? nullptr : &cpu_out);
  } catch (const std::exception& e) {
    // The device memory of (b) is gone with its scope; (c) may still run.
    row.status = std::string("dense failed: ") + e.what();
    say("  %s", row.status.c_str());
  }
  phase = "(c) sparse";
  sparse_phase(cfg, host, synth, row);
}

void run_row(const Config& cfg, const Synth& synth, Row& row, int threads) {
  Host host;
  host.geometry.n_layers = 1;
  host.geometry.n_kv_heads = kKvHeads;
  host.geometry.group_size = kGroup;
  host.geometry.head_dim = kHeadDim;
  host.geometry.page_tokens = kPageTokens;
  host.geometry.dtype = simd::Dtype::bf16;
  const CacheGeometry& g = host.geometry;
  const uint32_t batch = row.batch;
  const uint64_t max_tokens = row.context + cfg.c_warmup + cfg.c_steps + 1;
  const uint64_t pages_per_head = g.pages_for(max_tokens);
  CacheOptions options;
  options.pinned = !cfg.host_only;
  options.max_pages = uint64_t{batch} * kKvHeads * pages_per_head;
  row.pool_gib = double(options.max_pages) * g.slot_bytes() / double(1u << 30);

  const char* phase = "pinned pool";
  try {
    auto t = Clock::now();
    host.cache = std::make_unique<KvCache>(g, options, default_kernels());
    row.alloc_s = seconds_since(t);
    say("  pinned pool of %.2f GiB in %.2f s", row.pool_gib, row.alloc_s);

    phase = "fill";
    select::Policy policy;
    policy.kind = select::Kind::locks;
    policy.budget = cfg.budget;
    policy.device = cfg.locks_device;
    // Created before the fill, so that it sees every seal.
    host.pool = std::make_unique<ThreadPool>(threads);
    host.selector = select::Selector::create(policy, *host.cache, batch, pages_per_head + 1,
                                             *host.pool, default_kernels());
    for (uint32_t s = 0; s < batch; ++s) host.ids.push_back(host.cache->create_sequence());
    t = Clock::now();
    fill(host, synth, row.context, threads);
    row.fill_s = seconds_since(t);
    say("  filled %lu tokens x %u sequences in %.2f s", static_cast<unsigned long>(row.context),
        batch, row.fill_s);

    phase = "LOCKS summaries";
    host.anchor = synth.anchor(batch);
    host.q = host.anchor;
    drift(host.q, host.anchor, ~uint64_t{0}, cfg.drift_noise);
    t = Clock::now();
    {
      select::Selection selection;
      host.selector->reserve_selection(selection);
      const select::SelectCall call{0, batch, host.ids.data(), host.q.data()};
      host.selector->prepare(call, selection);
      host.selector->select(call, selection);  // builds every pending summary first
    }
    row.build_s = seconds_since(t);
    say("  LOCKS summaries of %lu pages and one selection in %.2f s",
        static_cast<unsigned long>(uint64_t{batch} * kKvHeads * (row.context / kPageTokens)),
        row.build_s);

    if (cfg.host_only) {
      phase = "(c) host half";
      host_phase(cfg, host, synth, row);
    } else {
      device_phases(cfg, host, synth, row, threads, phase);
    }
  } catch (const std::bad_alloc&) {
    row.status = std::string(phase) + ": out of host memory (std::bad_alloc)";
    say("  %s", row.status.c_str());
  } catch (const std::exception& e) {
    const std::string prefix = row.status == "ok" ? "" : row.status + "; ";
    row.status = prefix + phase + ": " + e.what();
    say("  %s", row.status.c_str());
  }
  const auto t = Clock::now();
  host.selector.reset();
  host.cache.reset();
  say("  released the row in %.2f s", seconds_since(t));
}

}  // namespace

int main(int argc, char** argv) {
  g_start = Clock::now();
  Config cfg;
  namespace apps = kvsift::apps;
  CLI::App app{
      "kvsift-bench-offload: dense HBM, dense offload and LOCKS offload on one "
      "Llama-3.1-8B layer (scripts/gpu_bench.sh prints the table)",
      "kvsift-bench-offload"};
  apps::set_up_command_line(app, "kvsift-bench-offload");
  app.add_option("--contexts", cfg.contexts, "tokens per sequence")
      ->delimiter(',')
      ->check(CLI::Range(uint64_t{1}, uint64_t{1} << 24));
  app.add_option("--batches", cfg.batches, "sequences per step")
      ->delimiter(',')
      ->check(CLI::Range(1, 256));
  app.add_option("--budget", cfg.budget, "LOCKS budget, a fraction of the context")
      ->check(apps::above_and_at_most(0.0, 1.0));
  app.add_option("--drift-noise", cfg.drift_noise, "(c) the query's new noise per step")
      ->check(CLI::Range(0.0, 100.0));
  app.add_option("--a-reps", cfg.a_reps, "(a) kernel repetitions")->check(CLI::Range(1, 100000));
  app.add_option(
         "--a-tunings", cfg.a_tunings,
         "(a) also times the kernel tuned as each "
         "CTAS_PER_SM:MIN_TILES:CHUNKS[:TENSOR_CORES[:L2_PREFETCH[:BULK_COPIES[:WARP_TOKENS]]]] "
         "asks "
         "(gpu::AttendTuning; 0 CTAs per multiprocessor: its occupancy; fields left out are 0); "
         "'none': no sweep")
      ->delimiter(',');
  app.add_option("--b-steps", cfg.b_steps, "(b) cold dense steps")->check(CLI::Range(1, 100000));
  app.add_option("--c-warmup", cfg.c_warmup, "(c) untimed steps first (the cold fill)")
      ->check(CLI::Range(0, 100000));
  app.add_option("--c-steps", cfg.c_steps, "(c) timed steps")->check(CLI::Range(1, 100000));
  app.add_option("--check-tokens", cfg.check_tokens,
                 "compare (b)'s output with the CPU kernel on rows of at most this many tokens");
  app.add_option("--threads", cfg.threads, "CPU threads (0: OpenMP's default)")
      ->check(CLI::Range(0, 1024));
  app.add_option("--csv", cfg.csv, "write one line per row here");
  app.add_option("--locks-device", cfg.locks_device,
                 "(c) selects on this CUDA device (the LOCKS records resident there); -1: the CPU")
      ->check(CLI::Range(-1, 64));
  app.add_flag("--host-only", cfg.host_only,
               "no device: fill, summaries and (c)'s selections only, to check the workload");
  const auto validate = [&] {
    if (!cfg.csv.empty()) apps::require_writable_file("--csv", cfg.csv);
    cfg.a_points.clear();
    for (const std::string& text : cfg.a_tunings)
      if (text != "none") cfg.a_points.push_back(parse_tuning(text));
    if (cfg.host_only && cfg.locks_device >= 0)
      throw apps::UsageError("--locks-device " + std::to_string(cfg.locks_device) +
                             ": --host-only uses no device");
  };
  if (const auto stop = apps::parse_command_line(app, argc, argv, validate)) return *stop;
  const int threads = cfg.threads > 0 ? cfg.threads : omp_get_max_threads();

  int n_devices = 0;
  if (const gpu::Result r = gpu::device_count(&n_devices);
      !cfg.host_only && (!r.ok || n_devices == 0)) {
    std::printf("kvsift-bench-offload: no usable CUDA device (%s): nothing to measure\n",
                r.ok ? "none found" : r.message.c_str());
    return apps::kExitOk;
  }

  // Smallest rows first, so that a run cut short loses the largest; the largest last.
  std::vector<Row> rows;
  for (uint64_t context : cfg.contexts)
    for (uint32_t batch : cfg.batches) {
      Row r;
      r.context = context;
      r.batch = batch;
      rows.push_back(r);
    }
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    return a.context * a.batch < b.context * b.batch ||
           (a.context * a.batch == b.context * b.batch && a.context < b.context);
  });
  std::FILE* csv = nullptr;
  if (!cfg.csv.empty()) {
    csv = std::fopen(cfg.csv.c_str(), "w");
    if (csv == nullptr) {
      std::printf("kvsift-bench-offload: cannot write %s\n", cfg.csv.c_str());
      return apps::kExitOutputUnwritable;
    }
    std::fprintf(csv, "%s\n", kCsvHeader);
    std::fflush(csv);
  }
  say("%d CPU threads, LOCKS budget %.3f, (a) %d reps, (b) %d steps, (c) %d + %d steps", threads,
      cfg.budget, cfg.a_reps, cfg.b_steps, cfg.c_warmup, cfg.c_steps);
  const Synth synth;
  int failed = 0;
  for (Row& row : rows) {
    say("row context %lu, batch %u", static_cast<unsigned long>(row.context), row.batch);
    run_row(cfg, synth, row, threads);
    if (row.status != "ok") ++failed;
    write_csv(csv, row);
  }
  if (csv != nullptr) std::fclose(csv);
  say("done: %zu rows, %d with a failure", rows.size(), failed);
  return failed == 0 ? apps::kExitOk : apps::kExitCheckFailed;
}
