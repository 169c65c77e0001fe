// Spin, yield, then futex: see wait.h.
#include "core/wait.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <climits>

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

constexpr int kYieldRounds = 256;  // polls between sched_yield calls before sleeping
constexpr int kMinSpinPolls = 4;
constexpr long kSleepNs = 1000000;  // futex sleep slice: 1 ms

// Shared (not private) futex: the word lives in memory mapped by several processes.
long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

std::atomic<InterruptCheck> g_interrupt_check{nullptr};

}  // namespace

void set_interrupt_check(InterruptCheck fn) { g_interrupt_check.store(fn); }
InterruptCheck interrupt_check() { return g_interrupt_check.load(std::memory_order_relaxed); }

uint32_t wait_reached(Counter& c, uint32_t target, WaitMonitor& mon) {
  uint32_t v = c.value.load(std::memory_order_acquire);
  if (reached(v, target)) return v;
  // Poll after every pause: a pause costs ~140 cycles on recent Intel cores,
  // and data that waits for a batch of them is noticed a microsecond late.
  for (int i = 0; i < mon.spin_polls; ++i) {
    PYC_PAUSE();
    v = c.value.load(std::memory_order_acquire);
    if (reached(v, target)) {
      if (mon.spin_polls < mon.max_spin_polls) mon.spin_polls *= 2;
      return v;
    }
    if ((i & 63) == 63) mon.check_fast();
  }
  if (mon.spin_polls > kMinSpinPolls) mon.spin_polls /= 2;
  for (int r = 0; r < kYieldRounds; ++r) {
    sched_yield();
    v = c.value.load(std::memory_order_acquire);
    if (reached(v, target)) return v;
    mon.check_fast();
  }
  const timespec slice{0, kSleepNs};
  for (;;) {
    c.sleepers.fetch_add(1, std::memory_order_seq_cst);
    v = c.value.load(std::memory_order_seq_cst);
    if (!reached(v, target)) {
      // EAGAIN (value changed), EINTR and ETIMEDOUT all just mean: look again.
      futex(&c.value, FUTEX_WAIT, v, &slice);
    }
    c.sleepers.fetch_sub(1, std::memory_order_relaxed);
    v = c.value.load(std::memory_order_acquire);
    if (reached(v, target)) return v;
    mon.check_fast();
    mon.check_slow();
  }
}

void publish(Counter& c, uint32_t value) {
  c.value.store(value, std::memory_order_release);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (c.sleepers.load(std::memory_order_relaxed) != 0)
    futex(&c.value, FUTEX_WAKE, INT_MAX, nullptr);
}

}  // namespace pyc
