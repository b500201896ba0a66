// Sparse paged decode attention on sm_90 (gpu/sparse_attention.hpp has the contract and layout).
//
// One CTA of 4 warps serves one (pair, head block, split). A K/V row of head_dim elements is read
// by head_dim / 8 lanes with one 16-byte load each (a "row group"), so a warp reads 32 / (d / 8)
// rows at once and the CTA kTokens rows per iteration, each row once for all the block's query
// heads. The rows arrive through a three-stage cp.async pipeline in shared memory (or bulk copies:
// AttendTuning::bulk_copies, below). Every row group keeps its own online-softmax state (m, l,
// acc) in registers and the CTA combines them once at the end, so the token loop has no barrier;
// the last CTA of a pair merges the pair's splits.
// Logits are kept in base 2 (q pre-multiplied by log2(e) / sqrt(d)) so that each exponential is
// one ex2, and the running sums are rescaled lazily.
//
// Measured on the H200 (bench/bench_gpu_attend.cpp, Llama-3.1-8B layer, bf16, batch 8, every
// page of 128K tokens): register-held loads 2.41 TB/s; loads pipelined through registers 2.71;
// cp.async stages, fused merge, ex2.approx 3.36; lazy rescaling, fewer guards, a merge with its
// reads in flight 3.62 (86% of the 4.19 TB/s device-to-device copy). The inner loop is then near
// the issue limit (SASS of the bf16, d = 128, G = 4 kernel: about 720 instructions per warp per
// 4 KiB of K/V on the common path, 256 of them the FMAs): the butterfly reduction of the logits
// across a row group's lanes (64 shuffles and 64 adds per tile now) is the next saving.
//
// Batch 1 (same layer, 128K tokens) ran at 163 us against torch SDPA's 128 us, timed one call at
// a time, so that each call's interval held its own launch; bench/bench_offload.cpp now times
// back to back, as tools/sdpa_baseline.py times torch. What AttendTuning varies, for one device
// run to pick the defaults from (bench_offload's (a) sweep at 128K and 1M, batch 1 and 8;
// bench/bench_gpu_attend.cpp's /tune: cases at 2% and 100%):
// - CTAs per multiprocessor: at batch 1 the 8 pairs take 66 splits each to fill one wave, and the
//   last CTA of each pair merges 66 partials after the stream has drained; fewer CTAs shorten
//   that tail but keep fewer bytes in flight, several waves balance multiprocessors that finish
//   early.
// - Tiles per split: the floor on a split's length, which decides short (selective) calls.
// - Pieces per lane: two 16-byte pieces of a row per lane halve the lanes that share a row, so
//   the logits' butterfly loses a level (48 shuffles and adds per 4 KiB instead of 128) and each
//   lane evaluates half as many exponentials per byte, for 64 more registers a thread (fewer
//   resident CTAs; init() sizes the default split from the occupancy of the kernel it picked).
// Measured on the H200 (docs/results/gpu-scale/one-layer-table.txt, medians of 20 calls back to
// back), 128K batch 1 / batch 8 / 1M batch 1 / batch 8, in us: the defaults (one wave, 2 tiles,
// one piece) 158.9 / 1133 / 1114 / 9247; 2 CTAs a multiprocessor 150.5 / 1096 / 1124 / 9637; two
// pieces a lane 153.9 / 1138 / 1115 / 9532; torch SDPA 130.5 / 951 / 948 / 7484. No setting wins
// everywhere, none comes within 1.05x of torch, so the defaults stay.
//
// The tensor-core variant (AttendTuning::tensor_cores = 1; f16 and bf16, q8 keeps the FMA loop)
// attacks that issue limit: the copies, the pipeline, the splits and the merge are the same, only
// a tile's computation differs (MmaTile). Each warp computes on the rows its own lanes copied (2
// to 16 tokens a tile) with mma.sync: S = Q K^T with q as the A operand held in registers for
// the whole split and K rows as B through ldmatrix; the online softmax on the S fragments in
// fp32, a head's logits on 4 lanes (2 shuffles for its maximum, no butterfly per logit); O += P V
// computed as O^T += V^T P^T, V through ldmatrix.trans and P^T as the B operand taken straight
// from the S registers (the FlashAttention-2 register reuse). For fp32 accuracy q and p are split
// into 16-bit high and low parts at no extra mma: the block's heads are at most 8, so q's halves
// take rows 0-7 and 8-15 of the 16-row A operand, and p's halves the two k halves of an m16n8k16
// whose A repeats V's registers. At d = 128, G = 4 (8 tokens a warp a tile, 4 KiB of K/V) a
// warp's tile is 4 ldmatrix.x4 and 8 m16n8k16 for S, 2 exponentials and about 25 other
// instructions for the softmax, 4 ldmatrix.x4.trans and 8 m16n8k16 for P V; the ldmatrix
// addresses are a register and a constant (MmaTile::address). In PTX (nvcc 13) that token loop,
// copies and rare paths included, is 310 instructions against the FMA loop's 997, whose 256 FMAs,
// 64 shuffles and 64 adds go (the 720 above are the FMA loop's SASS on its common path; the new
// loop's SASS is not yet read: no disassembler on the build machine). The tensor work, about 32K
// multiply-adds per 4 KiB, comes to about 130 a cycle per multiprocessor at HBM speed, an eighth
// or so of mma.sync's rate (an estimate). The pieces land in shared memory XOR-swizzled
// (piece_index) so that ldmatrix meets no bank conflicts. ptxas (nvcc 13, sm_90), no spills: 96
// to 126 registers at d = 128, so 4 CTAs a multiprocessor as the FMA kernel's 128 (G = 4); 64 to
// 72 at d = 64; 168 at d = 256.
// Measured on the H200 (bench_offload's (a) sweep, medians of 20 calls back to back, one run),
// FMA default 0:2:1 against the variant 0:2:1:1 and 2:2:1:1, torch SDPA in the same run:
//   128K batch 1: 158.3 | 151.1, 148.8 | torch 130.6  (best 1.14x torch)
//   128K batch 8: 1133.0 | 1100.3, 1107.6 | 951.9     (1.16x)
//   1M batch 1:   1113.3 | 1099.7, 1099.8 | 950.8     (1.16x)
// and the selective step's attend at 1M (10,480 pages): 40.3 | 36.3, 34.1 us. The variant is
// faster at every point, so it is the default (AttendTuning); with it the model-level offload
// tests (greedy tokens against the CPU, tests/test_offload.cpp) and the device demo pass.
// compute-sanitizer: memcheck over its 206 test cases and racecheck over 35 found nothing.
//
// Where the rest goes (arithmetic on the measurements above; the variants' times follow). The
// layer reads 512 bytes of K and V per token and KV head: 537 MB at 128K batch 1, 4295 MB at 1M
// batch 1 and at 128K batch 8. A fixed cost F per call (launch, ramp, merge) and a streaming rate
// W fit both contexts at batch 1: ours 151.1 = 537 / W + F and 1099.7 = 4295 / W + F give W =
// 3.96 TB/s, F = 15.5 us; torch's 130.6 and 950.8 give 4.58 TB/s and 13.4 us. So the fixed costs
// differ by about 2 us and the streaming rate by 13.5%: the gap is in the steady state, the same
// at every point (1.14-1.16x), not in the split count, the merge or the tail.
// - Bytes in flight: at 4.58 TB/s and ~700 ns of loaded latency Little's law asks for ~3.2 MB in
//   flight, 24 KB a multiprocessor. A CTA keeps 2 to 3 tiles of 16 KiB in flight (kStages), 4
//   CTAs a multiprocessor: 128 to 192 KiB, 5 to 8 times that. Halving it (2 CTAs a multiprocessor)
//   won 2 us at 128K batch 1 and lost 7 at batch 8, so more stages would not help (1:2:1:1, 32
//   to 48 KiB a multiprocessor, probes the low end).
// - Split and merge: at 128K batch 1, 66 splits of 2016 tokens a pair, 528 CTAs, exactly one wave
//   of 4 a multiprocessor; the fused merge reads 66 partials of ~2 KiB a pair (1.1 MB in all,
//   0.2% of the K/V) in about 4 L2 round trips with 16 float4 loads a thread in flight: a few
//   us, inside F. No second launch.
// - Page table: a tile of 32 tokens spans 2 pages, each thread loads its rows' slot ids one tile
//   ahead (L1 hits: a 128-byte line of ids covers 16 tiles); one miss in 16 tiles can delay a
//   refill, not the stream.
// - The copies: a tile is 1024 cp.async of 16 bytes (8 a thread, each with its own 64-bit address
//   from the slot id), all through the LSU and L1: with their addresses and slot loads about 70
//   of the 308 PTX instructions a thread runs per tile of the tensor-core loop (bf16, d = 128,
//   G = 4); and they carry no L2 prefetch size, so an L2 miss asks HBM for the missing 32-byte
//   sectors. FlashAttention-2, torch's first fused SDPA backend (tools/sdpa_baseline.py does not
//   log which one ran), copies its tiles with CUTLASS's SM80_CP_ASYNC_CACHEGLOBAL, which recent
//   CUTLASS emits as cp.async.cg.shared.global.L2::128B: a difference in the copy itself.
// So variants of the copies (AttendTuning, bench_offload's --a-tunings fields 5 and 6), the
// tensor-core loop, its splits and merge otherwise unchanged:
// - l2_prefetch 128 or 256 (kPrefetch): the same cp.async with .L2::128B or .L2::256B, so that
//   each miss fetches a whole 128- or 256-byte block of the 512 contiguous bytes a warp copies.
//   Costs nothing: 124 registers at d = 128, G = 4, as without.
// - bulk_copies 1 (BulkTile): warp 0 brings each K and V row of a tile with one cp.async.bulk
//   (the copy engine: 64 copies of 256 bytes a tile at d = 128 instead of 1024 LDGSTS), their
//   bytes counted on a per-stage mbarrier; the rows land at a pitch of 16 bytes past a 128-byte
//   multiple, so ldmatrix stays free of bank conflicts without the swizzle. The other warps issue
//   no copies and hold no addresses: 96 registers instead of 124, 239 PTX instructions a tile for
//   warp 0 and fewer for the others, shared memory 51 KiB a CTA (4 still fit a multiprocessor).
//   The price: a __syncthreads a tile before a stage is refilled, and rows past the list are
//   copies of the split's last listed row (weight zero) where cp.async wrote zeros.
// - bulk_copies 2: the same stage, but each warp copies the 8 rows it computes on (16 copies a
//   tile) and waits on an mbarrier of its own, so the loop keeps no CTA-wide barrier and the
//   warps run apart as in the cp.async loop; the issue work is spread over the warps. Whether
//   the __syncthreads of 1 costs anything is what the pair measures.
// Whole-page bulk copies (8 KiB in one) would put the 8 rows of an ldmatrix phase 256 bytes
// apart, an 8-way bank conflict; a tensor-map copy (cp.async.bulk.tensor, 128-byte swizzle) could
// have both, and is the next step if whole-row copies win.
// ptxas (nvcc 13, sm_90): l2_prefetch as the plain tensor-core kernel (72 registers at d = 64, 96
// to 126 at d = 128, 166 to 168 at d = 256); bulk copies 1 and 2 56 to 72 at d = 64, 96 at
// d = 128, 162 to 164 at d = 256. No spills, except 8 bytes in bulk copies 2 at d = 64, G = 2,
// token form, where ptxas stops at 56 registers (not a benchmark shape). The kernels that existed
// before keep their registers exactly (and the FMA loop's q8, d = 256, G = 1 page-form kernel
// its 8-byte spill).
// Measured on the H200 (bench_offload's (a) sweep, each a median of 20 calls), us. The default,
// bulk 2 and 2:2:1:1:0:2: medians over five runs at 128K and three at 1M, torch SDPA in each run
// (docs/results/gpu-scale/raw/kernels/); the L2 hints and bulk 1: one run of the same lease.
//                      0:2:1:1   :128    :256   bulk 1  bulk 2  2:..:0:2   torch
//   128K batch 1        154.0    153.2   157.4   168.6   142.1   148.4     130.5
//   128K batch 8       1111.4   1106.8  1140.5  1316.4  1027.9  1132.0     949.7
//   1M batch 1         1098.3      -       -       -    1024.2  1109.3     949.0
// bulk_copies 2 is the fastest at every point: 1.089x torch at 128K batch 1 (1.088-1.094 over
// the five runs, each against its own torch), 1.082x at batch 8 (1.077-1.084), 1.079x at 1M,
// against 1.16-1.18x for the default; it also attends the selective step's pages faster (13.6
// against 15.2 us at 128K, 35.0 against 36.3 at 1M). The L2 prefetch hint changes nothing at 128
// bytes and loses at 256; one warp issuing the CTA's bulk copies (bulk 1) loses 10-18%. Its
// tests, memcheck, racecheck and synccheck pass; it is not the default yet because the
// model-level offload tests have not run with it. The 8% left is for a tensor-map copy of whole
// pages (above).
//
// bulk_copies 3 (TmaTile; page form only, token-form calls run bulk 2): the same per-warp
// pipeline as bulk 2, but each warp's rows of a tile, kWarpRows consecutive rows of one page (8
// at d = 128, G = 4), arrive as tensor-map copies (cp.async.bulk.tensor) of 64 columns each: at
// d = 128, 4 copies of 1 KiB a warp a tile (K and V, two halves of the row) instead of 16 row
// copies of 256 bytes. The rows of a warp are one page's because a split starts at a multiple
// of the tile and a warp's rows at a multiple of kWarpRows (2 to 16), which divides page_tokens.
// The tensor map (SparseDecodeAttention::tensor_map) sees the pool as [slots][2 page_tokens
// rows][head_dim] (a slot's K rows, then its V rows); a box is 64 columns, 128 bytes, the widest
// inner extent the 128-byte swizzle allows, of kWarpRows rows. Each box lands in a region of its
// own on a 1024-byte boundary (the stages are rounded up to one; regions of fewer than 8 rows
// are padded to 8), where the swizzle puts chunk c of the region's line n at chunk c ^ (n % 8):
// the 8 tokens of an ldmatrix phase are 8 consecutive lines, so they cover all 32 banks, with no
// padding of the rows (a stage is 16 KiB instead of 17 at d = 128, G = 4: 49 KiB a CTA with the
// alignment slack; where a warp has 2 or 4 rows, at d = 256 and at d = 128, G = 8, the padded
// regions make the stages 2 to 4 times the rows' bytes: 97 KiB a CTA at d = 256, G = 4, so 2
// CTAs a multiprocessor there, not a benchmark shape). A single box of whole rows (64-column lines,
// 2 or 4 a row) was the first version: it put the 8 tokens of a phase 2 or 4 lines apart, a 2- or
// 4-way bank conflict. The lane's ldmatrix offsets stay a register and a constant
// (MmaTile::address); they are made opaque to the compiler, which otherwise recomputed them from
// the thread index in every tile. Rows past the list: a box brings whole page rows, so past the
// open page's last token it brings whatever the slot holds (NaN in the tests' pools), and a warp
// whose rows all lie past the list copies the box of the list's last row. Their logits are set to
// -inf as before; on the split's last tile their V registers are also zeroed after ldmatrix (a
// register's two halves are the tokens of the lane's two probabilities), since 0 * NaN would poison
// O; the other tiles run the P V loop unmasked. The map is encoded on the host with
// cuTensorMapEncodeTiled, which init() takes from the driver through
// cudaGetDriverEntryPointByVersion (no libcuda link), once per (pool, slot count), cached for the
// last 4 pools: run() then costs a few compares. The kernel takes it as a __grid_constant__
// parameter (every kernel does; the others never read it), and thread 0 prefetches it. PTX (nvcc
// 13, sm_90, bf16, d = 128, G = 4, page form), the token loop a warp runs per tile, rare paths
// included: bulk 2 255 instructions, 98 of them (row addresses, 16 copies) before the barrier wait;
// bulk 3 234 on every tile but the last, 78 of them before the wait (one slot id, then lane 0's
// expect_tx and 4 tensor copies), plus 40 for the masked P V that the last tile runs instead of the
// plain one's 18: 274 in all. The rest, the computation, is the same in both (156 and 157
// instructions, 16 mma.sync, 8 ldmatrix); what bulk 3 saves is in the copies (98 -> 78 instructions
// a warp, 16 -> 4 copy-engine requests). ptxas (sm_90), no spills: 96 registers at d = 128 (as bulk
// 2), 58 to 68 at d = 64, 160 at d = 256 (bulk 2: 162 to 164); 4 CTAs a multiprocessor at d = 128.
// Measured below, after the wide tiles. The fixed cost F: every kernel loaded q (a global round
// trip, then the conversions) before it issued its first copies, so a CTA's first tile waited on
// q's latency and then on the rows'. The tensor-core kernels now load q once their first copies are
// in flight (Compute::load_q); the FMA loop keeps the old order, where the move cost registers
// (sparse_attend). ptxas (sm_90), against the old order: at d = 128 the cp.async tensor-core
// kernels go from 124-126 to 125-128 registers (4 CTAs a multiprocessor still) and bulk copies 1
// and 2 keep their 96; at d = 64 and 256 the tensor-core kernels move by up to 8 either way
// (56-80, 164-168); the FMA kernels keep theirs exactly; bulk 2's one spill (8 bytes at d = 64,
// G = 2, token form) is gone.
//
// Wide warp tiles (AttendTuning::warp_tokens 16 and 32, WideTile, WideMmaTile, wide_loop;
// measured below). Nsight Compute at 128K batch 1 (locked clocks, cache flushed) puts torch's
// kernel, cuDNN's sm80 flash_fprop_wmma 16x128x128, at 87.9% of DRAM bandwidth with 256 CTAs of 4
// warps, 2 a multiprocessor (8 warps), 86 KB of shared memory each, every CTA consuming 128 tokens
// (64 KiB of K and V, 16 KiB a warp) an iteration; ours at 70.3% with 528 CTAs, 4 a multiprocessor
// (16 warps), a CTA tile of 32 tokens (16 KiB, 4 KiB a warp). Ours is also the more sensitive to
// the SM clock (3.38 TB/s at ncu's 1.29 GHz, about 3.9 at 1.98; torch 4.23 and 4.58), so part of
// the gap is issue work per byte: every 8-token warp tile pays the softmax's maximum, its two
// shuffles and the rescale test, the pipeline's wait and two __syncwarp, the page-table load and
// the copies' address arithmetic, fixed costs that a wider tile spreads over more bytes. So
// warp_tokens 16 or 32: each warp owns 16 or 32 consecutive tokens of a CTA tile of 64 or 128,
// copies exactly those rows itself (cp.async, 16-byte pieces swizzled by row mod 8, so ldmatrix
// meets no bank conflicts; or with bulk_copies 2 one cp.async.bulk per row at BulkTile's padded
// pitch and an mbarrier per warp and stage) and computes S = Q K^T as 2 or 4 n-tiles per k-step
// (the mma and ldmatrix per byte are unchanged: MmaTile's fragments, hi/lo halves of q and p, O^T
// += V^T P^T), one softmax maximum, 2 shuffles and one rescale test per wide tile. A warp's rows
// start at a multiple of its width (splits start at multiples of the CTA tile), so in page form
// each 16 of them lie in one page: a lane loads one slot id (two for 32 tokens, whose halves may be
// two 16-token pages), one tile ahead as before, and addresses its 16-byte pieces at constant
// offsets from it (the CTA tile of 32 loaded a slot id per row a thread copies). PTX of the token
// loop (nvcc 13, sm_90, bf16, d = 128, G = 4, page form, copies and rare paths included; a warp's
// tile is 4 KiB of K/V per 8 tokens), instructions per 4 KiB:
//   tensor-core loop, cp.async (today's default)  308 (308 a tile: 16 mma, 8 ldmatrix, 8 cp.async)
//   bulk_copies 2                                  255
//   warp_tokens 16, cp.async                       156 (311 a tile: 32 mma, 16 ldmatrix, 16 cp)
//   warp_tokens 32, cp.async                       132 (529 a tile: 64 mma, 32 ldmatrix, 32 cp)
//   warp_tokens 16, bulk_copies 2                  155 (310 a tile)
//   warp_tokens 32, bulk_copies 2                  100 (399 a tile)
// (token form: 285 today, 223 and 194 with cp.async, where each row's (slot, row) is loaded.)
// ptxas (nvcc 13, sm_90), no spills in any of the 160 wide kernels: at d = 128, 132 to 134
// registers for 16 tokens with cp.async, 112 to 114 with bulk copies; 146 for 32 tokens (168 in
// token form), 134 to 138 with bulk copies; 108 to 112 at d = 64; 182 to 214 at d = 256 (16 tokens
// only: init() refuses 32 there, two 128 KiB stages). The kernel is sparse_attend_wide, whose
// __launch_bounds__(kThreads, 1) lets ptxas use them: under plain __launch_bounds__(kThreads) it
// aimed at 128 registers (the 4 CTAs that shared memory no longer allows) and spilled 4 bytes.
// Stages (3 where three fit 110 KiB, else 2) and CTAs a multiprocessor on the H200 at d = 128: 16
// tokens, 3 x 32 KiB (bulk 3 x 34 KiB), 2 CTAs (8 warps, as torch); 32 tokens 2 x 64 KiB (bulk 2 x
// 68 KiB), 1 CTA (4 warps). init() sizes the splits from that occupancy: at 128K batch 1, 16 tokens
// give 264 CTAs of 33 splits x 4032 tokens, 32 tokens 128 CTAs of 16 x 8192. Parts whose blocks
// take less shared memory (sm_89: 99 KiB) refuse the tunings that do not fit. Instantiated:
// warp_tokens 16 and 32, cp.async and bulk_copies 2 (sm_90 only, as before), f16 and bf16, both
// forms, head blocks 1, 2, 4, 8, d = 64, 128, 256 (32 tokens: 64, 128); init() refuses q8,
// chunks_per_lane 2, l2_prefetch, bulk_copies 1 and the FMA loop with them.
//
// Measured, the tensor-map copies and the wide tiles (H200, bench_offload's (a) sweep of 20 calls
// a point; per tuning the median, over five runs at 128K and three at 1M, of its time over the
// same run's torch SDPA, min..max in docs/results/gpu-scale/raw/kernels/dec03/; torch took 127.7,
// 927.4 and 927.7 us in the first run):
//                 default  bulk 2  bulk 3  2:..:0:3  w16    w16 bulk 2  w32    w32 bulk 2
//   128K batch 1  1.198    1.086   1.095   1.127     1.163  1.094       1.157  1.422
//   128K batch 8  1.193    1.076   1.098   1.130     1.187  1.072       1.180  1.448
//   1M batch 1    1.181    1.073   1.093   1.121     1.183  1.089       1.182  1.449
// Neither design moves the kernel past bulk 2. The tensor-map copies cost 1-2% more than bulk
// 2's row copies: a quarter of the copy requests (4 a warp a tile, not 16) bought no time, so the
// kernel is not bound by issuing its copies. The wide tiles with cp.async gain 3% on the default at
// 128K batch 1 and nothing at batch 8 or 1M; with bulk copies, 16 tokens ties bulk 2 (ahead by 0.4%
// at batch 8, behind by 0.7-1.5% elsewhere) and 32 tokens is 31-35% slower (one CTA of 4 warps a
// multiprocessor keeps too few bytes in flight). So the per-tile issue work is not what keeps the
// kernel at 1.07-1.09x torch either; bulk 2 reads K and V at 3.85 TB/s at 128K batch 1 and 4.31
// at 1M, torch at 4.20 and 4.63 (of the H200's 4.8). Loading q after the first copies left the
// default where it was (153.0 us at 128K batch 1 against 154.0 before). All variants pass the
// attention tests, and compute-sanitizer's memcheck and racecheck, on the H200.
#include <cuda.h>          // CUtensorMap and its enums only: the driver's encoder comes at run time
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#include "gpu/cuda_backend.cuh"
#include "gpu/cuda_handles.cuh"
#include "gpu/cuda_result.cuh"
#include "gpu/mma.cuh"
#include "gpu/sparse_attention.hpp"

