// Louver (docs/methods.md, Louver): an exact halfspace range-search index over the keys of one
// (sequence, layer, KV head). For a query q and threshold tau it returns exactly the token ids
// with q . k >= tau (the sound algorithm: docs/methods.md, Louver: departures from the paper; not
// the authors' centroid-ranked top-256 GPU heuristic, which can miss keys).
//
// Structure. The head_dim coordinates are split into S contiguous subspaces (widths differ by at
// most one, the wider first). In each subspace a balanced binary tree splits the keys in half by
// rank along a direction (the node's principal direction or its highest-variance axis) until
// clusters of r keys remain (the last cluster of a build may hold fewer). Each cluster keeps, per
// subspace, a ball: center = the members' mean rounded to fp16, radius = the largest member
// distance to that rounded center, computed in float64 and rounded up to float32, so the ball
// contains every member and q_s . k_s <= q_s . c + |q_s| rho holds for every member k.
//
// Queries (LouverSearch):
// - all_subspace (Query 1): t_s = tau - sum_{s' != s} max_C UB_s'(C); a key is a candidate when
//   its cluster's bound reaches t_s in every subspace.
// - threshold_algorithm (Query 2, Fagin's TA): per subspace the clusters in descending bound;
//   the stop row L is the first with sum_s UB_s(pi_s(L)) < tau; a key is a candidate when one of
//   its clusters ranks above the stop row in some subspace (bound >= the stop row's bound).
// - summed_key_bound (on by default, on top of either): a key is a candidate only when the sum of
//   its own clusters' bounds reaches tau. This implies Query 1's test and is never looser than
//   Query 2's, and costs S gathers per key; measured in bench_louver.cpp.
// Every candidate and every buffered key is then scored exactly; the result is the ids whose
// score reaches tau. Rounding: bounds are computed in float32, so every pruning comparison is
// made against tau - slack, slack = (2d + 16S + 64) * 2^-24 * |q| * 4 max|k| (a bound on the
// float32 error of a length-d dot product plus S bound sums); the final test is the exact check,
// whose arithmetic is the brute-force scan's (simd/louver_kernels.hpp). The answer therefore
// equals scan() bit for bit.
// The summed-bound filter can also run elsewhere: begin_query() chooses tau and hands out each
// head's gate terms (|q_s| per subspace, t = tau - slack), a filter marks the candidates in a
// bitmask (filter_mask() on the CPU; gpu/louver_filter.hpp on a device, over a copy of the
// centers, radii and assignments), and finish_query() checks them exactly. Any bitmask that
// holds the answer's indexed keys gives the same ids, so the two modes choose the same tokens.
//
// Updates. append() stores a decode key in the buffer (buffer_keys, default 256), which every
// query checks exactly; when the buffer is full its keys are clustered with the same tree and
// added as new clusters; earlier clusters are never refitted.
//
// Threshold oracle (LouverTau). A reservoir sample of sample_keys (default 512) key ids, kept
// uniform over every key appended. Per query the sample is scored exactly and tau is:
// sample_fraction: the ceil(f * M)-th largest sample score (the authors' `budget` mode);
// token_budget: the same with f = budget / n_keys; target_mass: the largest sample score s such
// that the sample keys scoring >= s hold at least the target share of the sample's softmax mass
// exp(scale * score); fixed: the caller's tau.
// GQA (LouverGroupMode): union_of_heads gives each query head its own tau and returns the keys
// that reach it for some head; shared_tau takes one tau from the sample's per-key maximum over
// the heads and returns the keys whose maximum reaches it. shared_tau is the default: on real
// SmolLM2 keys at f = 0.10 (test_louver.cpp, 30 layers x 3 KV heads x 4 decode steps, G = 3) it
// returns 10.3% of the keys and keeps 0.79 of the worst head's softmax mass, against 18.0% and
// 0.86 for the union: 7.7 against 4.8 mass points per percent of keys, and the set size stays
// the budget the caller asked for.
//
// Memory layout (per index): keys fp16 [capacity, d] in token order (an own copy of the cache's
// keys; simd/louver_kernels.hpp has the exact layouts of centers, radii and assignments); per
// subspace: centers fp16 in blocks of 16 clusters, radii float32 [clusters rounded up to 16],
// assignments uint32 [keys]. index_bytes() counts centers, radii, assignments and the sample.
//
// Measured (bench_louver.cpp on structured synthetic keys, d = 128; real SmolLM2-135M keys,
// d = 64, 4,000 tokens, 30 layers x 3 KV heads x 12 real decode queries):
// - index_bytes per key: 2d/r + 4S/r + 4S (+ 4M/n sample ids): 84 B at d = 128, S = 4, r = 4
//   (33% of the fp16 key); 42 B at d = 64, S = 2.
// - Share of keys the bounds keep (checked; pruning = 1 - checked), summed bound, real keys:
//   S = 2 (the d = 64 default): 0.92 at f = 0.10, 0.69 at f = 0.01, 0.64 at the top-20 score;
//   S = 4: 0.85 / 0.52 / 0.47; S = 8: 0.72 / 0.31 / 0.25; S = 16: 0.40 / 0.08 / 0.06.
//   Synthetic d = 128, f = 0.10: S = 4 keeps 0.99+, S = 16 0.71-0.85, S = 32 0.26-0.36.
//   Query 1 alone keeps every key at f = 0.10, Query 2 (TA) 0.9996+ and costs 3-4x a scan
//   (the sorts); the summed bound is the default.
// - PCA split against the highest-variance axis: the PCA tree keeps fewer keys (S = 16, 40K
//   synthetic: 0.85 against 0.89; 128K: 0.71 against 0.77) and builds at about twice the cost,
//   so it is the default.
// Narrow subspaces prune far better, but each key then costs S random gathers into the bounds:
// at f = 0.10 and S = 4 the bounds prune almost nothing, and the scan fallback keeps the query
// within ~1.1-1.3x of the brute-force scan rather than faster.
//
// Thread safety: an index is used by one thread at a time (query() writes its workspace);
// distinct indexes are independent. query() and scan() are noexcept and do not allocate; the
// workspaces are sized by the constructor and by append() when the buffer is flushed.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "lib/core/aligned.hpp"
#include "lib/core/thread_pool.hpp"
#include "simd/louver_kernels.hpp"

