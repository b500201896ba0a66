#include "lib/select/louver_index.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <numeric>

#include "lib/cache/kv_cache.hpp"
#include "lib/core/error.hpp"
#include "simd/half.hpp"

namespace kvsift {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
// gate_head's answer when the bounds would keep so many keys that query() scans them all.
constexpr uint32_t kAllKeys = UINT32_MAX;
// Above this predicted share of keys kept, the streaming scan is cheaper than the gated check
// (bench_louver.cpp: the indirect check of all keys costs about 1.6x the scan; bounds and
// filter another 0.3x).
constexpr double kScanShare = 0.5;

uint64_t splitmix64(uint64_t& state) noexcept {
  uint64_t z = (state += 0x9e3779b97f4a7c15);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9;
  z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
  return z ^ (z >> 31);
}

// float(x) rounded towards +inf: the stored radius must not undercut the float64 one.
float round_up(double x) noexcept {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) f = std::nextafter(f, kInf);
  return f;
}

uint32_t round16(uint64_t n) {
  return static_cast<uint32_t>((n + 15) / 16 * 16);
}

// The k-th largest (1-based) of v[0..n), reordering v.
float kth_largest(float* v, uint32_t n, uint32_t k) noexcept {
  std::nth_element(v, v + (k - 1), v + n, std::greater<float>());
  return v[k - 1];
}

// Balanced tree over the points of one subspace (x: [n, w]): splits the node holding leaves
// [a, b) at the rank of the left half's capacity along the node's split direction. The rows are
// kept physically in node order (xs), so each level streams contiguous floats; the direction of
// a large node comes from a strided subsample of kDirectionSample rows (the ranks are still
// taken over every row, so only pruning power, never soundness, depends on it). Measured in
// bench_louver.cpp: the id-indirect float64 version built at 18 us/key at 40K keys.
struct TreeBuilder {
  static constexpr uint32_t kDirectionSample = 256;
  TreeBuilder(const float* x_, uint32_t w_, uint32_t r_, uint32_t n_, LouverSplit split_,
              uint32_t iterations_)
      : x(x_), w(w_), r(r_), n(n_), split(split_), iterations(iterations_) {}
  const float* x;
  uint32_t w, r, n;
  LouverSplit split;
  uint32_t iterations;
  std::vector<uint32_t> perm;  // out: ids in leaf order
  std::vector<float> xs, tmp, proj, mean, dir, next;
  std::vector<uint32_t> order;

  void direction(uint32_t lo, uint32_t hi) {
    const uint32_t stride = std::max(1u, (hi - lo) / kDirectionSample);
    uint32_t m = 0;
    std::fill(mean.begin(), mean.end(), 0.0f);
    for (uint32_t i = lo; i < hi; i += stride, ++m)
      for (uint32_t j = 0; j < w; ++j) mean[j] += xs[std::size_t{i} * w + j];
    for (float& v : mean) v /= float(m);
    std::fill(next.begin(), next.end(), 0.0f);  // per-axis variance
    for (uint32_t i = lo; i < hi; i += stride)
      for (uint32_t j = 0; j < w; ++j) {
        const float e = xs[std::size_t{i} * w + j] - mean[j];
        next[j] += e * e;
      }
    const uint32_t axis = uint32_t(std::max_element(next.begin(), next.end()) - next.begin());
    std::fill(dir.begin(), dir.end(), 0.0f);
    dir[axis] = 1.0f;
    // Power iteration from the highest-variance axis (6 iterations in the authors' reference
    // tree: docs/methods.md, Louver: the index), on the centered points directly: 2mw per step, no
    // w x w Gram.
    for (uint32_t it = 0; split == LouverSplit::pca && it < iterations; ++it) {
      std::fill(next.begin(), next.end(), 0.0f);
      for (uint32_t i = lo; i < hi; i += stride) {
        const float* p = xs.data() + std::size_t{i} * w;
        float t = 0.0f;
        for (uint32_t j = 0; j < w; ++j) t += (p[j] - mean[j]) * dir[j];
        for (uint32_t j = 0; j < w; ++j) next[j] += t * (p[j] - mean[j]);
      }
      float norm = 0.0f;
      for (float v : next) norm += v * v;
      if (!(norm > 0.0f) || !std::isfinite(norm)) break;
      norm = std::sqrt(norm);
      for (uint32_t j = 0; j < w; ++j) dir[j] = next[j] / norm;
    }
  }

