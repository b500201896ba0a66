// GPU sparse paged decode attention (gpu/sparse_attention.hpp) against the float64 CPU reference
// on the same stored fp16/bf16 values: batches, GQA groups, head sizes, page sizes, both list
// forms, partial and empty lists, split and unsplit plans, both inner loops (FMA and tensor
// cores), and the argument checks. Every output buffer is poisoned with NaN first, and pool memory
// no list may read (the open page's rows past the sequence, spare slots) holds NaN too, so a
// missed write or a stray read shows.
//
// The tests skip where the build has no CUDA or no usable device is present (the dev box and CI);
// scripts/gpu_check.sh runs them on the H200.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/host_memory.hpp"
#include "gpu/sparse_attention.hpp"
#include "simd/half.hpp"
#include "simd/page_rows.hpp"
#include "test_util.hpp"
#include "tests/reference_attention.hpp"

#if KVSIFT_TEST_WITH_CUDA
#include <cuda_runtime.h>
#endif

using namespace kvsift;

#if KVSIFT_TEST_WITH_CUDA

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Device allocations of one test, freed at its end. The tests run only where init() found a
// device, so a failing CUDA call here is a test failure, not a skip.
class DeviceMemory {
 public:
  ~DeviceMemory() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <class T>
  T* upload(const std::vector<T>& host) {
    T* p = allocate<T>(std::max<std::size_t>(host.size(), 1));
    if (!host.empty())
      check(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
  }
  // n floats, every one NaN (all-ones bytes are a NaN pattern).
  float* poisoned(std::size_t n) {
    float* p = allocate<float>(n);
    check(cudaMemset(p, 0xff, n * sizeof(float)));
    return p;
  }
  template <class T>
  T* allocate(std::size_t n) {
    void* p = nullptr;
    check(cudaMalloc(&p, n * sizeof(T)));
    blocks_.push_back(p);
    return static_cast<T*>(p);
  }
  static std::vector<float> download(const float* p, std::size_t n) {
    std::vector<float> host(n);
    check(cudaDeviceSynchronize());
    check(cudaMemcpy(host.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost));
    return host;
  }
  static void check(cudaError_t err) { ASSERT_EQ(err, cudaSuccess) << cudaGetErrorString(err); }

 private:
  std::vector<void*> blocks_;
};

enum class Form { pages, tokens };

struct Case {
  uint32_t n_seqs;
  uint32_t group_size;
  uint32_t head_dim;
  uint32_t page_tokens;
  simd::Dtype dtype;
  Form form;
  uint32_t n_kv_heads = 2;
  uint32_t max_context_pages = 40;  // each sequence holds 1..this many pages per KV head
  double keep = 0.5;                // share of pages (or tokens) a pair lists
  float key_growth = 0.0f;          // K of a pair's page i is scaled by 1 + key_growth * i
  uint32_t chunks = 1;              // gpu::AttendTuning::chunks_per_lane
  uint32_t tensor_cores = 0;        // gpu::AttendTuning::tensor_cores
  uint32_t l2_prefetch = 0;         // gpu::AttendTuning::l2_prefetch
  uint32_t bulk_copies = 0;         // gpu::AttendTuning::bulk_copies
  uint32_t warp_tokens = 0;         // gpu::AttendTuning::warp_tokens
};

std::string case_name(const Case& c) {
  std::ostringstream name;
  name << "b" << c.n_seqs << "_g" << c.group_size << "_d" << c.head_dim << "_p" << c.page_tokens
       << (c.dtype == simd::Dtype::f16    ? "_f16"
           : c.dtype == simd::Dtype::bf16 ? "_bf16"
                                          : "_q8")
       << (c.form == Form::pages ? "_pages" : "_tokens") << (c.chunks == 2 ? "_c2" : "")
       << (c.tensor_cores ? "_tc" : "");
  if (c.l2_prefetch != 0) name << "_pf" << c.l2_prefetch;
  if (c.bulk_copies != 0) name << "_bulk" << c.bulk_copies;
  if (c.warp_tokens != 0) name << "_w" << c.warp_tokens;
  return name.str();
}

// A pool of random K/V pages, per (sequence, KV head) a context in randomly placed slots, a
// selection over it in both list forms, and the queries.
struct Problem {
  gpu::AttentionShape shape;
  uint32_t n_seqs = 0;
  uint64_t n_slots = 0;
  simd::PageLayout layout;
  std::vector<std::byte> pool;
  std::vector<float> q;
  // Page form.
  std::vector<uint32_t> page_offsets{0}, slots, last_page_tokens;
  // Token form.
  std::vector<uint32_t> token_offsets{0};
  std::vector<gpu::TokenAddress> tokens;
  // What each pair attends to in the form under test, for the reference.
  std::vector<std::vector<gpu::TokenAddress>> attended;

