// Louver kernels (docs/methods.md, Louver): ball upper bounds over fp16 cluster centers, the
// per-key candidate filter over those bounds, and the exact check q.k >= tau over fp16 keys. One
// table per instruction set, chosen once per index for its level (louver_kernels_for).
//
// Layouts (owned by lib/select/louver_index.hpp, stated here because the kernels read them):
// - keys: fp16 [n, head_dim] row-major, token order, 64-byte aligned rows (head_dim * 2 bytes).
// - centers of one subspace of width w: fp16 in blocks of 16 clusters, [n_blocks, w, 16]: the
//   value of coordinate j of cluster c at ((c / 16) * w + j) * 16 + c % 16, so one vector holds
//   one coordinate of 16 clusters and a bound needs no horizontal sum.
// - radii of one subspace: float32 [n_clusters].
// - assignments of one subspace: uint32 [n_keys], the cluster of each key.
//
// Exactness contract: check and scan compute each key's score with the same arithmetic (one
// function per ISA), so for one table a key passes in check iff it passes in scan. That is what
// makes the index's answer equal to the brute-force answer bit for bit, not just within rounding.
#pragma once

#include <cstddef>
#include <cstdint>

#include "simd/isa.hpp"

namespace kvsift::simd {

inline constexpr uint32_t kLouverMaxSubspaces = 32;
inline constexpr uint32_t kLouverMaxGroup = 16;

// Which clusters a key's bounds must pass (lib/select/louver_index.hpp: LouverQuery).
enum class LouverGate : uint8_t {
  all = 0,     // every subspace s: ub_s[a_s[i]] >= t_s (Query 1)
  any = 1,     // some subspace s: ub_s[a_s[i]] >= t_s (Query 2, TA: t_s = the stop row's bound)
  summed = 2,  // sum_s ub_s[a_s[i]] >= t_0 (the key's own summed bound)
};

// Candidate filter for one query head: ids of the keys in [0, n) whose gate passes, ascending.
struct LouverFilterJob {
  uint32_t n_subspaces;
  uint32_t n;                                   // keys to filter
  const uint32_t* assign[kLouverMaxSubspaces];  // [n] each
  const float* ub[kLouverMaxSubspaces];         // [n_clusters] each
  float t[kLouverMaxSubspaces];                 // thresholds (summed: t[0] only)
  LouverGate gate;
  uint32_t* out;  // [n] capacity; returns the count written
};

struct LouverKernels {
  Level level;  // the level whose instructions it uses (scalar or avx512)
  // ub[c] = sum_{j < width} q[j] * center_c[j] + q_norm * radius[c] for c < n rounded up to a
  // multiple of 16 (ub and radius have that many entries); q holds the subspace's coordinates.
  void (*ball_bounds)(const float* q, const uint16_t* centers, uint32_t width, const float* radius,
                      float q_norm, uint32_t n, float* ub) noexcept;
  uint32_t (*filter)(const LouverFilterJob& job) noexcept;
  // For each id in ids[0..n): keep it when q_g . key(id) >= tau[g] for some g < group; writes
  // the kept ids to out in the order given and returns their count. head_dim a multiple of 16.
  uint32_t (*check)(const float* q, uint32_t group, const float* tau, const uint16_t* keys,
                    uint32_t head_dim, const uint32_t* ids, uint32_t n, uint32_t* out) noexcept;
  // The brute-force scan: check over ids first .. first + n - 1 (same scores as check).
  uint32_t (*scan)(const float* q, uint32_t group, const float* tau, const uint16_t* keys,
                   uint32_t head_dim, uint32_t first, uint32_t n, uint32_t* out) noexcept;
  // scores[i] = q . key(ids[i]) with check's arithmetic.
  void (*scores)(const float* q, const uint16_t* keys, uint32_t head_dim, const uint32_t* ids,
                 uint32_t n, float* out) noexcept;
};

// The Louver table of a level the CPU has (simd/kernels.cpp): AVX-512's for avx512 and
// avx512_vnni, the scalar one for the others (there is no AVX2 Louver table yet).
const LouverKernels& louver_kernels_for(Level level) noexcept;
const LouverKernels& louver_scalar_kernels() noexcept;

}  // namespace kvsift::simd
