// One direction of a link between two ranks on different hosts, over TCP,
// behind the SendConn / RecvConn interface the algorithms use (conn.h).
//
// A slot is a frame: a 32-byte header (the slot's tag and size) and the
// payload. The sender copies into one of its slots, and post() writes the
// frame to the socket at once (non-blocking); what the kernel does not take
// stays queued and the network thread writes it as the socket drains, so a
// rank waiting for something else never holds its peers up. A slot is free
// again once the kernel has all of it. The receiver reads the next frame
// into its one slot when it waits for it (or asks whether it is there): the
// data waits in the kernel's buffers until the algorithm needs it, and TCP's
// window holds the sender back, as the slots' count does in shared memory.
//
// The connection of a direction is made by the sender when it first sends
// (PYCOLL_SOCKET_NSOCKS sockets, frames striped over them in turn), and
// accepted by the receiver's network thread, which hands it to the receiving
// side here once its handshake (tcp_auth.h) proved the peer holds the
// communicator's key and named this communicator, this pair and the stripe.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/function_ref.h"
#include "transport/conn.h"
#include "transport/tcp/tcp_auth.h"
#include "transport/tcp/tcp_socket.h"

namespace pyc {

enum class PeerState : int { kAlive = 0, kClosed, kDied, kUnreachable };

// What this rank knows of a peer on another host, shared by its connections
// and the network thread.
struct PeerNet {
  std::atomic<int> state{0};     // a PeerState
  std::atomic<int> data_in{0};   // incoming data sockets adopted
  std::atomic<int> data_eof{0};  // of which the peer closed (read to the end)
  // Records why the peer is gone (the first verdict stays, except that a
  // clean close can still turn out to be a death).
  void fail(PeerState s, const std::string& why);
  std::string why();

 private:
  std::mutex mu_;
  std::string why_;
};

// What a connection needs from its communicator's network layer.
struct TcpLinkEnv {
  int rank = 0, world_size = 0;
  uint8_t comm_id[16] = {};
  NetKey key;  // the communicator's: every handshake proves it (tcp_auth.h)
  NetConfig cfg;
  size_t slot_bytes = 0;
  uint32_t nslots = 0;
};

class TcpNet;

class TcpSendConn final : public SendConn {
 public:
  TcpSendConn(const TcpLinkEnv& env, TcpNet& net, PeerNet& state, int peer, SockAddr addr);
  ~TcpSendConn() override;
  size_t slot_bytes() const override { return env_.slot_bytes; }
  void* acquire(WaitMonitor& mon) override;
  // A slot is free, or acquire() has something to do at once: connect (the
  // peer's network thread answers whatever its rank is doing) or raise a
  // failed socket's error.
  bool ready() override;
  void post(const SlotTag& tag, size_t bytes) override;

  // The network thread: writes what is queued. Returns the errno that failed
  // the socket (then the peer's state says why), 0 otherwise; *more: frames
  // are still queued.
  int push(bool* more);
  // The sockets with frames queued (for the network thread's poll).
  std::vector<int> pending_fds();
  // close(): whether every queued frame went to the kernel.
  bool drained();
  std::vector<int> fds();
  void close_sockets();
  uint64_t bytes_sent() const { return sent_.load(std::memory_order_relaxed); }

 private:
  struct Frame {
    int slot;
    size_t off, len;
  };
  void connect(WaitMonitor& mon);
  int push_locked();
  [[noreturn]] void fail(int err, WaitMonitor& mon, const char* what);
  [[noreturn]] void refused(const DialFailure& why, WaitMonitor& mon);

  const TcpLinkEnv& env_;
  TcpNet& net_;
  PeerNet& state_;
  int peer_;
  SockAddr addr_;
  std::vector<int> fds_;
  bool connected_ = false;
  std::unique_ptr<char[]> mem_;  // nslots frames (header + payload), 64-byte aligned
  char* base_ = nullptr;
  size_t stride_ = 0;
  int current_ = -1;  // the slot acquire() returned
  int stripe_ = 0;    // the socket of the next frame
  std::mutex mu_;     // the queues and the free slots: this thread and the network thread
  std::vector<std::deque<Frame>> queue_;  // per socket
  std::vector<int> free_;
  int error_ = 0;                  // a socket failed (errno)
  std::atomic<uint64_t> sent_{0};  // payload bytes posted
};

class TcpRecvConn final : public RecvConn {
 public:
  TcpRecvConn(const TcpLinkEnv& env, PeerNet& state, int peer);
  ~TcpRecvConn() override;
  size_t slot_bytes() const override { return env_.slot_bytes; }
  RecvSlot wait(WaitMonitor& mon) override;
  bool ready() override;
  void release() override;

  // The network thread: the peer's connection for `stripe` passed its
  // handshake. False if that stripe has one already.
  bool adopt(int stripe, int fd);
  void close_sockets();
  uint64_t bytes_received() const { return recvd_.load(std::memory_order_relaxed); }

 private:
  // Reads what has arrived of the next frame; true once it is whole. Errors
  // and end of stream set error_ (errno, or -1 for the end).
  bool progress();
  [[noreturn]] void fail(WaitMonitor& mon);

  const TcpLinkEnv& env_;
  PeerNet& state_;
  int peer_;
  std::vector<std::atomic<int>> fds_;
  int stripe_ = 0;
  DataHeader hdr_{};
  size_t got_ = 0;  // bytes of the current frame read (header included)
  bool held_ = false;
  int error_ = 0;
  std::unique_ptr<char[]> mem_;
  char* buf_ = nullptr;
  std::atomic<uint64_t> recvd_{0};  // payload bytes received
};

// Waits until try_op() returns true: polls it for spin_us, then sleeps in
// poll() on fd() (for `events`; -1: a short nap), about a millisecond at a
// time, running the monitor's checks, which throw to end the wait.
void net_wait(FunctionRef<bool()> try_op, FunctionRef<int()> fd, short events, WaitMonitor& mon,
              int spin_us);

// Whether errno `err` on a connection means the peer cannot be reached (a cut
// link, a dead host) rather than that its process went away.
bool unreachable_errno(int err);

}  // namespace pyc
