// Decode attention with the KV cache in host memory and only the selected pages on the GPU
// (docs/architecture.md): the offload counterpart of lib/attend's DecodeAttention, same
// calls, same output. Per call (one layer of one decode step): q goes to the device, the layer's
// device page cache makes the listed pages resident (moving only the misses, from the cache's
// mapped pinned pool), the lists are translated to device slots, the sparse paged kernel attends,
// and the output comes back; one event wait at the end, no device-wide synchronisation. Plain C++:
// the CUDA work goes through gpu/*.hpp; without the CUDA backend create() refuses with unsupported.
//
// Stale pages. The device cache is keyed by host pool slot, and a host slot's contents can change
// under it in two ways, both handled here: the open page of a pair grows by one token per step (a
// cached copy made when it held fewer tokens is sent again, "refreshed", in the same step; so is a
// page that was cached partial and has since filled), and slots given back to the pool, by
// free_sequence() or by release_pages() (S4R), are reused by later appends: the cache tells its
// listeners before it gives them back, and the device copies of exactly those slots are marked so
// that they are sent again the next time their slot is listed. A mirror (OffloadOptions::
// cache_pages = 0: a device copy of the whole pool, slot for slot) needs none of that bookkeeping:
// a full page changes only by being sealed anew in a reused slot, so the pages sealed since the
// last call go at the next call, with each open page it lists; a step's host work is its lists.
//
// Row chunks (the token rows Louver gathers and S4R reconstructs) go over per call: the host
// copies them into pinned staging, one copy moves them to slots reserved after each layer's page
// cache (PageCacheConfig::reserved_slots), and the call runs the kernel's token form over the
// pages' rows and the chunks' rows. Calls without rows keep the page form.
//
// S4R's rows can come as coefficients instead (AttendCall::latent, over a 16-bit cache that takes
// pre-RoPE keys: reconstructs_rows()). The bases of each (sequence, layer, unit) are copied to the
// device the first time a call names them, and again only when their basis_id changes; they are
// freed with the sequence. Per call the chosen rows' key and value coefficients and positions go
// over in one copy, with a table of the units, and gpu/row_reconstruct.hpp's kernel writes K
// (rotated at each position) and V into the same reserved slots, in the cache's layout, before the
// token form attends them: the attention does not know where its rows came from. Why here, and not
// in the selector: the reserved slots, the stream that orders the rows before their attention,
// and the device are this backend's; the selector keeps the bases and the ranking on the host and
// only learns, per call, that its rows may stay latent (SelectCall::latent_rows).
//
// The critical path of a call, after the selection: the page lists, the device cache's plan
// (residency lookups, host only), then one gather of the misses and the refreshed pages together
// (DevicePageCache::plan and move: one kernel and one PCIe round trip, where the refreshes were a
// second kernel after the misses), one copy of q and the page lists (q sits right before the lists
// in a part's pinned block and its device mirror), the attention, the output back. q no longer
// goes first on its own: nothing reads it before the lists arrive.
//
// Overlap. A call can come in parts (begin(), enqueue() per part, finish()): while the device
// moves and attends part i, the caller plans part i + 1 (lib/engine/decode_engine.hpp selects it:
// the step's only CPU work that can run beside the device, since the query of layer l + 1 depends
// on layer l's output). One stream orders the parts, so a later part's moves never overwrite slots
// an earlier part's kernel still reads.
//
// No CUDA graph here: the static part of a call is one kernel launch, and it is not static either,
// since SparseDecodeAttention sizes its splits per call from the longest list, so a graph would be
// re-captured or updated every call and cost what it saves. The static part of a decode step is
// the device model's work between two attention calls, which gpu/device_llama replays as one
// graph per (layer, batch size).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "gpu/offload_runtime.hpp"
#include "gpu/page_transfer.hpp"
#include "gpu/row_reconstruct.hpp"
#include "gpu/sparse_attention.hpp"
#include "lib/attend/decode_attention.hpp"
#include "lib/cache/kv_cache.hpp"
#include "lib/core/error.hpp"

