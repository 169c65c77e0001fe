// Waiting on a counter in shared memory: spin briefly, then yield, then sleep
// on a futex, so that ranks progress when there are more ranks than cores.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "core/function_ref.h"

namespace pyc {

// Watches a wait on behalf of the operation that waits. Either hook throws to
// stop the wait (abort, mismatch, dead peer, timeout).
class WaitMonitor {
 public:
  virtual ~WaitMonitor() = default;
  // The rank whose progress the current wait depends on (-1: several), set by
  // the transport before it waits, for error messages.
  int peer = -1;
  // How many polls (one pause each, ~35 ns) before polling between yields.
  // Short: a peer that shares our core (oversubscribed, or not yet spread out
  // by the scheduler) runs only once we yield, so every poll past a few
  // microseconds delays the very data we wait for.
  // wait_reached adapts it: doubled when data arrived while spinning or within
  // ~2 us of yielding (the peer was only late), halved when it took longer
  // (the peer needed our core, or was descheduled).
  int spin_polls = 256;
  int max_spin_polls = 256;
  // Per rank, or null: 1 where that rank is pinned to the one CPU this rank is
  // pinned to. Such a peer runs only once this rank gives the CPU up, so a
  // wait on it (peer) yields at once instead of spinning.
  const unsigned char* shares_cpu = nullptr;
  // No other rank of this host may run on this rank's CPUs (every rank pinned
  // apart): yielding cannot help a peer run, and hands the CPU to another
  // process for a whole time slice, so the wait spins where it would yield.
  bool spin_only = false;
  // How long a wait yields before it sleeps, in microseconds: the
  // communicator's (PYCOLL_YIELD_US when it was made); negative: the
  // process's PYCOLL_YIELD_US (a wait outside a communicator's operation).
  int64_t yield_us = -1;
  bool shares_cpu_with(int p) const { return p >= 0 && shares_cpu != nullptr && shares_cpu[p]; }
  // Called every few spins; must be cheap (one load).
  virtual void check_fast() = 0;
  // Called about once a millisecond after the wait has started sleeping.
  virtual void check_slow() = 0;
  // A copy into or out of rank `peer`'s process failed (the kernel refused
  // it): throws as check_slow does when that is because the peer died or
  // closed, giving its death a moment to show; returns otherwise, for the
  // caller to raise the copy's own error.
  virtual void peer_failed(int peer) = 0;
};

// PYCOLL_YIELD_US's largest value (10 s).
constexpr size_t kMaxYieldUs = 10'000'000;

// True when counter `value` has reached `target` (wrap-around safe).
inline bool reached(uint32_t value, uint32_t target) {
  return static_cast<int32_t>(value - target) >= 0;
}

// A counter with a count of sleeping waiters beside it, in shared memory: the
// words a wait and a publish use. Unaligned, so that other data can share its
// cache line (the one-shot areas' flag carries its payload, shm_layout.h).
struct Flag {
  std::atomic<uint32_t> value{0};
  std::atomic<uint32_t> sleepers{0};
};

// A Flag alone in its cache line.
struct alignas(64) Counter : Flag {};

// A hook the bindings install: returns true when the calling thread has a
// pending interrupt (Ctrl-C) that should stop its wait. Called about every
// millisecond by a sleeping wait; null when no hook is installed.
using InterruptCheck = bool (*)();
void set_interrupt_check(InterruptCheck fn);
InterruptCheck interrupt_check();

// What the calling thread does once before it stops running on the CPU
// (yields, sleeps, waits for the progress thread): the Python bindings let go
// of the GIL there, so that a call on a small message keeps it while it spins
// (saving its release and re-take) and still never blocks with it. One per
// thread, installed for the length of one call.
class BlockHook {
 public:
  virtual void before_block() = 0;

 protected:
  ~BlockHook() = default;
};
// Installs `hook` (or none) for the calling thread; returns the previous one.
BlockHook* set_block_hook(BlockHook* hook);
// Runs the calling thread's hook, if any (cheap when there is none).
void before_block();

// Blocks until reached(c.value, target); returns the value seen.
uint32_t wait_reached(Flag& c, uint32_t target, WaitMonitor& mon);

// Blocks until ready() returns true: for a wait on several counters at once
// (a receive from whichever peer sends first). Spins, yields, then polls
// every ~50 us, since no single futex word announces the event; the
// monitor's hooks run as in wait_reached (check_slow about once a
// millisecond once the spin is over).
void wait_until(FunctionRef<bool()> ready, WaitMonitor& mon);

// Stores `value` (release) and wakes sleepers, if any.
void publish(Flag& c, uint32_t value);

}  // namespace pyc
