// Sparse paged decode attention on the GPU: a batch of sequences, one query token each, all query
// heads of one layer, over the pages (or tokens) a selector chose, with the pages already in a
// device page pool. Plain C++: lib/ includes this without CUDA headers. The class is the host's
// facade over the CUDA backend's implementation (gpu/backend.hpp, gpu/sparse_attention.cu); where
// the backend is absent every call returns Result{unsupported} saying why.
//
// Data layout (stated once, here; every pointer named "device" is device memory):
// - Pool: slots in the host pool's slot layout (simd/page_layout.hpp), so a host page moves to the
//   device as one unit. 16-byte aligned.
// - q, out: [n_seqs, n_kv_heads * group_size, head_dim] fp32, query head kv_head * group_size + g
//   (the CPU kernel's layout, lib/attend/decode_attention.hpp). q is unscaled; 1/sqrt(head_dim) is
//   applied here.
// - Lists: compressed rows over the pairs = n_seqs * n_kv_heads (sequence, KV head) pairs,
//   sequence-major (pair = seq_index * n_kv_heads + kv_head), as lib/attend's PageLists.
//   Page form: each pair lists device slots, one per page; every listed page is full except the
//   pair's last, which holds last_page_tokens[pair] tokens (the sequence's open page, or a full
//   page when the selection left the open page out). Token form: each pair lists token addresses
//   (slot, row), for selectors that return tokens (Louver).
// A pair with nothing listed gets zeros, as on the CPU.
//
// The kernel is flash-decoding: each (pair, split) is one CTA that reads its share of the pair's
// K/V rows once for all G query heads (GQA), keeps an fp32 online softmax, and leaves an
// unnormalised partial (max, sum, accumulator); the last CTA of a pair to finish merges its
// splits (no second launch). Split sizes are picked per call from the longest list so that the
// grid fills the device in one wave (AttendTuning can ask for fewer or more CTAs, for benchmarks
// that sweep it); a call whose lists fit one split per pair writes the output directly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "gpu/host_memory.hpp"
#include "simd/kernels.hpp"

namespace kvsift::gpu {

namespace backend {
class SparseDecodeAttention;
}

// What the kernels are instantiated for: head_dim 64, 128 or 256; page_tokens 16, 32 or 64;
// group_size 1..64 (groups above 8 are served in blocks of 8 heads, each block reading the pages
// again); fp16, bf16 or q8 (dequantized in the kernel).
struct AttentionShape {
  uint32_t n_kv_heads = 1;
  uint32_t group_size = 1;
  uint32_t head_dim = 128;
  uint32_t page_tokens = 16;
  simd::Dtype dtype = simd::Dtype::f16;