  uint32_t pairs() const { return n_seqs * shape.n_kv_heads; }
  std::size_t out_elems() const {
    return std::size_t{n_seqs} * shape.n_query_heads() * shape.head_dim;
  }
  // Every value of a slot NaN (q8: NaN scales).
  void poison(uint32_t slot) {
    std::byte* s = layout.slot(pool.data(), slot);
    if (layout.quantized()) {
      std::fill_n(layout.key_scales(s), 2 * layout.page_tokens, kNaN);
    } else {
      const uint16_t nan =
          shape.dtype == simd::Dtype::f16 ? simd::f32_to_f16(kNaN) : simd::f32_to_bf16(kNaN);
      std::fill_n(layout.key(s), 2 * layout.page_elems(), nan);
    }
  }
  // The stored K or V row of a token, as float32.
  std::vector<float> row(gpu::TokenAddress a, bool value) const {
    std::vector<float> out(shape.head_dim);
    simd::load_rows(simd::scalar_kernels(), layout, layout.slot(pool.data(), a.slot),
                    value ? simd::SlotPart::value : simd::SlotPart::key, a.row, 1, out.data());
    return out;
  }
};

// context_pages[pair] pages of which the last holds last_tokens[pair] rows; a pair with
// context_pages 0 lists nothing.
Problem make_problem(const Case& c, uint32_t seed, const std::vector<uint32_t>& context_pages,
                     const std::vector<uint32_t>& last_tokens) {
  Problem p;
  p.shape = gpu::AttentionShape{c.n_kv_heads, c.group_size, c.head_dim, c.page_tokens, c.dtype};
  p.n_seqs = c.n_seqs;
  // One context length and one last-page length per (sequence, KV head) pair.
  if (context_pages.size() != p.pairs() || last_tokens.size() != p.pairs())
    throw std::invalid_argument("make_problem: " + std::to_string(context_pages.size()) + " and " +
                                std::to_string(last_tokens.size()) + " lengths for " +
                                std::to_string(p.pairs()) + " pairs");
  const uint32_t B = c.page_tokens, d = c.head_dim;
  std::mt19937 rng(seed);
  const uint32_t total_pages = std::accumulate(context_pages.begin(), context_pages.end(), 0u);
  p.n_slots = total_pages + 7;  // spare slots, never listed, all NaN
  std::vector<uint32_t> placement(p.n_slots);
  std::iota(placement.begin(), placement.end(), 0u);
  std::shuffle(placement.begin(), placement.end(), rng);

  p.layout = simd::PageLayout{B, d, c.dtype};
  p.pool.assign(p.n_slots * p.layout.slot_bytes(), std::byte{0});
  for (uint32_t s = 0; s < p.n_slots; ++s) p.poison(s);
  const std::vector<float> k_values = test::random_floats(total_pages * B * d, seed + 1, 2.0f);
  const std::vector<float> v_values = test::random_floats(total_pages * B * d, seed + 2);
  p.q = test::random_floats(p.out_elems(), seed + 3);

  std::bernoulli_distribution keep(c.keep);
  uint32_t next_page = 0;
  p.attended.resize(p.pairs());
  for (uint32_t pair = 0; pair < p.pairs(); ++pair) {
    std::vector<gpu::TokenAddress> pair_tokens;
    for (uint32_t page = 0; page < context_pages[pair]; ++page, ++next_page) {
      const uint32_t slot = placement[next_page];
      const bool open = page + 1 == context_pages[pair];
      const uint32_t rows = open ? last_tokens[pair] : B;
      std::byte* bytes = p.layout.slot(p.pool.data(), slot);
      for (uint32_t r = 0; r < rows; ++r) {
        const std::size_t from = (std::size_t{next_page} * B + r) * d;
        std::vector<float> k_row(k_values.begin() + from, k_values.begin() + from + d);
        for (float& x : k_row) x *= 1.0f + c.key_growth * page;
        simd::store_rows(simd::scalar_kernels(), p.layout, bytes, simd::SlotPart::key, r, 1,
                         k_row.data(), d);
        simd::store_rows(simd::scalar_kernels(), p.layout, bytes, simd::SlotPart::value, r, 1,
                         v_values.data() + from, d);
      }
      // A selector always keeps the open page (docs/methods.md, Budget, sinks and window);
      // others at random.
      if (open || keep(rng)) {
        p.slots.push_back(slot);
        if (c.form == Form::pages)
          for (uint32_t r = 0; r < rows; ++r) p.attended[pair].push_back({slot, r});
      }
      for (uint32_t r = 0; r < rows; ++r) pair_tokens.push_back({slot, r});
    }
    p.page_offsets.push_back(static_cast<uint32_t>(p.slots.size()));
    p.last_page_tokens.push_back(context_pages[pair] ? last_tokens[pair] : 0);
    // Token form: a random subset of the context's tokens in random order (Louver's tokens are
    // not sorted by position).
    std::shuffle(pair_tokens.begin(), pair_tokens.end(), rng);
    for (const gpu::TokenAddress& a : pair_tokens)
      if (keep(rng)) {
        p.tokens.push_back(a);
        if (c.form == Form::tokens) p.attended[pair].push_back(a);
      }
    p.token_offsets.push_back(static_cast<uint32_t>(p.tokens.size()));
  }
  return p;
}

Problem make_random_problem(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<uint32_t> pages(1, c.max_context_pages);
  std::uniform_int_distribution<uint32_t> rows(1, c.page_tokens);
  std::vector<uint32_t> context_pages, last_tokens;
  for (uint32_t pair = 0; pair < c.n_seqs * c.n_kv_heads; ++pair) {
    context_pages.push_back(pages(rng));
    last_tokens.push_back(rows(rng));
  }
  return make_problem(c, seed, context_pages, last_tokens);
}

std::vector<double> reference(const Problem& p) {
  const uint32_t G = p.shape.group_size, d = p.shape.head_dim;
  std::vector<double> out(p.out_elems());
  for (uint32_t pair = 0; pair < p.pairs(); ++pair) {
    std::vector<float> k, v;
    for (const gpu::TokenAddress& a : p.attended[pair]) {
      const std::vector<float> k_row = p.row(a, false), v_row = p.row(a, true);
      k.insert(k.end(), k_row.begin(), k_row.end());
      v.insert(v.end(), v_row.begin(), v_row.end());
    }
    reference_attention(p.q.data() + std::size_t{pair} * G * d, k.data(), v.data(),
                        p.attended[pair].size(), G, d, out.data() + std::size_t{pair} * G * d);
  }
  return out;
}

// The device copies of a problem and the calls over them.
struct DeviceProblem {
  DeviceMemory memory;
  gpu::PageAttendCall pages;
  gpu::TokenAttendCall tokens;
  float* out = nullptr;

  explicit DeviceProblem(const Problem& p) {
    gpu::AttendTarget target;
    target.n_seqs = p.n_seqs;
    target.pool = memory.upload(p.pool);
    target.n_slots = p.n_slots;
    target.q = memory.upload(p.q);
    target.out = out = memory.poisoned(p.out_elems());
    pages.target = tokens.target = target;
    pages.host = {p.page_offsets.data(), p.slots.data(), p.last_page_tokens.data()};
    pages.device = {memory.upload(p.page_offsets), memory.upload(p.slots),
                    memory.upload(p.last_page_tokens)};
    tokens.host = {p.token_offsets.data(), p.tokens.data()};
    tokens.device = {memory.upload(p.token_offsets), memory.upload(p.tokens)};
  }
};

#define ASSERT_OK(expr)                             \
  do {                                              \
    const gpu::Result r_ = (expr);                  \
    ASSERT_TRUE(r_.ok) << #expr ": " << r_.message; \
  } while (0)

// The largest relative error any check saw, printed once at the end of the run.
class ErrorSummary : public ::testing::Environment {
 public:
  void record(double error, const std::string& where) {
    ++checks_;
    if (error >= worst_) worst_ = error, worst_where_ = where;
  }
  void TearDown() override {
    if (checks_ > 0)
      std::printf(
          "GPU attention vs float64 reference: %d checks, largest relative error %.3g (%s)\n",
          checks_, worst_, worst_where_.c_str());
  }

