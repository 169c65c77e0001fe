// The TCP side of a communicator whose ranks span hosts: its listening socket,
// its connections to the ranks of other hosts and its network thread.
//
// Every rank listens on one address (published through the bootstrap store).
// Two kinds of connection reach it, each opened with a handshake that names
// the communicator (its 128-bit random id), the two ranks and the kind:
// - a control connection with each of its cross-host peers (Topology::xpeers:
//   one rank on every other host), made at connect() by the lower rank. The
//   network thread reads them: the errors a rank reports (so that every host
//   aborts, not just the ones that saw it), goodbyes (close()), and the
//   questions a timeout asks of another host (who is late). Keepalive probes
//   and TCP_USER_TIMEOUT find a dead host or a cut link within
//   PYCOLL_NET_TIMEOUT;
// - data connections, one direction each (tcp_conn.h), made by the sender the
//   first time an algorithm sends to that peer.
// A connection whose first bytes are not a valid handshake for this rank of
// this communicator is closed and logged; nothing else changes.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/topology.h"
#include "core/clock.h"
#include "core/function_ref.h"
#include "transport/tcp_conn.h"

namespace pyc {

// What the network thread needs from its communicator.
class NetHost {
 public:
  virtual ~NetHost() = default;
  // A rank of another host reported an error: raise it here too (the first
  // error wins). Returns whether it was taken (then it is passed on).
  virtual bool adopt_abort(int kind, int from, const std::string& msg) = 0;
  // Where this host's ranks are (for another host's timeout verdict).
  virtual std::vector<CtlStatusEntry> host_status() = 0;
  // Another host's answer about one of its ranks.
  virtual void peer_status(const CtlStatusEntry& e) = 0;
};

class TcpNet {
 public:
  // Listens at once (the address goes to the store before the peers connect).
  // `hint`: the store's address (MASTER_ADDR), for the choice of interface.
  TcpNet(const Topology& topo, const NetConfig& cfg, const uint8_t comm_id[16], size_t slot_bytes,
         uint32_t nslots, NetHost& host, const std::string& hint);
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
  // Sends an error to every control peer but `except`.
  void send_abort(int kind, int from, const std::string& msg, int except = -1);
  // Asks a control peer on every other host where its host's ranks are;
  // returns once all answered (NetHost::peer_status) or at `deadline`.
  void query_status(Clock::time_point deadline);
  // A data connection has frames queued: the thread writes them as it can.
  void want_write(int peer);
  // Connections refused so far (handshakes that failed).
  uint64_t rejected() const { return rejected_.load(); }
  // Payload bytes sent to and received from other hosts so far.
  std::pair<uint64_t, uint64_t> bytes() const;
  // Writes what is queued (bounded), says goodbye to the control peers,
  // stops the thread and closes every socket. Idempotent. (A forked child
  // leaks its copy instead: the thread is the parent's.)
  void close();

 private:
  struct Ctl;      // a control connection
  struct Pending;  // an accepted connection before its handshake
  void loop();
  void on_accept();
  void on_pending(size_t i);
  void reject(Pending& p, const std::string& why);
  void on_control(int peer, uint32_t events);
  void handle_frame(int peer, uint32_t type, const char* body, uint32_t bytes);
  void send_ctl(int peer, uint32_t type, const void* body, uint32_t bytes,
                const void* more = nullptr, uint32_t more_bytes = 0);
  void flush_ctl(Ctl& c);
  void register_ctl(int peer, int fd);
  void control_failed(int peer, int err);
  void push_pending_writes();
  void on_data_out(int peer);
  void wake();
  void expire_pending();
  std::string host_note(int p) const;

  Topology topo_;
  int rank_;
  TcpLinkEnv env_;
  NetHost& host_;
  SockAddr listen_addr_;
  std::string address_, iface_;
  int listen_fd_ = -1, epoll_fd_ = -1, wake_fd_ = -1;
  std::vector<SockAddr> addrs_;
  std::vector<std::unique_ptr<PeerNet>> peers_;
  std::vector<std::unique_ptr<TcpSendConn>> send_;
  std::vector<std::unique_ptr<TcpRecvConn>> recv_;
  std::vector<int> xpeers_;
  std::mutex ctl_mu_;                              // ctl_'s entries (made by dial() and the thread)
  std::vector<std::unique_ptr<Ctl>> ctl_;          // by rank; null for non-control peers
  std::vector<std::unique_ptr<Pending>> pending_;  // the thread's only
  std::mutex write_mu_;
  std::vector<int> want_write_;  // peers whose data connections have frames queued
  std::atomic<bool> stop_{false};
  std::atomic<bool> closed_{false};
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> query_id_{0};
  std::atomic<int> answers_{0};
  std::mutex fatal_mu_;
  std::string fatal_;  // the thread failed: every peer is unreachable from here
  std::thread thread_;
};

}  // namespace pyc
