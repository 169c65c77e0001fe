// The accepting side of a rank's TCP connections (the network thread's): the
// listening socket, the connections accepted whose handshake (tcp_auth.h) is
// not complete yet, and the handshake's accepting half.
//
// Anyone who reaches the port can connect, so a flood of connections must
// cost the job's own connections nothing:
// - a connection has kHandshakeTime (1 s) from its accept to its proof;
// - at most kMaxPending (256) are pending, at most kMaxPerSource (64) from
//   one address. A new connection past either limit evicts the oldest
//   pending one of the address holding the most (of its own address past
//   the second): a flood displaces itself, and a legitimate connection, whose
//   handshake takes a few round trips, is never the oldest for long. (The
//   connecting side tries a dropped connection again: tcp_auth.h, dial.)
// - garbage is refused at its first bytes; the accept loop takes at most 64
//   connections per wake, so the thread's other work goes on;
// - every refusal, eviction and expiry is counted and logged to stderr, at
//   most kLogBurst lines at once and one a second after that, each saying
//   how many were left out since the last (and a last line with those left
//   out when it stops listening);
// - once every connection this rank expects is in (TcpNet counts them), the
//   socket stops listening: a finished set-up has no open port.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/clock.h"
#include "transport/tcp/tcp_auth.h"

namespace pyc {

// What the listener asks of its network layer about a connection whose Hello
// arrived.
class ListenerHost {
 public:
  virtual ~ListenerHost() = default;
  // Whether this rank expects connection `h` (its version checked already):
  // Refusal::kNone, or why not (*why: the log's words).
  virtual Refusal vet(const Hello& h, std::string* why) = 0;
  // The connection passed its handshake: take socket fd (no longer in the
  // poll set), or refuse it (kDuplicate: that one is connected already).
  virtual Refusal adopt(const Hello& h, int fd, std::string* why) = 0;
};

class TcpListener {
 public:
  static constexpr size_t kMaxPending = 256, kMaxPerSource = 64;
  static constexpr auto kHandshakeTime = std::chrono::seconds(1);
  static constexpr int kLogBurst = 10;

  // Listens on `addr` (port 0: any). Pending connections go into epoll set
  // `epoll_fd` with data pending_tag + their slot; the listening socket with
  // listen_tag.
  TcpListener(int rank, const SockAddr& addr, const NetKey& key, const NetConfig& cfg, int epoll_fd,
              uint64_t listen_tag, uint64_t pending_tag, ListenerHost& host);
  ~TcpListener();
  TcpListener(const TcpListener&) = delete;
  TcpListener& operator=(const TcpListener&) = delete;

  // The address it listens on (the one its handshakes sign).
  const SockAddr& address() const { return addr_; }
  void on_accept();
  void on_pending(size_t slot);
  // Refuses the handshakes past their time.
  void expire();
  // Stops listening and drops what is pending (every expected connection is
  // in). Idempotent.
  void stop();
  bool listening() const { return fd_ >= 0; }
  // Connections refused, evicted or expired so far.
  uint64_t refused() const { return refused_.load(); }

 private:
  struct Pending;
  void refuse(size_t slot, Refusal status, const std::string& why);
  void evict_for(const std::string& source);
  void log(const std::string& from, const std::string& why);
  void flush_log();         // the count of lines left out, if any
  bool answer(Pending& p);  // sends the Challenge: false if it could not
  void finish(size_t slot);

  int rank_;
  SockAddr addr_;
  NetKey key_;
  NetConfig cfg_;
  int fd_ = -1, epoll_fd_;
  uint64_t pending_tag_;
  ListenerHost& host_;
  std::vector<std::unique_ptr<Pending>> pending_;
  uint64_t accepted_ = 0;  // the order of accepts (pending connections' age)
  std::atomic<uint64_t> refused_{0};
  double log_tokens_ = kLogBurst;  // lines that may go now
  Clock::time_point log_last_ = Clock::now();
  uint64_t log_held_ = 0;  // lines left out since the last
};

}  // namespace pyc
