// SPDX-License-Identifier: Apache-2.0
#include "engine/backend/cpu/cpu_parallel.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/backend/backends.h"
#include "engine/core/error.h"

namespace specula {
namespace cpu {
namespace {

// Chunks per team thread: enough that a thread running late, or a causal
// prefill's heavier last rows, leave the others work to take.
constexpr int64_t kChunksPerThread = 8;
constexpr int64_t kMaxChunks = 0xffff;
// How long an idle worker polls for the next job before sleeping. Decode steps
// run their regions microseconds apart, so a short spin catches the next one;
// past it the worker yields the core (to another process, or to the caller).
constexpr auto kSpin = std::chrono::microseconds(50);
// How long a caller polls for chunks that other threads claimed before yielding
// its core each round (a claimer the scheduler took off the core needs one).
constexpr int kWaitPolls = 2000;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The claim word: job epoch (32 bits), chunk count (16), next unclaimed chunk
// (16). A worker claims chunk `next` by compare-and-swap; since the word holds
// the job's own chunk count, a swap succeeds only while that job has chunks
// left, so its caller is still waiting and the job's fields are still its own.
constexpr uint64_t pack(uint32_t epoch, uint64_t chunks, uint64_t next) {
  return static_cast<uint64_t>(epoch) << 32 | chunks << 16 | next;
}
constexpr uint32_t epoch_of(uint64_t c) {
  return static_cast<uint32_t>(c >> 32);
}
constexpr uint64_t chunks_of(uint64_t c) {
  return (c >> 16) & 0xffff;
}
constexpr uint64_t next_of(uint64_t c) {
  return c & 0xffff;
}

// Sleeping and waking on the signal word: the futex calls themselves, no
// library layer between (what std::atomic::wait does varies by libstdc++).
void futex_wait(std::atomic<uint32_t>& word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAIT_PRIVATE, expected, nullptr,
          nullptr, 0);
}
void futex_wake_all(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
          nullptr, 0);
}
static_assert(sizeof(std::atomic<uint32_t>) == 4 && std::atomic<uint32_t>::is_always_lock_free);

int available_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

class Team {
 public:
  static Team& get() {
    // Never destroyed: workers are left blocked at exit rather than joined
    // from a static destructor.
    static Team* team = new Team(available_cores());
    return *team;
  }

  int size() const { return size_.load(std::memory_order_relaxed); }

  void resize(int threads) {
    acquire_busy();
    stop_workers();
    start_workers(threads);
    busy_.store(false, std::memory_order_release);
  }

  void run(int64_t n, bool parallel, ChunkFn fn, void* ctx) {
    if (n <= 0) return;
    const int team = size();
    if (!parallel || team <= 1 || n == 1 || busy_.exchange(true, std::memory_order_acquire)) {
      fn(ctx, 0, n, 0);
      return;
    }
    const int64_t chunks = std::min({n, team * kChunksPerThread, kMaxChunks});
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint32_t epoch = ++epoch_;
    claim_.store(pack(epoch, static_cast<uint64_t>(chunks), 0), std::memory_order_release);
    signal_.store(epoch, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(signal_);
    work(epoch, 0);
    // Only chunks that were claimed remain; wait for their claimers.
    for (int polls = 0; done_.load(std::memory_order_acquire) < chunks;) {
      if (++polls < kWaitPolls) {
        cpu_relax();
      } else {
        polls = 0;
        std::this_thread::yield();
      }
    }
    busy_.store(false, std::memory_order_release);
  }

 private:
  explicit Team(int threads) { start_workers(threads); }

  void acquire_busy() {
    while (busy_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
  }

  void start_workers(int threads) {
    stop_.store(false, std::memory_order_relaxed);
    // Each worker starts from the word as it is now, so that a job or a stop
    // published before the thread first runs is not missed.
    const uint32_t seen = signal_.load(std::memory_order_acquire);
    for (int slot = 1; slot < threads; ++slot) {
      workers_.emplace_back([this, slot, seen] { loop(slot, seen); });
    }
    size_.store(threads, std::memory_order_relaxed);
  }

  void stop_workers() {
    stop_.store(true, std::memory_order_seq_cst);
    signal_.store(++epoch_, std::memory_order_seq_cst);  // a new value: no job has it
    futex_wake_all(signal_);
    for (std::thread& t : workers_) t.join();
    workers_.clear();
    size_.store(1, std::memory_order_relaxed);
  }

  // Claims and runs chunks of job `epoch` until it has none left (or a later
  // job has replaced it).
  void work(uint32_t epoch, int slot) {
    const ChunkFn fn = fn_.load(std::memory_order_relaxed);
    void* const ctx = ctx_.load(std::memory_order_relaxed);
    const int64_t n = n_.load(std::memory_order_relaxed);
    uint64_t c = claim_.load(std::memory_order_acquire);
    for (;;) {
      if (epoch_of(c) != epoch || next_of(c) >= chunks_of(c)) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire)) {
        continue;
      }
      const auto chunks = static_cast<int64_t>(chunks_of(c));
      const auto i = static_cast<int64_t>(next_of(c));
      fn(ctx, i * n / chunks, (i + 1) * n / chunks, slot);
      done_.fetch_add(1, std::memory_order_release);
      c = claim_.load(std::memory_order_acquire);
    }
  }

  void loop(int slot, uint32_t seen) {
    for (;;) {
      auto since = std::chrono::steady_clock::now();
      uint32_t now;
      for (int polls = 0; (now = signal_.load(std::memory_order_acquire)) == seen;) {
        cpu_relax();
        if (++polls % 64 != 0) continue;
        if (std::chrono::steady_clock::now() - since < kSpin) continue;
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (signal_.load(std::memory_order_seq_cst) == seen) futex_wait(signal_, seen);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
        since = std::chrono::steady_clock::now();
      }
      if (stop_.load(std::memory_order_acquire)) return;
      seen = now;
      work(now, slot);
    }
  }

  std::atomic<int> size_{1};
  std::atomic<bool> busy_{false};  // a caller (or resize) holds the team
  std::atomic<bool> stop_{false};
  std::vector<std::thread> workers_;
  uint32_t epoch_ = 0;  // the latest job's epoch (written by the team's holder)

  // The current job: its fields are written before its claim word is published.
  std::atomic<ChunkFn> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0};
  alignas(64) std::atomic<uint64_t> claim_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<uint32_t> signal_{0};  // the latest epoch (a job's or a stop's)
  std::atomic<int> sleepers_{0};
};

}  // namespace

int team_size() {
  return Team::get().size();
}

void parallel_run(int64_t n, bool parallel, ChunkFn fn, void* ctx) {
  Team::get().run(n, parallel, fn, ctx);
}

}  // namespace cpu

int cpu_cores() {
  return cpu::available_cores();
}

void set_cpu_threads(int threads) {
  if (threads < 0 || threads > 4 * cpu_cores()) {
    fail("threads: {} is out of range (0 = all cores, at most {}: 4 x the {} cores)", threads,
         4 * cpu_cores(), cpu_cores());
  }
  const int want = threads == 0 ? cpu_cores() : threads;
  cpu::Team& team = cpu::Team::get();
  if (team.size() != want) team.resize(want);
}

int cpu_threads() {
  return cpu::team_size();
}

}  // namespace specula
