// A small symmetric eigensolver: cyclic Jacobi in float64 for the page Gram matrices of LOCKS
// (papers.md 2(b) step 3), 16 x 16 at the default page size and at most 64 x 64.
//
// Hand-written rather than LAPACK because it is called once per (page, KV head) from the hot
// seal path, with no allocation, on matrices small enough that LAPACK's call and workspace
// overhead dominate; it is tested against LAPACK's dsyev (tests/test_locks.cpp).
#pragma once

#include <cstdint>

namespace kvsift::select {

// Largest matrix order jacobi_eigen takes (the largest page, 64 tokens).
inline constexpr uint32_t kJacobiMaxOrder = 64;

// Eigen-decomposes the symmetric n x n matrix a (1 <= n <= kJacobiMaxOrder).
//   a: [n, n] row-major, both triangles filled and equal; destroyed (left near-diagonal).
//   eigenvalues: out [n], descending.
//   vectors: out [n, n] row-major, row k the unit eigenvector of eigenvalue k (so the rows are
//     orthonormal and a = sum_k eigenvalues[k] vectors[k] vectors[k]^T). Each vector's component
//     of largest magnitude (the first, on ties) is positive, so the output is deterministic.
// Accuracy: eigenvalues to about 1e-15 * ||a||_F absolute (relative for well-conditioned
// positive definite a). Stops after a sweep that rotates nothing, or after 60 sweeps. No
// allocation (the caller owns every array); reentrant.
void jacobi_eigen(uint32_t n, double* a, double* eigenvalues, double* vectors) noexcept;

}  // namespace kvsift::select
