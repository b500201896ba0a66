// OffloadAttention (lib/offload/offload_attention.hpp). Measured on the H200 host (tests/
// test_offload.cpp, one Llama-3.1-8B layer at 32K, batch 1, LOCKS at 5%: 816 pages listed per call,
// hit rate 0.65 under a fast-drifting synthetic query, 2.3 MiB of pages per call; two runs): per
// call 137-195 us of host work, 147-180 us from the first copy to the lists on the device,
// 16-18 us of attention, 5-8 us for the output, 193-229 us wall clock; selection on 2 threads
// took 1.3-1.5 ms. The transfer interval includes the device's wait for the CPU's planning, so
// overlapping the next layer's selection with it is where time is to be won. Since then the
// refreshes go with the misses in one gather and q with the lists in one copy: two CUDA calls and
// a kernel fewer per part. The step at 128K with LOCKS at 2% selected on the device
// (bench/bench_offload.cpp (c), docs/results/gpu-scale/one-layer-table.txt): 186 us at batch 1
// (host 37, of it 20 the residency plan; transfer interval 58; attention 20), 1.43x torch SDPA over
// an HBM-resident cache (217 us, 1.70x, in a run of the day before); 1,566 us at batch 8 (1.65x).
#include "lib/offload/offload_attention.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>
#include <new>

