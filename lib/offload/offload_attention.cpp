// OffloadAttention (lib/offload/offload_attention.hpp). Measured on the H200 host (tests/
// test_offload.cpp, one Llama-3.1-8B layer at 32K, batch 1, LOCKS at 5%: 816 pages listed per call,
// hit rate 0.65 under a fast-drifting synthetic query, 2.3 MiB of pages per call; two runs): per
// call 137-195 us of host work, 147-180 us from the first copy to the lists on the device,
// 16-18 us of attention, 5-8 us for the output, 193-229 us wall clock; selection on 2 threads
// took 1.3-1.5 ms. The transfer interval includes the device's wait for the CPU's planning, so
// overlapping the next layer's selection with it is where time is to be won.
#include "lib/offload/offload_attention.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace kvsift {

namespace {

using Clock = std::chrono::steady_clock;

double micros(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double, std::micro>(to - from).count();
}

std::size_t round_up(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

// Cold-path failures of the gpu layer: no device is "unsupported", the rest is internal.
void check(const gpu::Result& r, const char* what) {
  if (r.ok) return;
  fail(r.unsupported ? Status::unsupported : Status::internal, "OffloadAttention: ", what, ": ",
       r.message);
}

// The events of a call: start, transfers enqueued, attention done, output back.
constexpr uint32_t kStart = 0, kTransferred = 1, kAttended = 2, kDone = 3;

}  // namespace

std::unique_ptr<OffloadAttention> OffloadAttention::create(KvCache& cache,
                                                           const OffloadOptions& options) {
  if (!gpu::built_with_cuda())
    fail(Status::unsupported,
         "OffloadAttention: kvsift was built without CUDA (KVSIFT_ENABLE_CUDA=OFF); attend on "
         "the CPU with DecodeAttention");
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
  require(options.cache_pages >= listed && options.cache_pages <= (1u << 31),
          "OffloadOptions.cache_pages=", options.cache_pages, " is not in ", listed,
          "..2^31 (at least max_batch * n_kv_heads * max_pages_per_pair, so that a call never "
          "needs more pages than the device cache holds)");
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
  std::unique_ptr<OffloadAttention> self(new OffloadAttention(cache, options));
  self->host_pool_device_ = mapped;
  return self;
}

OffloadAttention::OffloadAttention(KvCache& cache, const OffloadOptions& options)
    : cache_(cache),
      options_(options),
      geometry_(cache.geometry()),
      max_pairs_(options.max_batch * geometry_.n_kv_heads),
      max_listed_(uint64_t{max_pairs_} * options.max_pages_per_pair),
      checker_(geometry_, options.max_batch, 1) {
  check(stream_.init(), "stream");
  const gpu::AttentionShape shape{geometry_.n_kv_heads, geometry_.group_size, geometry_.head_dim,
                                  geometry_.page_tokens, geometry_.dtype};
  check(attention_.init(shape, options.max_batch), "attention workspace");
  caches_.resize(geometry_.n_layers);
  for (gpu::DevicePageCache& layer_cache : caches_) {
    gpu::PageCacheConfig config;
    config.slot_bytes = geometry_.slot_bytes();
    config.capacity = options.cache_pages;
    config.host_pool = cache.pool().base();
    config.host_slots = cache.pool().capacity();
    config.policy = options.eviction;
    config.path = options.path;
    check(layer_cache.init(config), "device page cache");
  }

  const std::size_t qo_elems =
      std::size_t{options.max_batch} * geometry_.n_query_heads() * geometry_.head_dim;
  const std::size_t list_words = 2 * std::size_t{max_pairs_} + 1 + max_listed_;
  const std::size_t refresh_bytes = round_up(max_listed_ * sizeof(gpu::PageMove), 256);
  const std::size_t list_bytes = round_up(list_words * sizeof(uint32_t), 256);
  const std::size_t qo_bytes = round_up(qo_elems * sizeof(float), 256);
  void* pinned = nullptr;
  check(gpu::pinned_alloc(refresh_bytes + list_bytes + 2 * qo_bytes, &pinned), "pinned buffers");
  pinned_.reset(pinned);
  auto* p = static_cast<std::byte*>(pinned);
  refresh_ = reinterpret_cast<gpu::PageMove*>(p);
  lists_ = reinterpret_cast<uint32_t*>(p + refresh_bytes);
  q_host_ = reinterpret_cast<float*>(p + refresh_bytes + list_bytes);
  out_host_ = reinterpret_cast<float*>(p + refresh_bytes + list_bytes + qo_bytes);
  const void* refresh_view = nullptr;
  check(gpu::mapped_device_pointer(refresh_, &refresh_view), "refresh list view");
  refresh_device_ = static_cast<const gpu::PageMove*>(refresh_view);
  void* dev = nullptr;
  check(gpu::device_alloc(list_bytes + 2 * qo_bytes, &dev), "device buffers");
  device_.reset(dev);
  auto* d = static_cast<std::byte*>(dev);
  lists_device_ = reinterpret_cast<uint32_t*>(d);
  q_device_ = reinterpret_cast<float*>(d + list_bytes);
  out_device_ = reinterpret_cast<float*>(d + list_bytes + qo_bytes);

  lists_[0] = 0;  // attended_*() before the first run(): nothing
  host_slots_.resize(max_listed_);
  const std::size_t tracked = std::size_t{geometry_.n_layers} * options.cache_pages;
  copied_epoch_.assign(tracked, 0);
  copied_tokens_.assign(tracked, 0);
  cache_.add_seal_listener(this);
}

// Nothing is in flight when the buffers go: run() returns only after its stream drained.
OffloadAttention::~OffloadAttention() {
  cache_.remove_seal_listener(this);
}

void OffloadAttention::on_sequence_freed(int32_t) noexcept {
  // Its slots go back to the pool and later appends reuse them: every cached copy is suspect.
  ++epoch_;
}

void OffloadAttention::validate(const KvCache& cache, const AttendCall& call) const {
  require(&cache == &cache_, "OffloadAttention: cache is not the one it was created with");
  checker_.validate(cache, call);
  const uint32_t pairs = call.n_seqs * geometry_.n_kv_heads;
  if (call.rows != nullptr && call.rows->chunk_offsets[pairs] > 0)
    fail(Status::unsupported,
         "OffloadAttention: row chunks (the token rows of Louver and S4R) are not offloaded yet; "
         "attend such selections on the CPU (DecodeAttention)");
  if (cache.has_released_pages())
    fail(Status::unsupported,
         "OffloadAttention: the cache holds released (compressed) pages, whose reused slots the "
         "device cache cannot tell apart; attend it on the CPU");
  for (uint32_t pair = 0; pair < pairs; ++pair) {
    const uint64_t n = call.pages ? call.pages->offsets[pair + 1] - call.pages->offsets[pair]
                                  : geometry_.pages_for(cache.length_unchecked(
                                        call.seq_ids[pair / geometry_.n_kv_heads], call.layer));
    if (n > options_.max_pages_per_pair)
      fail(Status::capacity_exceeded, "OffloadAttention: pair ", pair, " lists ", n,
           " pages, more than OffloadOptions.max_pages_per_pair=", options_.max_pages_per_pair);
  }
}

void OffloadAttention::fail_run(const gpu::Result& r) noexcept {
  error_ = r.message;
  // Drain what was enqueued, so that the buffers are free for the next call.
  if (stream_.mark(kDone).ok) stream_.wait(kDone);
}

Status OffloadAttention::run(const KvCache& cache, const AttendCall& call) noexcept {
  const Clock::time_point t0 = Clock::now();
  // The calling thread's current device may differ from create()'s (the runtime keeps it per
  // thread); the stream and the buffers belong to create()'s.
  if (gpu::Result r = gpu::set_device(options_.device); !r.ok) {
    error_ = r.message;
    return Status::internal;
  }
  const uint32_t H = geometry_.n_kv_heads, B = geometry_.page_tokens;
  const uint32_t pairs = call.n_seqs * H;
  uint32_t* offsets = lists_;
  uint32_t* last_tokens = offsets + max_pairs_ + 1;
  uint32_t* device_slots = last_tokens + max_pairs_;

  // Logical page ids to host slots; the last listed page of a pair is the only one that can be
  // partial (the open page, when listed).
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
      for (uint64_t id = 0; id < n_pages; ++id) host_slots_[n++] = table[last_id = id];
    }
    last_tokens[pair] =
        n > offsets[pair] ? static_cast<uint32_t>(std::min<uint64_t>(B, length - last_id * B)) : B;
  }
  offsets[pairs] = n;
  last_pairs_ = pairs;

  const std::size_t qo_bytes =
      std::size_t{call.n_seqs} * geometry_.n_query_heads() * geometry_.head_dim * sizeof(float);
  gpu::Result r = stream_.mark(kStart);
  if (r.ok) {
    std::memcpy(q_host_, call.q, qo_bytes);
    r = stream_.copy_to_device(q_device_, q_host_, qo_bytes);
  }
  gpu::DevicePageCache& layer_cache = caches_[call.layer];
  if (r.ok) r = layer_cache.ensure(host_slots_.data(), n, device_slots, stream_.handle());
  if (!r.ok) {
    fail_run(r);
    return Status::internal;
  }

  // Pages cached earlier whose host copy has since changed go again, after the misses.
  const std::size_t base = std::size_t{call.layer} * options_.cache_pages;
  uint64_t* epoch = copied_epoch_.data() + base;
  uint32_t* tokens = copied_tokens_.data() + base;
  for (const gpu::PageMove& move : layer_cache.residency().moves()) {
    epoch[move.device_slot] = epoch_;
    tokens[move.device_slot] = kFresh;
  }
  uint32_t n_refresh = 0;
  for (uint32_t pair = 0; pair < pairs; ++pair)
    for (uint32_t i = offsets[pair]; i < offsets[pair + 1]; ++i) {
      const uint32_t slot = device_slots[i];
      const uint32_t held = i + 1 == offsets[pair + 1] ? last_tokens[pair] : B;
      if (tokens[slot] != kFresh && (epoch[slot] != epoch_ || tokens[slot] < held))
        refresh_[n_refresh++] = gpu::PageMove{host_slots_[i], slot};
      tokens[slot] = held;
      epoch[slot] = epoch_;
    }
  void* pool = const_cast<void*>(layer_cache.device_pool());
  r = stream_.refresh_pages(host_pool_device_, pool, geometry_.slot_bytes(), refresh_device_,
                            n_refresh);
  const std::size_t list_bytes = (2 * std::size_t{max_pairs_} + 1 + n) * sizeof(uint32_t);
  if (r.ok) r = stream_.copy_to_device(lists_device_, lists_, list_bytes);
  if (r.ok) r = stream_.mark(kTransferred);
  if (r.ok) {
    uint32_t* offsets_device = lists_device_;
    uint32_t* last_device = offsets_device + max_pairs_ + 1;
    uint32_t* slots_device = last_device + max_pairs_;
    gpu::PageAttendCall attend;
    attend.target = gpu::AttendTarget{call.n_seqs, pool,        layer_cache.capacity(),
                                      q_device_,   out_device_, stream_.handle()};
    attend.host = gpu::PageLists{offsets, device_slots, last_tokens};
    attend.device = gpu::PageLists{offsets_device, slots_device, last_device};
    r = attention_.run(attend);
  }
  if (r.ok) r = stream_.mark(kAttended);
  if (r.ok) r = stream_.copy_to_host(out_host_, out_device_, qo_bytes);
  if (r.ok) r = stream_.mark(kDone);
  const Clock::time_point t_enqueued = Clock::now();
  if (r.ok) r = stream_.wait(kDone);
  if (!r.ok) {
    fail_run(r);
    return Status::internal;
  }
  std::memcpy(call.out, out_host_, qo_bytes);
  const Clock::time_point t_end = Clock::now();

  const gpu::TransferStats& moved = layer_cache.last_step();
  last_ = OffloadStats{};
  last_.calls = 1;
  last_.pages_listed = n;
  last_.hits = moved.hits;
  last_.misses = moved.misses;
  last_.evictions = moved.evictions;
  last_.refreshed = n_refresh;
  last_.page_bytes_h2d = moved.bytes_moved + uint64_t{n_refresh} * geometry_.slot_bytes();
  last_.bytes_h2d = last_.page_bytes_h2d + qo_bytes + list_bytes;
  last_.bytes_d2h = qo_bytes;
  last_.host_us = micros(t0, t_enqueued);
  last_.transfer_us = 1e3 * stream_.elapsed_ms(kStart, kTransferred);
  last_.attend_us = 1e3 * stream_.elapsed_ms(kTransferred, kAttended);
  last_.copy_out_us = 1e3 * stream_.elapsed_ms(kAttended, kDone);
  last_.total_us = micros(t0, t_end);
  totals_.calls += 1;
  totals_.pages_listed += last_.pages_listed;
  totals_.hits += last_.hits;
  totals_.misses += last_.misses;
  totals_.evictions += last_.evictions;
  totals_.refreshed += last_.refreshed;
  totals_.page_bytes_h2d += last_.page_bytes_h2d;
  totals_.bytes_h2d += last_.bytes_h2d;
  totals_.bytes_d2h += last_.bytes_d2h;
  totals_.host_us += last_.host_us;
  totals_.transfer_us += last_.transfer_us;
  totals_.attend_us += last_.attend_us;
  totals_.copy_out_us += last_.copy_out_us;
  totals_.total_us += last_.total_us;
  return Status::ok;
}

