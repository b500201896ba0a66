// The dense float32 product of the kernel table (simd/kernels.hpp: GemmJob, gemm_f32), written once
// over a vector type and instantiated per level: simd/attend_scalar.cpp (OneLane, below),
// simd/x86/gemm_avx2.cpp and simd/x86/gemm_avx512.cpp (xsimd batches).
//
// Why not Eigen compiled per level: Eigen's product templates are named by the scalar type alone,
// not by the instruction set, so an AVX-512 translation unit defines weak symbols
// (general_matrix_vector_product<long, float, ...>::run, queryCacheSizes, ...) with the same names
// as the baseline copies lib/select/symmetric_eigen.cpp uses, and the linker may keep the AVX-512
// copy for every caller (tests/check_isa_symbols.cmake refuses such objects). Here every name has
// internal linkage and the only templates over outside types are xsimd's, named by their arch.
//
// Method (the GotoBLAS/BLIS structure, reduced to what S4R's shapes need): B is packed one panel
// at a time, kKc rows of k by kNr columns of n, into a stack buffer that stays in L1 while every
// row of A passes over it; the micro-kernel holds an MR x kNr tile of C in registers and, for each
// k, broadcasts MR values of A against NV vectors of the panel. A is read in place (each tile
// streams MR rows of it; MR broadcast loads per MR * NV multiply-adds need little bandwidth, so
// A needs no packing), and C is loaded and stored once per panel of k. The last panel of n runs
// only the vectors it needs and the last rows of m a tile of fewer rows, so odd sizes waste no
// multiply-adds beyond the last vector's padding.
#pragma once

#include <cstddef>
#include <cstring>

#include "simd/kernels.hpp"

namespace kvsift::simd {
namespace {

// A "vector" of one float, for the scalar level: the same blocking in plain float32 (a * b + c,
// rounded twice: baseline x86-64 has no fused multiply-add).
struct OneLane {
  static constexpr std::size_t size = 1;
  float value;
  static OneLane broadcast(float x) noexcept { return {x}; }
  static OneLane load_aligned(const float* p) noexcept { return {*p}; }
  static OneLane load_unaligned(const float* p) noexcept { return {*p}; }
  void store_unaligned(float* p) const noexcept { *p = value; }
};
inline OneLane fma(OneLane a, OneLane b, OneLane c) noexcept { return {a.value * b.value + c.value}; }

// Vec: xsimd::batch<float, Arch> or OneLane. MR x NV vectors of accumulators plus NV of B and one
// broadcast must fit the level's registers.
template <class Vec, std::size_t MR, std::size_t NV>
struct GemmBody {
  static constexpr std::size_t W = Vec::size;
  static constexpr std::size_t kNr = NV * W;  // columns of C per tile and per packed panel
  // The packed panel fills at most this much of L1 (Zen 4/5 and recent Intel: 48 KB), leaving
  // room for the tile's rows of A and C.
  static constexpr std::size_t kPanelBytes = 32 * 1024;
  static constexpr std::size_t kKc = kPanelBytes / (kNr * sizeof(float));  // depth of a panel
  static_assert(kKc >= 16, "a panel shallower than this reloads C too often");

  static std::size_t smaller(std::size_t a, std::size_t b) noexcept { return a < b ? a : b; }

  // What one micro-kernel call works on.
  struct Tile {
    const GemmJob* job;
    const float* panel;  // [kc, kNr], zero in the columns past n
    std::size_t i, k0, kc, j0, cols;  // first row, first k, depth, first column, columns < kNr
    bool first;                       // k0 == 0: C starts at zero instead of being loaded
  };

  // panel[kk * kNr + jj] = B(k0 + kk, j0 + jj), zero where j0 + jj >= n.
  static void pack(const GemmJob& job, std::size_t k0, std::size_t kc, std::size_t j0,
                   std::size_t cols, float* panel) noexcept {
    if (cols < kNr) std::memset(panel, 0, kc * kNr * sizeof(float));
    if (job.b_layout == GemmB::k_by_n) {
      for (std::size_t kk = 0; kk < kc; ++kk)
        std::memcpy(panel + kk * kNr, job.b + (k0 + kk) * job.ldb + j0, cols * sizeof(float));
    } else {
      for (std::size_t jj = 0; jj < cols; ++jj) {
        const float* column = job.b + (j0 + jj) * job.ldb + k0;
        for (std::size_t kk = 0; kk < kc; ++kk) panel[kk * kNr + jj] = column[kk];
      }
    }
  }