namespace kvsift {

struct OffloadOptions {
  int device = 0;          // CUDA device index
  uint32_t max_batch = 1;  // most sequences per call, 1..65536
  // Most pages one (sequence, KV head) pair lists in a call: the selection's page budget, or the
  // longest context's page count for dense calls (no lists). Sizes the list buffers.
  uint64_t max_pages_per_pair = 0;
  // Most row chunks (page_tokens token rows each, summed over the pairs) one call attends; 0
  // refuses calls with rows. Reserves as many device slots per layer, and pinned staging.
  uint64_t max_row_chunks = 0;
  // Device page cache slots per layer, 1..2^31 - 1; a call listing more pages than this is refused
  // (capacity_exceeded). Each slot is geometry.slot_bytes() of device memory, times n_layers.
  // 0: the device mirrors the whole host pool (gpu/page_transfer.hpp, PageCacheConfig::mirror),
  // every page of every layer at its own slot: nothing is planned or evicted, and a call sends
  // only the pages sealed since the last call and the open pages it lists. The KV cache in HBM,
  // for a device that holds it; the pool's size of device memory.
  uint32_t cache_pages = 0;
  gpu::EvictionPolicy eviction = gpu::EvictionPolicy::clock;
  // automatic: the mapped-memory gather kernel (measured faster than staging at every size on
  // the H200 host, gpu/page_transfer.hpp).
  gpu::TransferPath path = gpu::TransferPath::automatic;
  // The most parts a call comes in (begin(), enqueue() per part, finish()), 1..kMaxParts: each
  // part has list buffers of its own, so that they are not rewritten while an earlier part's
  // copies are in flight. The decode engine splits a batch into this many parts (at most the
  // batch) so that selection overlaps the device.
  uint32_t step_parts = 2;
  // A part's page moves are planned in pieces of whole (sequence, KV head) pairs, each sent
  // before the next is planned, so that the host's planning overlaps the device's gather: the
  // first piece lists at least this many pages (and an eighth of the part's), each later one about
  // twice the last. A part listing fewer than twice this many pages is one piece; 0: always one.
  uint32_t min_piece_pages = 128;
};

// One call (last_step()) or the sum over calls (totals()). Times in microseconds; the GPU times
// are event intervals on the step's stream, so they include the gaps in which the device waited
// for the CPU to enqueue the next operation.
struct OffloadStats {
  uint64_t calls = 0;
  uint64_t pages_listed = 0;    // (page, KV head) units attended
  uint64_t hits = 0;            // listed pages resident in the layer's device cache
  uint64_t misses = 0;          // listed pages moved host to device
  uint64_t evictions = 0;       // misses that replaced a resident page
  uint64_t refreshed = 0;       // resident pages sent again because their host copy changed
  uint64_t page_bytes_h2d = 0;  // (misses + refreshed) * slot_bytes
  uint64_t bytes_h2d = 0;       // pages, rows (or coefficients), S4R bases, q, the lists
  uint64_t bytes_d2h = 0;       // the output
  uint32_t parts = 0;           // parts the call came in
  double host_us = 0.0;         // CPU: list translation, the cache's planning, the launches
  double lists_us = 0.0;        //   of which the page lists (page ids to host slots)
  double plan_us = 0.0;         //   and the residency plan with the refresh scan
  double transfer_us = 0.0;     // GPU: q, page misses and refreshes, the lists
  double attend_us = 0.0;       // GPU: the sparse attention kernel
  double copy_out_us = 0.0;     // GPU: the output back to host
  double total_us = 0.0;        // wall clock of run(), including its final wait
  // Token rows: what went (reconstructed rows in whole chunks of page_tokens rows, or, latent, the
  // coefficients, positions and unit table the device reconstructs them from), and what the same
  // rows cost as values (chunks * slot_bytes), the PCIe bytes a latent call avoided being their
  // difference. S4R bases copied to the device (once per compression) are counted apart.
  uint64_t row_bytes_h2d = 0;
  uint64_t rows_equivalent_bytes = 0;
  uint64_t basis_bytes_h2d = 0;