  std::size_t slot_bytes() const noexcept {
    return simd::PageLayout{page_tokens, head_dim, dtype}.slot_bytes();
  }
  uint32_t n_query_heads() const noexcept { return n_kv_heads * group_size; }
};

// One token of a pool slot: row `row` of slot `slot` (simd/page_layout.hpp).
struct TokenAddress {
  uint32_t slot;
  uint32_t row;  // < page_tokens
};

// Page-form lists, one view in host memory and one in device memory with the same contents.
struct PageLists {
  const uint32_t* offsets = nullptr;           // [pairs + 1], offsets[0] == 0, non-decreasing
  const uint32_t* slots = nullptr;             // [offsets[pairs]] pool slots
  const uint32_t* last_page_tokens = nullptr;  // [pairs] 1..page_tokens (read where listed)
};

// Token-form lists, likewise.
struct TokenLists {
  const uint32_t* offsets = nullptr;     // [pairs + 1], offsets[0] == 0, non-decreasing
  const TokenAddress* tokens = nullptr;  // [offsets[pairs]]
};

// The arguments both forms share.
struct AttendTarget {
  uint32_t n_seqs = 0;
  const void* pool = nullptr;  // device, 16-byte aligned
  uint64_t n_slots = 0;        // slots in the pool: every listed slot is below this
  const float* q = nullptr;    // device [n_seqs, n_query_heads, head_dim]
  float* out = nullptr;        // device [n_seqs, n_query_heads, head_dim]
  void* stream = nullptr;      // a cudaStream_t; nullptr is the legacy default stream
};

struct PageAttendCall {
  AttendTarget target;
  PageLists host;    // validate() reads all of it; run() reads offsets only (split planning)
  PageLists device;  // what the kernel reads
};

struct TokenAttendCall {
  AttendTarget target;
  TokenLists host;  // as in PageAttendCall
  TokenLists device;
};

// How calls are split and rows are read, for benchmarks that sweep it (bench/bench_offload.cpp
// --a-tunings, bench/bench_gpu_attend.cpp); every other caller keeps the defaults.
struct AttendTuning {
  // CTAs per multiprocessor the splits aim for, 0..64: 0 takes the kernel's occupancy (one full
  // wave of resident CTAs); below it, fewer CTAs with longer splits and a shorter merge; above
  // it, several waves of shorter splits.
  uint32_t ctas_per_sm = 0;
  // A split covers at least this many CTA tiles (1..64): bounds the merge's traffic against the
  // K/V a split reads.
  uint32_t min_tiles_per_split = 2;
  // 16-byte pieces of a K/V row each lane reads, 1 or 2: with 2, half as many lanes share a row,
  // so a logit's sum over them takes one shuffle level fewer and each lane computes half as many
  // exponentials per byte, for twice the registers of q and the accumulators. Blocks of 8 heads
  // (group sizes above 4) keep 1.
  uint32_t chunks_per_lane = 1;
  // 0 or 1: 1 computes each tile's products on the tensor cores (mma.sync, fp32 accumulators, q
  // and the probabilities split into two 16-bit halves that keep about 16 of their bits with
  // bf16 and 22 with f16), which takes the FMAs and the logits' shuffles off the issue-bound
  // inner loop; the copies, splits and merge are the same. f16 and bf16 only: q8 keeps the FMA
  // loop. With f16 K/V, q is rounded to f16 too, so |q| * log2(e) / sqrt(head_dim) must stay below
  // 65504. The default: measured faster than the FMA loop at every point of the H200 sweep
  // (gpu/sparse_attention.cu).
  uint32_t tensor_cores = 1;
  // 0, 128 or 256: the L2 prefetch size the cp.async copies of the rows carry (.L2::128B,
  // .L2::256B): a hint that an L2 miss may fetch that many aligned bytes from HBM at once rather
  // than the missed 32-byte sectors. 0 asks for none (the kernel's original copies). CUTLASS's
  // SM80_CP_ASYNC_CACHEGLOBAL, through which FlashAttention-2's tiles arrive, asks for 128.
  // Instantiated for the tensor-core loop with one piece a lane (tensor_cores 1, chunks_per_lane
  // 1, f16 or bf16) and without bulk copies: init() refuses anything else.
  uint32_t l2_prefetch = 0;
  // 0, 1, 2 or 3: 1 and 2 bring each K and V row into shared memory with one bulk copy
  // (cp.async.bulk, the Hopper copy engine, completion counted in bytes on an mbarrier) instead
  // of head_dim / 8 16-byte cp.async per row spread over the CTA's threads; the rows land at a
  // pitch of 16 bytes past a multiple of 128, so ldmatrix meets no bank conflicts. 1: one warp
  // copies the CTA's tile and the CTA synchronises once a tile; 2: each warp copies the rows it
  // computes on and waits on its own barrier, with no CTA-wide barrier in the loop. 3: as 2, but
  // page-form calls bring a warp's rows (consecutive rows of one page) as tensor-map copies of
  // 64 columns of K and of V (cp.async.bulk.tensor, 128-byte swizzle; the map over the call's
  // pool is encoded on its first call and cached); token-form calls run 2. The tensor-core loop only
  // (tensor_cores 1, chunks_per_lane 1, f16 or bf16), and a device of compute capability 9.0 or
  // later: init() refuses anything else.
  uint32_t bulk_copies = 0;
  // 0, 8, 16 or 32: tokens each warp computes on per tile in the tensor-core loop (0 and 8: the
  // loop above, whose warps take 8 tokens at d = 128 and a CTA tile of 32). 16 and 32 give each
  // warp a tile of 16 or 32 rows that its own lanes copy (2 or 4 n-tiles of S per k-step), so the
  // per-tile work (online-softmax maximum, rescale, shuffles, pipeline waits, page-table lookup,
  // address arithmetic) is paid once per 2 or 4 times the bytes; the CTA tile is 64 or 128 tokens,
  // a stage 2 or 4 times larger, fewer CTAs fit a multiprocessor (init() sizes the splits from the
  // occupancy). With the cp.async copies (bulk_copies 0) or the per-warp bulk copies (bulk_copies
  // 2); tensor_cores 1, chunks_per_lane 1, l2_prefetch 0, f16 or bf16: init() refuses anything
  // else.
  uint32_t warp_tokens = 0;
};

// How the last call was split, and what it read.
struct SplitPlan {
  uint32_t splits_per_pair = 0;   // CTAs per (pair, head block); 1: no merge
  uint32_t tokens_per_split = 0;  // a multiple of the CTA's token tile
  uint32_t head_blocks = 0;       // ceil(group_size / 8) rounded up to the kernel's block
  uint64_t ctas = 0;              // attention CTAs launched
  uint32_t device_ctas = 0;       // CTAs the splits aim for: multiprocessors x ctas per SM
  uint64_t tokens = 0;            // listed tokens summed over pairs (page form: an upper bound,
                                  // full pages; the open page's missing rows are not read)
  uint64_t kv_bytes = 0;          // K + V bytes those tokens occupy, times head_blocks
};

// Owns the split workspace on one device (the current device when init() ran). Use from one
// host thread at a time; calls are asynchronous on the call's stream, and a call may reuse the
// workspace of the previous one, so two calls on different streams must be ordered by the
// caller. Movable, not copyable.
class SparseDecodeAttention {
 public:
  SparseDecodeAttention();  // out of line, where the backend's class is complete
  ~SparseDecodeAttention();
  SparseDecodeAttention(SparseDecodeAttention&& other) noexcept;
  SparseDecodeAttention& operator=(SparseDecodeAttention&& other) noexcept;
  SparseDecodeAttention(const SparseDecodeAttention&) = delete;
  SparseDecodeAttention& operator=(const SparseDecodeAttention&) = delete;

  // Checks the shape, max_batch (1..65536) and the tuning before touching the device, so bad
  // arguments are reported as such even where no device is present; then reads the device's
  // multiprocessor count and occupancy, and allocates the split workspace for max_batch sequences
  // split as `tuning` asks.
  Result init(const AttentionShape& shape, uint32_t max_batch, const AttendTuning& tuning = {});

  // Host-side checks of a call against the shape: n_seqs, pointers, alignment, offsets, and every
  // listed slot, row and last-page count in the host view. Reads no device memory.
  Result validate(const PageAttendCall& call) const;
  Result validate(const TokenAttendCall& call) const;

  // Enqueues the attention (one kernel; it merges its splits itself) on the call's stream; does
  // not synchronise. Requires a call that validate() accepted: only init, n_seqs and the launch are
  // checked here. The returned Result reports launch errors; errors of the kernel's execution
  // surface at the caller's next synchronisation.
  Result run(const PageAttendCall& call) noexcept;
  Result run(const TokenAttendCall& call) noexcept;

  const SplitPlan& last_plan() const noexcept;
  const AttentionShape& shape() const noexcept;

 private:
  std::unique_ptr<backend::SparseDecodeAttention> impl_;  // made by the first init()
};

}  // namespace kvsift::gpu