  void build() {
    perm.resize(n);
    xs.assign(x, x + std::size_t{n} * w);
    tmp.resize(std::size_t{n} * w);
    proj.resize(n);
    order.resize(n);
    mean.resize(w);
    dir.resize(w);
    next.resize(w);
    std::iota(perm.begin(), perm.end(), 0u);
    const uint32_t leaves = (n + r - 1) / r;
    std::vector<std::pair<uint32_t, uint32_t>> stack{{0u, leaves}};
    while (!stack.empty()) {
      const auto [a, b] = stack.back();
      stack.pop_back();
      if (b - a < 2) continue;
      const uint32_t m = (a + b) / 2;
      const uint32_t lo = a * r, mid = m * r, hi = std::min(b * r, n);
      direction(lo, hi);
      for (uint32_t i = lo; i < hi; ++i) {
        const float* p = xs.data() + std::size_t{i} * w;
        float t = 0.0f;
        for (uint32_t j = 0; j < w; ++j) t += p[j] * dir[j];
        proj[i] = t;
        order[i] = i;
      }
      std::nth_element(order.begin() + lo, order.begin() + mid, order.begin() + hi,
                       [&](uint32_t i, uint32_t j) { return proj[i] < proj[j]; });
      for (uint32_t i = lo; i < hi; ++i) {
        std::copy_n(xs.data() + std::size_t{order[i]} * w, w, tmp.data() + std::size_t{i} * w);
        proj[i] = std::bit_cast<float>(perm[order[i]]);  // proj is free again: park the ids
      }
      std::copy(tmp.begin() + std::size_t{lo} * w, tmp.begin() + std::size_t{hi} * w,
                xs.begin() + std::size_t{lo} * w);
      for (uint32_t i = lo; i < hi; ++i) perm[i] = std::bit_cast<uint32_t>(proj[i]);
      stack.push_back({a, m});
      stack.push_back({m, b});
    }
  }
};

}  // namespace