namespace kvsift::gpu {
namespace {

constexpr uint32_t kWarps = 4;
constexpr uint32_t kThreads = kWarps * 32;
constexpr uint32_t kMaxBlockHeads = 8;  // partials are laid out with this many heads per block
// Copy stages: with 4 rows per thread a stage is 16 KiB, so two stages ahead keep 32 KiB per CTA
// loading (128 KiB per multiprocessor at 4 CTAs), past what HBM latency needs covered.
constexpr uint32_t kStages = 3;
// AttendTuning's bounds. Its default of two tiles per split: a split's partial (m, l, acc for the
// block's heads) is about 2 KiB at d = 128, G = 4, against 16 KiB of K/V per tile, so two tiles
// keep the merge's traffic near 6% while short selections still spread over many CTAs.
constexpr uint32_t kMaxCtasPerSm = 64;
constexpr uint32_t kMaxMinTiles = 64;
// Tokens of one pair stay below 2^31 so that split offsets fit 32-bit arithmetic in the kernel.
constexpr uint64_t kMaxPairTokens = uint64_t{1} << 31;
constexpr float kLog2e = 1.4426950408889634f;
// Lazy rescaling threshold in base-2 logits: probabilities stay below 2^8 (see the token loop).
constexpr float kLazyRescale = 8.0f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// kChunks: 16-byte pieces of a row per lane (AttendTuning::chunks_per_lane). With 2, a row is
// read by half as many lanes, so the butterfly that sums a logit over them is one level shorter
// and each lane evaluates half as many exponentials per byte, for twice the q and acc registers.
template <uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kChunks>
struct Tile {
  static_assert(kChunks == 1 || (kChunks == 2 && kBlockHeads <= 4), "registers: q and acc");
  static constexpr uint32_t kPieces = kChunks;                        // of a row, per lane
  static constexpr uint32_t kLanesPerRow = kHeadDim / (8 * kChunks);  // 8 elements a piece
  static constexpr uint32_t kRowsPerWarp = 32 / kLanesPerRow;
  static constexpr uint32_t kRowsPerStep = kWarps * kRowsPerWarp;
  // Rows per thread per tile: 4 / kChunks (a 16 KiB tile per CTA); with 8 heads the q and acc
  // registers (2 x 64) leave room for 2.
  static constexpr uint32_t kRowsPerThread = (kBlockHeads <= 4 ? 4 : 2) / kChunks;
  static constexpr uint32_t kTokens = kRowsPerStep * kRowsPerThread;
  // Dynamic shared memory: the copy stages, reused after the loop for the warps' accumulators.
  static constexpr uint32_t kStageBytes = kRowsPerThread * kChunks * 2 * kThreads * 16;
  static constexpr uint32_t kAccumulatorBytes = kWarps * kBlockHeads * kHeadDim * 4;
  static constexpr uint32_t kSharedBytes = std::max(kStages * kStageBytes, kAccumulatorBytes);
};

// The stage of the bulk copies (AttendTuning::bulk_copies): [K, V][kTokens] rows of head_dim
// 16-bit values, kPitch bytes apart, as many tokens as the cp.async tile (plan_splits serves both).
// A bulk copy cannot swizzle its bytes, so the rows are padded instead: kPitch is 16 bytes past a
// multiple of 128, so the 8 rows of an ldmatrix phase start in 8 different 16-byte bank groups.
template <uint32_t kHeadDim, uint32_t kBlockHeads>
struct BulkTile {
  using T = Tile<kHeadDim, kBlockHeads, 1>;
  static constexpr uint32_t kTokens = T::kTokens;
  static constexpr uint32_t kRowBytes = kHeadDim * 2;
  static constexpr uint32_t kPitch = kRowBytes + 16;
  static constexpr uint32_t kStageBytes = 2 * kTokens * kPitch;
  static constexpr uint32_t kSharedBytes = std::max(kStages * kStageBytes, T::kAccumulatorBytes);
};

// The stage of the tensor-map copies (AttendTuning::bulk_copies 3, page form). A row of head_dim
// 16-bit values is head_dim / 64 "halves" of 128 bytes (the widest inner box the 128-byte swizzle
// allows), and each (K or V, half, warp) has a region of its own: the warp's kWarpRows rows of
// that half, one 128-byte line each, from a 1024-byte boundary (regions of 8 lines when a warp
// has fewer rows). In the swizzle of cp.async.bulk.tensor the 16-byte chunk c of a region's line
// n lands at chunk c ^ (n % 8), so the 8 rows an ldmatrix phase reads (8 consecutive tokens)
// cover all 32 banks. Layout: [K, V][half][warp][region]; one more KiB of dynamic shared memory
// lets the kernel round the stages up to a 1024-byte boundary.
template <uint32_t kHeadDim, uint32_t kBlockHeads>
struct TmaTile {
  using T = Tile<kHeadDim, kBlockHeads, 1>;
  static constexpr uint32_t kTokens = T::kTokens;
  static constexpr uint32_t kWarpRows = kTokens / kWarps;
  static constexpr uint32_t kHalves = kHeadDim / 64;
  static constexpr uint32_t kBoxBytes = kWarpRows * 128;  // one copy: a half of the warp's rows
  static constexpr uint32_t kRegionBytes = std::max(kWarpRows, 8u) * 128;
  static constexpr uint32_t kKvBytes = kHalves * kWarps * kRegionBytes;
  static constexpr uint32_t kStageBytes = 2 * kKvBytes;
  static constexpr uint32_t kSharedBytes =
      std::max(kStages * kStageBytes + 1024, T::kAccumulatorBytes);
  // A warp's rows lie in one page (the smallest page holds 16 tokens, and kWarpRows divides it);
  // regions are whole swizzle atoms.
  static_assert(kWarpRows <= 16 && 16 % kWarpRows == 0 && kRegionBytes % 1024 == 0);
  // The region of (kv, half) of warp `warp`, in bytes from the stage.
  __host__ __device__ static constexpr uint32_t region(uint32_t kv, uint32_t half, uint32_t warp) {
    return kv * kKvBytes + (half * kWarps + warp) * kRegionBytes;
  }
};

// The smallest kernel head block that holds the group (groups above 8 take several blocks).
uint32_t block_heads_for(uint32_t group_size) {
  return group_size <= 1 ? 1 : group_size <= 2 ? 2 : group_size <= 4 ? 4 : kMaxBlockHeads;
}

struct AttendParams {
  const uint16_t* pool;
  const float* q;
  float* out;
  float* partial_m;    // [slots, kMaxBlockHeads]
  float* partial_l;    // [slots, kMaxBlockHeads]
  float* partial_acc;  // [slots, kMaxBlockHeads, head_dim]
  uint32_t* arrivals;  // [units] CTAs of the unit done; zero between calls
  uint32_t group_size;
  uint32_t page_tokens;
  uint32_t splits;
  uint32_t tokens_per_split;
  uint32_t head_blocks;
  float q_scale;
};

// Page form: token i of a pair is row i % page_tokens of its (i / page_tokens)-th listed slot.
struct PageForm {
  const uint32_t* offsets;
  const uint32_t* slots;
  const uint32_t* last_page_tokens;
  uint32_t page_shift;  // log2(page_tokens)

  __device__ uint32_t begin(uint32_t pair) const { return __ldg(offsets + pair); }
  __device__ uint32_t count(uint32_t pair, uint32_t begin) const {
    const uint32_t pages = __ldg(offsets + pair + 1) - begin;
    return pages == 0 ? 0 : ((pages - 1) << page_shift) + __ldg(last_page_tokens + pair);
  }
  __device__ TokenAddress address(uint32_t begin, uint32_t i) const {
    return TokenAddress{__ldg(slots + begin + (i >> page_shift)), i & ((1u << page_shift) - 1)};
  }
};

// Token form: token i of a pair is its i-th listed (slot, row).
struct TokenForm {
  const uint32_t* offsets;
  const TokenAddress* tokens;

