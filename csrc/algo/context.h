// What an algorithm needs to run one operation: who it is, the operation's
// tag, the links to its peers and the monitor that bounds every wait.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/types.h"
#include "core/wait.h"
#include "reduce/reduce.h"
#include "transport/conn.h"

namespace pyc {

// The links of one communicator, provided by its transport.
class Links {
 public:
  virtual ~Links() = default;
  virtual SendConn& send_to(int peer) = 0;
  virtual RecvConn& recv_from(int peer) = 0;
  // A slot from `peer` carried another operation's tag: report and throw.
  [[noreturn]] virtual void tag_mismatch(int peer, const SlotTag& got, const SlotTag& want) = 0;
};

// Runs an operation's copy and reduce kernels somewhere other than on the
// calling CPU thread (the CUDA path: on the communicator's stream, over
// device memory). Same semantics as reduce/reduce.h.
class KernelExec {
 public:
  virtual ~KernelExec() = default;
  virtual void reduce(const ReduceArgs& args) = 0;
  virtual void scale_avg(void* x, DataType dtype, size_t count, int divisor) = 0;
  virtual void copy(void* dst0, void* dst1, const void* src, size_t bytes) = 0;
};

// How an operation moved its bytes (counted per collective in the stats).
// Across hosts: kHier, in two levels (within each host, then across hosts by
// the hosts' ranks in parallel, or the reverse); kFlat, one ring or chain
// over every rank (shared memory and TCP links), host by host.
enum class Path : int { kSlots = 0, kOneShot, kDirect, kCma, kHier, kFlat };
constexpr int kNumPaths = 6;
inline const char* path_name(Path p) {
  static const char* const names[kNumPaths] = {"slots", "oneshot",      "direct",
                                               "cma",   "hierarchical", "flat"};
  return names[static_cast<int>(p)];
}

struct OpCtx {
  int rank = 0;
  int nranks = 1;
  DataType dtype = DataType::kFloat32;
  ReduceOp op = ReduceOp::kSum;  // as called; kAvg sums, then divides once
  // kAvg divides by this (0: nranks): a schedule over some of the ranks
  // (a host's, a rail across hosts) that finishes an average of them all.
  int avg_div = 0;
  SlotTag tag;  // what this rank's slots carry and expects
  Links* links = nullptr;
  WaitMonitor* mon = nullptr;
  KernelExec* exec = nullptr;  // null: host memory, the CPU kernels run inline
  uint64_t bytes_sent = 0;
  uint64_t bytes_recv = 0;
  Path path = Path::kSlots;
  uint64_t taken_over = 0;  // single copy: chunks of other ranks' parts this rank did
  // How copies write the caller's output: streamed past the caches when the
  // operation's output is larger than they are (Communicator::output_store).
  Store out_store = Store::kCached;

  size_t esize() const { return dtype_size(dtype); }
  int avg_divisor() const { return avg_div > 0 ? avg_div : nranks; }
  int mod(long i) const { return static_cast<int>(((i % nranks) + nranks) % nranks); }
};

}  // namespace pyc