LouverIndex::LouverIndex(const LouverParams& params, const float* keys, uint64_t n,
                         ThreadPool* pool)
    : params_(params), pool_(pool), rng_state_(params.seed) {
  d_ = params.head_dim;
  if (d_ < 16 || d_ > 256 || d_ % 16 != 0)
    fail(Status::invalid_argument, "head_dim=", d_, " is not a multiple of 16 in 16..256");
  S_ = params.n_subspaces != 0 ? params.n_subspaces : (d_ >= 128 ? 4 : 2);
  if (S_ > simd::kLouverMaxSubspaces || S_ > d_)
    fail(Status::invalid_argument, "n_subspaces=", S_, " is not in 1..32");
  params_.n_subspaces = S_;
  r_ = params.cluster_keys;
  if (r_ < 2 || r_ > 64) fail(Status::invalid_argument, "cluster_keys=", r_, " is not in 2..64");
  if (params.buffer_keys < r_ || params.buffer_keys % r_ != 0)
    fail(Status::invalid_argument, "buffer_keys=", params.buffer_keys,
         " is not a positive multiple of cluster_keys");
  if (params.sample_keys == 0) fail(Status::invalid_argument, "sample_keys=0");
  if (params.max_group == 0 || params.max_group > simd::kLouverMaxGroup)
    fail(Status::invalid_argument, "max_group=", params.max_group, " is not in 1..16");
  if (n > UINT32_MAX / 2) fail(Status::invalid_argument, "n=", n, " keys exceed the id range");
  kernels_ = &simd::louver_kernels_for(simd::resolve_level(params.isa));
  // Contiguous near-equal subspaces, the wider first (docs/methods.md, Louver: the index).
  for (uint32_t s = 0; s < S_; ++s) offset_[s + 1] = offset_[s] + d_ / S_ + (s < d_ % S_);
  centers_.resize(S_);
  radius_.resize(S_);
  assign_.resize(S_);
  ub_.resize(S_);
  sorted_.resize(S_);
  sample_.reserve(params.sample_keys);
  sample_scores_.resize(std::size_t{params.max_group} * params.sample_keys);
  sample_tmp_.resize(params.sample_keys);
  tau_.resize(params.max_group);
  tau_eff_.resize(params.max_group);

  grow(n + params.buffer_keys, round16((n + r_ - 1) / r_ + params.buffer_keys / r_));
  for (uint64_t i = 0; i < n; ++i) {
    const float* k = keys + i * d_;
    uint16_t* dst = keys_.data() + i * d_;
    double norm = 0.0;
    for (uint32_t j = 0; j < d_; ++j) {
      if (!std::isfinite(k[j])) fail(Status::invalid_argument, "key ", i, " is not finite");
      dst[j] = simd::f32_to_f16(k[j]);
      const double v = simd::f16_to_f32(dst[j]);
      norm += v * v;
    }
    max_key_norm_ = std::max(max_key_norm_, round_up(std::sqrt(norm)));
    if (!std::isfinite(max_key_norm_)) fail(Status::invalid_argument, "key ", i, " overflows fp16");
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (sample_.size() < params.sample_keys) {
      sample_.push_back(static_cast<uint32_t>(i));
    } else {
      const uint64_t j = splitmix64(rng_state_) % (i + 1);
      if (j < params.sample_keys) sample_[j] = static_cast<uint32_t>(i);
    }
  }
  n_keys_ = n;
  cluster_keys(0, n);
  n_indexed_ = n;
}

LouverIndex LouverIndex::from_cache(const KvCache& cache, int32_t seq_id, uint32_t layer,
                                    uint32_t kv_head, LouverParams params, ThreadPool* pool) {
  params.head_dim = cache.geometry().head_dim;
  const uint64_t n = cache.length(seq_id, layer);
  std::vector<float> keys(n * params.head_dim);
  if (n > 0) cache.read_tokens(seq_id, layer, kv_head, 0, n, keys.data(), nullptr);
  return LouverIndex(params, keys.data(), n, pool);
}

void LouverIndex::grow(uint64_t key_capacity, uint32_t cluster_capacity) {
  if (key_capacity > key_capacity_) {
    key_capacity_ = key_capacity;
    keys_.resize(key_capacity * d_);
    for (auto& a : assign_) a.resize(key_capacity);
    cand_.resize(key_capacity);
    merged_.resize(key_capacity);
    out_.resize(key_capacity);
    mark_.resize(key_capacity);
  }
  if (cluster_capacity > cluster_capacity_) {
    cluster_capacity_ = cluster_capacity;
    for (uint32_t s = 0; s < S_; ++s) {
      centers_[s].resize(std::size_t{cluster_capacity} * subspace_width(s));
      radius_[s].resize(cluster_capacity);
      ub_[s].resize(cluster_capacity);
      sorted_[s].resize(cluster_capacity);
    }
  }
}

