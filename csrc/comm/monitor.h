// The watchdog of one operation: bounds every wait by the timeout, notices
// aborts, dead peers and mismatched collectives, and says who is to blame.
#pragma once

#include <chrono>

#include "comm/communicator.h"

namespace pyc {

class OpMonitor final : public WaitMonitor {
 public:
  // collective: seq is a collective sequence number (else a point-to-point one).
  OpMonitor(Communicator& comm, const OpSig& sig, uint32_t seq, bool collective, double timeout_s);
  ~OpMonitor() override;  // hands the adapted spin budget back to the communicator
  void check_fast() override;
  void check_slow() override;
  void peer_failed(int peer) override;
  std::chrono::steady_clock::time_point start() const { return start_; }

 private:
  [[noreturn]] void timed_out();
  void check_mismatch();
  void check_peers();
  void check_peer(int p);  // throws PeerFailure if rank p died or closed

  Communicator& c_;
  OpSig sig_;
  uint32_t seq_;
  bool collective_;
  double timeout_s_;
  const char* doing_ = "waiting for";  // what this rank did with `peer`, for the messages
  std::chrono::steady_clock::time_point start_, deadline_, next_liveness_;
};

}  // namespace pyc