  double hit_rate() const noexcept {
    return hits + misses == 0 ? 1.0
                              : static_cast<double>(hits) / static_cast<double>(hits + misses);
  }
};

// Owns, on one device: a stream and its events, one DevicePageCache per layer, the attention
// kernel's workspace and pinned/device buffers for q, the output and the lists, all sized by
// create(); run() allocates nothing for pages and value rows. Calls with latent rows (S4R) are the
// exception: a (sequence, layer)'s device bases are allocated at its first such call, and the
// coefficient staging grows (by half again) when a call needs more, each a cudaMalloc or
// cudaHostAlloc on that call's path; a decode reaches its sizes within its first steps.
// Registered with the cache as a seal listener (to see
// free_sequence) until destroyed, so it must not outlive the cache. Use from one host thread at a
// time. Not copyable or movable (the cache holds its address).
class OffloadAttention final : public AttentionBackend, public SealListener {
 public:
  // cache: the host KV cache, whose pool must be pinned and mapped (CacheOptions.pinned). Throws
  // Error: unsupported (no CUDA backend, or no usable device), invalid_argument (an unpinned
  // pool, options out of range; the message names the field), out_of_memory / internal (device
  // allocation).
  static std::unique_ptr<OffloadAttention> create(KvCache& cache, const OffloadOptions& options);
  ~OffloadAttention() override;
  OffloadAttention(const OffloadAttention&) = delete;
  OffloadAttention& operator=(const OffloadAttention&) = delete;

  // DecodeAttention::validate's checks, then this path's limits: the cache is the one given to
  // create(); at most max_pages_per_pair pages per pair, cache_pages pages and max_row_chunks row
  // chunks in all (capacity_exceeded); latent rows only where reconstructs_rows() (unsupported),
  // with their units consistent with the rows (invalid_argument). Throws Error naming the
  // argument.
  void validate(const KvCache& cache, const AttendCall& call) const override;

  // Writes call.out exactly as DecodeAttention::run would (to fp32 rounding) for a call that
  // validate() accepted against the same cache state. Blocks until the output is in call.out.
  // Returns Status::ok, or Status::internal with last_error() set when a CUDA call failed (then
  // call.out is unspecified and the stream has drained).
  Status run(const KvCache& cache, const AttendCall& call) noexcept;
  // run(), with a failure thrown as Error{internal} (AttentionBackend).
  void attend(const KvCache& cache, const AttendCall& call) override;
  const AttendStats& last_stats() const noexcept override { return attend_stats_; }
  const char* name() const noexcept override { return name_.c_str(); }

  // A call in parts, planned one after another while the device works (FlashInfer's plan/run,
  // with the run cut where the caller plans): begin(); per part, a call that validate() accepted,
  // given to enqueue() with the row of the batch it starts at (its q and output rows); then
  // finish() with the whole batch's call, which waits once and writes call.out. Up to kMaxParts
  // parts. Each throws Error{internal} when a device call fails, having drained the stream; a
  // caller that gives up between begin() and finish() calls abort(). run() is the one-part case.
  static constexpr uint32_t kMaxParts = 4;
  void begin();
  void enqueue(const KvCache& cache, const AttendCall& part, uint32_t row0);
  void finish(const AttendCall& call);
  void abort() noexcept { drain(); }
  // After finish(): the device's attention kernel time of one part, in microseconds (event
  // interval), so that a caller can tell how much of it ran beside its planning.
  double part_attend_us(uint32_t part) const noexcept;

  const OffloadStats& last_step() const noexcept { return last_; }
  const OffloadStats& totals() const noexcept { return totals_; }
  const std::string& last_error() const noexcept { return error_; }

  // What the last run() (or the last part of step()) attended, in its pairs (sequence-major, as
  // PageLists): offsets [pairs + 1], and per listed page its host pool slot and the device cache
  // slot read.
  std::span<const uint32_t> attended_offsets() const noexcept;
  std::span<const uint32_t> attended_host_slots() const noexcept;
  std::span<const uint32_t> attended_device_slots() const noexcept;

  // The bytes of one slot of a layer's device page cache (slot_bytes), copied to host memory and
  // waited for: for tests that check what the kernel read. Throws Error (invalid_argument,
  // internal).
  void read_device_slot(uint32_t layer, uint32_t device_slot, void* out);

