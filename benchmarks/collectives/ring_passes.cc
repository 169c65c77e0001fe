// The compute floor of a 2-rank ring all-reduce: one rank's three passes over
// its data (copy half into a slot, reduce the other half with a slot into the
// buffer and the next slot, copy a slot out), run alone on one core with the
// library's kernels, so no waiting and no cross-core traffic is included.
//
//   g++ -std=c++17 -O3 -Icsrc benchmarks/collectives/ring_passes.cc csrc/reduce/*.cc csrc/core/types.cc \
//       -o /tmp/ring_passes && /tmp/ring_passes [MiB]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "reduce/reduce.h"

using namespace pyc;
using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  const size_t total = (argc > 1 ? std::atoi(argv[1]) : 8) * (size_t{1} << 20);
  const size_t half = total / 2, slot = 256 << 10;
  std::vector<float> user(total / 4, 1.0f), peer(total / 4, 2.0f);
  std::vector<char> slots(4 * slot);
  char* u = reinterpret_cast<char*>(user.data());
  char* p = reinterpret_cast<char*>(peer.data());
  std::vector<double> times;
  for (int rep = 0; rep < 11; ++rep) {
    double t_send = 0, t_reduce = 0, t_recv = 0;
    for (size_t off = 0; off < half; off += slot) {
      char* s0 = &slots[(off / slot % 4) * slot];
      char* s1 = &slots[((off / slot + 1) % 4) * slot];
      auto a = Clock::now();
      copy(s0, nullptr, u + half + off, slot);  // send
      auto b = Clock::now();
      const void* srcs[2] = {p + off, u + off};
      reduce(ReduceArgs{DataType::kFloat32, ReduceOp::kSum, u + off, s1, srcs, 2, slot / 4});
      auto c = Clock::now();
      copy(u + half + off, nullptr, p + half + off, slot);  // recv
      auto d = Clock::now();
      t_send += std::chrono::duration<double>(b - a).count();
      t_reduce += std::chrono::duration<double>(c - b).count();
      t_recv += std::chrono::duration<double>(d - c).count();
    }
    const double t = t_send + t_reduce + t_recv;
    times.push_back(t);
    std::printf(
        "%zu MiB: %.0f us (send %.0f, reduce %.0f, recv %.0f): busbw bound %.2f GB/s [%s]\n",
        total >> 20, t * 1e6, t_send * 1e6, t_reduce * 1e6, t_recv * 1e6, total / t / 1e9,
        simd_level());
  }
  return 0;
}