namespace kvsift {

class KvCache;

enum class LouverSplit : uint8_t { pca = 0, max_variance_axis = 1 };
enum class LouverSearch : uint8_t { all_subspace = 0, threshold_algorithm = 1 };
enum class LouverTau : uint8_t {
  fixed = 0,
  sample_fraction = 1,
  token_budget = 2,
  target_mass = 3
};
enum class LouverGroupMode : uint8_t { union_of_heads = 0, shared_tau = 1 };

struct LouverParams {
  uint32_t head_dim = 128;     // any multiple of 16 up to 256
  uint32_t n_subspaces = 0;    // S, 1..8; 0: 4 when head_dim >= 128, else 2
  uint32_t cluster_keys = 4;   // r, 2..64
  uint32_t buffer_keys = 256;  // decode keys held before a flush, a multiple of r
  uint32_t sample_keys = 512;  // oracle reservoir M
  LouverSplit split = LouverSplit::pca;
  uint32_t power_iterations = 6;        // per tree node, PCA split only
  uint32_t max_group = 8;               // most query heads per query (workspace sizing), <= 16
  uint64_t seed = 0x6c6f75766572;       // reservoir sampling
  simd::Level isa = simd::Level::best;  // simd::resolve_level: the CPU and the process cap
};

struct LouverQuery {
  LouverSearch search = LouverSearch::all_subspace;
  bool summed_key_bound = true;
  // With summed_key_bound: when the indexed sample keys predict that the bounds keep more than
  // half of the keys, score every key with the streaming scan instead (same answer, and never
  // much slower than the scan; checked then counts every key).
  bool scan_fallback = true;
  LouverTau tau_mode = LouverTau::sample_fraction;
  LouverGroupMode group_mode = LouverGroupMode::shared_tau;
  float fraction = 0.10f;      // sample_fraction, in (0, 1]
  uint64_t budget_tokens = 0;  // token_budget, >= 1
  float target_mass = 0.9f;    // target_mass, in (0, 1]
  float scale = 0.0f;          // target_mass: softmax scale; 0 means 1/sqrt(head_dim)
  const float* tau = nullptr;  // fixed: [group] (shared_tau reads tau[0])
};

// What the summed-bound filter compares for one query head: per subspace |q_s| rounded up (the
// multiplier of the radii), and the threshold t = tau - slack that a key's summed bound must reach.
struct LouverGateTerms {
  float q_norm[simd::kLouverMaxSubspaces];
  float t;
};

// Valid until the next query(), finish_query() or append() on the same index.
struct LouverResult {
  std::span<const uint32_t> token_ids;  // ascending
  std::span<const float> tau;           // [group] thresholds used (all equal under shared_tau)
  uint32_t checked = 0;                 // keys scored exactly for the answer (candidates + buffer)
  uint32_t candidates = 0;              // indexed keys that survived the bounds
  uint64_t bytes_read = 0;              // bounds, assignments, keys scored, sample ids
};

class LouverIndex {
 public:
  // Builds over keys [n, head_dim] float32 (rounded to fp16, the cache's storage; keys read from
  // the cache round-trip exactly). n may be 0. Throws Error (invalid_argument for bad params or a
  // non-finite key, out_of_memory). pool: where the clustering of a large batch of keys runs its
  // subspaces, now and on later appends (borrowed: it must outlive the index); nullptr: the
  // calling thread.
  LouverIndex(const LouverParams& params, const float* keys, uint64_t n,
              ThreadPool* pool = nullptr);
  // Builds over the stored keys of one (sequence, layer, KV head) of the cache (after prefill).
  // Throws what KvCache::read_tokens and the constructor throw.
  static LouverIndex from_cache(const KvCache& cache, int32_t seq_id, uint32_t layer,
                                uint32_t kv_head, LouverParams params, ThreadPool* pool = nullptr);

