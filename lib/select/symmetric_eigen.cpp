#include "lib/select/symmetric_eigen.hpp"

#include <Eigen/Eigenvalues>
#include <cmath>

namespace kvsift::select {

void symmetric_eigen(uint32_t n, const double* a, double* eigenvalues, double* vectors) noexcept {
  constexpr int kMax = static_cast<int>(kSymmetricEigenMaxOrder);
  // Fixed capacity: storage and every workspace of the solver live in the objects themselves.
  using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor, kMax, kMax>;
  const int size = static_cast<int>(n);
  Matrix m(size, size);
  for (int i = 0; i < size; ++i)
    for (int j = 0; j <= i; ++j) m(i, j) = a[i * size + j];
  Eigen::SelfAdjointEigenSolver<Matrix> solver(m, Eigen::ComputeEigenvectors);
  // Eigen sorts ascending; the selector wants the largest first.
  for (int k = 0; k < size; ++k) {
    const int from = size - 1 - k;
    eigenvalues[k] = solver.eigenvalues()(from);
    double* v = vectors + k * size;
    int largest = 0;
    for (int i = 0; i < size; ++i) {
      v[i] = solver.eigenvectors()(i, from);
      if (std::fabs(v[i]) > std::fabs(v[largest])) largest = i;
    }
    if (v[largest] < 0.0)
      for (int i = 0; i < size; ++i) v[i] = -v[i];
  }
}

}  // namespace kvsift::select