void LouverIndex::cluster_keys(uint64_t first, uint64_t n) {
  if (n == 0) return;
  const uint32_t base = n_clusters_;
  const uint32_t count = static_cast<uint32_t>((n + r_ - 1) / r_);
  // A subspace's tree allocates: what it throws is rethrown here, once every subspace has ended.
  std::vector<std::exception_ptr> errors(S_);
  auto subspace = [&](uint32_t s) {
    const uint32_t w = subspace_width(s), o = offset_[s];
    std::vector<float> x(n * w);
    for (uint64_t i = 0; i < n; ++i)
      for (uint32_t j = 0; j < w; ++j)
        x[i * w + j] = simd::f16_to_f32(keys_[(first + i) * d_ + o + j]);
    TreeBuilder tree(x.data(), w, r_, static_cast<uint32_t>(n), params_.split,
                     params_.power_iterations);
    tree.build();
    std::vector<double> mean(w);
    std::vector<float> c(w);
    for (uint32_t leaf = 0; leaf < count; ++leaf) {
      const uint32_t lo = leaf * r_, hi = std::min<uint32_t>(lo + r_, static_cast<uint32_t>(n));
      std::fill(mean.begin(), mean.end(), 0.0);
      for (uint32_t i = lo; i < hi; ++i)
        for (uint32_t j = 0; j < w; ++j) mean[j] += x[std::size_t{tree.perm[i]} * w + j];
      const uint32_t cluster = base + leaf;
      uint16_t* block = centers_[s].data() + std::size_t{cluster / 16} * w * 16 + cluster % 16;
      for (uint32_t j = 0; j < w; ++j) {
        block[j * 16] = simd::f32_to_f16(static_cast<float>(mean[j] / (hi - lo)));
        c[j] = simd::f16_to_f32(block[j * 16]);
      }
      // Radius against the rounded center, in float64, then rounded up (and a relative 1e-12
      // over the float64 rounding of the distance itself).
      double rho = 0.0;
      for (uint32_t i = lo; i < hi; ++i) {
        double dist = 0.0;
        for (uint32_t j = 0; j < w; ++j) {
          const double e = double(x[std::size_t{tree.perm[i]} * w + j]) - c[j];
          dist += e * e;
        }
        rho = std::max(rho, std::sqrt(dist));
        assign_[s][first + tree.perm[i]] = cluster;
      }
      radius_[s][cluster] = round_up(rho * (1.0 + 1e-12));
    }
  };
  // Small batches (a buffer flush during decode) are not worth waking threads for.
  parallel_for(n >= 1024 ? pool_ : nullptr, S_, 1,
               [&](uint64_t first, uint64_t last, int) noexcept {
                 for (uint64_t s = first; s < last; ++s) try {
                     subspace(static_cast<uint32_t>(s));
                   } catch (...) {
                     errors[s] = std::current_exception();
                   }
               });
  for (const std::exception_ptr& error : errors)
    if (error) std::rethrow_exception(error);
  n_clusters_ = base + count;
}

void LouverIndex::reserve(uint64_t n_keys) {
  if (n_keys <= key_capacity_) return;
  grow(n_keys + params_.buffer_keys,
       round16((n_keys + params_.buffer_keys + r_ - 1) / r_ + params_.buffer_keys / r_));
}

void LouverIndex::append(const float* key) {
  if (n_keys_ >= UINT32_MAX / 2) fail(Status::capacity_exceeded, "Louver index is full");
  uint16_t tmp[256];
  double norm = 0.0;
  for (uint32_t j = 0; j < d_; ++j) {
    if (!std::isfinite(key[j])) fail(Status::invalid_argument, "key is not finite");
    tmp[j] = simd::f32_to_f16(key[j]);
    const double v = simd::f16_to_f32(tmp[j]);
    norm += v * v;
  }
  const float key_norm = round_up(std::sqrt(norm));
  if (!std::isfinite(key_norm)) fail(Status::invalid_argument, "key overflows fp16");
  const uint32_t flush_clusters = params_.buffer_keys / r_;
  if (n_keys_ == key_capacity_)
    grow(key_capacity_ + std::max<uint64_t>(key_capacity_ / 2, params_.buffer_keys),
         cluster_capacity_);
  if (n_clusters_ + flush_clusters > cluster_capacity_)
    grow(key_capacity_,
         round16(cluster_capacity_ + std::max(cluster_capacity_ / 2, flush_clusters)));
  std::copy(tmp, tmp + d_, keys_.data() + n_keys_ * d_);
  max_key_norm_ = std::max(max_key_norm_, key_norm);
  if (sample_.size() < params_.sample_keys) {
    sample_.push_back(static_cast<uint32_t>(n_keys_));
  } else {
    const uint64_t j = splitmix64(rng_state_) % (n_keys_ + 1);
    if (j < params_.sample_keys) sample_[j] = static_cast<uint32_t>(n_keys_);
  }
  ++n_keys_;
  if (n_keys_ - n_indexed_ == params_.buffer_keys) {
    cluster_keys(n_indexed_, params_.buffer_keys);
    n_indexed_ = n_keys_;
  }
}

