#include "core/cpu_probe.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#include "core/error.h"

namespace pyc {
namespace {

using Clock = std::chrono::steady_clock;

void pin_self(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  PYC_ERRCHECK(pthread_setaffinity_np(pthread_self(), sizeof set, &set));
}

// The line the two threads pass: odd values are the ping, even the pong.
struct alignas(64) Line {
  std::atomic<uint32_t> value{0};
  std::atomic<bool> stop{false};  // a round ran past its deadline or a thread failed
};

// Spins until line.value == want; false when stopped or past `deadline`.
bool await(Line& line, uint32_t want, Clock::time_point deadline) {
  for (uint32_t spins = 1;; ++spins) {
    if (line.value.load(std::memory_order_acquire) == want) return true;
    if ((spins & 4095) == 0 &&
        (line.stop.load(std::memory_order_relaxed) || Clock::now() > deadline))
      return false;
  }
}

}  // namespace

double cpu_round_trip_ns(int cpu_a, int cpu_b, int round_trips) {
  if (cpu_a < 0 || cpu_b < 0 || cpu_a == cpu_b || cpu_a >= CPU_SETSIZE || cpu_b >= CPU_SETSIZE)
    PYC_THROW(InvalidArgument, "pycollectives: cpu_round_trip_ns: cpu_a and cpu_b must be two "
                                   << "different CPUs, not " << cpu_a << " and " << cpu_b);
  if (round_trips < 5)
    PYC_THROW(InvalidArgument,
              "pycollectives: cpu_round_trip_ns: round_trips must be >= 5, not " << round_trips);
  constexpr int kRounds = 5;
  const uint32_t per_round = static_cast<uint32_t>(round_trips / kRounds);
  Line line;
  std::exception_ptr failed_a, failed_b;
  std::atomic<int> ready{0};
  std::vector<double> ns;

  // B answers every ping (odd value v) with v + 1.
  std::thread b([&] {
    try {
      pin_self(cpu_b);
      ready.fetch_add(1);
      const auto deadline = Clock::now() + std::chrono::seconds(kRounds + 2);
      for (uint32_t v = 1; v < 2 * per_round * kRounds; v += 2) {
        if (!await(line, v, deadline)) return;
        line.value.store(v + 1, std::memory_order_release);
      }
    } catch (...) {
      failed_b = std::current_exception();
      line.stop.store(true);
    }
  });
  // A pings and times each round.
  std::thread a([&] {
    try {
      pin_self(cpu_a);
      ready.fetch_add(1);
      while (ready.load() < 2 && !line.stop.load()) std::this_thread::yield();
      uint32_t v = 0;
      for (int r = 0; r < kRounds && !line.stop.load(); ++r) {
        const auto start = Clock::now();
        const auto deadline = start + std::chrono::seconds(1);
        for (uint32_t i = 0; i < per_round; ++i) {
          line.value.store(v + 1, std::memory_order_release);
          v += 2;
          if (!await(line, v, deadline)) {
            line.stop.store(true);
            PYC_THROW(Error, "pycollectives: cpu_round_trip_ns: CPU "
                                 << cpu_b << " did not answer CPU " << cpu_a << " within 1 s");
          }
        }
        const std::chrono::duration<double, std::nano> took = Clock::now() - start;
        ns.push_back(took.count() / per_round);
      }
    } catch (...) {
      failed_a = std::current_exception();
      line.stop.store(true);
    }
  });
  a.join();
  b.join();
  if (failed_a) std::rethrow_exception(failed_a);
  if (failed_b) std::rethrow_exception(failed_b);
  std::sort(ns.begin(), ns.end());
  return ns[ns.size() / 2];
}

}  // namespace pyc