  // Appends one key [head_dim] (the next token id); flushes the buffer into the index when it is
  // full. Allocates only when a capacity is outgrown (reserve() avoids that). Throws Error.
  void append(const float* key);
  void reserve(uint64_t n_keys);

  // The keys with q_g . k >= tau_g for some head g < group; q [group, head_dim] float32, group in
  // 1..max_group. The query must have been validated with validate(); then this never fails.
  LouverResult query(const float* q, uint32_t group, const LouverQuery& query) noexcept;
  // Throws Error(invalid_argument) when query() would not accept (group, query).
  void validate(uint32_t group, const LouverQuery& query) const;

  // query() in two halves around a filter pass run elsewhere (gpu/louver_filter.hpp runs it on
  // a device over a copy of centers_data, radii_data and assignments_data). begin_query()
  // chooses the thresholds as query() does and writes each head's gate terms (terms[group]).
  // finish_query() takes the indexed keys the filter kept, keep: a bitmask of ceil(indexed() / 32)
  // words, key i at bit i % 32 of word i / 32, where key i is set when for some head g
  // sum_s UB_s(a_s(i)) >= terms[g].t (the summed bound, whatever query.summed_key_bound and
  // query.search say; bits past indexed() are ignored); it scores those keys and the buffered
  // ones exactly. Any keep that contains every indexed key of the answer gives query()'s
  // token_ids: the exact check decides. With query.scan_fallback, when more than half of the
  // indexed keys were kept the streaming scan scores every key instead (the count is exact
  // here, not the sample's prediction query() uses). bytes_read counts the host's reads (the
  // sample, the mask, the keys scored), not the filter's. Same preconditions as query(); no
  // append() in between.
  void begin_query(const float* q, uint32_t group, const LouverQuery& query,
                   LouverGateTerms* terms) noexcept;
  LouverResult finish_query(const float* q, uint32_t group, const LouverQuery& query,
                            const uint32_t* keep) noexcept;
  // The CPU's summed-bound filter pass alone (query()'s, without the sample's scan prediction)
  // for the heads' terms from begin_query(), into finish_query()'s bitmask: the reference the
  // device filter is compared against. keep has ceil(indexed() / 32) words.
  void filter_mask(const float* q, uint32_t group, const LouverGateTerms* terms,
                   uint32_t* keep) noexcept;

  // Brute-force reference with the same score arithmetic: ids with q_g . k >= tau[g] for some g.
  // out has room for size() ids; returns the count.
  uint32_t scan(const float* q, uint32_t group, const float* tau, uint32_t* out) const noexcept;