void LouverIndex::validate(uint32_t group, const LouverQuery& query) const {
  if (group == 0 || group > params_.max_group)
    fail(Status::invalid_argument, "group=", group, " is not in 1..max_group=", params_.max_group);
  switch (query.tau_mode) {
    case LouverTau::fixed:
      if (query.tau == nullptr) fail(Status::invalid_argument, "tau is null in fixed mode");
      break;
    case LouverTau::sample_fraction:
      if (!(query.fraction > 0.0f && query.fraction <= 1.0f))
        fail(Status::invalid_argument, "fraction=", query.fraction, " is not in (0, 1]");
      break;
    case LouverTau::token_budget:
      if (query.budget_tokens == 0) fail(Status::invalid_argument, "budget_tokens=0");
      break;
    case LouverTau::target_mass:
      if (!(query.target_mass > 0.0f && query.target_mass <= 1.0f))
        fail(Status::invalid_argument, "target_mass=", query.target_mass, " is not in (0, 1]");
      if (!(query.scale >= 0.0f && std::isfinite(query.scale)))
        fail(Status::invalid_argument, "scale=", query.scale);
      break;
    default: fail(Status::invalid_argument, "unknown tau_mode");
  }
}

void LouverIndex::choose_tau(const float* q, uint32_t group, const LouverQuery& query) noexcept {
  const bool shared = query.group_mode == LouverGroupMode::shared_tau;
  if (query.tau_mode == LouverTau::fixed) {
    for (uint32_t g = 0; g < group; ++g) tau_[g] = query.tau[shared ? 0 : g];
    return;
  }
  const uint32_t m = static_cast<uint32_t>(sample_.size());
  if (m == 0) {
    std::fill(tau_.begin(), tau_.begin() + group, kInf);
    return;
  }
  const uint32_t M = params_.sample_keys;
  for (uint32_t g = 0; g < group; ++g)
    kernels_->scores(q + std::size_t{g} * d_, keys_.data(), d_, sample_.data(), m,
                     sample_scores_.data() + std::size_t{g} * M);
  bytes_read_ += uint64_t{m} * (d_ * 2 + 4);
  if (shared)
    for (uint32_t i = 0; i < m; ++i)
      for (uint32_t g = 1; g < group; ++g)
        sample_scores_[i] = std::max(sample_scores_[i], sample_scores_[std::size_t{g} * M + i]);
  const uint32_t heads = shared ? 1 : group;
  for (uint32_t g = 0; g < heads; ++g) {
    float* v = sample_tmp_.data();
    std::copy_n(sample_scores_.data() + std::size_t{g} * M, m, v);
    float tau;
    if (query.tau_mode == LouverTau::target_mass) {
      const float scale = query.scale > 0.0f ? query.scale : 1.0f / std::sqrt(float(d_));
      std::sort(v, v + m, std::greater<float>());
      double total = 0.0;
      for (uint32_t i = 0; i < m; ++i) total += std::exp(double(scale) * (v[i] - v[0]));
      double kept = 0.0;
      uint32_t i = 0;
      for (; i + 1 < m; ++i) {
        kept += std::exp(double(scale) * (v[i] - v[0]));
        if (kept >= query.target_mass * total) break;
      }
      tau = v[i];
    } else {
      const double f = query.tau_mode == LouverTau::sample_fraction
                           ? query.fraction
                           : std::min(1.0, double(query.budget_tokens) / double(n_keys_));
      const uint32_t k = std::clamp<uint32_t>(static_cast<uint32_t>(std::ceil(f * m)), 1u, m);
      tau = kth_largest(v, m, k);
    }
    tau_[g] = tau;
  }
  if (shared) std::fill(tau_.begin() + 1, tau_.begin() + group, tau_[0]);
}

