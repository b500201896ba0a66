// kvsift's threads: one small pool per handle (a cache, a model), n_threads - 1 workers plus the
// thread that calls in, which always takes part.
//
// Why not OpenMP: libgomp reads its wait policy from the environment once, at load time, and
// spins its idle threads by default. A library cannot change that from inside someone else's
// process, and spinning threads cost a busy host almost everything (README, "Threads"). This
// pool waits passively: a short bounded spin (kSpinMicroseconds in thread_pool.cpp), then a futex
// sleep. It changes nothing process-wide.
//
// Contract: one thread calls into a pool at a time (the handle's thread-safety rule); bodies are
// noexcept (an exception escaping one terminates, as it did inside an OpenMP region); a call
// allocates nothing and returns when every participant has finished its part.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace kvsift {

class ThreadPool {
 public:
  // n_threads: threads taking part in a parallel call, the caller's included; 0 = the CPUs in
  // the process's affinity mask (sched_getaffinity). Throws Error(invalid_argument) outside
  // 0..4096, Error(out_of_memory) when a thread cannot be started.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const noexcept { return n_threads_; }

  // body(begin, end, thread) over [0, n) in chunks of `chunk` handed out first come, first served
  // (balances threads whose speed differs, as on a busy host); thread in 0..size()-1 indexes
  // per-thread scratch, 0 being the caller.
  template <class Body>
  void parallel_for(uint64_t n, uint64_t chunk, const Body& body) noexcept {
    if (chunk == 0) chunk = 1;
    const uint64_t chunks = (n + chunk - 1) / chunk;
    if (chunks == 0) return;
    struct Context {
      const Body* body;
      uint64_t n, chunk;
      std::atomic<uint64_t> next{0};
    } ctx{&body, n, chunk};
    static_assert(noexcept(body(uint64_t{0}, uint64_t{0}, 0)), "bodies are noexcept");
    run(
        [](void* raw, int thread) noexcept {
          auto& c = *static_cast<Context*>(raw);
          for (;;) {
            const uint64_t begin = c.next.fetch_add(c.chunk, std::memory_order_relaxed);
            if (begin >= c.n) return;
            (*c.body)(begin, begin + c.chunk < c.n ? begin + c.chunk : c.n, thread);
          }
        },
        &ctx, chunks < uint64_t(n_threads_) ? static_cast<int>(chunks) : n_threads_);
  }

  // body(begin, end, thread) over min(n, size()) equal contiguous parts of [0, n), whichever
  // thread is free taking the next part: for loops whose iterations cost the same and where a
  // fixed split keeps results bit-identical run to run (a kernel whose rounding depends on where
  // its range starts). Part p is [n p / parts, n (p + 1) / parts).
  template <class Body>
  void parallel_static(uint64_t n, const Body& body) noexcept {
    if (n == 0) return;
    const uint64_t parts = n < uint64_t(n_threads_) ? n : uint64_t(n_threads_);
    struct Context {
      const Body* body;
      uint64_t n, parts;
      std::atomic<uint64_t> next{0};
    } ctx{&body, n, parts};
    static_assert(noexcept(body(uint64_t{0}, uint64_t{0}, 0)), "bodies are noexcept");
    run(
        [](void* raw, int thread) noexcept {
          auto& c = *static_cast<Context*>(raw);
          for (;;) {
            const uint64_t p = c.next.fetch_add(1, std::memory_order_relaxed);
            if (p >= c.parts) return;
            (*c.body)(c.n * p / c.parts, c.n * (p + 1) / c.parts, thread);
          }
        },
        &ctx, static_cast<int>(parts));
  }

 private:
  using Task = void (*)(void* ctx, int thread) noexcept;
  // Runs task(ctx, thread) on the caller (thread 0) and on every worker that wakes in time to
  // join; the task hands out the work, so all of it is done by whoever joined. Returns when the
  // caller's task has returned and every worker that joined has left. A worker that had not
  // joined by then is not waited for: on a busy host a sleeping worker the scheduler has not run
  // yet costs nothing but the work the caller did instead. participants <= 1: the caller alone.
  void run(Task task, void* ctx, int participants) noexcept;
  void worker(int index) noexcept;
  void wake_workers() noexcept;
  void stop() noexcept;

  int n_threads_;
  std::vector<std::thread> workers_;
  // The job, written by the caller before it opens the job in state_ (release) and read by a
  // worker after it joined through state_ (acquire).
  Task task_ = nullptr;
  void* ctx_ = nullptr;
  uint32_t job_ = 0;  // the caller's count of jobs
  // (job << 32) | kClosed | members: the current job, whether it still takes members, and how
  // many workers are in it.
  std::atomic<uint64_t> state_;
  std::atomic<uint32_t> generation_{0};  // bumped per job: the workers' futex word
  std::atomic<uint32_t> exits_{0};       // bumped when a worker leaves a job: the caller's
  std::atomic<int> worker_sleepers_{0};  // workers asleep on generation_
  std::atomic<int> caller_sleepers_{0};  // 1 while the caller sleeps on exits_
  // Set by stop() before the generation bump that wakes the workers for the last time. Atomic: a
  // worker woken by the job before may still be reading it (tests/test_thread_stress.cpp, a race
  // ThreadSanitizer reported between a handle's destruction and its workers).
  std::atomic<bool> stop_{false};
};

// The two loops over an optional pool: without one (nullptr), the calling thread runs it all as
// thread 0.
template <class Body>
void parallel_for(ThreadPool* pool, uint64_t n, uint64_t chunk, const Body& body) noexcept {
  if (pool != nullptr)
    pool->parallel_for(n, chunk, body);
  else if (n > 0)
    body(uint64_t{0}, n, 0);
}
template <class Body>
void parallel_static(ThreadPool* pool, uint64_t n, const Body& body) noexcept {
  if (pool != nullptr)
    pool->parallel_static(n, body);
  else if (n > 0)
    body(uint64_t{0}, n, 0);
}

}  // namespace kvsift
