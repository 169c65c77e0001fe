// Where a collective on plain buffers takes single copy (CMA, algo/cma.cc)
// rather than the slots: in size bands where it can win (cma_band), and there
// only where it measured faster on this machine (CmaTuner).
//
// How fast the kernel copies between processes, against how fast a process
// copies in user space, differs by more from one machine to the next than the
// margins between the two paths: on the project's 2-core Intel VM single copy
// won by up to 2.3x inside the bands, on a 2-core AMD one it lost nearly always,
// by up to 5x (docs/benchmarks.md, "Single copy against the slots"). A
// fixed table tuned on one is wrong on the other, so each communicator times
// both paths on the first calls of each collective and size class and keeps
// the faster, as autotuners (Horovod's, oneCCL's) do for their knobs.
#pragma once

#include <array>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/types.h"

namespace pyc {

// Sizes are nccl-tests': the all-reduce, reduce and broadcast buffer, the
// reduce-scatter input, the all-gather and all-to-all output.
size_t cma_total(const OpSig& sig, int nranks);

// Whether single copy can beat the slots (and, for all-gather and broadcast,
// the one-shot areas) for a collective of `kind` moving `total` bytes on `n`
// ranks: the bands where it measured faster on some machine. A batch_p2p
// (`total`: the bytes of its sends of single-copy size) is in whenever it has
// such sends.
bool cma_band(OpKind kind, int n, size_t total);

// One rank's choice, per collective and size class (a power of two of bytes),
// between single copy and the slots. Each class runs one untimed call on
// single copy (pages faulted in, scratch allocated), then kTrials timed calls
// of each path alternately, then keeps the path with the lower best time per
// byte.
//
// Every rank keeps its own tuner over the same sequence of operations, so all
// try the same path at the same call. Their decisions rest on their own
// timings and may differ; a collective takes single copy only where every rank
// prefers it (Communicator::cma), so all ranks still take the same path.
class CmaTuner {
 public:
  static constexpr uint32_t kTrials = 2;

  struct Choice {
    bool cma;    // this rank prefers single copy
    bool timed;  // a trial: record() its time
  };

  // `enabled` false: prefer single copy throughout the bands (PYCOLL_CMA_TUNE=0).
  explicit CmaTuner(bool enabled = true) : enabled_(enabled) {}
  // This rank's choice for its next collective of `kind` moving `total` bytes
  // (inside a band). Call once per operation, in the order the operations
  // run, after the previous one's time was recorded.
  Choice choose(OpKind kind, size_t total);
  // Records how long a timed operation took, and whether it ran on single copy.
  void record(OpKind kind, size_t total, bool ran_cma, uint64_t ns);
  // The decision for the class of (kind, total): 1 single copy, 0 the slots,
  // -1 still trying.
  int decided(OpKind kind, size_t total) const;

  // What one size class of one kind measured, for comm.cma_tuning(): safe to
  // read from another thread while operations run.
  struct Report {
    size_t from_bytes;  // the class: [from_bytes, 2 * from_bytes)
    int decided;        // as decided()
    double best[2];     // least ns per byte timed, [slots, cma]; HUGE_VAL: none yet
  };
  // The classes of `kind` that ran at least one operation, smallest first.
  std::vector<Report> report(OpKind kind) const;

 private:
  // Written by the engine's thread only; atomic so report() may read them.
  struct Class {
    std::atomic<uint32_t> calls{0};
    std::atomic<int8_t> decided{-1};
    std::atomic<double> best[2] = {HUGE_VAL, HUGE_VAL};  // least ns per byte, [slots, cma]
  };
  static constexpr int kClasses = 64;
  static int size_class(size_t total);  // floor(log2(total))
  Class& at(OpKind kind, size_t total);

  bool enabled_;
  std::array<std::array<Class, kClasses>, kNumOpKinds> classes_{};
};

}  // namespace pyc
