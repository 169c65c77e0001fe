// The question a rank asks the other hosts when an operation times out (where
// are your host's ranks?) and its answers: which host answered, and which was
// asked and stayed silent (control.cc; the frames: CtlQuery, CtlStatusEntry in
// transport/tcp/tcp_socket.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/clock.h"
#include "core/function_ref.h"
#include "core/topology.h"
#include "transport/tcp/tcp_net.h"

namespace pyc {

class StatusQuery {
 public:
  // Asks a control peer on every other host (its first alive one) where its
  // host's ranks are; returns once all answered (take) or at `deadline`.
  void ask(TcpNet& net, const Topology& topo, Clock::time_point deadline);
  // A kStatus frame from `peer` (its body: `bytes` at `body`, unchecked): if it
  // answers the latest question and comes from the rank asked, once, `take`
  // gets each entry that speaks for a rank of peer's host.
  void answer(const Topology& topo, int peer, const char* body, uint32_t bytes,
              FunctionRef<void(const CtlStatusEntry&)> take);
  // After ask: -1 if rank p's host answered (or p is of this host); else the
  // rank of p's host that was asked and did not answer, or -2 if none could be
  // asked (its connection gone) or none was asked yet.
  int silent_link(const Topology& topo, int p);

 private:
  std::mutex mu_;
  std::atomic<uint64_t> id_{0};
  std::atomic<int> answers_{0};
  std::vector<int> asked_;      // by host: the rank the last query asked (-2: none)
  std::vector<bool> answered_;  // by host: whether it answered
};

}  // namespace pyc