  __device__ uint32_t begin(uint32_t pair) const { return __ldg(offsets + pair); }
  __device__ uint32_t count(uint32_t pair, uint32_t begin) const {
    return __ldg(offsets + pair + 1) - begin;
  }
  __device__ TokenAddress address(uint32_t begin, uint32_t i) const {
    const uint2 a = __ldg(reinterpret_cast<const uint2*>(tokens + begin + i));
    return TokenAddress{a.x, a.y};
  }
};

// A thread's 8 values of a row from its 16-byte stage piece: 8 16-bit values, or for q8 8 codes
// in .x and .y with the row's scale in .z (issue_copies in sparse_attend).
template <simd::Dtype D>
__device__ __forceinline__ void to_float8(const uint4& raw, float* f) {
  if constexpr (D == simd::Dtype::q8) {
    const float scale = __uint_as_float(raw.z);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      f[i] =
          scale * static_cast<float>(static_cast<int8_t>((i < 4 ? raw.x : raw.y) >> (i % 4 * 8)));
    return;
  }
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (D == simd::Dtype::f16) {
      __half2 h;
      static_assert(sizeof(h) == sizeof(uint32_t));
      memcpy(&h, &words[i], sizeof(h));
      const float2 pair = __half22float2(h);
      f[2 * i] = pair.x;
      f[2 * i + 1] = pair.y;
    } else {
      f[2 * i] = __uint_as_float(words[i] << 16);
      f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  }
}

// 2^x with one MUFU.EX2 (exp2f adds range handling this kernel does not need: its arguments are
// <= 0 or -inf, and ex2.approx's relative error, 2^-22, is far inside the 1e-3 budget).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Weight of a state with max m_part once the common max is m_all (-inf: both empty).
__device__ __forceinline__ float rescale(float m_part, float m_all) {
  return m_all == kNegInf ? 0.0f : fast_exp2(m_part - m_all);
}

// 16 bytes global -> shared, asynchronously, through L2 only (the rows are read once); with
// fill false it writes zeros and reads nothing. kPrefetch is AttendTuning::l2_prefetch.
template <uint32_t kPrefetch>
__device__ __forceinline__ void copy16(uint4* shared, const void* global, bool fill) {
  const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  const uint32_t bytes = fill ? 16 : 0;
  if constexpr (kPrefetch == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(to), "l"(global),
                 "r"(bytes));
  else if constexpr (kPrefetch == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(to), "l"(global),
                 "r"(bytes));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(global),
                 "r"(bytes));
}
// 4 or 8 bytes global -> shared, asynchronously, through L1 (cp.async.cg copies only 16): a q8
// thread's codes and its row's scale.
template <int kBytes>
__device__ __forceinline__ void copy_small(void* shared, const void* global, bool fill) {
  const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(to), "l"(global),
               "n"(kBytes), "r"(fill ? kBytes : 0));
}
__device__ __forceinline__ void commit_copies() {
  asm volatile("cp.async.commit_group;\n" ::);
}
template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// The bulk copies (AttendTuning::bulk_copies): one mbarrier per stage counts the bytes that have
// landed (PTX ISA, "cp.async.bulk" and "mbarrier"; the sequence CUTLASS's SM90 TMA pipelines use).
// They exist from sm_90 on. The module is also built for earlier targets (sm_80, sm_89), where
// these helpers trap instead: init() refuses bulk copies when the kernel the device runs was
// compiled for one of them, so the traps are never reached.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KVSIFT_BULK_ASM(...) __trap()
#else
#define KVSIFT_BULK_ASM(...) asm volatile(__VA_ARGS__)
#endif
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void barrier_init(uint64_t* barrier, uint32_t arrivals) {
  KVSIFT_BULK_ASM("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)),
                  "r"(arrivals)
                  : "memory");
}
// Makes the initialised barriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void barrier_init_fence() {
  KVSIFT_BULK_ASM("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// One arrival that also tells the barrier to expect `bytes` more before its phase completes.
__device__ __forceinline__ void barrier_expect(uint64_t* barrier, uint32_t bytes) {
  KVSIFT_BULK_ASM(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)),
      "r"(bytes)
      : "memory");
}
// Returns once the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void barrier_wait(uint64_t* barrier, uint32_t parity) {
  uint32_t done = 0;
  do {
    KVSIFT_BULK_ASM(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_address(barrier)), "r"(parity)
        : "memory");
  } while (!done);
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared by the copy engine;
// their arrival is counted on `barrier`. A CTA launched without a cluster is its own cluster, so
// its shared::cta addresses serve as shared::cluster ones.
__device__ __forceinline__ void bulk_copy(void* shared, const void* global, uint32_t bytes,
                                          uint64_t* barrier) {
  KVSIFT_BULK_ASM(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(shared_address(shared)),
      "l"(global), "r"(bytes), "r"(shared_address(barrier))
      : "memory");
}
// The box of `map` at coordinates (c0, c1, c2) global -> shared (`shared`: a shared::cta
// address) by the copy engine, through the tensor map's swizzle; its bytes are counted on
// `barrier`. `map` is the address of a __grid_constant__ kernel parameter.
__device__ __forceinline__ void tensor_copy(uint32_t shared, const CUtensorMap* map, int32_t c0,
                                            int32_t c1, int32_t c2, uint64_t* barrier) {
  KVSIFT_BULK_ASM(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(shared),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(shared_address(barrier))
      : "memory");
}
// Brings the tensor map into the descriptor cache ahead of the first copy.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  KVSIFT_BULK_ASM("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Split-K merge of one (pair, head block): rescale each split's partial sums to the common max,
// then normalise. Each partial lives in L2, a round trip of a few hundred ns, so the merge keeps
// many reads in flight: the splits' (m, l) are staged in shared memory by all threads at once,
// then each thread reads four channels of every split's accumulator as float4, 16 splits per
// unrolled step. Partials written by other CTAs are read through L2 (__ldcg): L1 is not coherent
// across multiprocessors. scratch holds 2 * splits * kBlockHeads floats (plan_splits bounds it).
template <uint32_t kHeadDim, uint32_t kBlockHeads>
__device__ void merge_splits(const AttendParams& p, std::size_t first_partial, uint32_t pair,
                             uint32_t head0, uint32_t heads, float* scratch) {
  const uint32_t n = p.splits * kBlockHeads;
  float* s_m = scratch;
  float* s_l = scratch + n;
  for (uint32_t i = threadIdx.x; i < n; i += kThreads) {
    const uint32_t s = i / kBlockHeads, g = i % kBlockHeads;
    const std::size_t at = (first_partial + s) * kMaxBlockHeads + g;
    s_m[i] = g < heads ? __ldcg(p.partial_m + at) : kNegInf;
    s_l[i] = g < heads ? __ldcg(p.partial_l + at) : 0.0f;
  }
  __syncthreads();
  constexpr uint32_t kQuads = kHeadDim / 4;
  for (uint32_t e = threadIdx.x; e < heads * kQuads; e += kThreads) {
    const uint32_t g = e / kQuads, c = e % kQuads * 4;
    float m_all = kNegInf;
    for (uint32_t s = 0; s < p.splits; ++s) m_all = fmaxf(m_all, s_m[s * kBlockHeads + g]);
    float l_all = 0.0f;
    float4 a_all = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 16
    for (uint32_t s = 0; s < p.splits; ++s) {
      const float weight = rescale(s_m[s * kBlockHeads + g], m_all);
      l_all += s_l[s * kBlockHeads + g] * weight;
      const float4 a = __ldcg(reinterpret_cast<const float4*>(
          p.partial_acc + ((first_partial + s) * kMaxBlockHeads + g) * kHeadDim + c));
      a_all.x += a.x * weight, a_all.y += a.y * weight;
      a_all.z += a.z * weight, a_all.w += a.w * weight;
    }
    const float inv = m_all == kNegInf ? 0.0f : 1.0f / l_all;  // nothing listed: zeros
    float* out = p.out + (std::size_t{pair} * p.group_size + head0 + g) * kHeadDim + c;
    out[0] = a_all.x * inv, out[1] = a_all.y * inv, out[2] = a_all.z * inv, out[3] = a_all.w * inv;
  }
}

// Where piece (r, j, kv) of thread `thread` lives in stage `stage` ([kStages][R][C][K, V][kThreads]
// pieces of 16 bytes). The block of one (stage, r, j, kv) is a row-major [kRowsPerStep][d / C]
// matrix: thread t copies row t / kLanesPerRow, piece t % kLanesPerRow. The FMA loop reads back
// only its own pieces, so their order is free; the tensor-core loop reads 8 rows of the warp at
// one piece column per ldmatrix phase, and rows kLanesPerRow * 16 bytes apart fall in the same
// banks, so its pieces are XOR-swizzled within a row by the row's place among the warp's tokens
// (MmaTile): the 8 tokens of an ldmatrix phase then cover all 32 banks.
template <class T, bool kSwizzle>
__device__ __forceinline__ uint32_t piece_index(uint32_t stage, uint32_t r, uint32_t j, uint32_t kv,
                                                uint32_t thread) {
  constexpr uint32_t L = T::kLanesPerRow;
  uint32_t at = thread;
  if constexpr (kSwizzle) {
    const uint32_t row = thread / L;
    // The warp's token index of this row (MmaTile::tile_row inverts it).
    const uint32_t token = r * T::kRowsPerWarp + row % T::kRowsPerWarp;
    // Rows of 4 pieces (L = 4) share a 128-byte bank line in twos: swizzle by pairs of tokens.
    const uint32_t flip = (token % 8) / (L >= 8 ? 1 : 8 / L);
    at = row * L + ((thread % L) ^ flip);
  }
  return (((stage * T::kRowsPerThread + r) * T::kPieces + j) * 2 + kv) * kThreads + at;
}

// The FMA loop: every row group of head_dim / (8 * kChunks) lanes keeps its own online softmax
// (m, l, acc for the block's heads) over the rows it copied itself.
template <simd::Dtype D, uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kChunks>
struct FmaTile {
  using T = Tile<kHeadDim, kBlockHeads, kChunks>;
  static constexpr uint32_t R = T::kRowsPerThread;
  static constexpr uint32_t C = kChunks;
  static constexpr uint32_t kValues = 8 * C;  // a lane's elements of a row
  static constexpr bool kSwizzle = false;

  uint32_t warp, lane, chunk, row_group;
  float q[kBlockHeads][kValues];
  float m[kBlockHeads], l[kBlockHeads], acc[kBlockHeads][kValues];

  // A lane's piece j of a row holds elements (j * kLanesPerRow + chunk) * 8 .. + 8: the lanes of
  // a row group read 16-byte pieces side by side, so each load instruction stays coalesced.
  __device__ uint32_t channel(uint32_t j) const { return (j * T::kLanesPerRow + chunk) * 8; }

  // Heads past the group (a block of 4 for G = 3) get q = 0: finite logits, never written.
  __device__ void load_q(const float* q_pair, uint32_t heads, float q_scale) {
    warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    chunk = lane % T::kLanesPerRow;
    row_group = warp * T::kRowsPerWarp + lane / T::kLanesPerRow;
#pragma unroll
    for (uint32_t g = 0; g < kBlockHeads; ++g)
#pragma unroll
      for (uint32_t j = 0; j < C; ++j) {
        float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
        if (g < heads) {
          lo = __ldg(reinterpret_cast<const float4*>(q_pair + g * kHeadDim + channel(j)));
          hi = __ldg(reinterpret_cast<const float4*>(q_pair + g * kHeadDim + channel(j) + 4));
        }
        float* qj = q[g] + 8 * j;
        qj[0] = lo.x * q_scale, qj[1] = lo.y * q_scale, qj[2] = lo.z * q_scale;
        qj[3] = lo.w * q_scale, qj[4] = hi.x * q_scale, qj[5] = hi.y * q_scale;
        qj[6] = hi.z * q_scale, qj[7] = hi.w * q_scale;
      }
#pragma unroll
    for (uint32_t g = 0; g < kBlockHeads; ++g) {
      m[g] = kNegInf;
      l[g] = 0.0f;
#pragma unroll
      for (uint32_t c = 0; c < kValues; ++c) acc[g][c] = 0.0f;
    }
  }

  // One tile: the rows of `stage` from token `base` of the split, which ends at `last`.
  __device__ void tile(const uint4* stages, uint32_t stage, uint32_t base, uint32_t last) {
    uint4 k_raw[R][C], v_raw[R][C];
    bool valid[R];
#pragma unroll
    for (uint32_t r = 0; r < R; ++r) {
#pragma unroll
      for (uint32_t j = 0; j < C; ++j) {
        k_raw[r][j] = stages[piece_index<T, kSwizzle>(stage, r, j, 0, threadIdx.x)];
        v_raw[r][j] = stages[piece_index<T, kSwizzle>(stage, r, j, 1, threadIdx.x)];
      }
      valid[r] = base + r * T::kRowsPerStep + row_group < last;
    }

    float s[R][kBlockHeads];
#pragma unroll
    for (uint32_t r = 0; r < R; ++r) {
      float k[kValues];
#pragma unroll
      for (uint32_t j = 0; j < C; ++j) to_float8<D>(k_raw[r][j], k + 8 * j);
#pragma unroll
      for (uint32_t g = 0; g < kBlockHeads; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (uint32_t c = 0; c < kValues; ++c) dot = fmaf(q[g][c], k[c], dot);
        s[r][g] = dot;
      }
    }
    // Sum the row group's lanes; xor offsets below kLanesPerRow stay inside the group.
#pragma unroll
    for (uint32_t offset = T::kLanesPerRow / 2; offset > 0; offset /= 2)
#pragma unroll
      for (uint32_t r = 0; r < R; ++r)
#pragma unroll
        for (uint32_t g = 0; g < kBlockHeads; ++g)
          s[r][g] += __shfl_xor_sync(0xffffffffu, s[r][g], offset);

    // Lazy rescaling (as in FlashAttention 4): m is a reference point, not the running max, and
    // moves only when a logit exceeds it by more than kLazyRescale (base 2), so probabilities
    // stay below 2^kLazyRescale, harmless in fp32, and the accumulators are rescaled a few times
    // per split instead of every tile. The branch is taken for the whole warp or not at all.
    if (base + T::kTokens > last) {  // the split's last tile: rows past the list weigh nothing
#pragma unroll
      for (uint32_t r = 0; r < R; ++r)
#pragma unroll
        for (uint32_t g = 0; g < kBlockHeads; ++g)
          if (!valid[r]) s[r][g] = kNegInf;
    }
    float tile_max[kBlockHeads];
    bool grows = false;
#pragma unroll
    for (uint32_t g = 0; g < kBlockHeads; ++g) {
      tile_max[g] = s[0][g];
#pragma unroll
      for (uint32_t r = 1; r < R; ++r) tile_max[g] = fmaxf(tile_max[g], s[r][g]);
      grows |= tile_max[g] > m[g] + kLazyRescale;
    }
    if (__any_sync(0xffffffffu, grows)) {
#pragma unroll
      for (uint32_t g = 0; g < kBlockHeads; ++g) {
        if (!(tile_max[g] > m[g] + kLazyRescale)) continue;
        const float alpha = fast_exp2(m[g] - tile_max[g]);  // 0 when m was -inf
        m[g] = tile_max[g];
        l[g] *= alpha;
#pragma unroll
        for (uint32_t c = 0; c < kValues; ++c) acc[g][c] *= alpha;
      }
    }
#pragma unroll
    for (uint32_t g = 0; g < kBlockHeads; ++g) {
      // m is -inf only while every logit seen is -inf; any finite stand-in gives them weight 0.
      const float m_safe = m[g] == kNegInf ? 0.0f : m[g];
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
        s[r][g] = fast_exp2(s[r][g] - m_safe);  // the probability; 0 for rows past the list
        l[g] += s[r][g];
      }
    }
#pragma unroll
    for (uint32_t r = 0; r < R; ++r) {
      float v[kValues];
#pragma unroll
      for (uint32_t j = 0; j < C; ++j) to_float8<D>(v_raw[r][j], v + 8 * j);
#pragma unroll
      for (uint32_t g = 0; g < kBlockHeads; ++g)
#pragma unroll
        for (uint32_t c = 0; c < kValues; ++c) acc[g][c] = fmaf(s[r][g], v[c], acc[g][c]);
    }
  }

  // The warp's state as one (m, l, acc) per head: row groups combined through shuffles, then
  // stored for the CTA's combine. Called by every thread, after the stages are free.
  __device__ void store(float (*s_acc)[kBlockHeads][kHeadDim], float (*s_m)[kBlockHeads],
                        float (*s_l)[kBlockHeads]) {
#pragma unroll
    for (uint32_t offset = T::kLanesPerRow; offset < 32; offset *= 2) {
#pragma unroll
      for (uint32_t g = 0; g < kBlockHeads; ++g) {
        const float m_other = __shfl_xor_sync(0xffffffffu, m[g], offset);
        const float l_other = __shfl_xor_sync(0xffffffffu, l[g], offset);
        const float m_new = fmaxf(m[g], m_other);
        const float a = rescale(m[g], m_new), b = rescale(m_other, m_new);
        l[g] = l[g] * a + l_other * b;
#pragma unroll
        for (uint32_t c = 0; c < kValues; ++c)
          acc[g][c] = acc[g][c] * a + __shfl_xor_sync(0xffffffffu, acc[g][c], offset) * b;
        m[g] = m_new;
      }
    }
    if (lane < T::kLanesPerRow) {
#pragma unroll
      for (uint32_t g = 0; g < kBlockHeads; ++g) {
#pragma unroll
        for (uint32_t j = 0; j < C; ++j)
#pragma unroll
          for (uint32_t c = 0; c < 8; ++c) s_acc[warp][g][channel(j) + c] = acc[g][8 * j + c];
        if (chunk == 0) s_m[warp][g] = m[g], s_l[warp][g] = l[g];
      }
    }
  }
};

// Two 16-bit values (f16 or bf16, as the K/V rows) in one register, `low` in the low half: the
// order of the element pairs in mma.sync fragments.
template <simd::Dtype D>
__device__ __forceinline__ uint32_t pack2(float low, float high) {
  uint32_t bits;
  if constexpr (D == simd::Dtype::f16) {
    const __half2 h = __floats2half2_rn(low, high);
    memcpy(&bits, &h, sizeof(bits));
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(low, high);
    memcpy(&bits, &h, sizeof(bits));
  }
  return bits;
}
template <simd::Dtype D>
__device__ __forceinline__ float2 unpack2(uint32_t bits) {
  if constexpr (D == simd::Dtype::f16) {
    __half2 h;
    memcpy(&h, &bits, sizeof(h));
    return __half22float2(h);
  } else {
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
  }
}
// x = hi + lo to about 2^-16 (bf16) or 2^-22 (f16) relative: the two 16-bit halves of an fp32
// operand, each an exact product on the tensor cores, so the logits and P V keep fp32's accuracy
// (one 16-bit rounding alone would cost 2^-9 relative for bf16).
template <simd::Dtype D>
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  hi = pack2<D>(x0, x1);
  const float2 h = unpack2<D>(hi);
  lo = pack2<D>(x0 - h.x, x1 - h.y);
}