  const gpu::DevicePageCache& device_cache(uint32_t layer) const {
    return caches_.at(mirror() ? 0 : layer);
  }
  const OffloadOptions& options() const noexcept { return options_; }
  // Whether calls may give S4R rows as coefficients (AttendCall::latent): a cache of f16 or bf16
  // that takes pre-RoPE keys, and slots reserved for rows. A q8 cache's rows are per-row quantized
  // codes: its selector reconstructs and quantizes them on the host, as on the CPU.
  bool reconstructs_rows() const noexcept { return reconstructor_ready_; }

  void on_page_sealed(const SealedPage& page) noexcept override;
  void on_sequence_freed(int32_t seq_id) noexcept override;
  void on_pages_released(int32_t seq_id, uint32_t layer, uint64_t first_page,
                         uint64_t end_page) noexcept override;

 private:
  // The pinned and device buffers of one part of a step, so that a part's host buffers are not
  // rewritten while an earlier part's copies are in flight. Pinned: q [max_batch, n_query_heads,
  // head_dim] fp32, the part's rows placed at the end of it so that the page lists follow them
  // directly; page lists (offsets [max_pairs_ + 1], last_page_tokens [max_pairs_], device slots
  // [max_listed_]); with rows, token lists (offsets [max_pairs_ + 1], then TokenAddress
  // [max_tokens_]) and the row staging [max_row_chunks, slot_bytes]. The device block mirrors q
  // and both lists; q and the page lists go over in one copy (one copy fewer on the step's
  // critical path), the token lists in another.
  struct Part {
    std::byte* q_end = nullptr;  // pinned: the end of the q area, where the page lists begin
    std::byte* q_end_device = nullptr;
    uint32_t* lists = nullptr;
    uint32_t* token_lists = nullptr;
    std::byte* rows = nullptr;
    uint32_t* lists_device = nullptr;
    uint32_t* token_lists_device = nullptr;
  };
  // What enqueue() moved, for the stats.
  struct PartCounts {
    uint64_t listed = 0, hits = 0, misses = 0, evictions = 0, refreshed = 0;
    uint64_t bytes_h2d = 0, page_bytes_h2d = 0, tokens = 0;
    uint64_t row_bytes_h2d = 0, rows_equivalent_bytes = 0, basis_bytes_h2d = 0;
    double lists_us = 0.0, plan_us = 0.0;
  };

  OffloadAttention(KvCache& cache, const OffloadOptions& options);
  bool mirror() const noexcept { return options_.cache_pages == 0; }
  gpu::DevicePageCache& cache_for(uint32_t layer) noexcept { return caches_[mirror() ? 0 : layer]; }
  // Mirror: lists a host slot to send at the next call, unless it is listed already.
  bool mark_pending(uint32_t host_slot) noexcept;
  // Cuts a part's pairs (offsets [pairs + 1], its page lists' offsets) into the pieces its moves
  // are planned in (OffloadOptions::min_piece_pages): piece k is pairs [piece_ends_[k],
  // piece_ends_[k + 1]).
  void plan_pieces(const uint32_t* offsets, uint32_t pairs) noexcept;
  // Enqueues one part: the listed pages made resident and refreshed (one gather), the rows staged,
  // q with the lists, the attention into the device output at row0; records events 3 * part ..
  // 3 * part + 2. Waits for nothing on the device.
  gpu::Result enqueue_part(const KvCache& cache, const AttendCall& call, uint32_t part,
                           uint32_t row0, PartCounts& counts) noexcept;
  // Latent rows: copies the bases the call names that the device lacks, stages the coefficients,
  // positions and unit table in the part's latent buffers (grown when too small), copies them and
  // enqueues their reconstruction into the reserved slots from `rows_device` on.
  gpu::Result reconstruct_part(const AttendCall& call, uint32_t part, std::byte* rows_device,
                               PartCounts& counts) noexcept;
  // Copies the output rows [0, n_seqs) back, waits, and writes out. Event kDone.
  gpu::Result copy_out(uint32_t n_seqs, float* out) noexcept;
  // The token lists' offsets take [max_pairs_ + 1] words, padded so that the addresses after them
  // are 16-byte aligned (the kernel loads each as one 8-byte word).
  std::size_t token_offset_words() const noexcept { return (std::size_t{max_pairs_} + 4) / 4 * 4; }
  void record(uint32_t parts, const PartCounts& counts, double host_us, double total_us,
              uint32_t n_seqs) noexcept;
  void add_to_totals() noexcept;
  // Keeps r's message for last_error() and waits for what was enqueued, so that the buffers are
  // free for the next call.
  void fail_run(const gpu::Result& r) noexcept;
  void drain() noexcept;