 private:
  int checks_ = 0;
  double worst_ = 0.0;
  std::string worst_where_;
};

ErrorSummary* const error_summary =
    static_cast<ErrorSummary*>(::testing::AddGlobalTestEnvironment(new ErrorSummary));

// The bulk copies are sm_90 instructions (gpu/sparse_attention.cu): a device before it refuses
// them, which this checks, and the tests leave those tunings out there.
bool bulk_copies_refused_here(const gpu::AttendTuning& tuning) {
  if (tuning.bulk_copies == 0) return false;
#if KVSIFT_TEST_WITH_CUDA
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
    return false;
  if (major >= 9) return false;
  const gpu::AttentionShape shape{1, 4, 128, 16, simd::Dtype::bf16};
  gpu::SparseDecodeAttention attention;
  const gpu::Result r = attention.init(shape, 1, tuning);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.message.find("compute capability 9.0"), std::string::npos) << r.message;
  return true;
#else
  return false;
#endif
}

// As bulk_copies_refused_here, and the wide tiles (AttendTuning::warp_tokens 16, 32), whose
// stages can exceed what a block may take on smaller parts (99 KiB on sm_89): init() refuses them
// there with a message naming the bytes, which this checks.
bool tuning_refused_here(const gpu::AttendTuning& tuning,
                         const gpu::AttentionShape& shape = {1, 4, 128, 16, simd::Dtype::bf16}) {
  if (tuning.warp_tokens <= 8) return bulk_copies_refused_here(tuning);
#if KVSIFT_TEST_WITH_CUDA
  int n_devices = 0;
  if (!gpu::device_count(&n_devices).ok) return false;  // GpuTest skips
  gpu::SparseDecodeAttention attention;
  const gpu::Result r = attention.init(shape, 1, tuning);
  if (r.ok) return false;
  const bool known = r.message.find("bytes of shared memory a block") != std::string::npos ||
                     r.message.find("compute capability 9.0") != std::string::npos;
  EXPECT_TRUE(known) << r.message;
  return true;
#else
  return false;
#endif
}

// Runs the case's form and checks it against the reference; returns the output.
std::vector<float> run_and_check(const Problem& p, Form form, gpu::SplitPlan* plan = nullptr,
                                 const gpu::AttendTuning& tuning = {}) {
  DeviceProblem dev(p);
  gpu::SparseDecodeAttention attention;
  std::vector<float> out;
  [&] {
    ASSERT_OK(attention.init(p.shape, p.n_seqs, tuning));
    if (form == Form::pages) {
      ASSERT_OK(attention.validate(dev.pages));
      ASSERT_OK(attention.run(dev.pages));
    } else {
      ASSERT_OK(attention.validate(dev.tokens));
      ASSERT_OK(attention.run(dev.tokens));
    }
    out = DeviceMemory::download(dev.out, p.out_elems());
  }();
  if (out.empty()) return out;
  if (plan) *plan = attention.last_plan();
  const std::size_t not_finite =
      std::count_if(out.begin(), out.end(), [](float x) { return !std::isfinite(x); });
  EXPECT_EQ(not_finite, 0u) << "outputs left unwritten (NaN poison) or read from NaN rows";
  const std::vector<double> ref = reference(p);
  const double error = test::relative_error(out.data(), ref.data(), out.size());
  EXPECT_LE(error, 1e-3) << "splits_per_pair=" << attention.last_plan().splits_per_pair;
  error_summary->record(error, ::testing::UnitTest::GetInstance()->current_test_info()->name());
  // Pairs with nothing listed get exact zeros, as on the CPU.
  const std::size_t pair_elems = std::size_t{p.shape.group_size} * p.shape.head_dim;
  for (uint32_t pair = 0; pair < p.pairs(); ++pair) {
    if (!p.attended[pair].empty()) continue;
    for (std::size_t i = 0; i < pair_elems; ++i) {
      EXPECT_EQ(out[pair * pair_elems + i], 0.0f) << "pair " << pair << " lists nothing";
    }
  }
  return out;
}

// Skips where no device can run the kernels.
class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n_devices = 0;
    const gpu::Result r = gpu::device_count(&n_devices);
    if (!r.ok) GTEST_SKIP() << "no usable CUDA device: " << r.message;
  }
};

class GpuAttentionCase : public ::testing::WithParamInterface<Case>, public GpuTest {};