namespace kvsift {

namespace {

using Clock = std::chrono::steady_clock;

double micros(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::micro>(to - from).count();
}

std::size_t round_up(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

// Cold-path failures of the gpu layer, with gpu/result.hpp's statuses.
void check(const gpu::Result& r, const char* what) {
  gpu::check(r, "OffloadAttention: ", what, ": ");
}

// The events: per part p, 3p (start), 3p + 1 (transfers enqueued), 3p + 2 (attention done); then
// the output back.
constexpr uint32_t kDone = gpu::StepStream::kEvents - 1;
constexpr uint32_t part_event(uint32_t part, uint32_t which) {
  return 3 * part + which;
}

// The key of a (sequence, layer, unit)'s device bases.
uint64_t bases_key(int32_t seq_id, uint32_t layer, uint32_t unit) {
  return uint64_t{static_cast<uint32_t>(seq_id)} << 32 | uint64_t{layer} << 16 | unit;
}

// Latent staging: the unit table, positions, key and value coefficients, each 16-byte aligned.
std::size_t align16(std::size_t n) {
  return round_up(n, 16);
}

}  // namespace

std::unique_ptr<OffloadAttention> OffloadAttention::create(KvCache& cache,
                                                           const OffloadOptions& options) {
  // Without the CUDA backend (not built, or not loadable here) the loader's message says which.
  if (const gpu::Result r = gpu::backend_status(); !r.ok)
    fail(Status::unsupported, "OffloadAttention: ", r.message,
         "; attend on the CPU with DecodeAttention");
  const CacheGeometry& g = cache.geometry();
  require(cache.pool().region().pinned(),
          "OffloadAttention: the cache's page pool is not pinned (create the KvCache with "
          "CacheOptions.pinned = true)");
  require(options.max_batch >= 1 && options.max_batch <= 65536,
          "OffloadOptions.max_batch=", options.max_batch, " is not in 1..65536");
  require(options.max_pages_per_pair >= 1 && options.max_pages_per_pair <= cache.pool().capacity(),
          "OffloadOptions.max_pages_per_pair=", options.max_pages_per_pair, " is not in 1..",
          cache.pool().capacity(), " (the pool's pages)");
  const uint64_t listed = uint64_t{options.max_batch} * g.n_kv_heads * options.max_pages_per_pair;
  require(listed <= UINT32_MAX,
          "OffloadOptions: max_batch * n_kv_heads * max_pages_per_pair=", listed,
          " does not fit 32-bit list offsets");
  require(options.cache_pages < (1u << 31), "OffloadOptions.cache_pages=", options.cache_pages,
          " is not in 0..2^31 - 1");
  // A mirror's slots are the pool's ids, and its row slots come after them.
  const uint64_t device_slots =
      options.cache_pages != 0 ? options.cache_pages : cache.pool().capacity();
  require(device_slots < (uint64_t{1} << 31), "OffloadOptions.cache_pages=0 mirrors the pool's ",
          device_slots, " slots, more than 2^31 - 1 device slots");
  require(options.step_parts >= 1 && options.step_parts <= kMaxParts,
          "OffloadOptions.step_parts=", options.step_parts, " is not in 1..", kMaxParts);
  require(options.max_row_chunks <= (uint64_t{1} << 31) - device_slots,
          "OffloadOptions.max_row_chunks=", options.max_row_chunks,
          " with cache_pages does not fit 2^31 device slots");
  int n_devices = 0;
  check(gpu::device_count(&n_devices), "device query");
  require(options.device >= 0 && options.device < n_devices,
          "OffloadOptions.device=", options.device, " is not in 0..", n_devices - 1);
  check(gpu::set_device(options.device), "set device");
  const void* mapped = nullptr;
  if (!gpu::mapped_device_pointer(cache.pool().base(), &mapped).ok)
    fail(Status::invalid_argument,
         "OffloadAttention: the cache's page pool is pinned but not mapped into the device's "
         "address space (the mapped gather reads it over PCIe; allocate it with "
         "gpu::pinned_alloc)");
  return std::unique_ptr<OffloadAttention>(new OffloadAttention(cache, options));
}

OffloadAttention::OffloadAttention(KvCache& cache, const OffloadOptions& options)
    : cache_(cache),
      options_(options),
      geometry_(cache.geometry()),
      name_("cuda:" + std::to_string(options.device)),
      max_pairs_(options.max_batch * geometry_.n_kv_heads),
      // Pairs hold distinct pages, so a call lists at most the pool's.
      max_listed_(std::min<uint64_t>(uint64_t{max_pairs_} * options.max_pages_per_pair,
                                     cache.pool().capacity())),
      max_tokens_(options.max_row_chunks == 0
                      ? 0
                      : (max_listed_ + options.max_row_chunks) * geometry_.page_tokens),
      checker_(geometry_, options.max_batch, 1, simd::scalar_kernels()) {  // never runs them
  static_assert(3 * kMaxParts < gpu::StepStream::kEvents, "3 events per part and kDone");
  check(stream_.init(), "stream");
  const gpu::AttentionShape shape{geometry_.n_kv_heads, geometry_.group_size, geometry_.head_dim,
                                  geometry_.page_tokens, geometry_.dtype};
  check(attention_.init(shape, options.max_batch), "attention workspace");
  if (options.max_row_chunks != 0 && geometry_.dtype != simd::Dtype::q8 &&
      cache.key_form() == KeyForm::pre_rope) {
    gpu::ReconstructShape rows;
    rows.head_dim = geometry_.head_dim;
    rows.page_tokens = geometry_.page_tokens;
    rows.dtype = geometry_.dtype;
    rows.rope_theta = cache.rope().theta();
    rows.max_heads = geometry_.n_kv_heads;
    check(reconstructor_.init(rows), "S4R row reconstruction");
    reconstructor_ready_ = true;
  }
  caches_.resize(mirror() ? 1 : geometry_.n_layers);
  for (gpu::DevicePageCache& layer_cache : caches_) {
    gpu::PageCacheConfig config;
    config.slot_bytes = geometry_.slot_bytes();
    config.mirror = mirror();
    config.capacity =
        mirror() ? static_cast<uint32_t>(cache.pool().capacity()) : options.cache_pages;
    config.reserved_slots = static_cast<uint32_t>(options.max_row_chunks);
    config.host_pool = cache.pool().base();
    config.host_slots = cache.pool().capacity();
    config.policy = options.eviction;
    config.path = options.path;
    check(layer_cache.init(config), "device page cache");
  }

  const std::size_t slot_bytes = geometry_.slot_bytes();
  const std::size_t qo_elems =
      std::size_t{options.max_batch} * geometry_.n_query_heads() * geometry_.head_dim;
  const std::size_t list_bytes =
      round_up((2 * std::size_t{max_pairs_} + 1 + max_listed_) * sizeof(uint32_t), 256);
  const std::size_t token_list_bytes = max_tokens_ == 0
                                           ? 0
                                           : round_up(token_offset_words() * sizeof(uint32_t) +
                                                          max_tokens_ * sizeof(gpu::TokenAddress),
                                                      256);
  const std::size_t rows_bytes = options.max_row_chunks * slot_bytes;
  const std::size_t qo_bytes = round_up(qo_elems * sizeof(float), 256);
  const uint32_t parts = options.step_parts;
  const std::size_t part_pinned = qo_bytes + list_bytes + token_list_bytes + rows_bytes;
  const std::size_t part_device = qo_bytes + list_bytes + token_list_bytes;
  void* pinned = nullptr;
  check(gpu::pinned_alloc(parts * part_pinned + qo_bytes, &pinned), "pinned buffers");
  pinned_.reset(pinned);
  void* dev = nullptr;
  check(gpu::device_alloc(parts * part_device + qo_bytes, &dev), "device buffers");
  device_.reset(dev);
  auto* p = static_cast<std::byte*>(pinned);
  auto* d = static_cast<std::byte*>(dev);
  for (uint32_t i = 0; i < parts; ++i) {
    Part& part = parts_[i];
    part.q_end = p + qo_bytes;
    part.q_end_device = d + qo_bytes;
    part.lists = reinterpret_cast<uint32_t*>(p + qo_bytes);
    part.token_lists = reinterpret_cast<uint32_t*>(p + qo_bytes + list_bytes);
    part.rows = p + qo_bytes + list_bytes + token_list_bytes;
    part.lists_device = reinterpret_cast<uint32_t*>(d + qo_bytes);
    part.token_lists_device = reinterpret_cast<uint32_t*>(d + qo_bytes + list_bytes);
    part.lists[0] = 0;  // attended_*() before the first run(): nothing
    p += part_pinned;
    d += part_device;
  }
  out_host_ = reinterpret_cast<float*>(p);
  out_device_ = reinterpret_cast<float*>(d);

  host_slots_.resize(max_listed_);
  refresh_.resize(max_listed_);
  piece_ends_.reserve(std::size_t{max_pairs_} + 1);
  if (mirror()) {
    // Each slot is flagged once, so the list never outgrows the pool and sealing never allocates.
    // Pages stored before this mirror existed go at the first call: every slot handed out so far.
    pending_.reserve(cache.pool().capacity());
    pending_flag_.assign(cache.pool().capacity(), 0);
    for (uint64_t slot = 0; slot < cache.pool().high_water(); ++slot)
      mark_pending(static_cast<uint32_t>(slot));
  } else {
    copied_tokens_.assign(std::size_t{geometry_.n_layers} * options.cache_pages, 0);
  }
  cache_.add_seal_listener(this);
}

// Nothing is in flight when the buffers go: run() and step() return only after the stream drained.
OffloadAttention::~OffloadAttention() {
  cache_.remove_seal_listener(this);
}

void OffloadAttention::forget_copies(uint32_t layer, const uint32_t* table, uint64_t first,
                                     uint64_t end) noexcept {
  const gpu::PageResidency& residency = caches_[layer].residency();
  uint32_t* tokens = copied_tokens_.data() + std::size_t{layer} * options_.cache_pages;
  for (uint64_t p = first; p < end; ++p)
    if (const uint32_t slot = residency.find(table[p]); slot != gpu::PageResidency::kNone)
      tokens[slot] = 0;  // below any page's tokens: sent again when listed
}

bool OffloadAttention::mark_pending(uint32_t host_slot) noexcept {
  if (pending_flag_[host_slot] != 0) return false;
  pending_flag_[host_slot] = 1;
  pending_.push_back(gpu::PageMove{host_slot, host_slot});
  return true;
}

void OffloadAttention::on_page_sealed(const SealedPage& page) noexcept {
  if (mirror())
    mark_pending(static_cast<uint32_t>((page.slot - cache_.pool().base()) /
                                       static_cast<std::ptrdiff_t>(geometry_.slot_bytes())));
}

// Called before the slots go back to the pool, so the page tables still name them. A mirror has
// nothing to forget: a slot's next contents are sent when they seal or, open, when listed.
void OffloadAttention::on_sequence_freed(int32_t seq_id) noexcept {
  // The sequence's S4R bases (bases_key: the sequence in the high word). Between calls, so no
  // kernel reads them.
  for (auto it = bases_.begin(); it != bases_.end();)
    it = it->first >> 32 == static_cast<uint32_t>(seq_id) ? bases_.erase(it) : std::next(it);
  if (mirror()) return;
  for (uint32_t layer = 0; layer < geometry_.n_layers; ++layer) {
    const uint64_t pages = geometry_.pages_for(cache_.length_unchecked(seq_id, layer));
    for (uint32_t h = 0; h < geometry_.n_kv_heads; ++h) {
      const uint32_t* table = cache_.page_table(seq_id, layer, h);
      // Pages that cannot be read were forgotten when they stopped being readable (released).
      for (uint64_t p = 0; p < pages; ++p)
        if (cache_.page_readable(seq_id, layer, p)) forget_copies(layer, table, p, p + 1);
    }
  }
}

void OffloadAttention::on_pages_released(int32_t seq_id, uint32_t layer, uint64_t first_page,
                                         uint64_t end_page) noexcept {
  if (mirror()) return;
  for (uint32_t h = 0; h < geometry_.n_kv_heads; ++h)
    forget_copies(layer, cache_.page_table(seq_id, layer, h), first_page, end_page);
}

void OffloadAttention::validate(const KvCache& cache, const AttendCall& call) const {
  require(&cache == &cache_, "OffloadAttention: cache is not the one it was created with");
  checker_.validate_lists(cache, call);
  const uint32_t pairs = call.n_seqs * geometry_.n_kv_heads;
  const uint64_t chunks = call.rows != nullptr ? call.rows->chunk_offsets[pairs] : 0;
  if (call.latent != nullptr) {
    if (!reconstructs_rows())
      fail(Status::unsupported,
           "OffloadAttention: latent rows need a cache of f16 or bf16 with pre-RoPE keys and "
           "OffloadOptions.max_row_chunks > 0");
    const LatentRows& latent = *call.latent;
    const uint32_t H = geometry_.n_kv_heads, hpu = latent.heads_per_unit;
    require(call.rows != nullptr, "latent: rows is NULL (the latent rows' placement)");
    require(hpu == 1 || hpu == H, "latent->heads_per_unit=", hpu,
            " is neither 1 nor n_kv_heads=", H);
    require(latent.units != nullptr, "latent->units is NULL");
    const uint64_t dim = uint64_t{hpu} * geometry_.head_dim;
    for (uint32_t u = 0; u < pairs / hpu; ++u) {
      const uint32_t pair = u * hpu, rows = call.rows->row_counts[pair];
      for (uint32_t h = 1; h < hpu; ++h)
        require(call.rows->row_counts[pair + h] == rows, "latent: the pairs of unit ", u,
                " hold different row counts");
      if (rows == 0) continue;
      const LatentUnit& unit = latent.units[u];
      require(unit.basis_id != 0, "latent->units[", u, "].basis_id is 0");
      require(unit.rank >= 1 && unit.rank <= dim, "latent->units[", u, "].rank=", unit.rank,
              " is not in 1..", dim);
      require(unit.key_basis != nullptr && unit.value_basis != nullptr &&
                  unit.key_coeffs != nullptr && unit.value_coeffs != nullptr &&
                  unit.positions != nullptr,
              "latent->units[", u, "] has a NULL pointer");
      for (uint32_t r = 0; r < rows; ++r)
        require(unit.positions[r] >= unit.first && unit.positions[r] - unit.first < unit.n_tokens,
                "latent->units[", u, "].positions[", r, "]=", unit.positions[r],
                " is not among its coefficients' tokens [", unit.first, ", ",
                unit.first + unit.n_tokens, ")");
    }
  }
  if (chunks > options_.max_row_chunks)
    fail(Status::capacity_exceeded, "OffloadAttention: the call's row chunks (", chunks,
         ") exceed OffloadOptions.max_row_chunks=", options_.max_row_chunks);
  uint64_t listed = 0;
  for (uint32_t pair = 0; pair < pairs; ++pair) {
    const uint64_t n = call.pages ? call.pages->offsets[pair + 1] - call.pages->offsets[pair]
                                  : geometry_.pages_for(cache.length_unchecked(
                                        call.seq_ids[pair / geometry_.n_kv_heads], call.layer));
    if (n > options_.max_pages_per_pair)
      fail(Status::capacity_exceeded, "OffloadAttention: pair ", pair, " lists ", n,
           " pages, more than OffloadOptions.max_pages_per_pair=", options_.max_pages_per_pair);
    listed += n;
  }
  if (listed > max_listed_)
    fail(Status::capacity_exceeded, "OffloadAttention: the call lists ", listed,
         " pages, more than its list buffers hold (", max_listed_, ")");
  // Every page of a call must be resident at once (pages of different pairs are distinct).
  if (!mirror() && listed > options_.cache_pages)
    fail(Status::capacity_exceeded, "OffloadAttention: the call lists ", listed,
         " pages, more than the device cache holds (OffloadOptions.cache_pages=",
         options_.cache_pages, ")");
}

void OffloadAttention::fail_run(const gpu::Result& r) noexcept {
  error_ = r.message;
  drain();
}

void OffloadAttention::drain() noexcept {
  if (stream_.mark(kDone).ok) stream_.wait(kDone);
}

void OffloadAttention::plan_pieces(const uint32_t* offsets, uint32_t pairs) noexcept {
  piece_ends_.clear();  // within the capacity reserved: no allocation
  piece_ends_.push_back(0);
  const uint64_t least = options_.min_piece_pages;
  if (least > 0 && offsets[pairs] >= 2 * least) {
    uint64_t target = std::max<uint64_t>(least, offsets[pairs] / 8);
    uint32_t first_page = 0;
    for (uint32_t pair = 0; pair + 1 < pairs; ++pair)
      if (offsets[pair + 1] - first_page >= target) {
        piece_ends_.push_back(pair + 1);
        first_page = offsets[pair + 1];
        target *= 2;
      }
  }
  piece_ends_.push_back(pairs);
}

gpu::Result OffloadAttention::enqueue_part(const KvCache& cache, const AttendCall& call,
                                           uint32_t part_index, uint32_t row0,
                                           PartCounts& counts) noexcept {
  Part& part = parts_[part_index];
  const uint32_t H = geometry_.n_kv_heads, B = geometry_.page_tokens;
  const uint32_t pairs = call.n_seqs * H;
  uint32_t* offsets = part.lists;
  uint32_t* last_tokens = offsets + max_pairs_ + 1;
  uint32_t* device_slots = last_tokens + max_pairs_;

  // Logical page ids to host slots; the last listed page of a pair is the only one that can be
  // partial (the open page, when listed).
  const Clock::time_point t_lists = Clock::now();
  uint32_t n = 0;
  for (uint32_t pair = 0; pair < pairs; ++pair) {
    const int32_t seq = call.seq_ids[pair / H];
    const uint32_t* table = cache.page_table(seq, call.layer, pair % H);
    const uint64_t length = cache.length_unchecked(seq, call.layer);
    offsets[pair] = n;
    uint64_t last_id = 0;
    if (call.pages) {
      for (uint32_t i = call.pages->offsets[pair]; i < call.pages->offsets[pair + 1]; ++i)
        host_slots_[n++] = table[last_id = call.pages->page_ids[i]];
    } else {
      const uint64_t n_pages = geometry_.pages_for(length);
      std::copy_n(table, n_pages, host_slots_.data() + n);
      n += static_cast<uint32_t>(n_pages);
      last_id = n_pages - 1;
    }
    last_tokens[pair] =
        n > offsets[pair] ? static_cast<uint32_t>(std::min<uint64_t>(B, length - last_id * B)) : B;
  }
  offsets[pairs] = n;
  last_part_ = part_index;
  last_pairs_ = pairs;

  counts.lists_us += micros(t_lists, Clock::now());

  gpu::DevicePageCache& layer_cache = cache_for(call.layer);
  gpu::Result r = stream_.mark(part_event(part_index, 0));
  if (!r.ok) return r;
  const Clock::time_point t_plan = Clock::now();
  const std::size_t slot_bytes = geometry_.slot_bytes();
  // What this part sends and finds, for the stats.
  uint64_t hits = 0, misses = 0, evictions = 0, page_bytes = 0;
  uint32_t n_refresh = 0;
  if (mirror()) {
    // Every page is resident at its own slot: what goes is what changed since its copy, the pages
    // sealed since the last call (of any layer) and each listed open page.
    std::memcpy(device_slots, host_slots_.data(), std::size_t{n} * sizeof(uint32_t));
    const std::size_t sealed = pending_.size();
    for (uint32_t pair = 0; pair < pairs; ++pair)
      if (offsets[pair + 1] > offsets[pair] && last_tokens[pair] < B &&
          mark_pending(host_slots_[offsets[pair + 1] - 1]))
        ++n_refresh;
    counts.plan_us += micros(t_plan, Clock::now());
    // Refused or failed: the list stays, sent at the next call.
    r = layer_cache.move(stream_.handle(), pending_.data(), pending_.size());
    if (!r.ok) return r;
    hits = n - n_refresh;
    misses = sealed;
    page_bytes = pending_.size() * slot_bytes;
    for (const gpu::PageMove& move : pending_) pending_flag_[move.host_slot] = 0;
    pending_.clear();
  } else {
    // The listed pages made resident in pieces of whole pairs, each piece's misses and refreshes
    // sent (one gather) before the next piece is planned, so that the host plans piece k + 1 while
    // the device gathers piece k and only the first piece's planning waits in front of the
    // transfer (on the H200 host a page's plan took about 80 ns in the 8B model's step against
    // about 200 ns to gather its 8 KiB at 40 GB/s, so each piece may be twice the last:
    // plan_pieces).
    uint32_t* tokens = copied_tokens_.data() + std::size_t{call.layer} * options_.cache_pages;
    plan_pieces(offsets, pairs);
    for (std::size_t k = 0; k + 1 < piece_ends_.size(); ++k) {
      const uint32_t first_pair = piece_ends_[k], end_pair = piece_ends_[k + 1];
      const uint32_t i0 = offsets[first_pair], i1 = offsets[end_pair];
      const Clock::time_point t_piece = Clock::now();
      r = layer_cache.plan(host_slots_.data() + i0, i1 - i0, device_slots + i0,
                           k == 0 ? gpu::StepMode::next : gpu::StepMode::same);
      if (!r.ok) return r;

      // Pages cached earlier whose host copy has since changed go again, with the misses.
      for (const gpu::PageMove& move : layer_cache.residency().moves())
        tokens[move.device_slot] = kFresh;
      // tokens is indexed by device slot, so the listed pages land on scattered lines of a
      // layer's cache_pages words (L3 by the time a layer comes round again): prefetch a few
      // pages ahead, as plan() does its map (bench/bench_residency.cpp: 20 -> 15 ns a page with
      // the plan at batch 1 over 32 layers).
      constexpr uint32_t kAhead = 16;
      uint32_t piece_refresh = 0;
      for (uint32_t pair = first_pair; pair < end_pair; ++pair)
        for (uint32_t i = offsets[pair]; i < offsets[pair + 1]; ++i) {
          if (i + kAhead < i1) __builtin_prefetch(&tokens[device_slots[i + kAhead]], 1);
          const uint32_t slot = device_slots[i];
          const uint32_t held = i + 1 == offsets[pair + 1] ? last_tokens[pair] : B;
          if (tokens[slot] != kFresh && tokens[slot] < held)
            refresh_[piece_refresh++] = gpu::PageMove{host_slots_[i], slot};
          tokens[slot] = held;
        }
      counts.plan_us += micros(t_piece, Clock::now());
      r = layer_cache.move(stream_.handle(), refresh_.data(), piece_refresh);
      if (!r.ok) {
        // Nothing of this piece was sent: its pages were marked as copied above, so forget them
        // (sent again when next listed). The earlier pieces' moves are on the stream.
        for (uint32_t i = i0; i < i1; ++i) tokens[device_slots[i]] = 0;
        return r;
      }
      const gpu::TransferStats& moved = layer_cache.last_step();
      hits += moved.hits;
      misses += moved.misses;
      evictions += moved.evictions;
      page_bytes += moved.bytes_moved + uint64_t{piece_refresh} * slot_bytes;
      n_refresh += piece_refresh;
    }
  }
  auto* pool = static_cast<std::byte*>(const_cast<void*>(layer_cache.device_pool()));

  // q sits right before the page lists, in the pinned block and in the device one.
  const std::size_t q_row = std::size_t{geometry_.n_query_heads()} * geometry_.head_dim;
  const std::size_t q_bytes = call.n_seqs * q_row * sizeof(float);
  std::byte* q_host = part.q_end - q_bytes;
  const auto* q_device = reinterpret_cast<const float*>(part.q_end_device - q_bytes);
  std::memcpy(q_host, call.q, q_bytes);
  const uint64_t chunks = call.rows != nullptr ? call.rows->chunk_offsets[pairs] : 0;
  std::size_t list_bytes = 0;
  if (chunks == 0) {
    list_bytes = (2 * std::size_t{max_pairs_} + 1 + n) * sizeof(uint32_t);
    r = stream_.copy_to_device(part.q_end_device - q_bytes, q_host, q_bytes + list_bytes);
  } else {
    // Token form: each pair's page rows, then its chunks' rows from the reserved slots.
    const uint32_t row_base = layer_cache.capacity();
    uint32_t* token_offsets = part.token_lists;
    auto* addresses = reinterpret_cast<gpu::TokenAddress*>(token_offsets + token_offset_words());
    uint32_t t = 0;
    for (uint32_t pair = 0; pair < pairs; ++pair) {
      token_offsets[pair] = t;
      for (uint32_t i = offsets[pair]; i < offsets[pair + 1]; ++i) {
        const uint32_t rows = i + 1 == offsets[pair + 1] ? last_tokens[pair] : B;
        for (uint32_t row = 0; row < rows; ++row) addresses[t++] = {device_slots[i], row};
      }
      const uint32_t first = call.rows->chunk_offsets[pair];
      for (uint32_t row = 0; row < call.rows->row_counts[pair]; ++row)
        addresses[t++] = {row_base + first + row / B, row % B};
    }
    token_offsets[pairs] = t;
    r = stream_.copy_to_device(part.q_end_device - q_bytes, q_host, q_bytes);
    counts.rows_equivalent_bytes += chunks * slot_bytes;
    if (r.ok && call.latent != nullptr) {
      r = reconstruct_part(call, part_index, pool + row_base * slot_bytes, counts);
    } else if (r.ok) {
      std::memcpy(part.rows, call.rows->chunks, chunks * slot_bytes);
      r = stream_.copy_to_device(pool + row_base * slot_bytes, part.rows, chunks * slot_bytes);
      counts.row_bytes_h2d += chunks * slot_bytes;
      counts.bytes_h2d += chunks * slot_bytes;
    }
    list_bytes = token_offset_words() * sizeof(uint32_t) + t * sizeof(gpu::TokenAddress);
    if (r.ok) r = stream_.copy_to_device(part.token_lists_device, part.token_lists, list_bytes);
    counts.tokens += t;
  }
  if (r.ok) r = stream_.mark(part_event(part_index, 1));
  if (r.ok) {
    const gpu::AttendTarget target{call.n_seqs,
                                   pool,
                                   uint64_t{layer_cache.capacity()} + options_.max_row_chunks,
                                   q_device,
                                   out_device_ + row0 * q_row,
                                   stream_.handle()};
    if (chunks == 0) {
      uint32_t* offsets_device = part.lists_device;
      uint32_t* last_device = offsets_device + max_pairs_ + 1;
      gpu::PageAttendCall attend;
      attend.target = target;
      attend.host = gpu::PageLists{offsets, device_slots, last_tokens};
      attend.device = gpu::PageLists{offsets_device, last_device + max_pairs_, last_device};
      r = attention_.run(attend);
      for (uint32_t pair = 0; pair < pairs; ++pair)
        if (offsets[pair + 1] > offsets[pair])
          counts.tokens += uint64_t{offsets[pair + 1] - offsets[pair] - 1} * B + last_tokens[pair];
    } else {
      const uint32_t* token_offsets = part.token_lists;
      gpu::TokenAttendCall attend;
      attend.target = target;
      attend.host = gpu::TokenLists{token_offsets, reinterpret_cast<const gpu::TokenAddress*>(
                                                       token_offsets + token_offset_words())};
      attend.device = gpu::TokenLists{part.token_lists_device,
                                      reinterpret_cast<const gpu::TokenAddress*>(
                                          part.token_lists_device + token_offset_words())};
      r = attention_.run(attend);
    }
  }
  if (r.ok) r = stream_.mark(part_event(part_index, 2));

  counts.listed += n;
  counts.hits += hits;
  counts.misses += misses;
  counts.evictions += evictions;
  counts.refreshed += n_refresh;
  counts.page_bytes_h2d += page_bytes;
  counts.bytes_h2d += page_bytes + q_bytes + list_bytes;
  return r;
}

gpu::Result OffloadAttention::reconstruct_part(const AttendCall& call, uint32_t part_index,
                                               std::byte* rows_device,
                                               PartCounts& counts) noexcept {
  const LatentRows& latent = *call.latent;
  const RowChunks& placement = *call.rows;
  const uint32_t H = geometry_.n_kv_heads, hpu = latent.heads_per_unit;
  const uint32_t n_units = call.n_seqs * H / hpu;
  const std::size_t dim = std::size_t{hpu} * geometry_.head_dim;

  // The bases the device lacks, and the staging's size. A basis changes only when its sequence
  // is compressed anew, so this is the first call of a (sequence, layer) after its prefill.
  uint32_t active = 0, max_rows = 0;
  uint64_t rows = 0, coeffs = 0, basis_bytes = 0;
  for (uint32_t u = 0; u < n_units; ++u) {
    const uint32_t n = placement.row_counts[u * hpu];
    if (n == 0) continue;
    const LatentUnit& unit = latent.units[u];
    ++active;
    max_rows = std::max(max_rows, n);
    rows += n;
    coeffs += uint64_t{n} * unit.rank;
    DeviceBases* bases = nullptr;
    try {
      bases = &bases_[bases_key(call.seq_ids[u * hpu / H], call.layer, u % (H / hpu))];
    } catch (const std::bad_alloc&) {
      return gpu::Result::out_of_memory("OffloadAttention: the S4R bases' index");
    }
    if (bases->basis_id == unit.basis_id) continue;
    const std::size_t matrix = std::size_t{unit.rank} * dim * sizeof(float);
    bases->basis_id = 0;  // until the copies below are enqueued
    if (bases->bytes < 2 * matrix) {
      bases->memory.reset();
      bases->bytes = 0;
      void* memory = nullptr;
      if (gpu::Result r = gpu::device_alloc(2 * matrix, &memory); !r.ok) return r;
      bases->memory.reset(memory);
      bases->bytes = 2 * matrix;
    }
    auto* device = static_cast<std::byte*>(bases->memory.get());
    // From the selector's pageable vectors: the runtime stages them, once per compression.
    gpu::Result r = stream_.copy_to_device(device, unit.key_basis, matrix);
    if (r.ok) r = stream_.copy_to_device(device + matrix, unit.value_basis, matrix);
    if (!r.ok) return r;
    bases->basis_id = unit.basis_id;
    basis_bytes += 2 * matrix;
  }
  counts.basis_bytes_h2d += basis_bytes;
  counts.bytes_h2d += basis_bytes;

  const std::size_t table_bytes = align16(active * sizeof(gpu::ReconstructUnit));
  const std::size_t positions_bytes = align16(rows * sizeof(uint32_t));
  const std::size_t coeff_bytes = align16(coeffs * sizeof(uint16_t));
  const std::size_t bytes = table_bytes + positions_bytes + 2 * coeff_bytes;
  LatentStaging& staging = latent_[part_index];
  if (staging.bytes < bytes) {
    // Half again, so that a few calls of growing ranks do not each reallocate. The part's previous
    // use was a call that has finished (finish() and run() wait for the stream).
    const std::size_t grown = std::max(bytes, staging.bytes + staging.bytes / 2);
    staging.host.reset();
    staging.device.reset();
    staging.bytes = 0;
    void* host = nullptr;
    void* device = nullptr;
    if (gpu::Result r = gpu::pinned_alloc(grown, &host); !r.ok) return r;
    staging.host.reset(host);
    if (gpu::Result r = gpu::device_alloc(grown, &device); !r.ok) return r;
    staging.device.reset(device);
    staging.bytes = grown;
  }
  auto* host = static_cast<std::byte*>(staging.host.get());
  auto* device = static_cast<std::byte*>(staging.device.get());
  auto* table = reinterpret_cast<gpu::ReconstructUnit*>(host);
  auto* positions = reinterpret_cast<uint32_t*>(host + table_bytes);
  auto* key_coeffs = reinterpret_cast<uint16_t*>(host + table_bytes + positions_bytes);
  auto* value_coeffs =
      reinterpret_cast<uint16_t*>(host + table_bytes + positions_bytes + coeff_bytes);
  uint32_t i = 0, row = 0;
  uint64_t offset = 0;
  for (uint32_t u = 0; u < n_units; ++u) {
    const uint32_t n = placement.row_counts[u * hpu];
    if (n == 0) continue;
    const LatentUnit& unit = latent.units[u];
    const auto* bases = static_cast<const float*>(
        bases_.find(bases_key(call.seq_ids[u * hpu / H], call.layer, u % (H / hpu)))
            ->second.memory.get());
    gpu::ReconstructUnit& entry = table[i++];
    entry.key_basis = bases;
    entry.value_basis = bases + std::size_t{unit.rank} * dim;
    entry.coeff_offset = offset;
    entry.row_offset = row;
    entry.n_rows = n;
    entry.rank = unit.rank;
    entry.heads = hpu;
    entry.first_chunk = placement.chunk_offsets[u * hpu];
    entry.pad = 0;
    // Gathered here, from the selector's arrays: the one host copy of the coefficients.
    const std::size_t row_bytes = std::size_t{unit.rank} * sizeof(uint16_t);
    for (uint32_t r = 0; r < n; ++r) {
      const uint64_t j = unit.positions[r] - unit.first;
      positions[row + r] = unit.positions[r];
      std::memcpy(key_coeffs + offset + std::size_t{r} * unit.rank, unit.key_coeffs + j * unit.rank,
                  row_bytes);
      std::memcpy(value_coeffs + offset + std::size_t{r} * unit.rank,
                  unit.value_coeffs + j * unit.rank, row_bytes);
    }
    row += n;
    offset += uint64_t{n} * unit.rank;
  }
  gpu::Result r = stream_.copy_to_device(device, host, bytes);
  counts.row_bytes_h2d += bytes;
  counts.bytes_h2d += bytes;
  if (!r.ok) return r;
  gpu::ReconstructCall reconstruct;
  reconstruct.units = reinterpret_cast<const gpu::ReconstructUnit*>(device);
  reconstruct.n_units = active;
  reconstruct.max_rows = max_rows;
  reconstruct.max_heads = hpu;
  reconstruct.positions = reinterpret_cast<const uint32_t*>(device + table_bytes);
  reconstruct.key_coeffs =
      reinterpret_cast<const uint16_t*>(device + table_bytes + positions_bytes);
  reconstruct.value_coeffs =
      reinterpret_cast<const uint16_t*>(device + table_bytes + positions_bytes + coeff_bytes);
  reconstruct.chunks = rows_device;
  reconstruct.stream = stream_.handle();
  return reconstructor_.run(reconstruct);
}

gpu::Result OffloadAttention::copy_out(uint32_t n_seqs, float* out) noexcept {
  const std::size_t bytes =
      std::size_t{n_seqs} * geometry_.n_query_heads() * geometry_.head_dim * sizeof(float);
  gpu::Result r = stream_.copy_to_host(out_host_, out_device_, bytes);
  if (r.ok) r = stream_.mark(kDone);
  if (r.ok) r = stream_.wait(kDone);
  if (r.ok) std::memcpy(out, out_host_, bytes);
  return r;
}

void OffloadAttention::record(uint32_t parts, const PartCounts& counts, double host_us,
                              double total_us, uint32_t n_seqs) noexcept {
  last_ = OffloadStats{};
  last_.calls = 1;
  last_.parts = parts;
  last_.pages_listed = counts.listed;
  last_.hits = counts.hits;
  last_.misses = counts.misses;
  last_.evictions = counts.evictions;
  last_.refreshed = counts.refreshed;
  last_.page_bytes_h2d = counts.page_bytes_h2d;
  last_.bytes_h2d = counts.bytes_h2d;
  last_.row_bytes_h2d = counts.row_bytes_h2d;
  last_.rows_equivalent_bytes = counts.rows_equivalent_bytes;
  last_.basis_bytes_h2d = counts.basis_bytes_h2d;
  last_.bytes_d2h =
      std::size_t{n_seqs} * geometry_.n_query_heads() * geometry_.head_dim * sizeof(float);
  for (uint32_t p = 0; p < parts; ++p) {
    last_.transfer_us += 1e3 * stream_.elapsed_ms(part_event(p, 0), part_event(p, 1));
    last_.attend_us += 1e3 * stream_.elapsed_ms(part_event(p, 1), part_event(p, 2));
  }
  last_.copy_out_us = 1e3 * stream_.elapsed_ms(part_event(parts - 1, 2), kDone);
  last_.host_us = host_us;
  last_.lists_us = counts.lists_us;
  last_.plan_us = counts.plan_us;
  last_.total_us = total_us;
  attend_stats_.pages_read = counts.listed;
  attend_stats_.tokens_read = counts.tokens;
  attend_stats_.bytes_read = counts.tokens * geometry_.token_bytes();
}

void OffloadAttention::add_to_totals() noexcept {
  totals_.calls += last_.calls;
  totals_.pages_listed += last_.pages_listed;
  totals_.hits += last_.hits;
  totals_.misses += last_.misses;
  totals_.evictions += last_.evictions;
  totals_.refreshed += last_.refreshed;
  totals_.page_bytes_h2d += last_.page_bytes_h2d;
  totals_.bytes_h2d += last_.bytes_h2d;
  totals_.row_bytes_h2d += last_.row_bytes_h2d;
  totals_.rows_equivalent_bytes += last_.rows_equivalent_bytes;
  totals_.basis_bytes_h2d += last_.basis_bytes_h2d;
  totals_.bytes_d2h += last_.bytes_d2h;
  totals_.parts += last_.parts;
  totals_.host_us += last_.host_us;
  totals_.lists_us += last_.lists_us;
  totals_.plan_us += last_.plan_us;
  totals_.transfer_us += last_.transfer_us;
  totals_.attend_us += last_.attend_us;
  totals_.copy_out_us += last_.copy_out_us;
  totals_.total_us += last_.total_us;
}

Status OffloadAttention::run(const KvCache& cache, const AttendCall& call) noexcept {
  const Clock::time_point t0 = Clock::now();
  // The calling thread's current device may differ from create()'s (the runtime keeps it per
  // thread); the stream and the buffers belong to create()'s.
  gpu::Result r = gpu::set_device(options_.device);
  PartCounts counts;
  if (r.ok) r = enqueue_part(cache, call, 0, 0, counts);
  const Clock::time_point t_enqueued = Clock::now();
  if (r.ok) r = copy_out(call.n_seqs, call.out);
  if (!r.ok) {
    fail_run(r);
    return Status::internal;
  }
  record(1, counts, micros(t0, t_enqueued), micros(t0, Clock::now()), call.n_seqs);
  add_to_totals();
  return Status::ok;
}

void OffloadAttention::attend(const KvCache& cache, const AttendCall& call) {
  if (run(cache, call) != Status::ok) fail(Status::internal, "OffloadAttention: ", error_);
}

void OffloadAttention::begin() {
  step_start_ = Clock::now();
  step_parts_ = 0;
  step_counts_ = PartCounts{};
  step_host_us_ = 0.0;
  check(gpu::set_device(options_.device), "set device");
}

void OffloadAttention::enqueue(const KvCache& cache, const AttendCall& part, uint32_t row0) {
  const Clock::time_point t0 = Clock::now();
  if (step_parts_ >= options_.step_parts) {
    drain();
    fail(Status::internal,
         "OffloadAttention: more than OffloadOptions.step_parts=", options_.step_parts,
         " parts in one call");
  }
  if (gpu::Result r = enqueue_part(cache, part, step_parts_, row0, step_counts_); !r.ok) {
    fail_run(r);
    fail(Status::internal, "OffloadAttention: ", error_);
  }
  ++step_parts_;
  step_host_us_ += micros(t0, Clock::now());
}

void OffloadAttention::finish(const AttendCall& call) {
  if (gpu::Result r = copy_out(call.n_seqs, call.out); !r.ok) {
    fail_run(r);
    fail(Status::internal, "OffloadAttention: ", error_);
  }
  record(step_parts_, step_counts_, step_host_us_, micros(step_start_, Clock::now()), call.n_seqs);
  add_to_totals();
}

double OffloadAttention::part_attend_us(uint32_t part) const noexcept {
  return part < last_.parts ? 1e3 * stream_.elapsed_ms(part_event(part, 1), part_event(part, 2))
                            : 0.0;
}

std::span<const uint32_t> OffloadAttention::attended_offsets() const noexcept {
  return {parts_[last_part_].lists, last_pairs_ + std::size_t{1}};
}

std::span<const uint32_t> OffloadAttention::attended_host_slots() const noexcept {
  return {host_slots_.data(), parts_[last_part_].lists[last_pairs_]};
}

std::span<const uint32_t> OffloadAttention::attended_device_slots() const noexcept {
  return {parts_[last_part_].lists + 2 * std::size_t{max_pairs_} + 1,
          parts_[last_part_].lists[last_pairs_]};
}

void OffloadAttention::read_device_slot(uint32_t layer, uint32_t device_slot, void* out) {
  require(layer < geometry_.n_layers, "layer=", layer,
          " is out of range (n_layers=", geometry_.n_layers, ")");
  const gpu::DevicePageCache& layer_cache = cache_for(layer);
  const uint64_t slots = uint64_t{layer_cache.capacity()} + options_.max_row_chunks;
  require(device_slot < slots, "device_slot=", device_slot,
          " is out of range (the device cache's slots and max_row_chunks: ", slots, ")");
  const auto* pool = static_cast<const std::byte*>(layer_cache.device_pool());
  check(stream_.copy_to_host(out, pool + std::size_t{device_slot} * geometry_.slot_bytes(),
                             geometry_.slot_bytes()),
        "read device slot");
  check(stream_.mark(kDone), "read device slot");
  check(stream_.wait(kDone), "read device slot");
}

}  // namespace kvsift