  uint64_t size() const noexcept { return n_keys_; }
  uint64_t indexed() const noexcept { return n_indexed_; }
  uint32_t buffered() const noexcept { return static_cast<uint32_t>(n_keys_ - n_indexed_); }
  uint32_t n_clusters() const noexcept { return n_clusters_; }
  uint32_t n_subspaces() const noexcept { return S_; }
  uint32_t subspace_offset(uint32_t s) const noexcept { return offset_[s]; }
  uint32_t subspace_width(uint32_t s) const noexcept { return offset_[s + 1] - offset_[s]; }
  const LouverParams& params() const noexcept { return params_; }
  const simd::LouverKernels& kernels() const noexcept { return *kernels_; }
  // Centers, radii, assignments and the sample ids (not the keys, not the workspaces).
  uint64_t index_bytes() const noexcept;
  // For tests: the stored fp16 keys [size(), head_dim], and one cluster's ball and members.
  const uint16_t* keys() const noexcept { return keys_.data(); }
  uint32_t assignment(uint32_t s, uint64_t key) const noexcept { return assign_[s][key]; }
  void center(uint32_t s, uint32_t cluster, float* out) const noexcept;
  float radius(uint32_t s, uint32_t cluster) const noexcept { return radius_[s][cluster]; }
  // Subspace s's arrays in the layouts of simd/louver_kernels.hpp, for a copy elsewhere (a
  // device mirror): centers of n_clusters() clusters (blocked by 16, ceil(n_clusters() / 16)
  // blocks), radii [n_clusters()], assignments [indexed()]. Valid until the next append().
  const uint16_t* centers_data(uint32_t s) const noexcept { return centers_[s].data(); }
  const float* radii_data(uint32_t s) const noexcept { return radius_[s].data(); }
  const uint32_t* assignments_data(uint32_t s) const noexcept { return assign_[s].data(); }

 private:
  void grow(uint64_t key_capacity, uint32_t cluster_capacity);
  void cluster_keys(uint64_t first, uint64_t n);  // keys [first, first + n) into new clusters
  void choose_tau(const float* q, uint32_t group, const LouverQuery& query) noexcept;
  void gate_terms(const float* q, float tau, LouverGateTerms& terms) const noexcept;
  // Every cluster's bound for one head into ub_, and a filter job over them writing to out.
  simd::LouverFilterJob bound_clusters(const float* q, const LouverGateTerms& terms,
                                       uint32_t* out) noexcept;
  // The answer from the streaming scan of every key (the bounds kept too many).
  LouverResult scan_result(const float* q, uint32_t group) noexcept;
  // The answer from the candidates cand_[0, n_cand) among the indexed keys plus the buffer.
  LouverResult check_result(const float* q, uint32_t group, uint32_t n_cand) noexcept;
  // Candidates of head g among the indexed keys into cand_, marking mark_ when merging heads.
  uint32_t gate_head(const float* q, float tau, const LouverQuery& query, uint32_t* out) noexcept;

  LouverParams params_;
  ThreadPool* pool_;
  const simd::LouverKernels* kernels_;
  uint32_t d_, S_, r_;
  uint32_t offset_[simd::kLouverMaxSubspaces + 1] = {};
  uint64_t n_keys_ = 0, n_indexed_ = 0;
  uint32_t n_clusters_ = 0;
  uint64_t key_capacity_ = 0;
  uint32_t cluster_capacity_ = 0;  // a multiple of 16
  float max_key_norm_ = 0.0f;

  AlignedVector<uint16_t> keys_;                  // [key_capacity, d]
  std::vector<AlignedVector<uint16_t>> centers_;  // [S] blocked
  std::vector<AlignedVector<float>> radius_;      // [S][cluster_capacity]
  std::vector<AlignedVector<uint32_t>> assign_;   // [S][key_capacity]
  std::vector<uint32_t> sample_;                  // reservoir ids
  uint64_t rng_state_;

  // Query workspaces.
  std::vector<AlignedVector<float>> ub_;         // [S][cluster_capacity]
  std::vector<std::vector<float>> sorted_;       // [S][cluster_capacity] TA
  AlignedVector<uint32_t> cand_, merged_, out_;  // [key_capacity]
  std::vector<uint8_t> mark_;                    // [key_capacity]
  std::vector<float> sample_scores_;             // [max_group, sample_keys]
  std::vector<float> sample_tmp_;                // [sample_keys]
  std::vector<float> tau_, tau_eff_;             // [max_group]
  uint64_t bytes_read_ = 0;
};

// One decode step's queries over many indexes (every KV head of a layer, say), one index per
// iteration of a loop on `pool`: q[i] is index i's [group, head_dim] query, results[i] its answer.
// The indexes must be distinct and the query validated for each of them.
void louver_query_many(std::span<LouverIndex* const> indexes, const float* const* q, uint32_t group,
                       const LouverQuery& query, LouverResult* results, ThreadPool& pool) noexcept;

}  // namespace kvsift