void OffloadAttention::step(select::Selector& selector, select::Selection& selection,
                            const KvCache& cache, const AttendCall& call) {
  checker_.validate_sequences(cache, call);
  const select::SelectCall select_call{call.layer, call.n_seqs, call.seq_ids, call.q};
  const Clock::time_point t0 = Clock::now();
  selector.prepare(select_call, selection);
  selector.select(select_call, selection);
  const double select_us = micros(t0, Clock::now());
  const PageLists lists = selection.lists();
  const RowChunks rows = selection.rows();
  AttendCall attend = call;
  attend.pages = &lists;
  attend.rows = selection.has_rows ? &rows : nullptr;
  validate(cache, attend);
  if (run(cache, attend) != Status::ok) fail(Status::internal, "OffloadAttention: ", error_);
  last_.select_us = select_us;
  totals_.select_us += select_us;
}

std::span<const uint32_t> OffloadAttention::attended_offsets() const noexcept {
  return {lists_, last_pairs_ + std::size_t{1}};
}

std::span<const uint32_t> OffloadAttention::attended_host_slots() const noexcept {
  return {host_slots_.data(), lists_[last_pairs_]};
}

std::span<const uint32_t> OffloadAttention::attended_device_slots() const noexcept {
  return {lists_ + 2 * std::size_t{max_pairs_} + 1, lists_[last_pairs_]};
}

void OffloadAttention::read_device_slot(uint32_t layer, uint32_t device_slot, void* out) {
  require(layer < geometry_.n_layers, "layer=", layer,
          " is out of range (n_layers=", geometry_.n_layers, ")");
  require(device_slot < options_.cache_pages, "device_slot=", device_slot,
          " is out of range (cache_pages=", options_.cache_pages, ")");
  const auto* pool = static_cast<const std::byte*>(caches_[layer].device_pool());
  check(stream_.copy_to_host(out, pool + std::size_t{device_slot} * geometry_.slot_bytes(),
                             geometry_.slot_bytes()),
        "read device slot");
  check(stream_.mark(kDone), "read device slot");
  check(stream_.wait(kDone), "read device slot");
}

}  // namespace kvsift