TEST_P(GpuAttentionCase, matches_the_float64_reference) {
  const Case c = GetParam();
  const Problem p = make_random_problem(c, 1000 + c.head_dim + c.page_tokens + c.group_size);
  gpu::AttendTuning tuning;
  tuning.chunks_per_lane = c.chunks;
  tuning.tensor_cores = c.tensor_cores;
  tuning.l2_prefetch = c.l2_prefetch;
  tuning.bulk_copies = c.bulk_copies;
  tuning.warp_tokens = c.warp_tokens;
  if (tuning_refused_here(tuning, p.shape)) GTEST_SKIP() << "this device refuses the tuning";
  run_and_check(p, c.form, nullptr, tuning);
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (uint32_t n_seqs : {1u, 4u})
    for (uint32_t G : {1u, 4u})
      for (uint32_t d : {64u, 128u})
        for (uint32_t B : {16u, 64u})
          for (simd::Dtype dtype : {simd::Dtype::f16, simd::Dtype::bf16, simd::Dtype::q8})
            for (Form form : {Form::pages, Form::tokens})
              cases.push_back(Case{n_seqs, G, d, B, dtype, form});
  // Group blocks: 3 in a block of 4 (one head masked), 8 in one block, 12 in two blocks of 8 that
  // each read the pages; head_dim 256; page_tokens 32.
  cases.push_back(Case{2, 3, 128, 16, simd::Dtype::bf16, Form::pages});
  cases.push_back(Case{2, 8, 128, 32, simd::Dtype::f16, Form::pages});
  cases.push_back(Case{2, 12, 64, 16, simd::Dtype::f16, Form::tokens});
  cases.push_back(Case{3, 4, 256, 16, simd::Dtype::bf16, Form::pages});
  cases.push_back(Case{1, 8, 256, 32, simd::Dtype::f16, Form::tokens});
  cases.push_back(Case{2, 3, 128, 32, simd::Dtype::q8, Form::pages});
  cases.push_back(Case{2, 12, 256, 16, simd::Dtype::q8, Form::tokens});
  // Every shape again with two 16-byte pieces a lane (groups above 4 fall back to one).
  const std::size_t one_piece = cases.size();
  for (std::size_t i = 0; i < one_piece; ++i) {
    cases.push_back(cases[i]);
    cases.back().chunks = 2;
  }
  // Every shape of both again on the tensor cores (q8 keeps the FMA loop).
  const std::size_t fma = cases.size();
  for (std::size_t i = 0; i < fma; ++i) {
    cases.push_back(cases[i]);
    cases.back().tensor_cores = 1;
  }
  // Every 16-bit one-piece shape again on the tensor cores with an L2 prefetch on its copies, and
  // with bulk copies of each kind (3, the tensor-map copies, serve the page form; the token form
  // runs 2 under it).
  for (std::size_t i = 0; i < one_piece; ++i) {
    if (cases[i].dtype == simd::Dtype::q8) continue;
    cases.push_back(cases[i]);
    cases.back().tensor_cores = 1;
    cases.back().l2_prefetch = 256;
  }
  for (uint32_t bulk : {1u, 2u, 3u})
    for (std::size_t i = 0; i < one_piece; ++i) {
      if (cases[i].dtype == simd::Dtype::q8) continue;
      cases.push_back(cases[i]);
      cases.back().tensor_cores = 1;
      cases.back().bulk_copies = bulk;
    }
  // And with wide warp tiles, cp.async and per-warp bulk copies (32-token tiles stop at d = 128).
  for (uint32_t warp_tokens : {16u, 32u})
    for (uint32_t bulk : {0u, 2u})
      for (std::size_t i = 0; i < one_piece; ++i) {
        if (cases[i].dtype == simd::Dtype::q8) continue;
        if (warp_tokens == 32 && cases[i].head_dim == 256) continue;
        cases.push_back(cases[i]);
        cases.back().tensor_cores = 1;
        cases.back().bulk_copies = bulk;
        cases.back().warp_tokens = warp_tokens;
      }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GpuAttentionCase, ::testing::ValuesIn(all_cases()),
                         [](const auto& info) { return case_name(info.param); });

TEST_F(GpuTest, a_long_q8_context_splits_and_merges) {
  gpu::SplitPlan plan;
  const Case c{1, 4, 128, 16, simd::Dtype::q8, Form::pages, 8};
  run_and_check(make_problem(c, 77, std::vector<uint32_t>(8, 400), std::vector<uint32_t>(8, 9)),
                Form::pages, &plan);
  EXPECT_GT(plan.splits_per_pair, 1u);
  // Codes and scales: 2 * 128 + 8 bytes a token, for each of the one head block.
  EXPECT_EQ(plan.kv_bytes, plan.tokens * (2 * 128 + 8));
}

TEST_F(GpuTest, a_long_context_splits_and_merges) {
  // The benchmark's layer shape: 8 KV heads of 1024 pages (16K tokens) each, half of the pages
  // listed, then all of them: many splits per pair either way.
  // Both inner loops, and the tensor-core loop's other copies.
  for (const gpu::AttendTuning& tuning :
       {gpu::AttendTuning{0, 2, 1, 0}, gpu::AttendTuning{0, 2, 1, 1},
        gpu::AttendTuning{0, 2, 1, 1, 128}, gpu::AttendTuning{0, 2, 1, 1, 0, 1},
        gpu::AttendTuning{0, 2, 1, 1, 0, 2}, gpu::AttendTuning{0, 2, 1, 1, 0, 3},
        gpu::AttendTuning{0, 2, 1, 1, 0, 0, 16}, gpu::AttendTuning{0, 2, 1, 1, 0, 0, 32},
        gpu::AttendTuning{0, 2, 1, 1, 0, 2, 16}, gpu::AttendTuning{0, 2, 1, 1, 0, 2, 32}}) {
    if (tuning_refused_here(tuning)) continue;
    SCOPED_TRACE(::testing::Message()
                 << "tensor_cores " << tuning.tensor_cores << ", l2_prefetch " << tuning.l2_prefetch
                 << ", bulk_copies " << tuning.bulk_copies << ", warp_tokens "
                 << tuning.warp_tokens);
    Case c{1, 4, 128, 16, simd::Dtype::bf16, Form::pages, 8};
    const std::vector<uint32_t> pages(8, 1024);
    gpu::SplitPlan plan;
    run_and_check(make_problem(c, 7, pages, std::vector<uint32_t>(8, 9)), Form::pages, &plan,
                  tuning);
    EXPECT_GT(plan.splits_per_pair, 1u);
    c.keep = 1.0;
    run_and_check(make_problem(c, 8, pages, std::vector<uint32_t>(8, 16)), Form::pages, &plan,
                  tuning);
    EXPECT_GT(plan.splits_per_pair, 1u);
  }
}

