// Spin, yield, then futex: see wait.h.
#include "core/wait.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <utility>

#include "core/env.h"
#include "core/error.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PYC_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define PYC_PAUSE() asm volatile("yield")
#else
#define PYC_PAUSE() \
  do {              \
  } while (0)
#endif

namespace pyc {
namespace {

// How long a wait yields before it sleeps (PYCOLL_YIELD_US, default 1000).
// Ranks that outnumber the cores wait for peers that are descheduled, often
// for hundreds of microseconds; a wait that fell asleep then costs the op a
// wake-up (and the peers the sleeper's absence): 4 ranks on 2 cores, 16-byte
// all-reduce, 14-34 us per call with 256 yields (~0.1 ms) before sleeping,
// 7-12 us with ~1 ms. Alone on its core a yielding wait burns that core for as
// long.
// Liveness does not depend on it: the monitor's slow checks (timeouts, dead
// peers, mismatches, Ctrl-C) run every kSlowEvery while yielding too. A wait
// whose rank has its CPUs to itself (WaitMonitor::spin_only) spins this long
// instead of yielding.
// Read per communicator (CommConfig::from_env, range-checked there) into
// WaitMonitor::yield_us; a wait without one reads the process's setting.
std::chrono::microseconds yield_for(const WaitMonitor& mon) {
  if (mon.yield_us >= 0) return std::chrono::microseconds(mon.yield_us);
  static const auto us =
      std::chrono::microseconds(env_size("PYCOLL_YIELD_US", 1000, 0, kMaxYieldUs));
  return us;
}
constexpr int kMinSpinPolls = 4;
constexpr std::chrono::nanoseconds kLate{2000};  // see wait_reached
constexpr long kSleepNs = 1000000;               // futex sleep slice: 1 ms
constexpr long kPollNs = 50000;                  // wait_until's nap between polls
constexpr std::chrono::milliseconds kSlowEvery{1};

// Doubles or halves the spin budget, within [kMinSpinPolls, max_spin_polls].
void adapt_spin(WaitMonitor& mon, bool longer) {
  if (longer)
    mon.spin_polls = std::min(mon.spin_polls * 2, mon.max_spin_polls);
  else
    mon.spin_polls = std::max(mon.spin_polls / 2, kMinSpinPolls);
}

// Shared (not private) futex: the word lives in memory mapped by several
// processes. EAGAIN (the value changed), EINTR and ETIMEDOUT just mean: look
// again; anything else (EFAULT, EINVAL, ENOSYS) is a bug or a broken mapping.
void futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  if (syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0) == -1 &&
      errno != EAGAIN && errno != EINTR && errno != ETIMEDOUT)
    detail::throw_sys(__FILE__, __LINE__,
                      op == FUTEX_WAKE ? "futex(FUTEX_WAKE)" : "futex(FUTEX_WAIT)", errno);
}

std::atomic<InterruptCheck> g_interrupt_check{nullptr};

thread_local BlockHook* t_block_hook = nullptr;

}  // namespace

BlockHook* set_block_hook(BlockHook* hook) { return std::exchange(t_block_hook, hook); }

void before_block() {
  if (t_block_hook != nullptr) t_block_hook->before_block();
}

void set_interrupt_check(InterruptCheck fn) { g_interrupt_check.store(fn); }
InterruptCheck interrupt_check() { return g_interrupt_check.load(std::memory_order_relaxed); }

uint32_t wait_reached(Flag& c, uint32_t target, WaitMonitor& mon) {
  uint32_t v = c.value.load(std::memory_order_acquire);
  if (reached(v, target)) return v;
  // A peer on this rank's own CPU runs only once this rank yields: no spin.
  const bool mate = mon.shares_cpu_with(mon.peer);
  // Poll after every pause: a pause costs ~140 cycles on recent Intel cores,
  // and data that waits for a batch of them is noticed a microsecond late.
  for (int i = 0, polls = mate ? 0 : mon.spin_polls; i < polls; ++i) {
    PYC_PAUSE();
    v = c.value.load(std::memory_order_acquire);
    if (reached(v, target)) {
      adapt_spin(mon, true);
      return v;
    }
    if ((i & 63) == 63) mon.check_fast();
  }
  // The spin ran out. Data that comes within a couple of microseconds of
  // yielding was only late, and a longer spin would have caught it without a
  // system call: spin longer next time. Data that takes longer needed this
  // core (a peer on it ran) or a peer that was descheduled: spin less.
  before_block();
  const auto yielded = std::chrono::steady_clock::now();
  auto slow_at = yielded + kSlowEvery;
  for (int r = 1;; ++r) {
    if (mon.spin_only)
      PYC_PAUSE();
    else
      sched_yield();
    v = c.value.load(std::memory_order_acquire);
    if (reached(v, target)) {
      if (!mate) adapt_spin(mon, std::chrono::steady_clock::now() - yielded < kLate);
      return v;
    }
    mon.check_fast();
    if (r % 16 != 0) continue;
    const auto now = std::chrono::steady_clock::now();
    if (now - yielded > yield_for(mon)) break;
    if (now >= slow_at) {
      mon.check_slow();
      slow_at = now + kSlowEvery;
    }
  }
  if (!mate) adapt_spin(mon, false);
  const timespec slice{0, kSleepNs};
  for (;;) {
    c.sleepers.fetch_add(1, std::memory_order_seq_cst);
    v = c.value.load(std::memory_order_seq_cst);
    if (!reached(v, target)) {
      try {
        futex(&c.value, FUTEX_WAIT, v, &slice);
      } catch (...) {
        c.sleepers.fetch_sub(1, std::memory_order_relaxed);
        throw;
      }
    }
    c.sleepers.fetch_sub(1, std::memory_order_relaxed);
    v = c.value.load(std::memory_order_acquire);
    if (reached(v, target)) return v;
    mon.check_fast();
    mon.check_slow();
  }
}

void wait_until(FunctionRef<bool()> ready, WaitMonitor& mon) {
  if (ready()) return;
  for (int i = 0; i < mon.spin_polls; ++i) {
    PYC_PAUSE();
    if (ready()) return;
    if ((i & 63) == 63) mon.check_fast();
  }
  using Clock = std::chrono::steady_clock;
  before_block();
  const auto yielded = Clock::now();
  auto slow_at = yielded + kSlowEvery;
  auto checks = [&] {
    mon.check_fast();
    const auto now = Clock::now();
    if (now >= slow_at) {
      mon.check_slow();
      slow_at = now + kSlowEvery;
    }
    return now;
  };
  for (int r = 1;; ++r) {
    if (mon.spin_only)
      PYC_PAUSE();
    else
      sched_yield();
    if (ready()) return;
    if (mon.spin_only && r % 16 != 0) continue;
    if (checks() - yielded > yield_for(mon)) break;
  }
  const timespec nap{0, kPollNs};
  for (;;) {
    nanosleep(&nap, nullptr);
    if (ready()) return;
    checks();
  }
}

void publish(Flag& c, uint32_t value) {
  c.value.store(value, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (c.sleepers.load(std::memory_order_relaxed) != 0)
    futex(&c.value, FUTEX_WAKE, INT_MAX, nullptr);
}

}  // namespace pyc
