#include "lib/select/jacobi.hpp"

#include <cfloat>
#include <cmath>
#include <utility>

namespace kvsift::select {
namespace {

constexpr int kMaxSweeps = 60;
// Threshold sweeps (Rutishauser): the first sweeps skip rotations far below the mean
// off-diagonal size, which only later, cheaper sweeps need; this saved about a quarter of the
// rotations on random 16 x 16 Grams.
constexpr int kThresholdSweeps = 3;

// Rotates rows p and q of x (length n) by the plane rotation (c, s), written with
// tau = s / (1 + c) as in Rutishauser's formulation, which loses less to cancellation.
void rotate_rows(double* __restrict xp, double* __restrict xq, uint32_t n, double s,
                 double tau) noexcept {
  for (uint32_t k = 0; k < n; ++k) {
    const double a = xp[k], b = xq[k];
    xp[k] = a - s * (b + tau * a);
    xq[k] = b + s * (a - tau * b);
  }
}

}  // namespace

void jacobi_eigen(uint32_t n, double* a, double* eigenvalues, double* vectors) noexcept {
  for (uint32_t i = 0; i < n; ++i)
    for (uint32_t j = 0; j < n; ++j) vectors[i * n + j] = i == j ? 1.0 : 0.0;

  for (int sweep = 0; sweep < kMaxSweeps; ++sweep) {
    double off = 0.0;
    for (uint32_t p = 0; p < n; ++p)
      for (uint32_t q = p + 1; q < n; ++q) off += a[p * n + q] * a[p * n + q];
    if (off == 0.0) break;
    const double skip_below =
        sweep < kThresholdSweeps ? 0.2 * std::sqrt(off) / (double(n) * double(n)) : 0.0;
    bool rotated = false;
    for (uint32_t p = 0; p + 1 < n; ++p) {
      for (uint32_t q = p + 1; q < n; ++q) {
        double* row_p = a + p * n;
        double* row_q = a + q * n;
        const double apq = row_p[q], app = row_p[p], aqq = row_q[q];
        const double mag = std::fabs(apq);
        if (mag <= skip_below) continue;
        // Negligible against both diagonal entries: dropping it moves the eigenvalues by a
        // relative DBL_EPSILON at most (the criterion that keeps small eigenvalues of positive
        // semi-definite matrices accurate, Demmel & Veselic 1992).
        if (mag <= DBL_EPSILON * std::sqrt(std::fabs(app)) * std::sqrt(std::fabs(aqq)) ||
            mag < DBL_MIN) {
          row_p[q] = row_q[p] = 0.0;
          continue;
        }
        rotated = true;
        const double theta = (aqq - app) / (2.0 * apq);
        const double t = std::fabs(theta) > 1e150
                             ? 0.5 / theta
                             : std::copysign(1.0, theta) /
                                   (std::fabs(theta) + std::sqrt(theta * theta + 1.0));
        const double c = 1.0 / std::sqrt(t * t + 1.0), s = t * c, tau = s / (1.0 + c);
        // Rows p and q hold columns p and q too (symmetry): rotate the rows, fix the 2 x 2
        // block, then mirror the two rows into the two columns.
        rotate_rows(row_p, row_q, n, s, tau);
        row_p[p] = app - t * apq;
        row_q[q] = aqq + t * apq;
        row_p[q] = row_q[p] = 0.0;
        for (uint32_t k = 0; k < n; ++k) {
          a[k * n + p] = row_p[k];
          a[k * n + q] = row_q[k];
        }
        rotate_rows(vectors + p * n, vectors + q * n, n, s, tau);
      }
    }
    if (!rotated && sweep >= kThresholdSweeps) break;
  }

  for (uint32_t i = 0; i < n; ++i) eigenvalues[i] = a[i * n + i];
  // Selection sort, descending, moving the vector rows along (n <= 64: n^2 compares is nothing
  // beside the sweeps).
  for (uint32_t i = 0; i + 1 < n; ++i) {
    uint32_t best = i;
    for (uint32_t j = i + 1; j < n; ++j)
      if (eigenvalues[j] > eigenvalues[best]) best = j;
    if (best == i) continue;
    std::swap(eigenvalues[i], eigenvalues[best]);
    for (uint32_t k = 0; k < n; ++k) std::swap(vectors[i * n + k], vectors[best * n + k]);
  }
  for (uint32_t i = 0; i < n; ++i) {
    double* v = vectors + i * n;
    uint32_t largest = 0;
    for (uint32_t k = 1; k < n; ++k)
      if (std::fabs(v[k]) > std::fabs(v[largest])) largest = k;
    if (v[largest] < 0.0)
      for (uint32_t k = 0; k < n; ++k) v[k] = -v[k];
  }
}

}  // namespace kvsift::select