TEST_F(GpuTest, every_split_tuning_matches_the_float64_reference) {
  // The benchmarks' split tunings and odd ones: one CTA per multiprocessor, several waves, long
  // minimum splits, over pairs of uneven lengths (odd page counts, partial last pages), in both
  // forms. Each must merge to the same attention.
  const std::vector<uint32_t> pages = {301, 7, 1, 517, 64, 0, 129, 255};
  const std::vector<uint32_t> last = {9, 16, 3, 1, 16, 0, 11, 15};
  // Then L2 prefetches and bulk copies on the tensor-core loop under the same split tunings.
  const gpu::AttendTuning tunings[] = {
      {0, 2, 1},           {1, 1, 1},           {2, 2, 1},           {3, 5, 1},
      {8, 2, 1},           {16, 2, 1},          {0, 8, 1},           {64, 1, 1},
      {0, 64, 1},          {0, 2, 2},           {1, 1, 2},           {8, 2, 2},
      {0, 8, 2},           {0, 2, 1, 1},        {1, 1, 1, 1},        {2, 2, 1, 1},
      {3, 5, 1, 1},        {8, 2, 1, 1},        {0, 64, 1, 1},       {0, 2, 2, 1},
      {8, 2, 2, 1},        {0, 2, 1, 1, 128},   {2, 2, 1, 1, 256},   {8, 2, 1, 1, 128},
      {0, 2, 1, 1, 0, 1},  {1, 1, 1, 1, 0, 1},  {2, 2, 1, 1, 0, 1},  {3, 5, 1, 1, 0, 1},
      {8, 2, 1, 1, 0, 1},  {0, 64, 1, 1, 0, 1}, {64, 1, 1, 1, 0, 1}, {0, 2, 1, 1, 0, 2},
      {1, 1, 1, 1, 0, 2},  {2, 2, 1, 1, 0, 2},  {3, 5, 1, 1, 0, 2},  {8, 2, 1, 1, 0, 2},
      {0, 64, 1, 1, 0, 2}, {64, 1, 1, 1, 0, 2}, {0, 2, 1, 1, 0, 3},  {1, 1, 1, 1, 0, 3},
      {2, 2, 1, 1, 0, 3},  {3, 5, 1, 1, 0, 3},  {8, 2, 1, 1, 0, 3},  {0, 64, 1, 1, 0, 3},
      {64, 1, 1, 1, 0, 3}};
  // The wide warp tiles under the same split tunings, cp.async and bulk.
  const gpu::AttendTuning wide_tunings[] = {
      {0, 2, 1, 1, 0, 0, 16},  {1, 1, 1, 1, 0, 0, 16},  {2, 2, 1, 1, 0, 0, 16},
      {3, 5, 1, 1, 0, 0, 16},  {8, 2, 1, 1, 0, 0, 16},  {0, 64, 1, 1, 0, 0, 16},
      {64, 1, 1, 1, 0, 0, 16}, {0, 2, 1, 1, 0, 0, 32},  {1, 1, 1, 1, 0, 0, 32},
      {3, 5, 1, 1, 0, 0, 32},  {8, 2, 1, 1, 0, 0, 32},  {64, 1, 1, 1, 0, 0, 32},
      {0, 2, 1, 1, 0, 2, 16},  {1, 1, 1, 1, 0, 2, 16},  {3, 5, 1, 1, 0, 2, 16},
      {8, 2, 1, 1, 0, 2, 16},  {64, 1, 1, 1, 0, 2, 16}, {0, 2, 1, 1, 0, 2, 32},
      {1, 1, 1, 1, 0, 2, 32},  {8, 2, 1, 1, 0, 2, 32},  {64, 1, 1, 1, 0, 2, 32}};
  std::vector<gpu::AttendTuning> all(std::begin(tunings), std::end(tunings));
  all.insert(all.end(), std::begin(wide_tunings), std::end(wide_tunings));
  uint32_t seed = 90;
  for (Form form : {Form::pages, Form::tokens})
    for (const gpu::AttendTuning& tuning : all) {
      if (tuning_refused_here(tuning)) continue;
      SCOPED_TRACE(::testing::Message()
                   << "ctas_per_sm " << tuning.ctas_per_sm << ", min tiles "
                   << tuning.min_tiles_per_split << ", chunks " << tuning.chunks_per_lane
                   << ", tensor_cores " << tuning.tensor_cores << ", l2_prefetch "
                   << tuning.l2_prefetch << ", bulk_copies " << tuning.bulk_copies
                   << ", warp_tokens " << tuning.warp_tokens);
      const Case c{1, 4, 128, 16, simd::Dtype::bf16, form, 8};
      gpu::SplitPlan plan;
      run_and_check(make_problem(c, ++seed, pages, last), form, &plan, tuning);
      if (tuning.ctas_per_sm != 0) {
        EXPECT_EQ(plan.device_ctas % tuning.ctas_per_sm, 0u);
      }
      if (tuning.ctas_per_sm >= 8 && tuning.min_tiles_per_split <= 2) {
        EXPECT_GT(plan.splits_per_pair, 1u);
      }
    }
}

TEST_F(GpuTest, wide_tiles_cover_every_page_size_open_pages_and_split) {
  // The wide warp tiles address a warp's 16 or 32 rows from one or two slot ids (page form) and
  // leave the rows past a split's list at weight zero: every page size, so that warp tiles start
  // at page starts and inside pages (16 rows of a 32- or 64-row page) and span two 16-row pages
  // (32-token tiles); open last pages of 1, some and all rows; lists shorter than one warp tile
  // and than one CTA tile; and splits many and one, both forms, f16 and bf16, every head_dim.
  // Pair i lists pages[i] pages whose open last one holds last[i] rows (one, a full page, one
  // short of it, a few, half and some): lists from one row (below a warp tile) to 64 pages.
  uint32_t seed = 300;
  for (uint32_t B : {16u, 32u, 64u})
    for (uint32_t d : {64u, 128u, 256u})
      for (uint32_t warp_tokens : {16u, 32u})
        for (uint32_t bulk : {0u, 2u}) {
          if (warp_tokens == 32 && d == 256) continue;
          const std::vector<uint32_t> pages = {1, 1, 2, 3, 37, 5, 64, 9};
          const std::vector<uint32_t> last = {1, B, B - 1, 17 % B + 1, B / 2 + 3, 16, B, 2};
          const simd::Dtype dtype = (B + d) % 3 == 0 ? simd::Dtype::f16 : simd::Dtype::bf16;
          for (Form form : {Form::pages, Form::tokens})
            for (const gpu::AttendTuning& tuning :
                 {gpu::AttendTuning{0, 2, 1, 1, 0, bulk, warp_tokens},
                  gpu::AttendTuning{8, 1, 1, 1, 0, bulk, warp_tokens},
                  gpu::AttendTuning{1, 64, 1, 1, 0, bulk, warp_tokens}}) {
              const Case c{2, 4, d, B, dtype, form, 4, 40, 0.7};
              if (tuning_refused_here(tuning, {c.n_kv_heads, c.group_size, d, B, dtype})) continue;
              SCOPED_TRACE(::testing::Message()
                           << "page_tokens " << B << ", head_dim " << d << ", warp_tokens "
                           << warp_tokens << ", bulk_copies " << bulk << ", ctas_per_sm "
                           << tuning.ctas_per_sm << ", min tiles " << tuning.min_tiles_per_split
                           << (form == Form::pages ? ", pages" : ", tokens"));
              gpu::SplitPlan plan;
              run_and_check(make_problem(c, ++seed, pages, last), form, &plan, tuning);
              EXPECT_EQ(plan.tokens_per_split % (4 * warp_tokens), 0u);
              if (tuning.ctas_per_sm == 8 && form == Form::pages) {
                EXPECT_GT(plan.splits_per_pair, 1u);
              }
              if (tuning.min_tiles_per_split == 64) {
                EXPECT_EQ(plan.splits_per_pair, 1u);
              }
            }
        }
}