// Four 8x8 matrices of 16-bit elements from shared memory, lanes 8i .. 8i + 7 giving the rows of
// matrix i; .trans delivers each transposed. volatile: it must stay after the cp.async wait.
template <bool kTrans>
__device__ __forceinline__ void ldmatrix4(uint32_t (&r)[4], uint32_t address) {
  if constexpr (kTrans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// q's A fragments [q_hi; q_lo] for the tensor-core loops (MmaTile, WideMmaTile), one m16n8k16
// per 16 channels: registers 0 and 2 hold row g = lane / 4 (hi) at columns 2t, 2t + 1 and
// 8 + 2t, 9 + 2t of the k-step (t = lane % 4), registers 1 and 3 row g + 8 (lo) at the same
// columns; heads past `heads` are 0.
template <simd::Dtype D, uint32_t kHeadDim>
__device__ __forceinline__ void load_q_fragments(uint32_t (&qa)[kHeadDim / 16][4],
                                                 const float* q_pair, uint32_t heads, float q_scale,
                                                 uint32_t lane) {
  const uint32_t g = lane / 4, t = lane % 4;
#pragma unroll
  for (uint32_t kk = 0; kk < kHeadDim / 16; ++kk)
#pragma unroll
    for (uint32_t half = 0; half < 2; ++half) {
      float2 x = make_float2(0.f, 0.f);
      if (g < heads)
        x = __ldg(
            reinterpret_cast<const float2*>(q_pair + g * kHeadDim + kk * 16 + half * 8 + 2 * t));
      split2<D>(x.x * q_scale, x.y * q_scale, qa[kk][2 * half], qa[kk][2 * half + 1]);
    }
}

// A warp's state at the end of a split on the tensor-core loops, for the merge: O^T's
// accumulators (channels 16 i + groupID and + 8, heads 2t and 2t + 1), head groupID's maximum m and
// the sum l, whose 4 lanes' parts are added here.
template <uint32_t kHeadDim, uint32_t kBlockHeads>
__device__ __forceinline__ void store_mma_state(const float (&acc)[kHeadDim / 16][4], float m,
                                                float l, uint32_t warp, uint32_t lane,
                                                float (*s_acc)[kBlockHeads][kHeadDim],
                                                float (*s_m)[kBlockHeads],
                                                float (*s_l)[kBlockHeads]) {
  const uint32_t g = lane / 4, t = lane % 4;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
#pragma unroll
  for (uint32_t i = 0; i < kHeadDim / 16; ++i)
#pragma unroll
    for (uint32_t e = 0; e < 4; ++e) {
      const uint32_t head = 2 * t + e % 2, c = 16 * i + g + (e / 2) * 8;
      if (head < kBlockHeads) s_acc[warp][head][c] = acc[i][e];
    }
  if (g < kBlockHeads && t == 0) s_m[warp][g] = m, s_l[warp][g] = l;
}

// The online softmax of one tile of the tensor-core loops (MmaTile::tile, WideMmaTile::tile):
// x holds the lane's two logits of each n-tile (-inf where a token weighs zero), t is lane % 4.
// Updates the running maximum m and sum l, rescales the accumulators O^T lazily as
// FmaTile::tile does (the 4 lanes of a head see the same maximum), and returns P as the B
// fragments of P^T V's mma, p_hi (k 0-7) and p_lo (k 8-15) per n-tile.
template <simd::Dtype D, uint32_t kNTiles, uint32_t kMTiles>
__device__ __forceinline__ void softmax_tile(const float (&x)[kNTiles][2], uint32_t t, float& m,
                                             float& l, float (&acc)[kMTiles][4],
                                             uint32_t (&pb)[kNTiles][2]) {
  float tile_max = fmaxf(x[0][0], x[0][1]);
#pragma unroll
  for (uint32_t nt = 1; nt < kNTiles; ++nt) tile_max = fmaxf(tile_max, fmaxf(x[nt][0], x[nt][1]));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
  const bool grows = tile_max > m + kLazyRescale;
  if (__any_sync(0xffffffffu, grows)) {
    float alpha = 1.0f;
    if (grows) {
      alpha = fast_exp2(m - tile_max);  // 0 when m was -inf
      m = tile_max;
      l *= alpha;
    }
    // The accumulators' heads 2t and 2t + 1 keep their state on lanes 8t and 8t + 4.
    const float alpha0 = __shfl_sync(0xffffffffu, alpha, 8 * t);
    const float alpha1 = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
    for (uint32_t i = 0; i < kMTiles; ++i) {
      acc[i][0] *= alpha0, acc[i][1] *= alpha1;
      acc[i][2] *= alpha0, acc[i][3] *= alpha1;
    }
  }
  const float m_safe = m == kNegInf ? 0.0f : m;
#pragma unroll
  for (uint32_t nt = 0; nt < kNTiles; ++nt) {
    const float p0 = fast_exp2(x[nt][0] - m_safe), p1 = fast_exp2(x[nt][1] - m_safe);
    l += p0 + p1;
    split2<D>(p0, p1, pb[nt][0], pb[nt][1]);
  }
}

// The tensor-core loop (AttendTuning::tensor_cores; f16 and bf16). Each warp computes on the
// rows its own lanes copied, kWarpRows tokens a tile (2 to 16: R blocks of kRowsPerWarp rows),
// and keeps one online softmax per head for them. With groupID = lane / 4 and
// threadID_in_group = lane % 4 as in the PTX ISA's fragment layouts:
// - S = Q K^T is one m16n8k16 per 16 channels and 8 tokens, A = [q_hi; q_lo] (rows 0-7 the 16-bit
//   high parts of the block's 8 head rows, rows 8-15 the low parts; heads past the group are 0),
//   held in registers for the whole split; B = 8 K rows through ldmatrix. A thread's C fragment
//   holds head groupID's hi and lo sums for tokens 2 threadID_in_group and + 1, so its logits are
//   c0 + c2 and c1 + c3, and the softmax of a head needs only its 4 lanes.
// - O^T += V^T P^T is one m16n8k16 per 16 channels and 8 tokens: A = [V^T | V^T] (8 tokens of 16
//   channels through ldmatrix.trans, the same registers again for k 8-15), B = [p_hi; p_lo] along
//   k, so hi and lo are summed inside the mma. B's fragment (k = tokens 2 threadID_in_group and
//   + 1, n = head groupID) is exactly what the thread holds of S's accumulator, so P never leaves
//   its registers. With the channels as M the accumulator is all useful (16 channels x 8 heads,
//   4 registers per 16 channels) where P as the A operand would waste rows 8-15 or double the
//   accumulators to hold hi and lo apart; a thread's accumulators are heads 2 threadID_in_group
//   and + 1, whose rescaling factors two shuffles fetch from the heads' lanes.
// Warps of fewer than 8 tokens pad their 8 columns with copies of their rows at weight zero.
// kCopies (AttendTuning::bulk_copies): 0, the cp.async stage (piece_index); 1 and 2, BulkTile's
// (whole rows at a padded pitch, which every warp's lanes can read); 3, TmaTile's (whole rows in
// the tensor map's 128-byte swizzle). With any but 0, warp w computes the tile's tokens
// w * kWarpRows .. + kWarpRows - 1.
template <simd::Dtype D, uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kChunks,
          uint32_t kCopies>
struct MmaTile {
  static_assert(D == simd::Dtype::f16 || D == simd::Dtype::bf16, "16-bit K/V only");
  static_assert(kCopies == 0 || kChunks == 1, "bulk copies move whole rows");
  static constexpr bool kBulk = kCopies != 0;  // whole rows, a warp's tokens side by side
  static constexpr bool kTma = kCopies == 3;   // ... in the tensor map's swizzle
  using T = Tile<kHeadDim, kBlockHeads, kChunks>;
  using B = BulkTile<kHeadDim, kBlockHeads>;
  using M = TmaTile<kHeadDim, kBlockHeads>;
  static constexpr uint32_t kStageBytes = kTma    ? M::kStageBytes
                                          : kBulk ? B::kStageBytes
                                                  : T::kStageBytes;
  static constexpr uint32_t kWarpRows = T::kTokens / kWarps;
  static constexpr uint32_t kCols = kWarpRows < 8 ? 8 : kWarpRows;  // S's columns, 8 or 16
  static constexpr uint32_t kNTiles = kCols / 8;
  static constexpr uint32_t kKSteps = kHeadDim / 16;
  static constexpr uint32_t kMTiles = kHeadDim / 16;         // of O^T
  static constexpr uint32_t kRowElems = kHeadDim / kChunks;  // a stage block's row
  static constexpr bool kSwizzle = !kBulk;  // piece_index's; the bulk stages place their own
  static_assert(kBlockHeads <= 8 && (kCols == 8 || kCols == 16) && kKSteps % 2 == 0);
  static_assert(!kTma || kStageBytes == M::kStageBytes);  // sparse_attend passes tile_at's

  uint32_t warp, lane;
  // Byte offsets in a stage of the row this lane gives ldmatrix for its columns 8 (lane / 8) ..
  // + 7 of a 32-column group, K (j = 0), per tile of 8 tokens, in two variants: the cp.async
  // stage's for the group's piece index with bit 2 clear or set; the tensor map's for an even or
  // odd group, of the first 64 columns.
  uint32_t lane_bytes[kNTiles][2];
  uint32_t qa[kKSteps][4];  // A fragments of [q_hi; q_lo]
  float acc[kMTiles][4];    // O^T: channels 16 i + groupID (0, 1), + 8 (2, 3); heads 2 tig, + 1
  float m, l;               // head groupID's reference max and (this lane's part of) the sum

  // The tile row (of the T::kTokens) of the warp's token `token`.
  __device__ uint32_t tile_row(uint32_t token) const {
    if constexpr (kBulk) return warp * kWarpRows + token;
    return token / T::kRowsPerWarp * T::kRowsPerStep + warp * T::kRowsPerWarp +
           token % T::kRowsPerWarp;
  }
  // Shared address for ldmatrix: this lane's row of the 8 x 8 matrix lane / 8, which is columns
  // column0 + 8 (lane / 8) .. + 7 of the warp's tokens nt * 8 .. + 7 (column0 a multiple of 32),
  // K (kv 0) or V, as piece_index places them; stage_address is the stage's. The swizzle XORs a
  // piece index below 8 into the row's piece, and column0's pieces are a multiple of 4, so the
  // XOR splits into the lane's constant low part and a +4 or -4 on bit 2 that column0 decides at
  // compile time: no arithmetic per ldmatrix beyond one add. In the tensor map's stage the other
  // 64-column halves are other regions, a constant away.
  template <uint32_t kKv>
  __device__ uint32_t address(uint32_t stage_address, uint32_t nt, uint32_t column0) const {
    if constexpr (kTma)
      return stage_address + lane_bytes[nt][column0 / 32 % 2] + M::region(kKv, column0 / 64, 0);
    if constexpr (kBulk)
      return stage_address + lane_bytes[nt][0] + kKv * B::kTokens * B::kPitch + column0 * 2;
    const uint32_t j = column0 / kRowElems, piece = column0 % kRowElems / 8;
    return stage_address + lane_bytes[nt][piece / 4 % 2] +
           ((j * 2 + kKv) * kThreads + piece) * uint32_t{sizeof(uint4)};
  }

  // As FmaTile::load_q; sparse_attend calls it once the first copies are in flight, so that q's
  // loads wait with them.
  __device__ void load_q(const float* q_pair, uint32_t heads, float q_scale) {
    warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr uint32_t L = T::kLanesPerRow;
#pragma unroll
    for (uint32_t nt = 0; nt < kNTiles; ++nt) {
      // Columns past kWarpRows repeat the warp's rows (weight zero in tile()).
      const uint32_t token = (nt * 8 + lane % 8) % kWarpRows;
      if constexpr (kTma) {
        // An even (b = 0) or odd group of 32 columns: chunks 4 b .. + 3 of the token's line
        // (line `token` of the warp's region of the half), this lane's chunk 4 b + lane / 8,
        // placed at chunk ^ (token % 8).
#pragma unroll
        for (uint32_t b = 0; b < 2; ++b) {
          const uint32_t chunk = (4 * b + lane / 8) ^ (token % 8);
          lane_bytes[nt][b] = M::region(0, 0, warp) + token * 128 + chunk * 16;
          // Opaque to the compiler, which otherwise recomputed the offsets from the thread index
          // in every tile (about 25 more PTX instructions a tile at d = 128) to save registers.
          asm volatile("" : "+r"(lane_bytes[nt][b]));
        }
        continue;
      }
      if constexpr (kBulk) {
        lane_bytes[nt][0] = lane_bytes[nt][1] = tile_row(token) * B::kPitch + lane / 8 * 16;
        continue;
      }
      const uint32_t r = token / T::kRowsPerWarp;
      const uint32_t row = warp * T::kRowsPerWarp + token % T::kRowsPerWarp;
      // piece_index's swizzle of this row.
      const uint32_t flip = (token % 8) / (L >= 8 ? 1 : 8 / L);
      const uint32_t low = r * T::kPieces * 2 * kThreads + row * L + ((lane / 8) ^ (flip % 4));
      lane_bytes[nt][0] = (low + (flip & 4)) * uint32_t{sizeof(uint4)};
      lane_bytes[nt][1] = (low - (flip & 4)) * uint32_t{sizeof(uint4)};
    }
    load_q_fragments<D, kHeadDim>(qa, q_pair, heads, q_scale, lane);
#pragma unroll
    for (uint32_t i = 0; i < kMTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    m = kNegInf;
    l = 0.0f;
  }

  __device__ void tile(const uint4* stages, uint32_t stage, uint32_t base, uint32_t last) {
    tile_at(shared_address(stages) + stage * kStageBytes, base, last);
  }
  // The same, on the stage at shared address stage_address.
  __device__ void tile_at(uint32_t stage_address, uint32_t base, uint32_t last) {
    const uint32_t t = lane % 4;

    float s[kNTiles][4];
#pragma unroll
    for (uint32_t nt = 0; nt < kNTiles; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
      for (uint32_t kk = 0; kk < kKSteps; kk += 2) {
        // Matrices 0, 1: channels 16 kk + 0..7 and 8..15 (b0, b1 of k-step kk); 2, 3: kk + 1.
        uint32_t b[4];
        ldmatrix4<false>(b, address<0>(stage_address, nt, kk * 16));
        mma_m16n8k16<D == simd::Dtype::bf16>(s[nt], qa[kk], b[0], b[1]);
        mma_m16n8k16<D == simd::Dtype::bf16>(s[nt], qa[kk + 1], b[2], b[3]);
      }
    }
    // Logits of head g for the warp's tokens nt * 8 + 2t + e.
    float x[kNTiles][2];
    const bool last_tile = base + T::kTokens > last;
#pragma unroll
    for (uint32_t nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (uint32_t e = 0; e < 2; ++e) {
        const uint32_t token = nt * 8 + 2 * t + e;
        x[nt][e] = s[nt][e] + s[nt][e + 2];
        if ((kWarpRows < kCols && token >= kWarpRows) ||
            (last_tile && base + tile_row(token) >= last))
          x[nt][e] = kNegInf;  // padding, or rows past the list: weight zero
      }
    uint32_t pb[kNTiles][2];  // per 8 tokens, B of P^T: p_hi (k 0-7), p_lo (k 8-15)
    softmax_tile<D>(x, t, m, l, acc, pb);
    // O^T += V^T P^T. Matrices 0, 1: channels 16 i + 0..7 and 8..15 of the 8 tokens (A's rows
    // groupID and groupID + 8), 2, 3: those of 16 (i + 1); transposed, each is A at k = tokens.
    // The tensor map's boxes hold whole pages' rows: past the list (the open page's unwritten
    // rows, a clamped box's) they may hold anything, NaN included, and 0 * NaN is NaN. On the
    // split's last tile the V registers of tokens at weight zero are zeroed: a register's low
    // and high halves are tokens 2t and 2t + 1 of the 8, exactly those of x[nt][0] and [1].
    // (Their K needs nothing: those logits were replaced by -inf above.)
    auto p_v = [&](auto masked) {
#pragma unroll
      for (uint32_t nt = 0; nt < kNTiles; ++nt) {
        uint32_t keep = 0xffffffffu;
        if constexpr (decltype(masked)::value)
          keep =
              (x[nt][0] == kNegInf ? 0u : 0x0000ffffu) | (x[nt][1] == kNegInf ? 0u : 0xffff0000u);
#pragma unroll
        for (uint32_t i = 0; i < kMTiles; i += 2) {
          uint32_t v[4];
          ldmatrix4<true>(v, address<1>(stage_address, nt, i * 16));
          if constexpr (decltype(masked)::value)
            v[0] &= keep, v[1] &= keep, v[2] &= keep, v[3] &= keep;
          mma_m16n8k16<D == simd::Dtype::bf16>(acc[i], {v[0], v[1], v[0], v[1]}, pb[nt][0],
                                               pb[nt][1]);
          mma_m16n8k16<D == simd::Dtype::bf16>(acc[i + 1], {v[2], v[3], v[2], v[3]}, pb[nt][0],
                                               pb[nt][1]);
        }
      }
    };
    if constexpr (kTma) {
      if (last_tile)
        p_v(std::true_type{});
      else
        p_v(std::false_type{});
    } else {
      p_v(std::false_type{});
    }
  }

  __device__ void store(float (*s_acc)[kBlockHeads][kHeadDim], float (*s_m)[kBlockHeads],
                        float (*s_l)[kBlockHeads]) const {
    store_mma_state<kHeadDim, kBlockHeads>(acc, m, l, warp, lane, s_acc, s_m, s_l);
  }
};

// The wide warp tiles (AttendTuning::warp_tokens 16 and 32): the tensor-core loop with each warp
// computing on kWarpTokens rows a tile that its own lanes copy, so the per-tile work (softmax
// maximum and rescale, the shuffles, the pipeline's wait and __syncwarp, the page-table load and
// the copies' address arithmetic) is spread over 2 or 4 times the bytes of the loop above.
// A stage is [K, V][kTokens] rows of head_dim 16-bit values, kPitch bytes apart; warp w owns rows
// w * kWarpTokens .. + kWarpTokens - 1. With cp.async (kBulk false) the rows are packed and each
// row's 16-byte pieces XOR-swizzled by the row's index mod 8 (piece ^ (row & 7)), so the 8 rows of
// an ldmatrix phase, one piece column each, fall in 8 different bank groups; with the per-warp
// bulk copies (kBulk true, AttendTuning::bulk_copies 2) the rows are whole, at BulkTile's padded
// pitch. Stages: 3 where three fit about half a multiprocessor's shared memory (two CTAs a
// multiprocessor), else 2.
template <uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kWarpTokens, bool kBulk>
struct WideTile {
  static_assert(kWarpTokens == 16 || kWarpTokens == 32, "a warp tile of 16 or 32 tokens");
  static constexpr uint32_t kTokens = kWarps * kWarpTokens;  // the CTA's tile
  static constexpr uint32_t kRowBytes = kHeadDim * 2;
  static constexpr uint32_t kPitch = kBulk ? kRowBytes + 16 : kRowBytes;
  static constexpr uint32_t kKvBytes = kTokens * kPitch;  // V's rows start here
  static constexpr uint32_t kStageBytes = 2 * kKvBytes;
  static constexpr uint32_t kStages = 3 * kStageBytes <= 110 * 1024 ? 3 : 2;
  static constexpr uint32_t kAccumulatorBytes = kWarps * kBlockHeads * kHeadDim * 4;
  static constexpr uint32_t kSharedBytes = std::max(kStages * kStageBytes, kAccumulatorBytes);
};

// The tensor-core tile of MmaTile (the fragment layouts, the hi/lo split of q and p, P V as
// O^T += V^T P^T) over kNTiles = kWarpTokens / 8 n-tiles of S: the online softmax's maximum,
// shuffles and rescale happen once per wide tile.
template <simd::Dtype D, uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kWarpTokens, bool kBulk>
struct WideMmaTile {
  static_assert(D == simd::Dtype::f16 || D == simd::Dtype::bf16, "16-bit K/V only");
  using W = WideTile<kHeadDim, kBlockHeads, kWarpTokens, kBulk>;
  static constexpr uint32_t kNTiles = kWarpTokens / 8;
  static constexpr uint32_t kKSteps = kHeadDim / 16;
  static constexpr uint32_t kMTiles = kHeadDim / 16;  // of O^T
  static_assert(kBlockHeads <= 8 && kKSteps % 2 == 0);

  uint32_t warp, lane;
  // Byte offsets in a stage of the row this lane gives ldmatrix (row warp * kWarpTokens +
  // lane % 8 of n-tile 0, K) for a 32-column group of even [0] or odd [1] index: the group's
  // pieces are 4 cg .. 4 cg + 3, the lane's 4 cg + lane / 8, and the swizzle XORs lane % 8 into
  // it, which splits into a constant low part and a +4 or -4 on bit 2 that cg's parity decides.
  uint32_t lane_bytes[2];
  uint32_t qa[kKSteps][4];  // A fragments of [q_hi; q_lo]
  float acc[kMTiles][4];    // O^T: channels 16 i + groupID (0, 1), + 8 (2, 3); heads 2 tig, + 1
  float m, l;               // head groupID's reference max and (this lane's part of) the sum

  // Shared address for ldmatrix: the lane's row of n-tile nt, 32-column group cg, K or V.
  template <uint32_t kKv>
  __device__ uint32_t address(uint32_t stage_address, uint32_t nt, uint32_t cg) const {
    return stage_address + lane_bytes[cg % 2] + kKv * W::kKvBytes + nt * 8 * W::kPitch + cg * 64;
  }

  __device__ WideMmaTile() {
    warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t row_bytes = (warp * kWarpTokens + lane % 8) * W::kPitch;
    if constexpr (kBulk) {
      lane_bytes[0] = lane_bytes[1] = row_bytes + lane / 8 * 16;
    } else {
      const uint32_t low = (lane / 8) ^ (lane % 4), high = lane & 4;
      lane_bytes[0] = row_bytes + (low + high) * 16;
      lane_bytes[1] = row_bytes + (low - high) * 16;
    }
#pragma unroll
    for (uint32_t i = 0; i < kMTiles; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    m = kNegInf;
    l = 0.0f;
  }

  // As MmaTile::load_q: wide_loop calls it once its first copies are in flight.
  __device__ void load_q(const float* q_pair, uint32_t heads, float q_scale) {
    load_q_fragments<D, kHeadDim>(qa, q_pair, heads, q_scale, lane);
  }

  // One tile: the warp's rows of `stage`, its first token `base` (of the pair's list), which the
  // split ends at `last`; rows at or past `last` weigh zero.
  __device__ void tile(const uint4* stages, uint32_t stage, uint32_t base, uint32_t last) {
    const uint32_t t = lane % 4;
    const uint32_t stage_address = shared_address(stages) + stage * W::kStageBytes;

    float s[kNTiles][4];
#pragma unroll
    for (uint32_t nt = 0; nt < kNTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (uint32_t kk = 0; kk < kKSteps; kk += 2)
#pragma unroll
      for (uint32_t nt = 0; nt < kNTiles; ++nt) {
        // Matrices 0, 1: channels 16 kk + 0..7 and 8..15 (b0, b1 of k-step kk); 2, 3: kk + 1.
        uint32_t b[4];
        ldmatrix4<false>(b, address<0>(stage_address, nt, kk / 2));
        mma_m16n8k16<D == simd::Dtype::bf16>(s[nt], qa[kk], b[0], b[1]);
        mma_m16n8k16<D == simd::Dtype::bf16>(s[nt], qa[kk + 1], b[2], b[3]);
      }
    // Logits of head g for the warp's tokens nt * 8 + 2t + e.
    float x[kNTiles][2];
    const bool last_tile = base + kWarpTokens > last;
#pragma unroll
    for (uint32_t nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (uint32_t e = 0; e < 2; ++e) {
        x[nt][e] = s[nt][e] + s[nt][e + 2];
        if (last_tile && base + nt * 8 + 2 * t + e >= last) x[nt][e] = kNegInf;
      }
    uint32_t pb[kNTiles][2];  // per 8 tokens, B of P^T: p_hi (k 0-7), p_lo (k 8-15)
    softmax_tile<D>(x, t, m, l, acc, pb);
    // O^T += V^T P^T, as MmaTile::tile, per n-tile.
#pragma unroll
    for (uint32_t i = 0; i < kMTiles; i += 2)
#pragma unroll
      for (uint32_t nt = 0; nt < kNTiles; ++nt) {
        uint32_t v[4];
        ldmatrix4<true>(v, address<1>(stage_address, nt, i / 2));
        mma_m16n8k16<D == simd::Dtype::bf16>(acc[i], {v[0], v[1], v[0], v[1]}, pb[nt][0],
                                             pb[nt][1]);
        mma_m16n8k16<D == simd::Dtype::bf16>(acc[i + 1], {v[2], v[3], v[2], v[3]}, pb[nt][0],
                                             pb[nt][1]);
      }
  }

  __device__ void store(float (*s_acc)[kBlockHeads][kHeadDim], float (*s_m)[kBlockHeads],
                        float (*s_l)[kBlockHeads]) const {
    store_mma_state<kHeadDim, kBlockHeads>(acc, m, l, warp, lane, s_acc, s_m, s_l);
  }
};

// 16 bytes global -> shared at a shared-space address (copy16 without a prefetch size).
__device__ __forceinline__ void copy16_at(uint32_t to, const void* global, bool fill) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(global),
               "r"(fill ? 16u : 0u));
}

// The wide tiles' token loop: each warp copies and computes its own kWarpTokens rows of every CTA
// tile, so the loop has no CTA-wide barrier, as the loops above. The split starts at a multiple of
// the CTA's tile (plan_splits), so a warp's rows start at a multiple of kWarpTokens; page form
// with 16-token pages or longer then puts each 16 of them in one page: a lane loads the slot ids
// of its warp tile's one or two 16-token halves (the same ids for the whole warp, one tile ahead
// of the copies) and addresses its rows from them with constant offsets. Token form loads each of
// the lane's rows' (slot, row), one tile ahead. Rows past the list: cp.async writes zeros, the
// bulk copies repeat the split's last listed row; MmaTile's rule weighs both zero.
template <simd::Dtype D, uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kWarpTokens, bool kBulk,
          class Form, class Compute, class LoadQ>
__device__ __forceinline__ void wide_loop(const AttendParams& p, const Form& form, Compute& compute,
                                          const LoadQ& load_q, uint4* stages, uint32_t list_begin,
                                          uint32_t first, uint32_t last) {
  using W = WideTile<kHeadDim, kBlockHeads, kWarpTokens, kBulk>;
  constexpr uint32_t S = W::kStages;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t n_tiles = first < last ? (last - first + W::kTokens - 1) / W::kTokens : 0;
  const simd::PageLayout layout{p.page_tokens, kHeadDim, D};
  const auto* pool = reinterpret_cast<const std::byte*>(p.pool);
  const std::size_t value_bytes = layout.page_elems() * 2;  // a slot's V after its K
  const uint32_t stages_address = shared_address(stages);
  auto warp_base = [&](uint32_t tile) { return first + tile * W::kTokens + warp * kWarpTokens; };

  if constexpr (kBulk) {
    // As sparse_attend's bulk_copies 2: one mbarrier per stage and warp. A lane copies K row
    // lane % kWarpTokens (lanes below kWarpTokens) or V row lane % kWarpTokens (16-token tiles,
    // the other lanes); with 32-token tiles each lane copies both.
    __shared__ uint64_t full[S][kWarps];
    constexpr uint32_t kRowBytes = W::kRowBytes;
    if (threadIdx.x == 0) {
#pragma unroll
      for (uint32_t s = 0; s < S; ++s)
#pragma unroll
        for (uint32_t w = 0; w < kWarps; ++w) barrier_init(&full[s][w], 1);
      barrier_init_fence();
    }
    __syncthreads();
    const uint32_t local = lane % kWarpTokens;
    auto fetch = [&](uint32_t tile) {
      return tile < n_tiles ? form.address(list_begin, min(warp_base(tile) + local, last - 1))
                            : TokenAddress{0, 0};
    };
    auto issue = [&](uint32_t tile, TokenAddress from) {
      const uint32_t stage = tile % S;
      std::byte* to = reinterpret_cast<std::byte*>(stages) + stage * W::kStageBytes +
                      (warp * kWarpTokens + local) * W::kPitch;
      if (lane == 0) barrier_expect(&full[stage][warp], 2 * kWarpTokens * kRowBytes);
      __syncwarp();
      const std::byte* slot = layout.slot(pool, from.slot);
      if (kWarpTokens == 32 || lane < 16)
        bulk_copy(to, layout.key(slot, from.row), kRowBytes, &full[stage][warp]);
      if (kWarpTokens == 32 || lane >= 16)
        bulk_copy(to + W::kKvBytes, layout.value(slot, from.row), kRowBytes, &full[stage][warp]);
    };
    {
      TokenAddress early[S - 1];
#pragma unroll
      for (uint32_t s = 0; s + 1 < S; ++s) early[s] = fetch(s);
#pragma unroll
      for (uint32_t s = 0; s + 1 < S; ++s)
        if (s < n_tiles) issue(s, early[s]);
    }
    TokenAddress next = fetch(S - 1);
    load_q();
    for (uint32_t tile = 0; tile < n_tiles; ++tile) {
      __syncwarp();  // the warp is done with stage (tile - 1) % S, refilled next
      if (tile + S - 1 < n_tiles) issue(tile + S - 1, next);
      next = fetch(tile + S);
      barrier_wait(&full[tile % S][warp], tile / S % 2);
      compute.tile(stages, tile % S, warp_base(tile), last);
    }
  } else {
    // A lane copies piece lane % P of rows lane / P + k kStep, k < kCopies, of K and of V (one
    // 16-byte cp.async each).
    constexpr uint32_t P = kHeadDim / 8, kStep = 32 / P, kCopies = kWarpTokens / kStep;
    constexpr bool kPage = std::is_same_v<Form, PageForm>;
    // Page form: the slot ids of the warp tile's 16-token halves; token form: the lane's rows.
    constexpr uint32_t kEntries = kPage ? kWarpTokens / 16 : kCopies;
    struct Sources {
      TokenAddress at[kEntries];
    };
    const uint32_t row0 = lane / P;          // the lane's first row of the warp tile
    const uint32_t piece = lane % P;         // its piece of each row
    const uint32_t swizzled = piece ^ row0;  // row0 + k kStep has row0 in its low bits
    // The lane's first destination in a stage (K, row row0, swizzle of row0 alone).
    const uint32_t lane_to = (warp * kWarpTokens + row0) * W::kRowBytes;
    auto fetch = [&](uint32_t tile, Sources& to) {
      const uint32_t base = warp_base(tile);
#pragma unroll
      for (uint32_t e = 0; e < kEntries; ++e) {
        to.at[e] = TokenAddress{0, 0};
        if constexpr (kPage) {
          // Clamped into the list: a half past it is never read (its rows are zero-filled).
          const uint32_t i = min(base + 16 * e, last - 1);
          if (tile < n_tiles)
            to.at[e].slot = __ldg(form.slots + list_begin + (i >> form.page_shift));
        } else {
          const uint32_t i = base + row0 + e * kStep;
          if (tile < n_tiles && i < last) to.at[e] = form.address(list_begin, i);
        }
      }
    };
    auto issue = [&](uint32_t tile, const Sources& from) {
      const uint32_t base = warp_base(tile);
      // Rows row0 + k kStep below `listed` are in the list.
      const uint32_t listed = last > base ? last - base : 0;
      const uint32_t to = stages_address + tile % S * W::kStageBytes + lane_to;
#pragma unroll
      for (uint32_t k = 0; k < kCopies; ++k) {
        const uint32_t local = k * kStep;  // + row0
        const std::byte* key;
        if constexpr (kPage) {
          // Half e's rows are rows (base + 16 e) % page_tokens .. + 15 of its page.
          const uint32_t e = local / 16;
          const uint32_t page_row = ((base + 16 * e) & ((1u << form.page_shift) - 1)) + row0;
          key = reinterpret_cast<const std::byte*>(
                    layout.key(layout.slot(pool, from.at[e].slot), page_row)) +
                (local - 16 * e) * W::kRowBytes;
        } else {
          key = reinterpret_cast<const std::byte*>(
              layout.key(layout.slot(pool, from.at[k].slot), from.at[k].row));
        }
        key += piece * 16;
        const uint32_t at = to + local * W::kRowBytes + ((swizzled ^ (local % 8)) * 16);
        const bool fill = row0 + local < listed;
        copy16_at(at, key, fill);
        copy16_at(at + W::kKvBytes, key + value_bytes, fill);
      }
    };
    {
      Sources early[S - 1];
#pragma unroll
      for (uint32_t s = 0; s + 1 < S; ++s) fetch(s, early[s]);
#pragma unroll
      for (uint32_t s = 0; s + 1 < S; ++s) {
        if (s < n_tiles) issue(s, early[s]);
        commit_copies();
      }
    }
    Sources next;
    fetch(S - 1, next);
    load_q();
    for (uint32_t tile = 0; tile < n_tiles; ++tile) {
      __syncwarp();  // the warp is done with stage (tile - 1) % S, refilled next
      if (tile + S - 1 < n_tiles) issue(tile + S - 1, next);
      commit_copies();  // empty past the end: the wait below counts groups
      fetch(tile + S, next);
      wait_copies<S - 1>();  // all but the newest S - 1 groups: tile `tile` has landed
      __syncwarp();          // and the other lanes' pieces are visible
      compute.tile(stages, tile % S, warp_base(tile), last);
    }
    wait_copies<0>();
  }
}

// kPrefetch: AttendTuning::l2_prefetch, a qualifier of the copy instruction, hence a parameter
// (a branch on it inside the kernel cost registers: ptxas kept a pipeline per size).
// kWarpTokens: AttendTuning::warp_tokens, 0 for the loops above, 16 or 32 for wide_loop. The
// CTA's work, called by the kernels sparse_attend and sparse_attend_wide (which differ only in
// their launch bounds).
template <simd::Dtype D, uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kChunks, bool kTensor,
          uint32_t kBulk, uint32_t kPrefetch, class Form, uint32_t kWarpTokens>
__device__ __forceinline__ void attend_cta(const AttendParams& p, const Form& form,
                                           const CUtensorMap& kv_map) {
  static_assert(!kBulk || kTensor, "bulk copies feed the tensor-core loop only");
  static_assert(!kBulk || kPrefetch == 0, "bulk copies have no prefetch qualifier");
  static_assert(kBulk != 3 || std::is_same_v<Form, PageForm>, "tensor maps copy whole pages");
  using T = Tile<kHeadDim, kBlockHeads, kChunks>;
  static_assert(
      kWarpTokens == 0 || (kTensor && kChunks == 1 && kPrefetch == 0 && (kBulk == 0 || kBulk == 2)),
      "wide tiles: the tensor-core loop, one piece, cp.async or per-warp bulk copies");
  using Compute = std::conditional_t<
      kWarpTokens != 0, WideMmaTile<D, kHeadDim, kBlockHeads, kWarpTokens, kBulk != 0>,
      std::conditional_t<kTensor, MmaTile<D, kHeadDim, kBlockHeads, kChunks, kBulk>,
                         FmaTile<D, kHeadDim, kBlockHeads, kChunks>>>;
  constexpr uint32_t R = T::kRowsPerThread;
  constexpr uint32_t C = kChunks;
  const uint32_t pair = blockIdx.x, split = blockIdx.y, block = blockIdx.z;
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t chunk = lane % T::kLanesPerRow;
  const uint32_t row_group = threadIdx.x / T::kLanesPerRow;
  const uint32_t head0 = block * kBlockHeads;
  const uint32_t heads = min(kBlockHeads, p.group_size - head0);
  // The elements a lane copies of a row: as FmaTile::channel.
  auto channel = [&](uint32_t j) { return (j * T::kLanesPerRow + chunk) * 8; };

  const float* q_pair = p.q + (std::size_t{pair} * p.group_size + head0) * kHeadDim;
  // The tensor-core loop loads q (Compute::load_q) once each path has its first copies in flight:
  // the CTA's first tile then waits on one memory latency, not on q's and then the rows'. The FMA
  // loop keeps loading it first: its 32 to 64 q registers, live across the copies' addresses,
  // cost up to 25 more registers a thread there (153 instead of 128 at d = 128, G = 4, one CTA a
  // multiprocessor less) and small spills.
  Compute compute;
  auto load_q = [&] { compute.load_q(q_pair, heads, p.q_scale); };
  if constexpr (!kTensor) load_q();

  const uint32_t list_begin = form.begin(pair);
  const uint32_t n_tokens = form.count(pair, list_begin);
  const uint32_t first = split * p.tokens_per_split;
  const uint32_t last = min(n_tokens, first + p.tokens_per_split);
  const simd::PageLayout layout{p.page_tokens, kHeadDim, D};
  const auto* pool = reinterpret_cast<const std::byte*>(p.pool);

  // Software pipeline through shared memory: cp.async copies (no registers held while in flight)
  // of tiles t + 1 .. t + kStages - 1 are outstanding while tile t is computed, and the addresses
  // (slot ids, token entries) that the next copies depend on are loaded one tile earlier still.
  // The FMA loop reads back only the 16-byte pieces each thread copied itself, so waiting on its
  // own copy groups is enough and the loop needs no barrier; the tensor-core loop reads the
  // pieces of its warp's lanes, so a __syncwarp after the wait makes them visible and one before
  // the copies keeps a stage from being refilled while other lanes still read it.
  extern __shared__ uint4 stages[];  // [kStages][R][C][K, V][kThreads], or BulkTile's
  if constexpr (kBulk == 3) {
    // The tensor-map copies (page form): each warp copies the kWarpRows rows it computes on
    // (MmaTile::tile_row), which lie in one page (a split starts at a multiple of the tile, a
    // warp's rows at a multiple of kWarpRows, which divides page_tokens), as one box of K and
    // one of V per 64 columns through kv_map (SparseDecodeAttention::tensor_map), and waits on
    // a barrier of its own, as bulk copies 2 do. Lane 0 issues them; the slot id of tile t +
    // kStages is loaded while tile t + kStages - 1 is issued. A warp whose rows start past the list
    // copies the box of the list's last row instead (any valid box; MmaTile::tile weighs it zero
    // and zeroes its V), so every stage's barrier expects the same bytes.
    using M = TmaTile<kHeadDim, kBlockHeads>;
    static_assert(Compute::kTma && !Compute::kSwizzle && Compute::kWarpRows == M::kWarpRows);
    __shared__ uint64_t full[kStages][kWarps];
    const uint32_t warp = threadIdx.x / 32;
    const uint32_t n_tiles = first < last ? (last - first + M::kTokens - 1) / M::kTokens : 0;
    // The stages from the first 1024-byte boundary (TmaTile::kSharedBytes has the slack).
    uint32_t stages_address = (shared_address(stages) + 1023) & ~1023u;
    asm volatile("" : "+r"(stages_address));  // computed once, as the offsets in MmaTile
    if (threadIdx.x == 0) {
      // (A call that lists nothing may come with no map at all: SparseDecodeAttention::tensor_map.)
      if (n_tiles != 0) prefetch_tensor_map(&kv_map);
#pragma unroll
      for (uint32_t s = 0; s < kStages; ++s)
#pragma unroll
        for (uint32_t w = 0; w < kWarps; ++w) barrier_init(&full[s][w], 1);
      barrier_init_fence();
    }
    __syncthreads();
    // (slot, first row) of the warp's box in tile `tile`.
    auto locate = [&](uint32_t tile) {
      TokenAddress at{0, 0};
      if (tile < n_tiles) {
        at = form.address(list_begin,
                          min(first + tile * M::kTokens + warp * M::kWarpRows, last - 1));
        at.row &= ~(M::kWarpRows - 1);
      }
      return at;
    };
    auto issue = [&](uint32_t tile, TokenAddress at) {
      if (lane != 0) return;
      const uint32_t stage = tile % kStages;
      const uint32_t to = stages_address + stage * M::kStageBytes;
      uint64_t* barrier = &full[stage][warp];
      barrier_expect(barrier, 2 * M::kHalves * M::kBoxBytes);
      // kv_map's coordinates: (element of a row, row of the slot, slot); a slot's V rows follow
      // its page_tokens K rows.
      const auto row = static_cast<int32_t>(at.row);
      const auto v_row = static_cast<int32_t>(p.page_tokens + at.row);
      const auto slot = static_cast<int32_t>(at.slot);
#pragma unroll
      for (uint32_t h = 0; h < M::kHalves; ++h) {
        const auto column = static_cast<int32_t>(64 * h);
        tensor_copy(to + M::region(0, h, warp), &kv_map, column, row, slot, barrier);
        tensor_copy(to + M::region(1, h, warp), &kv_map, column, v_row, slot, barrier);
      }
    };
    {
      TokenAddress early[kStages - 1];  // the first tiles' loads all in flight at once
#pragma unroll
      for (uint32_t s = 0; s + 1 < kStages; ++s) early[s] = locate(s);
#pragma unroll
      for (uint32_t s = 0; s + 1 < kStages; ++s)
        if (s < n_tiles) issue(s, early[s]);
    }
    TokenAddress next = locate(kStages - 1);
    if constexpr (kTensor) load_q();
    for (uint32_t tile = 0; tile < n_tiles; ++tile) {
      __syncwarp();  // the warp is done with stage (tile - 1) % kStages: it is refilled next
      if (tile + kStages - 1 < n_tiles) issue(tile + kStages - 1, next);
      next = locate(tile + kStages);
      barrier_wait(&full[tile % kStages][warp], tile / kStages % 2);
      compute.tile_at(stages_address + tile % kStages * M::kStageBytes, first + tile * M::kTokens,
                      last);
    }
  } else if constexpr (kWarpTokens != 0) {
    wide_loop<D, kHeadDim, kBlockHeads, kWarpTokens, kBulk != 0>(p, form, compute, load_q, stages,
                                                                 list_begin, first, last);
  } else if constexpr (kBulk != 0) {
    // The bulk copies: each K and V row (256 bytes at d = 128) is one copy by the copy engine,
    // where the cp.async tile takes 8 16-byte copies from every thread, and a stage's mbarrier
    // counts the bytes in. kBulk 1: warp 0's lanes copy the whole tile and every warp waits on the
    // one barrier, since each computes on rows that others' copies brought; one __syncthreads a
    // tile then guards the refill (the stage refilled at tile t is the one all warps computed at
    // t - 1). kBulk 2: each warp copies the rows it computes (MmaTile::tile_row) and waits on a
    // barrier of its own, so a __syncwarp guards the refill and the warps run apart as in the
    // cp.async loop. Rows past the list repeat the split's last listed row (a copy cannot
    // zero-fill): finite K and V, which MmaTile::tile weighs zero. The addresses of tile
    // t + kStages are loaded while tile t + kStages - 1 is issued, as the cp.async pipeline does.
    using B = BulkTile<kHeadDim, kBlockHeads>;
    static_assert(!Compute::kSwizzle, "MmaTile reads BulkTile's rows");
    constexpr bool kPerWarp = kBulk == 2;
    constexpr uint32_t kIssueRows = kPerWarp ? Compute::kWarpRows : B::kTokens;  // a warp copies
    constexpr uint32_t kPerLane = (kIssueRows + 31) / 32;
    constexpr uint32_t kBarriers = kPerWarp ? kWarps : 1;  // a stage's
    __shared__ uint64_t full[kStages][kBarriers];
    const uint32_t warp = threadIdx.x / 32;
    const uint32_t row0 = kPerWarp ? warp * kIssueRows : 0;  // the tile row of its first copy
    const uint32_t barrier = kPerWarp ? warp : 0;
    const uint32_t n_tiles = first < last ? (last - first + B::kTokens - 1) / B::kTokens : 0;
    const bool issuer = kPerWarp || warp == 0;
    if (threadIdx.x == 0) {
#pragma unroll
      for (uint32_t s = 0; s < kStages; ++s)
#pragma unroll
        for (uint32_t b = 0; b < kBarriers; ++b) barrier_init(&full[s][b], 1);
      barrier_init_fence();
    }
    __syncthreads();
    auto fetch = [&](uint32_t tile, TokenAddress(&to)[kPerLane]) {
#pragma unroll
      for (uint32_t k = 0; k < kPerLane; ++k) {
        const uint32_t j = lane + 32 * k;
        to[k] = TokenAddress{0, 0};
        if (tile < n_tiles && j < kIssueRows)
          to[k] = form.address(list_begin, min(first + tile * B::kTokens + row0 + j, last - 1));
      }
    };
    auto issue = [&](uint32_t tile, const TokenAddress(&from)[kPerLane]) {
      const uint32_t stage = tile % kStages;
      std::byte* to = reinterpret_cast<std::byte*>(stages) + stage * B::kStageBytes;
      if (lane == 0) barrier_expect(&full[stage][barrier], 2 * kIssueRows * B::kRowBytes);
      __syncwarp();
#pragma unroll
      for (uint32_t k = 0; k < kPerLane; ++k) {
        const uint32_t j = lane + 32 * k;
        if (j >= kIssueRows) continue;
        const std::byte* slot = layout.slot(pool, from[k].slot);
        bulk_copy(to + (row0 + j) * B::kPitch, layout.key(slot, from[k].row), B::kRowBytes,
                  &full[stage][barrier]);
        bulk_copy(to + (B::kTokens + row0 + j) * B::kPitch, layout.value(slot, from[k].row),
                  B::kRowBytes, &full[stage][barrier]);
      }
    };
    TokenAddress next[kPerLane];
    if (issuer) {
      TokenAddress early[kStages - 1][kPerLane];  // the first tiles' loads all in flight at once
#pragma unroll
      for (uint32_t s = 0; s + 1 < kStages; ++s) fetch(s, early[s]);
#pragma unroll
      for (uint32_t s = 0; s + 1 < kStages; ++s)
        if (s < n_tiles) issue(s, early[s]);
      fetch(kStages - 1, next);
    }
    if constexpr (kTensor) load_q();
    for (uint32_t tile = 0; tile < n_tiles; ++tile) {
      // Whoever computed stage (tile - 1) % kStages is done with it: it is refilled next.
      if constexpr (kPerWarp)
        __syncwarp();
      else
        __syncthreads();
      if (issuer) {
        if (tile + kStages - 1 < n_tiles) issue(tile + kStages - 1, next);
        fetch(tile + kStages, next);
      }
      barrier_wait(&full[tile % kStages][barrier], tile / kStages % 2);
      compute.tile(stages, tile % kStages, first + tile * B::kTokens, last);
    }
  } else {
    auto piece = [&](uint32_t stage, uint32_t r, uint32_t j, uint32_t kv) {
      return stages + piece_index<T, Compute::kSwizzle>(stage, r, j, kv, threadIdx.x);
    };
    TokenAddress address[R];
    bool listed[R];
    auto fetch_addresses = [&](uint32_t base) {
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
        const uint32_t i = base + r * T::kRowsPerStep + row_group;
        listed[r] = i < last;
        address[r] = listed[r] ? form.address(list_begin, i) : TokenAddress{0, 0};
      }
    };
    auto issue_copies = [&](uint32_t stage) {
#pragma unroll
      for (uint32_t r = 0; r < R; ++r) {
        const std::byte* slot = layout.slot(pool, address[r].slot);
        const uint32_t row = address[r].row;
#pragma unroll
        for (uint32_t j = 0; j < C; ++j) {
          // Rows past the list: zeros, nothing read.
          uint4* k = piece(stage, r, j, 0);
          uint4* v = piece(stage, r, j, 1);
          if constexpr (D == simd::Dtype::q8) {
            // Each lane of a row group copies its 8 codes and the row's scale: the scale's 4
            // bytes are read by every lane of the group, from L1 after the first.
            copy_small<8>(&k->x, layout.key_codes(slot, row) + channel(j), listed[r]);
            copy_small<4>(&k->z, layout.key_scales(slot) + row, listed[r]);
            copy_small<8>(&v->x, layout.value_codes(slot, row) + channel(j), listed[r]);
            copy_small<4>(&v->z, layout.value_scales(slot) + row, listed[r]);
          } else {
            copy16<kPrefetch>(k, layout.key(slot, row) + channel(j), listed[r]);
            copy16<kPrefetch>(v, layout.value(slot, row) + channel(j), listed[r]);
          }
        }
      }
      commit_copies();
    };
    uint32_t issue_base = first;
#pragma unroll
    for (uint32_t stage = 0; stage + 1 < kStages; ++stage, issue_base += T::kTokens) {
      fetch_addresses(issue_base);
      issue_copies(stage);
    }
    fetch_addresses(issue_base);
    if constexpr (kTensor) load_q();

    // The trip count is the same for every thread of the CTA, so the shuffles see full warps.
    uint32_t stage = 0;
    for (uint32_t base = first; base < last; base += T::kTokens) {
      if constexpr (kTensor) __syncwarp();
      issue_copies((stage + kStages - 1) % kStages);  // the stage computed last iteration
      issue_base += T::kTokens;
      fetch_addresses(issue_base);
      wait_copies<kStages - 1>();  // all but the newest kStages - 1 groups: tile t has landed
      if constexpr (kTensor) __syncwarp();
      compute.tile(stages, stage, base, last);
      stage = (stage + 1) % kStages;
    }
    wait_copies<0>();  // the zero-fill groups issued past the end
  }

  // Each warp's state, then the warps combined through shared memory.
  __shared__ float s_m[kWarps][kBlockHeads], s_l[kWarps][kBlockHeads];
  __syncthreads();  // the stages become the warps' accumulators: every thread is done reading
  auto s_acc = reinterpret_cast<float(*)[kBlockHeads][kHeadDim]>(stages);
  compute.store(s_acc, s_m, s_l);
  __syncthreads();
  const uint32_t unit = pair * p.head_blocks + block;
  const std::size_t first_partial = std::size_t{unit} * p.splits;
  for (uint32_t e = threadIdx.x; e < kBlockHeads * kHeadDim; e += kThreads) {
    const uint32_t g = e / kHeadDim, c = e % kHeadDim;
    if (g >= heads) break;  // e grows with g
    float m_all = kNegInf;
#pragma unroll
    for (uint32_t w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, s_m[w][g]);
    float l_all = 0.0f, a_all = 0.0f;
#pragma unroll
    for (uint32_t w = 0; w < kWarps; ++w) {
      const float weight = rescale(s_m[w][g], m_all);
      l_all += s_l[w][g] * weight;
      a_all += s_acc[w][g][c] * weight;
    }
    if (p.splits == 1) {
      // Nothing listed: zeros, as the CPU kernel writes.
      p.out[(std::size_t{pair} * p.group_size + head0 + g) * kHeadDim + c] =
          m_all == kNegInf ? 0.0f : a_all / l_all;
    } else {
      const std::size_t at = (first_partial + split) * kMaxBlockHeads + g;
      if (c == 0) p.partial_m[at] = m_all, p.partial_l[at] = l_all;
      p.partial_acc[at * kHeadDim + c] = a_all;
    }
  }
  if (p.splits == 1) return;

  // The unit's last CTA to finish merges its splits, which saves a second launch: the
  // threadFenceReduction pattern of the CUDA samples. Each CTA makes its partial visible
  // device-wide before taking a ticket.
  __shared__ bool s_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(p.arrivals + unit, 1u) == p.splits - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  merge_splits<kHeadDim, kBlockHeads>(p, first_partial, pair, head0, heads,
                                      reinterpret_cast<float*>(stages));
  if (threadIdx.x == 0) p.arrivals[unit] = 0;  // ready for the next call on the stream
}

template <simd::Dtype D, uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kChunks, bool kTensor,
          uint32_t kBulk, uint32_t kPrefetch, class Form>
__global__ void __launch_bounds__(kThreads)
    sparse_attend(AttendParams p, Form form, const __grid_constant__ CUtensorMap kv_map) {
  attend_cta<D, kHeadDim, kBlockHeads, kChunks, kTensor, kBulk, kPrefetch, Form, 0>(p, form,
                                                                                    kv_map);
}

// The wide tiles' kernel. Shared memory, not registers, bounds its residency (2 CTAs a
// multiprocessor, 1 with stages of 64 KiB), so it asks ptxas for no more than one resident CTA's
// register bound: under plain __launch_bounds__(kThreads) ptxas aimed at 128 registers (4 CTAs)
// and spilled.
template <simd::Dtype D, uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kBulk, class Form,
          uint32_t kWarpTokens>
__global__ void __launch_bounds__(kThreads, 1)
    sparse_attend_wide(AttendParams p, Form form, const __grid_constant__ CUtensorMap kv_map) {
  attend_cta<D, kHeadDim, kBlockHeads, 1, true, kBulk, 0, Form, kWarpTokens>(p, form, kv_map);
}

// One instantiation and what launching it needs.
template <class Form>
struct KernelInfo {
  void (*kernel)(AttendParams, Form, CUtensorMap);
  uint32_t tile_tokens;
  uint32_t shared_bytes;
  uint32_t max_splits;  // the merge stages (m, l) of every split in shared_bytes
};

template <simd::Dtype D, uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kChunks, bool kTensor,
          uint32_t kBulk, uint32_t kPrefetch, class Form>
KernelInfo<Form> info() {
  using T = Tile<kHeadDim, kBlockHeads, kChunks>;
  constexpr uint32_t shared = kBulk == 3   ? TmaTile<kHeadDim, kBlockHeads>::kSharedBytes
                              : kBulk != 0 ? BulkTile<kHeadDim, kBlockHeads>::kSharedBytes
                                           : T::kSharedBytes;
  return {sparse_attend<D, kHeadDim, kBlockHeads, kChunks, kTensor, kBulk, kPrefetch, Form>,
          T::kTokens, shared, shared / (2 * kBlockHeads * uint32_t{sizeof(float)})};
}

// Blocks of 8 heads have no 2-piece kernel (its q and acc would not fit the registers): they keep
// one piece a lane whatever the tuning asks. The bulk copies and the L2 prefetches are
// instantiated for one piece only (init() refuses chunks_per_lane 2 with them).
template <simd::Dtype D, uint32_t kHeadDim, bool kTensor, uint32_t kBulk, uint32_t kPrefetch,
          class Form>
KernelInfo<Form> kernel_for_heads(uint32_t block_heads, uint32_t chunks) {
  constexpr bool kOnePiece = kBulk != 0 || kPrefetch != 0;
  switch (block_heads) {
    case 1:
      if constexpr (!kOnePiece)
        if (chunks == 2) return info<D, kHeadDim, 1, 2, kTensor, kBulk, kPrefetch, Form>();
      return info<D, kHeadDim, 1, 1, kTensor, kBulk, kPrefetch, Form>();
    case 2:
      if constexpr (!kOnePiece)
        if (chunks == 2) return info<D, kHeadDim, 2, 2, kTensor, kBulk, kPrefetch, Form>();
      return info<D, kHeadDim, 2, 1, kTensor, kBulk, kPrefetch, Form>();
    case 4:
      if constexpr (!kOnePiece)
        if (chunks == 2) return info<D, kHeadDim, 4, 2, kTensor, kBulk, kPrefetch, Form>();
      return info<D, kHeadDim, 4, 1, kTensor, kBulk, kPrefetch, Form>();
    default: return info<D, kHeadDim, kMaxBlockHeads, 1, kTensor, kBulk, kPrefetch, Form>();
  }
}

template <simd::Dtype D, bool kTensor, uint32_t kBulk, uint32_t kPrefetch, class Form>
KernelInfo<Form> kernel_for_dim(uint32_t head_dim, uint32_t block_heads, uint32_t chunks) {
  switch (head_dim) {
    case 64: return kernel_for_heads<D, 64, kTensor, kBulk, kPrefetch, Form>(block_heads, chunks);
    case 128: return kernel_for_heads<D, 128, kTensor, kBulk, kPrefetch, Form>(block_heads, chunks);
    default: return kernel_for_heads<D, 256, kTensor, kBulk, kPrefetch, Form>(block_heads, chunks);
  }
}

// The wide tiles' kernels (AttendTuning::warp_tokens 16, 32): cp.async (kBulk 0) or per-warp
// bulk copies (2); 32-token tiles at head_dim 64 and 128 only (init() refuses 256: two stages of
// 128 KiB would not fit a multiprocessor).
template <simd::Dtype D, uint32_t kHeadDim, uint32_t kBlockHeads, uint32_t kWarpTokens,
          uint32_t kBulk, class Form>
KernelInfo<Form> wide_info() {
  using W = WideTile<kHeadDim, kBlockHeads, kWarpTokens, kBulk != 0>;
  return {sparse_attend_wide<D, kHeadDim, kBlockHeads, kBulk, Form, kWarpTokens>, W::kTokens,
          W::kSharedBytes, W::kSharedBytes / (2 * kBlockHeads * uint32_t{sizeof(float)})};
}

template <simd::Dtype D, uint32_t kHeadDim, uint32_t kWarpTokens, uint32_t kBulk, class Form>
KernelInfo<Form> wide_kernel_for_heads(uint32_t block_heads) {
  switch (block_heads) {
    case 1: return wide_info<D, kHeadDim, 1, kWarpTokens, kBulk, Form>();
    case 2: return wide_info<D, kHeadDim, 2, kWarpTokens, kBulk, Form>();
    case 4: return wide_info<D, kHeadDim, 4, kWarpTokens, kBulk, Form>();
    default: return wide_info<D, kHeadDim, kMaxBlockHeads, kWarpTokens, kBulk, Form>();
  }
}

template <simd::Dtype D, uint32_t kWarpTokens, uint32_t kBulk, class Form>
KernelInfo<Form> wide_kernel_for_dim(uint32_t head_dim, uint32_t block_heads) {
  switch (head_dim) {
    case 64: return wide_kernel_for_heads<D, 64, kWarpTokens, kBulk, Form>(block_heads);
    case 128: return wide_kernel_for_heads<D, 128, kWarpTokens, kBulk, Form>(block_heads);
    default:
      if constexpr (kWarpTokens == 16)
        return wide_kernel_for_heads<D, 256, kWarpTokens, kBulk, Form>(block_heads);
      else  // not reached: init() refuses 32-token tiles at head_dim 256
        return wide_kernel_for_heads<D, 128, kWarpTokens, kBulk, Form>(block_heads);
  }
}

template <simd::Dtype D, class Form>
KernelInfo<Form> wide_kernel_for(uint32_t d, uint32_t heads, const AttendTuning& tuning) {
  if (tuning.warp_tokens == 32)
    return tuning.bulk_copies == 2 ? wide_kernel_for_dim<D, 32, 2, Form>(d, heads)
                                   : wide_kernel_for_dim<D, 32, 0, Form>(d, heads);
  return tuning.bulk_copies == 2 ? wide_kernel_for_dim<D, 16, 2, Form>(d, heads)
                                 : wide_kernel_for_dim<D, 16, 0, Form>(d, heads);
}

// The 16-bit kernels: the FMA loop, the tensor-core loop with cp.async copies (with or without an
// L2 prefetch), or with bulk copies, or the wide tiles. The tensor-map copies (3) move whole
// pages' rows: the token form, whose rows are anywhere, takes the per-warp row copies (2) instead.
template <simd::Dtype D, class Form>
KernelInfo<Form> kernel_for_16bit(uint32_t d, uint32_t heads, const AttendTuning& tuning) {
  const uint32_t chunks = tuning.chunks_per_lane;
  if (tuning.tensor_cores == 0) return kernel_for_dim<D, false, 0, 0, Form>(d, heads, chunks);
  if (tuning.warp_tokens > 8) return wide_kernel_for<D, Form>(d, heads, tuning);
  if (tuning.bulk_copies == 3) {
    if constexpr (std::is_same_v<Form, PageForm>)
      return kernel_for_dim<D, true, 3, 0, Form>(d, heads, chunks);
    else
      return kernel_for_dim<D, true, 2, 0, Form>(d, heads, chunks);
  }
  if (tuning.bulk_copies == 1) return kernel_for_dim<D, true, 1, 0, Form>(d, heads, chunks);
  if (tuning.bulk_copies == 2) return kernel_for_dim<D, true, 2, 0, Form>(d, heads, chunks);
  switch (tuning.l2_prefetch) {
    case 128: return kernel_for_dim<D, true, 0, 128, Form>(d, heads, chunks);
    case 256: return kernel_for_dim<D, true, 0, 256, Form>(d, heads, chunks);
    default: return kernel_for_dim<D, true, 0, 0, Form>(d, heads, chunks);
  }
}

// The instantiation for a shape and a tuning that init() accepted. q8 has no tensor-core loop
// (its codes would need converting to 16 bits before ldmatrix): it keeps the FMA loop whatever
// the tuning asks (init() refuses bulk copies and prefetches for it).
template <class Form>
KernelInfo<Form> kernel_for(const AttentionShape& shape, const AttendTuning& tuning) {
  using simd::Dtype;
  const uint32_t heads = block_heads_for(shape.group_size);
  switch (shape.dtype) {
    case Dtype::f16: return kernel_for_16bit<Dtype::f16, Form>(shape.head_dim, heads, tuning);
    case Dtype::bf16: return kernel_for_16bit<Dtype::bf16, Form>(shape.head_dim, heads, tuning);
    default:
      return kernel_for_dim<Dtype::q8, false, 0, 0, Form>(shape.head_dim, heads,
                                                          tuning.chunks_per_lane);
  }
}

template <class... Parts>
Result invalid(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  return Result::invalid(message.str());
}

bool aligned16(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

Result validate_target(const AttendTarget& t, const AttentionShape& shape, uint32_t max_batch) {
  if (max_batch == 0) return invalid("SparseDecodeAttention is not initialised (call init first)");
  if (t.n_seqs < 1 || t.n_seqs > max_batch)
    return invalid("n_seqs=", t.n_seqs, " is not in 1..", max_batch, " (max_batch)");
  if (t.pool == nullptr) return invalid("pool is NULL");
  if (!aligned16(t.pool)) return invalid("pool is not 16-byte aligned");
  if (t.q == nullptr) return invalid("q is NULL");
  if (t.out == nullptr) return invalid("out is NULL");
  if (!aligned16(t.q)) return invalid("q is not 16-byte aligned");
  const std::size_t bytes =
      std::size_t{t.n_seqs} * shape.n_query_heads() * shape.head_dim * sizeof(float);
  const auto q_begin = reinterpret_cast<std::uintptr_t>(t.q);
  const auto out_begin = reinterpret_cast<std::uintptr_t>(t.out);
  if (!(q_begin + bytes <= out_begin || out_begin + bytes <= q_begin))
    return invalid("out overlaps q");
  return Result{};
}

// offsets must be present in both views, start at 0 and never decrease; tokens_per_entry turns
// entries into tokens for the per-pair bound.
Result validate_offsets(const uint32_t* host, const uint32_t* device, uint32_t pairs,
                        uint64_t tokens_per_entry) {
  if (host == nullptr) return invalid("host.offsets is NULL");
  if (device == nullptr) return invalid("device.offsets is NULL");
  if (host[0] != 0) return invalid("host.offsets[0]=", host[0], " is not 0");
  for (uint32_t pair = 0; pair < pairs; ++pair) {
    if (host[pair + 1] < host[pair])
      return invalid("host.offsets decreases at ", pair + 1, " (", host[pair], " then ",
                     host[pair + 1], ")");
    if (uint64_t{host[pair + 1] - host[pair]} * tokens_per_entry >= kMaxPairTokens)
      return invalid("pair ", pair, " lists ", host[pair + 1] - host[pair],
                     " entries: over 2^31 tokens");
  }
  return Result{};
}

// Splits per pair from the longest list: enough CTAs for target_ctas (the device's resident
// capacity by default), each at least the tuning's minimum of tiles, then the split rounded up to
// whole tiles.
SplitPlan plan_splits(const uint32_t* offsets, uint32_t pairs, uint32_t tokens_per_entry,
                      const AttentionShape& shape, const AttendTuning& tuning,
                      uint32_t target_ctas) {
  SplitPlan plan;
  plan.device_ctas = target_ctas;
  const uint32_t block_heads = block_heads_for(shape.group_size);
  plan.head_blocks = (shape.group_size + block_heads - 1) / block_heads;
  uint64_t longest = 0;
  for (uint32_t pair = 0; pair < pairs; ++pair) {
    const uint64_t tokens = uint64_t{offsets[pair + 1] - offsets[pair]} * tokens_per_entry;
    longest = std::max(longest, tokens);
    plan.tokens += tokens;
  }
  plan.kv_bytes = plan.tokens *
                  simd::PageLayout{shape.page_tokens, shape.head_dim, shape.dtype}.token_bytes() *
                  plan.head_blocks;
  // Tiles are alike in both forms.
  const KernelInfo<PageForm> kernel = kernel_for<PageForm>(shape, tuning);
  const uint64_t tile = kernel.tile_tokens;
  const uint64_t units = uint64_t{pairs} * plan.head_blocks;
  // Rounded down: one CTA past the resident capacity would start a second wave on its own.
  const uint64_t wanted = std::max<uint64_t>(1, target_ctas / units);
  const uint64_t min_tokens = tuning.min_tiles_per_split * tile;
  const uint64_t most = std::max<uint64_t>(1, (longest + min_tokens - 1) / min_tokens);
  uint64_t splits = std::clamp<uint64_t>(std::min<uint64_t>(wanted, kernel.max_splits), 1, most);
  uint64_t per_split = (longest + splits - 1) / splits;
  per_split = std::max<uint64_t>(tile, (per_split + tile - 1) / tile * tile);
  splits = std::max<uint64_t>(1, (longest + per_split - 1) / per_split);
  plan.splits_per_pair = static_cast<uint32_t>(splits);
  plan.tokens_per_split = static_cast<uint32_t>(per_split);
  plan.ctas = units * splits;
  return plan;
}

template <class Form>
Result launch(const AttendTarget& t, const uint32_t* host_offsets, uint32_t tokens_per_entry,
              const Form& form, const AttentionShape& shape, const AttendTuning& tuning,
              uint32_t target_ctas, std::size_t partial_slots, float* partials, uint32_t* arrivals,
              const CUtensorMap& kv_map, SplitPlan& plan) {
  const uint32_t pairs = t.n_seqs * shape.n_kv_heads;
  plan = plan_splits(host_offsets, pairs, tokens_per_entry, shape, tuning, target_ctas);
  if (plan.ctas > partial_slots)  // plan_splits keeps ctas <= target + pairs * head_blocks
    return Result::failed("split plan exceeds the workspace (internal error)");
  AttendParams params{};
  params.pool = static_cast<const uint16_t*>(t.pool);
  params.q = t.q;
  params.out = t.out;
  params.partial_m = partials;
  params.partial_l = partials + partial_slots * kMaxBlockHeads;
  params.partial_acc = partials + 2 * partial_slots * kMaxBlockHeads;
  params.arrivals = arrivals;
  params.group_size = shape.group_size;
  params.page_tokens = shape.page_tokens;
  params.splits = plan.splits_per_pair;
  params.tokens_per_split = plan.tokens_per_split;
  params.head_blocks = plan.head_blocks;
  params.q_scale = kLog2e / std::sqrt(static_cast<float>(shape.head_dim));
  const auto stream = static_cast<cudaStream_t>(t.stream);
  const dim3 grid(pairs, plan.splits_per_pair, plan.head_blocks);
  const KernelInfo<Form> k = kernel_for<Form>(shape, tuning);
  k.kernel<<<grid, kThreads, k.shared_bytes, stream>>>(params, form, kv_map);
  return cuda_result(cudaGetLastError(), "sparse attention launch");
}

// The kernel parameter of the launches that use no tensor map.
const CUtensorMap kNoTensorMap{};

uint32_t log2_exact(uint32_t power_of_two) {
  uint32_t shift = 0;
  while ((1u << shift) < power_of_two) ++shift;
  return shift;
}

}  // namespace

namespace cuda {

// The backend's SparseDecodeAttention (gpu/backend.hpp): the split workspace on one device.
class SparseDecodeAttention final : public backend::SparseDecodeAttention {
 public:
  ~SparseDecodeAttention() override { release(); }

  Result init(const AttentionShape& shape, uint32_t max_batch, const AttendTuning& tuning) override;
  Result validate(const PageAttendCall& call) const override;
  Result validate(const TokenAttendCall& call) const override;
  Result run(const PageAttendCall& call) noexcept override;
  Result run(const TokenAttendCall& call) noexcept override;
  const SplitPlan& last_plan() const noexcept override { return plan_; }
  const AttentionShape& shape() const noexcept override { return shape_; }

 private:
  struct Workspace {
    DeviceBuffer<float> memory;  // the partials, then the arrival counters
  };
  // The tensor map of bulk copies 3 over a pool (sparse_attend's kv_map), from the cache below or
  // encoded now.
  Result tensor_map(const AttendTarget& t, const CUtensorMap** map) noexcept;
  void release() noexcept;

  AttentionShape shape_{};
  uint32_t max_batch_ = 0;
  uint32_t target_ctas_ = 0;  // multiprocessors x CTAs per multiprocessor (AttendTuning, else
                              // the attention kernel's occupancy)
  AttendTuning tuning_{};
  std::size_t partial_slots_ = 0;  // (pair, head block, split) partials the workspace holds
  std::unique_ptr<Workspace> workspace_;
  float* partials_ = nullptr;     // workspace_: m, l [partial_slots_, 8] then acc [.., 8, head_dim]
  uint32_t* arrivals_ = nullptr;  // workspace_, after the partials: finished splits per (pair,
                                  // head block), back to zero at the end of every call
  SplitPlan plan_{};
  // Bulk copies 3: the driver's encoder (found by init(), no link to libcuda), the rows of a
  // warp's box, and the maps of the last few pools. A map depends only on the pool's address,
  // its slot count and the shape, so an entry stays right for as long as the shape does; encoding
  // costs about a microsecond of host time, a lookup a few compares.
  PFN_cuTensorMapEncodeTiled_v12000 encode_tiled_ = nullptr;
  uint32_t box_rows_ = 0;
  struct KvMap {
    const void* pool = nullptr;
    uint64_t n_slots = 0;
    CUtensorMap map{};
  };
  std::array<KvMap, 4> kv_maps_{};
  uint32_t kv_maps_used_ = 0, kv_map_next_ = 0;
};

std::unique_ptr<backend::SparseDecodeAttention> make_sparse_attention() {
  return std::make_unique<SparseDecodeAttention>();
}

void SparseDecodeAttention::release() noexcept {
  workspace_.reset();
  partials_ = nullptr;
  arrivals_ = nullptr;
  max_batch_ = 0;
  partial_slots_ = 0;
  kv_maps_used_ = kv_map_next_ = 0;  // the shape may change
}

Result SparseDecodeAttention::tensor_map(const AttendTarget& t, const CUtensorMap** map) noexcept {
  *map = &kNoTensorMap;
  if (t.n_slots == 0) return Result{};  // nothing can be listed: no copy reads the map
  for (uint32_t i = 0; i < kv_maps_used_; ++i)
    if (kv_maps_[i].pool == t.pool && kv_maps_[i].n_slots == t.n_slots) {
      *map = &kv_maps_[i].map;
      return Result{};
    }
  // The pool as [slots][rows][head_dim]: a slot's page_tokens K rows, then its V rows. A box is
  // 64 columns (128 bytes, the widest inner extent the 128-byte swizzle allows) of a warp's rows
  // of K or V (sparse_attend, TmaTile). A copy's coordinates are signed 32-bit: a pool of 2^31
  // slots or more (16 TiB at 8 KiB a slot) is refused rather than half addressed.
  if (t.n_slots > uint64_t{1} << 31)
    return invalid("tuning.bulk_copies=3 addresses at most 2^31 slots (n_slots=", t.n_slots, ")");
  const simd::PageLayout layout{shape_.page_tokens, shape_.head_dim, shape_.dtype};
  const cuuint64_t dims[3] = {shape_.head_dim, cuuint64_t{2} * shape_.page_tokens, t.n_slots};
  const cuuint64_t strides[2] = {layout.row_bytes(), layout.slot_bytes()};  // of dims 1 and 2
  const cuuint32_t box[3] = {64, box_rows_, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  KvMap& entry = kv_maps_[kv_map_next_];
  const CUresult r = encode_tiled_(
      &entry.map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, const_cast<void*>(t.pool), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    entry.pool = nullptr;
    std::ostringstream message;
    message << "cuTensorMapEncodeTiled failed (CUresult " << static_cast<int>(r)
            << ") for the pool at " << t.pool << " of " << t.n_slots << " slots of "
            << layout.slot_bytes() << " bytes";
    return Result::failed(message.str());
  }
  entry.pool = t.pool;
  entry.n_slots = t.n_slots;
  kv_map_next_ = (kv_map_next_ + 1) % kv_maps_.size();
  kv_maps_used_ = std::min<uint32_t>(kv_maps_used_ + 1, kv_maps_.size());
  *map = &entry.map;
  return Result{};
}

Result SparseDecodeAttention::init(const AttentionShape& shape, uint32_t max_batch,
                                   const AttendTuning& tuning) {
  if (shape.n_kv_heads < 1 || shape.n_kv_heads > 1024)
    return invalid("n_kv_heads=", shape.n_kv_heads, " is not in 1..1024");
  if (shape.group_size < 1 || shape.group_size > 64)
    return invalid("group_size=", shape.group_size, " is not in 1..64");
  if (shape.head_dim != 64 && shape.head_dim != 128 && shape.head_dim != 256)
    return invalid("head_dim=", shape.head_dim, " is not 64, 128 or 256");
  if (shape.page_tokens != 16 && shape.page_tokens != 32 && shape.page_tokens != 64)
    return invalid("page_tokens=", shape.page_tokens, " is not 16, 32 or 64");
  if (shape.dtype != simd::Dtype::f16 && shape.dtype != simd::Dtype::bf16 &&
      shape.dtype != simd::Dtype::q8)
    return invalid("dtype=", static_cast<int>(shape.dtype), " is not f16 (0), bf16 (1) or q8 (2)");
  if (max_batch < 1 || max_batch > 65536)
    return invalid("max_batch=", max_batch, " is not in 1..65536");
  if (tuning.ctas_per_sm > kMaxCtasPerSm)
    return invalid("tuning.ctas_per_sm=", tuning.ctas_per_sm, " is not in 0..", kMaxCtasPerSm);
  if (tuning.min_tiles_per_split < 1 || tuning.min_tiles_per_split > kMaxMinTiles)
    return invalid("tuning.min_tiles_per_split=", tuning.min_tiles_per_split, " is not in 1..",
                   kMaxMinTiles);
  if (tuning.chunks_per_lane != 1 && tuning.chunks_per_lane != 2)
    return invalid("tuning.chunks_per_lane=", tuning.chunks_per_lane, " is not 1 or 2");
  if (tuning.tensor_cores > 1)
    return invalid("tuning.tensor_cores=", tuning.tensor_cores, " is not 0 or 1");
  if (tuning.l2_prefetch != 0 && tuning.l2_prefetch != 128 && tuning.l2_prefetch != 256)
    return invalid("tuning.l2_prefetch=", tuning.l2_prefetch, " is not 0, 128 or 256");
  if (tuning.bulk_copies > 3)
    return invalid("tuning.bulk_copies=", tuning.bulk_copies, " is not 0, 1, 2 or 3");
  if (tuning.bulk_copies != 0) {
    const uint32_t bulk = tuning.bulk_copies;
    if (tuning.tensor_cores != 1)
      return invalid("tuning.bulk_copies=", bulk,
                     " needs tensor_cores=1 (the FMA loop reads the cp.async layout)");
    if (tuning.chunks_per_lane != 1)
      return invalid("tuning.bulk_copies=", bulk,
                     " needs chunks_per_lane=1 (a bulk copy moves whole rows)");
    if (shape.dtype == simd::Dtype::q8)
      return invalid("tuning.bulk_copies=", bulk,
                     " needs f16 or bf16 K/V (q8 has no tensor-core loop)");
    if (tuning.l2_prefetch != 0)
      return invalid("tuning.l2_prefetch=", tuning.l2_prefetch,
                     " applies to the cp.async copies: bulk_copies=", bulk, " has none");
  }
  if (tuning.l2_prefetch != 0) {
    if (tuning.tensor_cores != 1 || tuning.chunks_per_lane != 1 || shape.dtype == simd::Dtype::q8)
      return invalid("tuning.l2_prefetch=", tuning.l2_prefetch,
                     " is instantiated for the tensor-core loop only (tensor_cores=1, "
                     "chunks_per_lane=1, f16 or bf16)");
  }

  if (tuning.warp_tokens != 0 && tuning.warp_tokens != 8 && tuning.warp_tokens != 16 &&
      tuning.warp_tokens != 32)
    return invalid("tuning.warp_tokens=", tuning.warp_tokens, " is not 0, 8, 16 or 32");
  if (tuning.warp_tokens > 8) {
    const uint32_t wide = tuning.warp_tokens;
    if (tuning.tensor_cores != 1)
      return invalid("tuning.warp_tokens=", wide,
                     " needs tensor_cores=1 (the wide tiles are the tensor-core loop's)");
    if (tuning.chunks_per_lane != 1)
      return invalid("tuning.warp_tokens=", wide, " needs chunks_per_lane=1");
    if (shape.dtype == simd::Dtype::q8)
      return invalid("tuning.warp_tokens=", wide,
                     " needs f16 or bf16 K/V (q8 has no tensor-core loop)");
    if (tuning.l2_prefetch != 0)
      return invalid("tuning.warp_tokens=", wide,
                     " is not instantiated with l2_prefetch=", tuning.l2_prefetch, " (0 only)");
    if (tuning.bulk_copies != 0 && tuning.bulk_copies != 2)
      return invalid(
          "tuning.warp_tokens=", wide,
          " is instantiated with bulk_copies 0 or 2 only, not bulk_copies=", tuning.bulk_copies);
    if (wide == 32 && shape.head_dim == 256)
      return invalid(
          "tuning.warp_tokens=32 is not instantiated for head_dim=256 (two stages of "
          "its 128-token tile would not fit a multiprocessor's shared memory)");
  }

  release();
  int device = 0, multiprocessors = 0, resident = 0;
  if (Result r = cuda_result(cudaGetDevice(&device), "cudaGetDevice"); !r.ok) return r;
  if (Result r = cuda_result(
          cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device),
          "multiprocessor count");
      !r.ok)
    return r;
  // Both forms' kernels may take more than the default 48 KiB of dynamic shared memory.
  const KernelInfo<PageForm> page_kernel = kernel_for<PageForm>(shape, tuning);
  const KernelInfo<TokenForm> token_kernel = kernel_for<TokenForm>(shape, tuning);
  // The wide tiles' stages can exceed what a block may take on smaller parts (99 KiB on sm_89).
  if (tuning.warp_tokens > 8) {
    int most = 0;
    if (Result r = cuda_result(
            cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
            "shared memory per block");
        !r.ok)
      return r;
    if (page_kernel.shared_bytes > static_cast<uint32_t>(most))
      return invalid("tuning.warp_tokens=", tuning.warp_tokens, " needs ", page_kernel.shared_bytes,
                     " bytes of shared memory a block at head_dim=", shape.head_dim,
                     "; this device allows ", most);
  }
  for (cudaError_t err :
       {cudaFuncSetAttribute(page_kernel.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             page_kernel.shared_bytes),
        cudaFuncSetAttribute(token_kernel.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             token_kernel.shared_bytes)})
    if (Result r = cuda_result(err, "shared memory limit"); !r.ok) return r;
  // The bulk copies are sm_90 instructions: the kernel the device runs must have been compiled for
  // compute_90 or later (its PTX version), else its helpers trap (KVSIFT_BULK_ASM).
  if (tuning.bulk_copies != 0) {
    cudaFuncAttributes attributes{};
    if (Result r = cuda_result(cudaFuncGetAttributes(&attributes, page_kernel.kernel),
                               "kernel attributes");
        !r.ok)
      return r;
    if (attributes.ptxVersion < 90)
      return invalid("tuning.bulk_copies=", tuning.bulk_copies,
                     " needs a device of compute capability 9.0 or later (this device runs code "
                     "for compute_",
                     attributes.ptxVersion, ")");
  }
  // The tensor-map copies need the driver's encoder, looked up once (no link to libcuda).
  if (tuning.bulk_copies == 3 && encode_tiled_ == nullptr) {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry,
                                                             12000, cudaEnableDefault, &query);
#else
    const cudaError_t err =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &entry, cudaEnableDefault, &query);
#endif
    if (Result r = cuda_result(err, "driver entry point cuTensorMapEncodeTiled"); !r.ok) return r;
    if (query != cudaDriverEntryPointSuccess || entry == nullptr)
      return Result::failed(
          "tuning.bulk_copies=3: the driver has no cuTensorMapEncodeTiled (query result " +
          std::to_string(static_cast<int>(query)) + ")");
    encode_tiled_ = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
  }
  // The page and token kernels of a shape use the same registers within a few; one bound serves.
  if (Result r = cuda_result(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
                                 &resident, page_kernel.kernel, kThreads, page_kernel.shared_bytes),
                             "occupancy query");
      !r.ok)
    return r;
  const uint32_t per_sm =
      tuning.ctas_per_sm != 0 ? tuning.ctas_per_sm : static_cast<uint32_t>(std::max(resident, 1));
  const uint32_t target = static_cast<uint32_t>(multiprocessors) * per_sm;
  const uint32_t block_heads = block_heads_for(shape.group_size);
  const uint64_t head_blocks = (shape.group_size + block_heads - 1) / block_heads;
  const std::size_t units = uint64_t{max_batch} * shape.n_kv_heads * head_blocks;
  const std::size_t slots = target + units;
  const std::size_t floats = slots * kMaxBlockHeads * (2 + std::size_t{shape.head_dim});
  auto workspace = std::make_unique<Workspace>();
  if (Result r =
          cuda_result(workspace->memory.allocate(floats * sizeof(float) + units * sizeof(uint32_t)),
                      "split workspace");
      !r.ok)
    return r;
  float* partials = workspace->memory.get();
  uint32_t* arrivals = reinterpret_cast<uint32_t*>(partials + floats);
  if (Result r = cuda_result(cudaMemset(arrivals, 0, units * sizeof(uint32_t)), "split counters");
      !r.ok)
    return r;
  shape_ = shape;
  max_batch_ = max_batch;
  target_ctas_ = target;
  tuning_ = tuning;
  partial_slots_ = slots;
  workspace_ = std::move(workspace);
  partials_ = partials;
  arrivals_ = arrivals;
  box_rows_ = page_kernel.tile_tokens / kWarps;  // a warp's rows (MmaTile::kWarpRows)
  plan_ = SplitPlan{};
  return Result{};
}

Result SparseDecodeAttention::validate(const PageAttendCall& call) const {
  if (Result r = validate_target(call.target, shape_, max_batch_); !r.ok) return r;
  const uint32_t pairs = call.target.n_seqs * shape_.n_kv_heads;
  if (Result r =
          validate_offsets(call.host.offsets, call.device.offsets, pairs, shape_.page_tokens);
      !r.ok)
    return r;
  if (call.host.offsets[pairs] == 0) return Result{};
  if (call.host.slots == nullptr) return invalid("host.slots is NULL");
  if (call.device.slots == nullptr) return invalid("device.slots is NULL");
  if (call.host.last_page_tokens == nullptr) return invalid("host.last_page_tokens is NULL");
  if (call.device.last_page_tokens == nullptr) return invalid("device.last_page_tokens is NULL");
  for (uint32_t pair = 0; pair < pairs; ++pair) {
    const uint32_t begin = call.host.offsets[pair], end = call.host.offsets[pair + 1];
    for (uint32_t i = begin; i < end; ++i)
      if (call.host.slots[i] >= call.target.n_slots)
        return invalid("host.slots[", i, "]=", call.host.slots[i],
                       " is out of range (n_slots=", call.target.n_slots, ")");
    const uint32_t last = call.host.last_page_tokens[pair];
    if (end > begin && (last < 1 || last > shape_.page_tokens))
      return invalid("host.last_page_tokens[", pair, "]=", last, " is not in 1..",
                     shape_.page_tokens, " (page_tokens)");
  }
  return Result{};
}

Result SparseDecodeAttention::validate(const TokenAttendCall& call) const {
  if (Result r = validate_target(call.target, shape_, max_batch_); !r.ok) return r;
  const uint32_t pairs = call.target.n_seqs * shape_.n_kv_heads;
  if (Result r = validate_offsets(call.host.offsets, call.device.offsets, pairs, 1); !r.ok)
    return r;
  const uint32_t total = call.host.offsets[pairs];
  if (total == 0) return Result{};
  if (call.host.tokens == nullptr) return invalid("host.tokens is NULL");
  if (call.device.tokens == nullptr) return invalid("device.tokens is NULL");
  if (reinterpret_cast<std::uintptr_t>(call.device.tokens) % alignof(uint64_t) != 0)
    return invalid("device.tokens is not 8-byte aligned");
  for (uint32_t i = 0; i < total; ++i) {
    const TokenAddress a = call.host.tokens[i];
    if (a.slot >= call.target.n_slots)
      return invalid("host.tokens[", i, "].slot=", a.slot,
                     " is out of range (n_slots=", call.target.n_slots, ")");
    if (a.row >= shape_.page_tokens)
      return invalid("host.tokens[", i, "].row=", a.row,
                     " is not below page_tokens=", shape_.page_tokens);
  }
  return Result{};
}

Result SparseDecodeAttention::run(const PageAttendCall& call) noexcept {
  if (max_batch_ == 0) return invalid("SparseDecodeAttention is not initialised (call init first)");
  if (call.target.n_seqs < 1 || call.target.n_seqs > max_batch_ || call.host.offsets == nullptr)
    return invalid("run() needs a call that validate() accepted (n_seqs=", call.target.n_seqs,
                   ", host.offsets ", call.host.offsets ? "set" : "NULL", ")");
  const PageForm form{call.device.offsets, call.device.slots, call.device.last_page_tokens,
                      log2_exact(shape_.page_tokens)};
  const CUtensorMap* kv_map = &kNoTensorMap;
  if (tuning_.bulk_copies == 3)
    if (Result r = tensor_map(call.target, &kv_map); !r.ok) return r;
  return launch(call.target, call.host.offsets, shape_.page_tokens, form, shape_, tuning_,
                target_ctas_, partial_slots_, partials_, arrivals_, *kv_map, plan_);
}

Result SparseDecodeAttention::run(const TokenAttendCall& call) noexcept {
  if (max_batch_ == 0) return invalid("SparseDecodeAttention is not initialised (call init first)");
  if (call.target.n_seqs < 1 || call.target.n_seqs > max_batch_ || call.host.offsets == nullptr)
    return invalid("run() needs a call that validate() accepted (n_seqs=", call.target.n_seqs,
                   ", host.offsets ", call.host.offsets ? "set" : "NULL", ")");
  const TokenForm form{call.device.offsets, call.device.tokens};
  return launch(call.target, call.host.offsets, 1, form, shape_, tuning_, target_ctas_,
                partial_slots_, partials_, arrivals_, kNoTensorMap, plan_);
}

}  // namespace cuda
}  // namespace kvsift::gpu