void LouverIndex::gate_terms(const float* q, float tau, LouverGateTerms& terms) const noexcept {
  double q_norm2 = 0.0;
  for (uint32_t s = 0; s < S_; ++s) {
    const float* qs = q + offset_[s];
    double n2 = 0.0;
    for (uint32_t j = 0; j < subspace_width(s); ++j) n2 += double(qs[j]) * qs[j];
    q_norm2 += n2;
    terms.q_norm[s] = round_up(std::sqrt(n2) * (1.0 + 1e-6));
  }
  // The float32 error of a length-d dot product is below d * 2^-24 * |q| |k| in any summation
  // order (so for the device filter's too); the bounds add S terms of at most |q| (|c| + rho)
  // <= |q| 3.01 max|k| each (c is a mean of keys, rho at most twice max|k|); the slack covers
  // both with margin.
  const float slack = static_cast<float>((2.0 * d_ + 16.0 * S_ + 64.0) * 0x1p-24 *
                                         std::sqrt(q_norm2) * 4.0 * max_key_norm_);
  terms.t = tau - slack;
}

simd::LouverFilterJob LouverIndex::bound_clusters(const float* q, const LouverGateTerms& terms,
                                                  uint32_t* out) noexcept {
  simd::LouverFilterJob job{};
  job.n_subspaces = S_;
  job.n = static_cast<uint32_t>(n_indexed_);
  job.out = out;
  for (uint32_t s = 0; s < S_; ++s) {
    kernels_->ball_bounds(q + offset_[s], centers_[s].data(), subspace_width(s), radius_[s].data(),
                          terms.q_norm[s], n_clusters_, ub_[s].data());
    job.assign[s] = assign_[s].data();
    job.ub[s] = ub_[s].data();
  }
  bytes_read_ += uint64_t{n_clusters_} * (2 * d_ + 4 * S_) + n_indexed_ * 4 * S_;
  return job;
}

void LouverIndex::filter_mask(const float* q, uint32_t group, const LouverGateTerms* terms,
                              uint32_t* keep) noexcept {
  std::fill_n(keep, (n_indexed_ + 31) / 32, 0u);
  for (uint32_t g = 0; g < group && n_indexed_ > 0; ++g) {
    simd::LouverFilterJob job = bound_clusters(q + std::size_t{g} * d_, terms[g], merged_.data());
    job.gate = simd::LouverGate::summed;
    job.t[0] = terms[g].t;
    const uint32_t n = kernels_->filter(job);
    for (uint32_t i = 0; i < n; ++i) keep[merged_[i] / 32] |= 1u << (merged_[i] % 32);
  }
}