TEST_F(GpuTest, logits_that_keep_growing_rescale_the_running_sums) {
  // Keys that grow along the context push the logits' maximum up tile after tile, so the lazy
  // rescaling (a reference max moved only when a logit exceeds it by 2^8) fires again and again.
  for (Form form : {Form::pages, Form::tokens}) {
    Case c{2, 4, 128, 16, simd::Dtype::f16, form, 2, 120, 0.7};
    c.key_growth = 0.08f;
    for (uint32_t chunks : {1u, 2u})
      for (uint32_t tensor_cores : {0u, 1u})
        run_and_check(make_random_problem(c, 51), form, nullptr, {0, 2, chunks, tensor_cores});
    for (uint32_t bulk : {1u, 2u, 3u})
      if (!bulk_copies_refused_here({0, 2, 1, 1, 0, bulk}))
        run_and_check(make_random_problem(c, 51), form, nullptr, {0, 2, 1, 1, 0, bulk});
    for (uint32_t bulk : {0u, 2u})
      for (uint32_t warp_tokens : {16u, 32u})
        if (!tuning_refused_here({0, 2, 1, 1, 0, bulk, warp_tokens}))
          run_and_check(make_random_problem(c, 51), form, nullptr,
                        {0, 2, 1, 1, 0, bulk, warp_tokens});
  }
}

TEST_F(GpuTest, a_short_selection_writes_the_output_without_a_merge) {
  // Two pages of which the last holds one token: below two CTA tiles, so one split per pair.
  const Case c{2, 4, 128, 16, simd::Dtype::f16, Form::pages};
  const Problem p = make_problem(c, 11, {2, 1, 2, 2}, {1, 1, 16, 5});
  for (const gpu::AttendTuning& tuning :
       {gpu::AttendTuning{0, 2, 1, 0}, gpu::AttendTuning{0, 2, 1, 1},
        gpu::AttendTuning{0, 2, 1, 1, 0, 1}, gpu::AttendTuning{0, 2, 1, 1, 0, 2},
        gpu::AttendTuning{0, 2, 1, 1, 0, 3}, gpu::AttendTuning{0, 2, 1, 1, 0, 0, 16},
        gpu::AttendTuning{0, 2, 1, 1, 0, 0, 32}, gpu::AttendTuning{0, 2, 1, 1, 0, 2, 16},
        gpu::AttendTuning{0, 2, 1, 1, 0, 2, 32}}) {
    if (tuning_refused_here(tuning)) continue;
    gpu::SplitPlan plan;
    run_and_check(p, Form::pages, &plan, tuning);
    EXPECT_EQ(plan.splits_per_pair, 1u);
  }
}

TEST_F(GpuTest, pairs_with_nothing_listed_get_zeros) {
  for (Form form : {Form::pages, Form::tokens})
    for (const gpu::AttendTuning& tuning :
         {gpu::AttendTuning{0, 2, 1, 0}, gpu::AttendTuning{0, 2, 1, 1},
          gpu::AttendTuning{0, 2, 1, 1, 0, 1}, gpu::AttendTuning{0, 2, 1, 1, 0, 2},
          gpu::AttendTuning{0, 2, 1, 1, 0, 3}, gpu::AttendTuning{0, 2, 1, 1, 0, 0, 16},
          gpu::AttendTuning{0, 2, 1, 1, 0, 0, 32}, gpu::AttendTuning{0, 2, 1, 1, 0, 2, 16},
          gpu::AttendTuning{0, 2, 1, 1, 0, 2, 32}}) {
      if (tuning_refused_here(tuning)) continue;
      const Case c{2, 4, 64, 16, simd::Dtype::bf16, form, 2, 40, 0.5};
      // Some empty, then all empty.
      run_and_check(make_problem(c, 21, {0, 30, 0, 3}, {0, 4, 0, 16}), form, nullptr, tuning);
      run_and_check(make_problem(c, 22, {0, 0, 0, 0}, {0, 0, 0, 0}), form, nullptr, tuning);
    }
}

