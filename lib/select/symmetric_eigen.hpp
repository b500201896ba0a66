// Eigen-decomposition of the small symmetric matrices of LOCKS: the page Gram D D^T
// (docs/methods.md, LOCKS: summary build), 16 x 16 at the default page size and at most 64 x 64.
//
// Eigen's SelfAdjointEigenSolver (Householder tridiagonalisation, implicit symmetric QR) on
// fixed-capacity matrices, so nothing is allocated. A hand-written cyclic Jacobi solver (float64,
// Rutishauser's rotation, relative-threshold skipping) was measured against it on the Zen 5 dev
// box: 38 / 254 / 1907 us at n = 16 / 32 / 64, against Eigen's 12 / 50 / 267 us and LAPACK
// dsyev's 17 / 76 / 512 us; a Jacobi sweep does about twice the flops of tridiagonal QR and,
// in baseline x86-64 code, no faster, so the maintained library is used. Tested against LAPACK's
// dsyev (tests/test_locks.cpp).
#pragma once

#include <cstdint>

namespace kvsift::select {

// Largest matrix order symmetric_eigen takes (the largest page, 64 tokens).
inline constexpr uint32_t kSymmetricEigenMaxOrder = 64;

// Eigen-decomposes the symmetric n x n matrix a (1 <= n <= kSymmetricEigenMaxOrder).
//   a: [n, n] row-major; only its lower triangle is read.
//   eigenvalues: out [n], descending.
//   vectors: out [n, n] row-major, row k the unit eigenvector of eigenvalue k (the rows are
//     orthonormal and a = sum_k eigenvalues[k] vectors[k] vectors[k]^T). Each vector's component
//     of largest magnitude (the first, on ties) is positive, so the output is deterministic.
// Accuracy about 1e-15 * ||a||_F, absolute. No heap allocation (about 70 KB of stack at n = 64);
// reentrant.
void symmetric_eigen(uint32_t n, const double* a, double* eigenvalues, double* vectors) noexcept;

}  // namespace kvsift::select