  // Vector v of a tile row: all W columns valid, some, or none.
  static std::size_t valid(std::size_t cols, std::size_t v) noexcept {
    return cols > v * W ? smaller(W, cols - v * W) : 0;
  }

  // Rows [i, i + ROWS) and the first NVEC vectors of the tile's columns.
  template <std::size_t ROWS, std::size_t NVEC>
  static void tile(const Tile& t) noexcept {
    const GemmJob& job = *t.job;
    Vec acc[ROWS][NVEC];
    float* c = job.c + t.i * job.ldc + t.j0;
    for (std::size_t r = 0; r < ROWS; ++r)
      for (std::size_t v = 0; v < NVEC; ++v) {
        const std::size_t n = valid(t.cols, v);
        if (t.first || n == 0) {
          acc[r][v] = Vec::broadcast(0.0f);
        } else if (n == W) {
          acc[r][v] = Vec::load_unaligned(c + r * job.ldc + v * W);
        } else {
          alignas(64) float part[W] = {};
          std::memcpy(part, c + r * job.ldc + v * W, n * sizeof(float));
          acc[r][v] = Vec::load_aligned(part);
        }
      }
    const float* a = job.a + t.i * job.lda + t.k0;
    for (std::size_t kk = 0; kk < t.kc; ++kk) {
      Vec b[NVEC];
      for (std::size_t v = 0; v < NVEC; ++v) b[v] = Vec::load_aligned(t.panel + kk * kNr + v * W);
      for (std::size_t r = 0; r < ROWS; ++r) {
        const Vec x = Vec::broadcast(a[r * job.lda + kk]);
        for (std::size_t v = 0; v < NVEC; ++v) acc[r][v] = fma(x, b[v], acc[r][v]);
      }
    }
    for (std::size_t r = 0; r < ROWS; ++r)
      for (std::size_t v = 0; v < NVEC; ++v) {
        const std::size_t n = valid(t.cols, v);
        if (n == W) {
          acc[r][v].store_unaligned(c + r * job.ldc + v * W);
        } else if (n > 0) {
          alignas(64) float part[W];
          acc[r][v].store_unaligned(part);
          std::memcpy(c + r * job.ldc + v * W, part, n * sizeof(float));
        }
      }
  }

  // tile<rows, nvec> for rows in 1..MR and nvec in 1..NV, chosen at compile time down the chain.
  template <std::size_t ROWS, std::size_t NVEC = NV>
  static void tile_vectors(std::size_t nvec, const Tile& t) noexcept {
    if constexpr (NVEC > 1) {
      if (nvec < NVEC) return tile_vectors<ROWS, NVEC - 1>(nvec, t);
    }
    tile<ROWS, NVEC>(t);
  }
  template <std::size_t ROWS = MR>
  static void tile_rows(std::size_t rows, std::size_t nvec, const Tile& t) noexcept {
    if constexpr (ROWS > 1) {
      if (rows < ROWS) return tile_rows<ROWS - 1>(rows, nvec, t);
    }
    tile_vectors<ROWS>(nvec, t);
  }

  static void gemm_f32(const GemmJob& job) noexcept {
    if (job.m == 0 || job.n == 0) return;
    if (job.k == 0) {
      for (std::size_t i = 0; i < job.m; ++i)
        std::memset(job.c + i * job.ldc, 0, job.n * sizeof(float));
      return;
    }
    alignas(64) float panel[kKc * kNr];
    for (std::size_t k0 = 0; k0 < job.k; k0 += kKc) {
      const std::size_t kc = smaller(kKc, job.k - k0);
      for (std::size_t j0 = 0; j0 < job.n; j0 += kNr) {
        const std::size_t cols = smaller(kNr, job.n - j0);
        pack(job, k0, kc, j0, cols, panel);
        const Tile base{&job, panel, 0, k0, kc, j0, cols, k0 == 0};
        const std::size_t nvec = (cols + W - 1) / W;
        for (std::size_t i = 0; i < job.m; i += MR) {
          Tile t = base;
          t.i = i;
          tile_rows(smaller(MR, job.m - i), nvec, t);
        }
      }
    }
  }
};

}  // namespace
}  // namespace kvsift::simd
