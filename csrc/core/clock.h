// Time on the steady clock: elapsed times and deadlines from seconds.
#pragma once

#include <chrono>
#include <cstdint>

namespace pyc {

using Clock = std::chrono::steady_clock;

inline uint64_t elapsed_ns(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

}  // namespace pyc