TEST_F(GpuTest, repeated_runs_give_identical_bits) {
  // One object, several calls: the split counters the last CTA of each pair resets must be back
  // at zero for the next call, and no merge may depend on the order CTAs finish in.
  const Case c{4, 4, 128, 16, simd::Dtype::bf16, Form::tokens, 8, 200};
  const Problem p = make_random_problem(c, 31);
  for (const gpu::AttendTuning& tuning :
       {gpu::AttendTuning{0, 2, 1, 0}, gpu::AttendTuning{0, 2, 1, 1},
        gpu::AttendTuning{0, 2, 1, 1, 0, 1}, gpu::AttendTuning{0, 2, 1, 1, 0, 2},
        gpu::AttendTuning{0, 2, 1, 1, 0, 3}, gpu::AttendTuning{0, 2, 1, 1, 0, 0, 16},
        gpu::AttendTuning{0, 2, 1, 1, 0, 2, 32}}) {
    if (tuning_refused_here(tuning)) continue;
    SCOPED_TRACE(::testing::Message()
                 << "tensor_cores " << tuning.tensor_cores << ", bulk_copies " << tuning.bulk_copies
                 << ", warp_tokens " << tuning.warp_tokens);
    const std::vector<float> checked = run_and_check(p, Form::tokens, nullptr, tuning);
    DeviceProblem dev(p);
    gpu::SparseDecodeAttention attention;
    ASSERT_OK(attention.init(p.shape, p.n_seqs, tuning));
    ASSERT_OK(attention.validate(dev.tokens));
    for (int call = 0; call < 3; ++call) {
      ASSERT_OK(attention.run(dev.tokens));
      EXPECT_GT(attention.last_plan().splits_per_pair, 1u);
      const std::vector<float> out = DeviceMemory::download(dev.out, p.out_elems());
      ASSERT_EQ(out.size(), checked.size());
      EXPECT_EQ(std::memcmp(out.data(), checked.data(), out.size() * sizeof(float)), 0)
          << "call " << call;
    }
  }
}

TEST_F(GpuTest, tensor_maps_follow_the_pool) {
  // bulk_copies 3 encodes a tensor map per pool (its address and slot count) and keeps the last
  // few: one object over pools that differ in both, called in turn and then again, must read
  // each call's own pool. Partial last pages hold NaN past their rows (Problem::poison), which
  // the map's whole-page boxes bring in and the kernel must weigh zero.
  const gpu::AttendTuning tuning{0, 2, 1, 1, 0, 3};
  if (bulk_copies_refused_here(tuning)) GTEST_SKIP() << "bulk copies need sm_90";
  const Case c{2, 4, 128, 16, simd::Dtype::bf16, Form::pages, 2};
  std::vector<Problem> problems;
  problems.push_back(make_problem(c, 61, {40, 3, 17, 1}, {5, 16, 1, 9}));
  problems.push_back(make_problem(c, 62, {9, 90, 2, 33}, {16, 2, 7, 13}));
  problems.push_back(make_problem(c, 63, {1, 1, 120, 4}, {1, 3, 15, 16}));
  std::vector<std::unique_ptr<DeviceProblem>> devices;
  for (const Problem& p : problems) devices.push_back(std::make_unique<DeviceProblem>(p));
  gpu::SparseDecodeAttention attention;
  ASSERT_OK(attention.init(problems[0].shape, c.n_seqs, tuning));
  for (int round = 0; round < 2; ++round)
    for (std::size_t i = 0; i < problems.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "round " << round << ", pool " << i);
      ASSERT_OK(attention.validate(devices[i]->pages));
      ASSERT_OK(attention.run(devices[i]->pages));
      const std::vector<float> out =
          DeviceMemory::download(devices[i]->out, problems[i].out_elems());
      ASSERT_EQ(out.size(), problems[i].out_elems());
      const std::vector<double> ref = reference(problems[i]);
      EXPECT_LE(test::relative_error(out.data(), ref.data(), out.size()), 1e-3);
    }
}

void expect_invalid(const gpu::Result& r, const std::string& needle) {
  EXPECT_FALSE(r.ok) << "accepted; expected an error mentioning \"" << needle << "\"";
  EXPECT_FALSE(r.unsupported) << r.message;
  EXPECT_NE(r.message.find(needle), std::string::npos) << r.message;
}

// init() checks its arguments before it touches a device, so this runs on CUDA builds anywhere.
TEST(GpuSparseAttention, init_rejects_a_shape_it_has_no_kernel_for) {
  gpu::SparseDecodeAttention attention;
  const gpu::AttentionShape good{8, 4, 128, 16, simd::Dtype::bf16};
  auto with = [&](auto change) {
    gpu::AttentionShape s = good;
    change(s);
    return attention.init(s, 1);
  };
  expect_invalid(with([](auto& s) { s.head_dim = 96; }), "head_dim=96 is not 64, 128 or 256");
  expect_invalid(with([](auto& s) { s.page_tokens = 8; }), "page_tokens=8 is not 16, 32 or 64");
  expect_invalid(with([](auto& s) { s.group_size = 0; }), "group_size=0 is not in 1..64");
  expect_invalid(with([](auto& s) { s.group_size = 65; }), "group_size=65");
  expect_invalid(with([](auto& s) { s.n_kv_heads = 0; }), "n_kv_heads=0");
  expect_invalid(with([](auto& s) { s.dtype = static_cast<simd::Dtype>(7); }), "dtype=7");
  expect_invalid(attention.init(good, 0), "max_batch=0 is not in 1..65536");
  gpu::AttentionShape q8 = good;
  q8.dtype = simd::Dtype::q8;
  gpu::AttentionShape d256 = good;
  d256.head_dim = 256;
  const struct {
    gpu::AttentionShape shape;
    gpu::AttendTuning tuning;
    const char* message;
  } refused[] = {
      {good, {65, 2}, "tuning.ctas_per_sm=65 is not in 0..64"},
      {good, {0, 0}, "tuning.min_tiles_per_split=0 is not in 1..64"},
      {good, {0, 65}, "tuning.min_tiles_per_split=65"},
      {good, {0, 2, 3}, "tuning.chunks_per_lane=3 is not 1 or 2"},
      {good, {0, 2, 1, 2}, "tuning.tensor_cores=2 is not 0 or 1"},
      {good, {0, 2, 1, 1, 64}, "tuning.l2_prefetch=64 is not 0, 128 or 256"},
      {good,
       {0, 2, 1, 0, 128},
       "tuning.l2_prefetch=128 is instantiated for the tensor-core loop only"},
      {good,
       {0, 2, 2, 1, 256},
       "tuning.l2_prefetch=256 is instantiated for the tensor-core loop only"},
      {good, {0, 2, 1, 1, 0, 4}, "tuning.bulk_copies=4 is not 0, 1, 2 or 3"},
      {good, {0, 2, 1, 0, 0, 1}, "tuning.bulk_copies=1 needs tensor_cores=1"},
      {good, {0, 2, 2, 1, 0, 2}, "tuning.bulk_copies=2 needs chunks_per_lane=1"},
      {good, {0, 2, 1, 1, 128, 1}, "tuning.l2_prefetch=128 applies to the cp.async copies"},
      {q8, {0, 2, 1, 1, 0, 1}, "tuning.bulk_copies=1 needs f16 or bf16 K/V"},
      {q8, {0, 2, 1, 1, 0, 3}, "tuning.bulk_copies=3 needs f16 or bf16 K/V"},
      {good, {0, 2, 1, 0, 0, 3}, "tuning.bulk_copies=3 needs tensor_cores=1"},
      {good, {0, 2, 2, 1, 0, 3}, "tuning.bulk_copies=3 needs chunks_per_lane=1"},
      {good, {0, 2, 1, 1, 0, 0, 12}, "tuning.warp_tokens=12 is not 0, 8, 16 or 32"},
      {good, {0, 2, 1, 0, 0, 0, 16}, "tuning.warp_tokens=16 needs tensor_cores=1"},
      {good, {0, 2, 2, 1, 0, 0, 32}, "tuning.warp_tokens=32 needs chunks_per_lane=1"},
      {q8, {0, 2, 1, 1, 0, 0, 16}, "tuning.warp_tokens=16 needs f16 or bf16 K/V"},
      {good,
       {0, 2, 1, 1, 128, 0, 16},
       "tuning.warp_tokens=16 is not instantiated with l2_prefetch=128"},
      {good,
       {0, 2, 1, 1, 0, 1, 32},
       "tuning.warp_tokens=32 is instantiated with bulk_copies 0 or 2 only"},
      {d256, {0, 2, 1, 1, 0, 0, 32}, "tuning.warp_tokens=32 is not instantiated for head_dim=256"},
  };
  for (const auto& r : refused) expect_invalid(attention.init(r.shape, 1, r.tuning), r.message);
  gpu::PageAttendCall call;
  expect_invalid(attention.validate(call), "not initialised");
  expect_invalid(attention.run(call), "not initialised");
}