  KvCache& cache_;
  OffloadOptions options_;
  CacheGeometry geometry_;
  std::string name_;
  uint32_t max_pairs_ = 0;
  uint64_t max_listed_ = 0;  // max_pairs_ * max_pages_per_pair, at most the pool's pages
  uint64_t max_tokens_ = 0;  // (max_listed_ + max_row_chunks) * page_tokens; 0 without rows
  DecodeAttention checker_;  // validate()'s shared checks; its workspace is never run
  gpu::StepStream stream_;
  std::vector<gpu::DevicePageCache> caches_;  // [n_layers], or the one mirror
  gpu::SparseDecodeAttention attention_;

  struct PinnedFree {
    void operator()(void* p) const noexcept { gpu::pinned_free(p); }
  };
  struct DeviceFree {
    void operator()(void* p) const noexcept { gpu::device_free(p); }
  };
  std::unique_ptr<void, PinnedFree> pinned_;
  std::unique_ptr<void, DeviceFree> device_;
  // Latent rows (reconstructs_rows()): per part, pinned staging and its device copy of a call's
  // unit table, positions and coefficients, grown to the largest call so far (their size follows
  // the ranks the selector chose, unknown at create()).
  struct LatentStaging {
    std::unique_ptr<void, PinnedFree> host;
    std::unique_ptr<void, DeviceFree> device;
    std::size_t bytes = 0;
  };
  LatentStaging latent_[kMaxParts];
  // The device copies of S4R bases, per (sequence, layer, unit): B_K^T then B_V^T, and the
  // basis_id they were copied under.
  struct DeviceBases {
    uint64_t basis_id = 0;
    std::unique_ptr<void, DeviceFree> memory;
    std::size_t bytes = 0;
  };
  std::unordered_map<uint64_t, DeviceBases> bases_;
  gpu::RowReconstructor reconstructor_;
  bool reconstructor_ready_ = false;
  Part parts_[kMaxParts];
  float* out_host_ = nullptr;  // pinned [max_batch, n_query_heads, head_dim]
  float* out_device_ = nullptr;
  std::vector<uint32_t> host_slots_;  // [max_listed_] the listed pages' host slots
  // [max_listed_] a piece's refreshes, sent with its misses (DevicePageCache::move copies them)
  std::vector<gpu::PageMove> refresh_;
  std::vector<uint32_t> piece_ends_;  // plan_pieces(), capacity max_pairs_ + 1

  // Marks the device copies of host slots table[first, end) of a layer stale (their slots go back
  // to the pool).
  void forget_copies(uint32_t layer, const uint32_t* table, uint64_t first, uint64_t end) noexcept;

  // Per layer and device slot: the page's token count when its copy was made (kFresh: moved by
  // this call's ensure(); 0: stale, its host slot was given back).
  static constexpr uint32_t kFresh = UINT32_MAX;
  std::vector<uint32_t> copied_tokens_;  // [n_layers * cache_pages]; empty in a mirror
  // Mirror: the slots to send at the next call (sealed since the last one), each flagged once.
  std::vector<gpu::PageMove> pending_;
  std::vector<uint8_t> pending_flag_;  // [pool capacity]

  uint32_t last_part_ = 0, last_pairs_ = 0;
  // The call begin() started: its parts so far, what they moved, their host time, its start.
  uint32_t step_parts_ = 0;
  PartCounts step_counts_{};
  double step_host_us_ = 0.0;
  std::chrono::steady_clock::time_point step_start_{};
  OffloadStats last_{}, totals_{};
  AttendStats attend_stats_{};
  std::string error_;
};

}  // namespace kvsift
