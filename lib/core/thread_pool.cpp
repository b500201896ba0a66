#include "lib/core/thread_pool.hpp"

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <system_error>

#include "lib/core/error.hpp"

namespace kvsift {

namespace {

// How long a waiting thread spins before it sleeps. A decode step runs a few parallel loops per
// layer with microseconds of serial work between them, so a worker that spins this long is
// usually still awake for the next loop; a longer spin only burns a busy host's cycles.
// Measured in bench/bench_attend.cpp and bench/bench_decode.cpp (the commit that added this pool).
constexpr auto kSpin = std::chrono::microseconds(50);

void futex_wait(const std::atomic<uint32_t>& word, uint32_t old) noexcept {
  // Returns at once when the word no longer holds `old` (so a change made just before cannot be
  // slept through), on a wake, or spuriously; the callers re-check.
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(&word), FUTEX_WAIT_PRIVATE, old, nullptr,
          nullptr, 0);
}

void futex_wake(const std::atomic<uint32_t>& word) noexcept {
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX,
          nullptr, nullptr, 0);
}

// Waits until `word` differs from `old`: spins for kSpin, then sleeps on the futex with
// `sleepers` counted so that the writer makes the wake system call only when someone sleeps.
// Writer and sleeper order their two accesses seq_cst (store word, load sleepers / add sleepers,
// load word), so either the writer sees the sleeper or the sleeper sees the new value.
uint32_t wait_change(const std::atomic<uint32_t>& word, uint32_t old,
                     std::atomic<int>& sleepers) noexcept {
  using Clock = std::chrono::steady_clock;
  uint32_t now = word.load(std::memory_order_acquire);
  if (now != old) return now;
  const auto deadline = Clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      _mm_pause();
      now = word.load(std::memory_order_acquire);
      if (now != old) return now;
    }
    if (Clock::now() >= deadline) break;
  }
  for (;;) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
    now = word.load(std::memory_order_seq_cst);
    if (now == old) futex_wait(word, old);
    sleepers.fetch_sub(1, std::memory_order_relaxed);
    now = word.load(std::memory_order_acquire);
    if (now != old) return now;
  }
}

int affinity_cpus() noexcept {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  const int n = CPU_COUNT(&set);
  return n > 0 ? n : 1;
}

}  // namespace

constexpr uint64_t kClosed = uint64_t{1} << 31;
constexpr uint64_t kMembers = kClosed - 1;

ThreadPool::ThreadPool(int n_threads)
    : n_threads_(n_threads == 0 ? affinity_cpus() : n_threads), state_(kClosed) {
  require(n_threads >= 0 && n_threads <= 4096, "n_threads=", n_threads, " is not in 0..4096");
  try {
    workers_.reserve(static_cast<std::size_t>(n_threads_ - 1));
    for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
  } catch (const std::system_error& e) {
    stop();
    fail(Status::out_of_memory, "cannot start thread ", workers_.size() + 1, " of ", n_threads_,
         ": ", e.what());
  }
}

ThreadPool::~ThreadPool() {
  stop();
}

void ThreadPool::stop() noexcept {
  if (workers_.empty()) return;
  stop_.store(true, std::memory_order_release);
  wake_workers();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void ThreadPool::wake_workers() noexcept {
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (worker_sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(generation_);
}

void ThreadPool::run(Task task, void* ctx, int participants) noexcept {
  if (participants <= 1 || workers_.empty()) {
    task(ctx, 0);
    return;
  }
  task_ = task;
  ctx_ = ctx;
  state_.store(uint64_t{++job_} << 32, std::memory_order_release);  // open, no members
  wake_workers();
  task(ctx, 0);
  uint64_t state = state_.fetch_or(kClosed, std::memory_order_acq_rel);
  while ((state & kMembers) != 0) {
    // Read exits_ before re-checking the members, so that a leave after the check changes the
    // futex word this thread sleeps on.
    const uint32_t exits = exits_.load(std::memory_order_seq_cst);
    state = state_.load(std::memory_order_acquire);
    if ((state & kMembers) == 0) break;
    wait_change(exits_, exits, caller_sleepers_);
    state = state_.load(std::memory_order_acquire);
  }
}

void ThreadPool::worker(int index) noexcept {
  uint32_t seen = 0, last_job = 0;
  for (;;) {
    seen = wait_change(generation_, seen, worker_sleepers_);
    if (stop_.load(std::memory_order_acquire)) return;
    // Join the open job unless already in it (a job is opened before its generation is bumped,
    // so a worker can see it before its wake-up).
    uint64_t state = state_.load(std::memory_order_acquire);
    bool joined = false;
    while (!joined && (state & kClosed) == 0 && static_cast<uint32_t>(state >> 32) != last_job)
      joined = state_.compare_exchange_weak(state, state + 1, std::memory_order_acq_rel,
                                            std::memory_order_acquire);
    if (!joined) continue;
    last_job = static_cast<uint32_t>(state >> 32);
    task_(ctx_, index);
    state_.fetch_sub(1, std::memory_order_acq_rel);
    exits_.fetch_add(1, std::memory_order_seq_cst);
    if (caller_sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake(exits_);
  }
}

}  // namespace kvsift