uint32_t LouverIndex::gate_head(const float* q, float tau, const LouverQuery& query,
                                uint32_t* out) noexcept {
  const uint32_t K = n_clusters_;
  LouverGateTerms terms;
  gate_terms(q, tau, terms);
  simd::LouverFilterJob job = bound_clusters(q, terms, out);
  const float t = terms.t;
  if (query.summed_key_bound) {
    // When the bounds would keep most keys the indirect check costs more than the streaming
    // scan (bench_louver.cpp: at f = 0.10 on structured keys the gate keeps ~99%, and the query
    // took 2x the scan); the sample keys that are already indexed predict the share kept.
    uint32_t seen = 0, kept = 0;
    for (uint32_t id : sample_) {
      if (id >= n_indexed_) continue;
      float sum = 0.0f;
      for (uint32_t s = 0; s < S_; ++s) sum += ub_[s][assign_[s][id]];
      ++seen;
      kept += sum >= t;
    }
    if (query.scan_fallback && seen >= 64 && kept > seen * kScanShare) return kAllKeys;
    job.gate = simd::LouverGate::summed;
    job.t[0] = t;
    return kernels_->filter(job);
  }
  if (query.search == LouverSearch::all_subspace) {
    float max_ub[simd::kLouverMaxSubspaces];
    double total = 0.0;
    for (uint32_t s = 0; s < S_; ++s) {
      max_ub[s] = K ? *std::max_element(ub_[s].begin(), ub_[s].begin() + K) : -kInf;
      total += max_ub[s];
    }
    for (uint32_t s = 0; s < S_; ++s) job.t[s] = static_cast<float>(t - (total - max_ub[s]));
    job.gate = simd::LouverGate::all;
    return kernels_->filter(job);
  }
  // Fagin's TA over the bound-sorted lists: only the rows above the stop row are needed, so the
  // lists are sorted in growing prefixes (nth_element + sort) rather than whole.
  job.gate = simd::LouverGate::any;
  uint32_t L = std::min(K, std::max(64u, K / 16)), done = 0;
  for (uint32_t s = 0; s < S_; ++s) std::copy_n(ub_[s].begin(), K, sorted_[s].begin());
  while (true) {
    for (uint32_t s = 0; s < S_; ++s) {
      float* v = sorted_[s].data();
      if (L < K) std::nth_element(v, v + L, v + K, std::greater<float>());
      std::sort(v, v + L, std::greater<float>());
    }
    for (uint32_t row = done; row < L; ++row) {
      float sum = 0.0f;
      for (uint32_t s = 0; s < S_; ++s) sum += sorted_[s][row];
      if (sum < t) {
        for (uint32_t s = 0; s < S_; ++s) job.t[s] = sorted_[s][row];
        return kernels_->filter(job);
      }
    }
    if (L == K) break;
    done = L;
    L = std::min(K, 2 * L);
  }
  // The lists ran out before the bound sum fell below tau: every indexed key is a candidate.
  std::iota(out, out + n_indexed_, 0u);
  return static_cast<uint32_t>(n_indexed_);
}

LouverResult LouverIndex::query(const float* q, uint32_t group, const LouverQuery& query) noexcept {
  bytes_read_ = 0;
  choose_tau(q, group, query);
  uint32_t n_cand = 0;
  if (n_indexed_ > 0) {
    if (group == 1) {
      n_cand = gate_head(q, tau_[0], query, cand_.data());
    } else {
      for (uint32_t g = 0; g < group && n_cand != kAllKeys; ++g) {
        const uint32_t c = gate_head(q + std::size_t{g} * d_, tau_[g], query, merged_.data());
        if (c == kAllKeys) n_cand = kAllKeys;
        for (uint32_t i = 0; i < c && c != kAllKeys; ++i) mark_[merged_[i]] = 1;
      }
      if (n_cand == kAllKeys) std::fill(mark_.begin(), mark_.begin() + n_indexed_, 0);
    }
    if (n_cand == kAllKeys) return scan_result(q, group);
    if (group > 1) {
      for (uint32_t i = 0; i < n_indexed_; ++i) {
        cand_[n_cand] = i;
        n_cand += mark_[i];
        mark_[i] = 0;
      }
    }
  }
  return check_result(q, group, n_cand);
}

void LouverIndex::begin_query(const float* q, uint32_t group, const LouverQuery& query,
                              LouverGateTerms* terms) noexcept {
  bytes_read_ = 0;
  choose_tau(q, group, query);
  for (uint32_t g = 0; g < group; ++g) gate_terms(q + std::size_t{g} * d_, tau_[g], terms[g]);
}

