// The watchdog of one operation: bounds every wait by the timeout, notices
// aborts, dead peers and mismatched collectives, and says who is to blame.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "comm/communicator.h"

namespace pyc {

class OpMonitor final : public WaitMonitor {
 public:
  // collective: seq is a collective sequence number (else a point-to-point one).
  OpMonitor(Communicator& comm, const OpSig& sig, uint32_t seq, bool collective, double timeout_s);
  ~OpMonitor() override;  // hands the adapted spin budget back; clears the published wait
  void check_fast() override;
  void check_slow() override;
  void peer_failed(int peer) override;
  std::chrono::steady_clock::time_point start() const { return start_; }

 private:
  [[noreturn]] void timed_out();
  // Who the timeout is for: a rank that has not reached the operation, else,
  // following who waits for whom from `peer`, the first rank in the operation
  // that is not waiting for another (stopped, or busy), written into *why.
  int culprit(std::string* why) const;
  void check_mismatch();
  void check_peers();
  void check_peer(int p);  // throws PeerFailure if rank p died or closed
  // This rank is closing with the operation pending: aborts it once a peer
  // has stayed away from it, idle, for a moment (a point-to-point one: once
  // it has waited that long).
  void check_closing(std::chrono::steady_clock::time_point now);
  // Publishes what this rank waits for (RankCtl::waiting, beat_ns).
  void publish_wait(std::chrono::steady_clock::time_point now);

  Communicator& c_;
  OpSig sig_;
  uint32_t seq_;
  bool collective_;
  bool published_ = false;  // RankCtl::waiting holds this operation's wait
  double timeout_s_;
  int64_t stale_ns_;                   // see culprit()
  const char* doing_ = "waiting for";  // what this rank did with `peer`, for the messages
  std::chrono::steady_clock::time_point start_, deadline_, next_liveness_;
  std::chrono::steady_clock::time_point closing_since_{};  // check_closing's first look
  std::chrono::steady_clock::time_point next_refresh_{};   // check_closing's next question
};

}  // namespace pyc
