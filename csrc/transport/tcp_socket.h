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

// A non-blocking listening socket bound to `a` (port 0: any); returns its fd.
int tcp_listen(const SockAddr& a);
// The address a socket is bound to.
SockAddr local_address(int fd);
// TCP_NODELAY, keepalive probes and TCP_USER_TIMEOUT from cfg.timeout_s (a
// dead host or a cut link then fails the socket within about that long), and
// the buffer sizes if set. Non-blocking, close-on-exec.
void tune_socket(int fd, const NetConfig& cfg);
// Starts a non-blocking connect to `a`; returns the fd (connection in
// progress), or -errno where the kernel refused at once (no route).
int tcp_connect_start(const SockAddr& a, const NetConfig& cfg);
// The pending error of a socket (SO_ERROR), 0 if none.
int socket_error(int fd);

// ---- wire formats (native byte order: hosts of one job share an architecture,
// which the magic's byte order checks) ----

constexpr uint64_t kNetMagic = 0x3170636f6c6c7970ull;  // "pycollp1" little-endian
constexpr uint32_t kNetVersion = 1;
enum class ConnKind : uint32_t { kControl = 1, kData = 2 };

// The first bytes of every connection, from the side that connected.
struct Hello {
  uint64_t magic;
  uint32_t version;
  uint32_t kind;  // ConnKind
  uint8_t comm_id[16];
  int32_t from;    // the connecting rank
  int32_t to;      // the rank it means to reach
  int32_t stripe;  // data: which of the PYCOLL_SOCKET_NSOCKS sockets
  int32_t world_size;
};
// The answer of the side that accepted: status 0 when taken.
struct HelloAck {
  uint64_t magic;
  uint8_t comm_id[16];
  int32_t rank;
  int32_t status;
};

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