LouverResult LouverIndex::finish_query(const float* q, uint32_t group, const LouverQuery& query,
                                       const uint32_t* keep) noexcept {
  const uint32_t words = static_cast<uint32_t>((n_indexed_ + 31) / 32);
  bytes_read_ += uint64_t{words} * 4;
  uint32_t n_cand = 0;
  for (uint32_t w = 0; w < words; ++w) n_cand += std::popcount(keep[w]);
  // The last word's bits past indexed() are the filter's to leave unset; do not trust them.
  if (n_indexed_ % 32 != 0)
    n_cand -= std::popcount(keep[words - 1] & ~((1u << (n_indexed_ % 32)) - 1));
  if (query.scan_fallback && n_cand > n_indexed_ * kScanShare) return scan_result(q, group);
  n_cand = 0;
  for (uint32_t w = 0; w < words; ++w)
    for (uint32_t bits = keep[w]; bits != 0; bits &= bits - 1) {
      const uint32_t i = w * 32 + static_cast<uint32_t>(std::countr_zero(bits));
      if (i < n_indexed_) cand_[n_cand++] = i;
    }
  return check_result(q, group, n_cand);
}

LouverResult LouverIndex::scan_result(const float* q, uint32_t group) noexcept {
  LouverResult result;
  const uint32_t n_out = scan(q, group, tau_.data(), out_.data());
  bytes_read_ += n_keys_ * d_ * 2;
  result.token_ids = {out_.data(), n_out};
  result.tau = {tau_.data(), group};
  result.checked = static_cast<uint32_t>(n_keys_);
  result.candidates = static_cast<uint32_t>(n_indexed_);
  result.bytes_read = bytes_read_;
  return result;
}

LouverResult LouverIndex::check_result(const float* q, uint32_t group, uint32_t n_cand) noexcept {
  const uint32_t candidates = n_cand;
  for (uint64_t i = n_indexed_; i < n_keys_; ++i) cand_[n_cand++] = static_cast<uint32_t>(i);
  const uint32_t n_out =
      kernels_->check(q, group, tau_.data(), keys_.data(), d_, cand_.data(), n_cand, out_.data());
  bytes_read_ += uint64_t{n_cand} * (d_ * 2 + 4);
  LouverResult result;
  result.token_ids = {out_.data(), n_out};
  result.tau = {tau_.data(), group};
  result.checked = n_cand;
  result.candidates = candidates;
  result.bytes_read = bytes_read_;
  return result;
}

uint32_t LouverIndex::scan(const float* q, uint32_t group, const float* tau,
                           uint32_t* out) const noexcept {
  return kernels_->scan(q, group, tau, keys_.data(), d_, 0, static_cast<uint32_t>(n_keys_), out);
}

uint64_t LouverIndex::index_bytes() const noexcept {
  return uint64_t{n_clusters_} * (2 * d_ + 4 * S_) + n_keys_ * 4 * S_ + sample_.size() * 4;
}

void louver_query_many(std::span<LouverIndex* const> indexes, const float* const* q, uint32_t group,
                       const LouverQuery& query, LouverResult* results, ThreadPool& pool) noexcept {
  pool.parallel_for(indexes.size(), 1, [&](uint64_t i, uint64_t, int) noexcept {
    results[i] = indexes[i]->query(q[i], group, query);
  });
}

void LouverIndex::center(uint32_t s, uint32_t cluster, float* out) const noexcept {
  const uint32_t w = subspace_width(s);
  const uint16_t* block = centers_[s].data() + std::size_t{cluster / 16} * w * 16 + cluster % 16;
  for (uint32_t j = 0; j < w; ++j) out[j] = simd::f16_to_f32(block[j * 16]);
}

}  // namespace kvsift
