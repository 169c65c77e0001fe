// How far apart two CPUs are: the round trip of a cache line between them.
//
// The benchmarks record it because on a virtual machine it is not fixed: the
// 2-vCPU VM this project is measured on shows ~50-120 ns at some times and
// ~400 ns at others, switching within seconds to minutes (presumably as the
// host moves its vCPUs between cores that share a cache and cores that do
// not), and every collective that reads data another CPU wrote slows with it:
// a 4-rank 64 MiB all-reduce on the ring, ring neighbours on different CPUs,
// takes ~12.5 ms at the one and ~27 ms at the other (docs/benchmarks.md,
// "Reading the CPU figures").
#pragma once

namespace pyc {

// Median over 5 rounds of the time (ns) one cache line takes to go from CPU
// `cpu_a` to CPU `cpu_b` and back, measured by two threads pinned there that
// pass a counter `round_trips / 5` times a round. Throws InvalidArgument for
// equal or negative CPUs or round_trips < 5, pyc::Error when a thread cannot
// be pinned (a CPU this process may not use) or a round exceeds one second.
double cpu_round_trip_ns(int cpu_a, int cpu_b, int round_trips);

}  // namespace pyc