TEST_F(GpuTest, validate_names_the_first_bad_argument) {
  const Case c{2, 4, 64, 16, simd::Dtype::f16, Form::pages};
  Problem p = make_problem(c, 41, {3, 2, 1, 4}, {16, 5, 1, 2});
  DeviceProblem dev(p);
  gpu::SparseDecodeAttention attention;
  ASSERT_OK(attention.init(p.shape, 2));
  ASSERT_OK(attention.validate(dev.pages));
  ASSERT_OK(attention.validate(dev.tokens));

  auto pages_with = [&](auto change) {
    gpu::PageAttendCall call = dev.pages;
    change(call);
    return attention.validate(call);
  };
  expect_invalid(pages_with([](auto& k) { k.target.n_seqs = 0; }), "n_seqs=0 is not in 1..2");
  expect_invalid(pages_with([](auto& k) { k.target.n_seqs = 3; }), "n_seqs=3 is not in 1..2");
  expect_invalid(pages_with([](auto& k) { k.target.q = nullptr; }), "q is NULL");
  expect_invalid(pages_with([](auto& k) { k.target.out = nullptr; }), "out is NULL");
  expect_invalid(pages_with([](auto& k) { k.target.pool = nullptr; }), "pool is NULL");
  expect_invalid(
      pages_with([](auto& k) { k.target.pool = static_cast<const char*>(k.target.pool) + 2; }),
      "pool is not 16-byte aligned");
  expect_invalid(pages_with([](auto& k) { k.target.out = const_cast<float*>(k.target.q) + 4; }),
                 "out overlaps q");
  expect_invalid(pages_with([](auto& k) { k.host.offsets = nullptr; }), "host.offsets is NULL");
  expect_invalid(pages_with([](auto& k) { k.device.slots = nullptr; }), "device.slots is NULL");

  std::vector<uint32_t> offsets = p.page_offsets;
  offsets[0] = 1;
  expect_invalid(pages_with([&](auto& k) { k.host.offsets = offsets.data(); }),
                 "host.offsets[0]=1 is not 0");
  offsets = p.page_offsets;
  std::swap(offsets[1], offsets[2]);
  expect_invalid(pages_with([&](auto& k) { k.host.offsets = offsets.data(); }),
                 "host.offsets decreases at 2");
  std::vector<uint32_t> slots = p.slots;
  slots[2] = static_cast<uint32_t>(p.n_slots);
  expect_invalid(pages_with([&](auto& k) { k.host.slots = slots.data(); }),
                 "host.slots[2]=" + std::to_string(p.n_slots) + " is out of range");
  std::vector<uint32_t> last = p.last_page_tokens;
  last[1] = 0;
  expect_invalid(pages_with([&](auto& k) { k.host.last_page_tokens = last.data(); }),
                 "host.last_page_tokens[1]=0 is not in 1..16");
  last[1] = 17;
  expect_invalid(pages_with([&](auto& k) { k.host.last_page_tokens = last.data(); }),
                 "host.last_page_tokens[1]=17");

  ASSERT_GT(p.tokens.size(), 3u);
  std::vector<gpu::TokenAddress> tokens = p.tokens;
  tokens[3].row = 16;
  gpu::TokenAttendCall bad_row = dev.tokens;
  bad_row.host.tokens = tokens.data();
  expect_invalid(attention.validate(bad_row), "host.tokens[3].row=16 is not below page_tokens=16");
  tokens = p.tokens;
  tokens[0].slot = 1u << 30;
  gpu::TokenAttendCall bad_slot = dev.tokens;
  bad_slot.host.tokens = tokens.data();
  expect_invalid(attention.validate(bad_slot), "host.tokens[0].slot=1073741824 is out of range");
}

}  // namespace

#else  // a build without CUDA

TEST(GpuSparseAttention, needs_a_cuda_build) {
  ASSERT_FALSE(gpu::built_with_cuda());
  gpu::SparseDecodeAttention attention;
  const gpu::Result r = attention.init(gpu::AttentionShape{}, 1);
  EXPECT_TRUE(r.unsupported) << r.message;
  GTEST_SKIP() << "kvsift was built without CUDA (KVSIFT_ENABLE_CUDA=OFF): " << r.message;
}

#endif
