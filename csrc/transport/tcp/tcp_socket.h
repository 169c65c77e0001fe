// TCP sockets for the transport between hosts: addresses (IPv4 and IPv6),
// the choice of interface (PYCOLL_SOCKET_IFNAME, as NCCL_SOCKET_IFNAME), the
// socket options, and the wire formats of the handshake and the frames.
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace pyc {

// The settings of the TCP transport (PYCOLL_NET_TIMEOUT, PYCOLL_SOCKET_NSOCKS,
// PYCOLL_SOCKET_BUFFER, PYCOLL_NET_SPIN_US), read at init.
struct NetConfig {
  // How long a peer may stay silent to TCP (no acknowledgement of data, no
  // answer to keepalive probes) before it is declared unreachable.
  double timeout_s = 5.0;
  int nsocks = 1;       // data sockets per direction and peer, frames striped over them
  size_t sock_buf = 0;  // SO_SNDBUF / SO_RCVBUF; 0: the kernel's autotuning
  int spin_us = 50;     // how long a receive polls its socket before it sleeps in poll()
  static NetConfig from_env();
};

// An address with its port.
struct SockAddr {
  sockaddr_storage ss{};
  socklen_t len = 0;
  int family() const { return ss.ss_family; }
  int port() const;
  void set_port(int port);
  bool loopback() const;
  // "10.0.0.1:4242", "[fe80::1%eth0]:4242"
  std::string str() const;
  // Parses str()'s format (numeric only). Raises InvalidArgument naming `what`.
  static SockAddr parse(const std::string& s, const std::string& what);
};

// The address this rank listens on: on the interface PYCOLL_SOCKET_IFNAME
// names (a comma-separated list of name prefixes, "=name" for an exact name,
// a leading "^" to exclude them instead), of family PYCOLL_SOCKET_FAMILY
// (AF_INET or AF_INET6, else either, IPv4 first). Unset: the interface
// through which this host reaches `hint` (the bootstrap store's address,
// MASTER_ADDR) if given, else the first interface that is up and not
// loopback, else loopback. Port 0. *iface gets the interface's name.
SockAddr choose_address(const std::string& hint, std::string* iface);

// How long a silent peer has before its socket fails, for PYCOLL_NET_TIMEOUT
// = t seconds: TCP_USER_TIMEOUT (data unacknowledged that long, or keepalive
// probes unanswered) user_ms; keepalive probes idle_s after the last bytes
// received, then every intvl_s, so that the probe that finds the time up is
// sent by then. t >= 3: user_ms = (t - 1) s and idle_s + intvl_s <= t - 1,
// which leaves a second for the ranks to hear of it and raise, within t.
// Below 3 s, keepalive's resolution (a second) makes it about 2 s.
struct NetDeadlines {
  int user_ms, idle_s, intvl_s;
};
NetDeadlines net_deadlines(double timeout_s);
// A non-blocking listening socket bound to `a` (port 0: any); returns its fd.
int tcp_listen(const SockAddr& a);
// The address a socket is bound to.
SockAddr local_address(int fd);
// TCP_NODELAY, keepalive probes and TCP_USER_TIMEOUT from cfg.timeout_s (a
// dead host or a cut link then fails the socket within it: net_deadlines),
// and the buffer sizes if set. Non-blocking, close-on-exec.
void tune_socket(int fd, const NetConfig& cfg);
// Starts a non-blocking connect to `a`; returns the fd (connection in
// progress), or -errno where the kernel refused at once (no route).
int tcp_connect_start(const SockAddr& a, const NetConfig& cfg);
// The pending error of a socket (SO_ERROR), 0 if none.
int socket_error(int fd);
// epoll_ctl, raising on failure (but a removal of a socket already gone).
void epoll_set(int ep, int op, int fd, uint32_t events, uint64_t data);
// close() of a socket being dropped, whose failure changes nothing.
void close_quietly(int fd);

// ---- wire formats of the frames (native byte order: hosts of one job share
// an architecture; the handshakes that open the connections: tcp_auth.h) ----

// A data frame: one slot of the SendConn/RecvConn interface.
struct DataHeader {
  uint32_t seq;
  uint32_t flags;
  uint64_t w0, w1;
  uint64_t bytes;
};
static_assert(sizeof(DataHeader) == 32, "DataHeader is 32 bytes on the wire");

// Control frames (between the network threads of two ranks).
enum class CtlType : uint32_t { kAbort = 1, kClose = 2, kQuery = 3, kStatus = 4 };
struct NetCtlHeader {
  uint32_t type;   // CtlType
  uint32_t bytes;  // of the body that follows
};
constexpr uint32_t kMaxCtlBody = 64 << 10;

// The body of kAbort: then the message's bytes.
struct CtlAbort {
  int32_t kind;  // AbortKind
  int32_t from;  // the rank that reported it first
};
// kQuery: an id, echoed by the kStatus it asks for.
struct CtlQuery {
  uint64_t id;
};
// kStatus: the id, then one entry per rank of the answering host.
struct CtlStatusEntry {
  int32_t rank;
  uint32_t started;  // RankCtl::started, done, waiting (seq << 32 | peer + 1)
  uint32_t done;
  uint32_t pad;
  uint64_t waiting;
  int64_t idle_ns;  // since its latest check in that wait (beat_ns)
};

}  // namespace pyc
