// Time on the steady clock: elapsed times, and deadlines from seconds that may
// be infinite.
#pragma once

#include <chrono>
#include <cstdint>

namespace pyc {

using Clock = std::chrono::steady_clock;

inline uint64_t elapsed_ns(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

// Timeouts from this many seconds on (about 31 years) wait forever: inf,
// 1e300 and timedelta.max among them. Below it, `from + seconds` fits the
// clock's 64-bit nanoseconds.
constexpr double kForeverSeconds = 1e9;

inline bool is_forever(double seconds) { return !(seconds < kForeverSeconds); }

// `from` + `seconds` (> 0, not NaN: checked by the callers), or the end of
// time for a timeout that waits forever.
inline Clock::time_point deadline_after(Clock::time_point from, double seconds) {
  if (is_forever(seconds)) return Clock::time_point::max();
  return from + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace pyc
