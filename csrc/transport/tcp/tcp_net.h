// The TCP side of a communicator whose ranks span hosts: its listening socket,
// its connections to the ranks of other hosts and its network thread.
//
// Every rank listens on one address (published through the bootstrap store,
// or for split through the parent; tcp_listener.h). Two kinds of connection
// reach it, each opened with a handshake (tcp_auth.h) that proves both sides
// hold the communicator's key and names the communicator, the two ranks, the
// kind and the stripe:
// - a control connection with each of its cross-host peers (Topology::xpeers:
//   one rank on every other host), made at connect() by the lower rank. The
//   network thread reads them: goodbyes (close()), and the frames it hands
//   the communicator's control plane (NetHost, comm/control.cc): the errors a
//   rank reports (so that every host aborts, not just the ones that saw it)
//   and the questions a timeout asks of another host (who is late). Keepalive probes
//   and TCP_USER_TIMEOUT find a dead host or a cut link within
//   PYCOLL_NET_TIMEOUT;
// - data connections, one direction each (tcp_conn.h), made by the sender the
//   first time an algorithm sends to that peer.
// A connection whose handshake fails (not the protocol, another communicator
// or rank, a proof that does not verify, one connected already, too slow) is
// closed, counted and logged; nothing else changes. Once every connection
// this rank expects is in, it stops listening.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/function_ref.h"
#include "core/topology.h"
#include "transport/tcp/tcp_conn.h"
#include "transport/tcp/tcp_listener.h"

namespace pyc {

// What the network thread hands its communicator (comm/control.cc): every
// control frame from a control peer (rank `peer`, of another host) but the
// goodbye, which the transport takes itself (peer_gone). Called on the network
// thread; `body` holds `bytes` (at most kMaxCtlBody) as they came, unchecked.
class NetHost {
 public:
  virtual ~NetHost() = default;
  virtual void on_control(int peer, uint32_t type, const char* body, uint32_t bytes) = 0;
};

class TcpNet final : public ListenerHost {
 public:
  // Listens at once (the address goes to the store before the peers connect).
  // `key`: the communicator's (tcp_auth.h). `hint`: the store's address
  // (MASTER_ADDR), for the choice of interface.
  TcpNet(const Topology& topo, const NetConfig& cfg, const uint8_t comm_id[16], const NetKey& key,
         size_t slot_bytes, uint32_t nslots, NetHost& host, const std::string& hint);
  ~TcpNet();
  TcpNet(const TcpNet&) = delete;
  TcpNet& operator=(const TcpNet&) = delete;

  // "ip:port" to publish, and the interface it is on.
  const std::string& address() const { return address_; }
  const std::string& interface() const { return iface_; }
  // The control connections, in two steps (split across hosts agrees between
  // them, over the parent, that every rank made its own): dial(addrs), addrs[r]
  // rank r's address, starts the network thread and makes this rank's control
  // connections (to its higher control peers), raising if one fails;
  // await_peers() returns once the lower peers' are up too. Both raise at the
  // deadline, and whatever `check` raises (called about every 10 ms).
  void dial(const std::vector<std::string>& addrs, Clock::time_point deadline,
            FunctionRef<void()> check);
  void await_peers(Clock::time_point deadline, FunctionRef<void()> check);

  SendConn* send_conn(int p) { return send_[p].get(); }
  RecvConn* recv_conn(int p) { return recv_[p].get(); }
  // Why peer p (of another host) is gone, or "" while it is not known to be.
  // A clean close is reported only once its data to this rank has been read.
  std::string peer_gone(int p);
  // Queues a control frame of `type` (CtlType) to control peer `peer`: `body`
  // then `more` (either may be empty); the thread sends what the kernel does
  // not take at once. Dropped if the connection is gone (the read side reports it).
  void send_ctl(int peer, uint32_t type, const void* body, uint32_t bytes,
                const void* more = nullptr, uint32_t more_bytes = 0);
  // The ranks this rank keeps a control connection with (Topology::xpeers).
  const std::vector<int>& control_peers() const { return xpeers_; }
  // Whether peer p is not known to be gone (died, unreachable or closed).
  bool peer_alive(int p) const;
  // A data connection has frames queued: the thread writes them as it can.
  void want_write(int peer);
  // Connections refused so far (handshakes that failed, evicted or expired).
  uint64_t rejected() const { return listener_->refused(); }
  // Whether the port still listens (until every expected connection is in).
  bool listening() const { return listening_.load(); }
  // The largest a control connection's buffer of unparsed bytes has been.
  size_t control_buffer_peak() const { return ctl_in_peak_.load(); }
  // The communicator's key (split derives its children's from it).
  const NetKey& key() const { return env_.key; }
  // Payload bytes sent to and received from other hosts so far.
  std::pair<uint64_t, uint64_t> bytes() const;
  // Writes what is queued (bounded), says goodbye to the control peers,
  // stops the thread and closes every socket. Idempotent. (A forked child
  // leaks its copy instead: the thread is the parent's.)
  void close();

 private:
  struct Ctl;  // a control connection
  // ListenerHost
  Refusal vet(const Hello& h, std::string* why) override;
  Refusal adopt(const Hello& h, int fd, std::string* why) override;
  Hello hello(ConnKind kind, int to, int stripe) const;
  void loop();
  void on_control(int peer, uint32_t events);
  void handle_frame(int peer, uint32_t type, const char* body, uint32_t bytes);
  void flush_ctl(Ctl& c);
  void register_ctl(int peer, int fd);
  void control_failed(int peer, int err);
  void push_pending_writes();
  void on_data_out(int peer);
  void wake();
  std::string host_note(int p) const;

  Topology topo_;
  int rank_;
  TcpLinkEnv env_;
  NetHost& host_;
  std::string address_, iface_;
  int epoll_fd_ = -1, wake_fd_ = -1;
  std::unique_ptr<TcpListener> listener_;  // the thread's (after the constructor)
  int expected_in_ = 0, adopted_in_ = 0;   // connections this rank accepts: all, so far
  std::atomic<bool> listening_{true};
  std::vector<SockAddr> addrs_;
  std::vector<std::unique_ptr<PeerNet>> peers_;
  std::vector<std::unique_ptr<TcpSendConn>> send_;
  std::vector<std::unique_ptr<TcpRecvConn>> recv_;
  std::vector<int> xpeers_;
  std::mutex ctl_mu_;                      // ctl_'s entries (made by dial() and the thread)
  std::vector<std::unique_ptr<Ctl>> ctl_;  // by rank; null for non-control peers
  std::mutex write_mu_;
  std::vector<int> want_write_;  // peers whose data connections have frames queued
  std::atomic<bool> stop_{false};
  std::atomic<bool> closed_{false};
  std::atomic<size_t> ctl_in_peak_{0};
  std::mutex fatal_mu_;
  std::string fatal_;  // the thread failed: every peer is unreachable from here
  std::thread thread_;
};

}  // namespace pyc
