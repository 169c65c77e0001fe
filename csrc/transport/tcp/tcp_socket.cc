// TCP addresses, interfaces and socket options (see tcp_socket.h).
#include "transport/tcp/tcp_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "core/env.h"
#include "core/error.h"

namespace pyc {
namespace {

std::string env_str(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// PYCOLL_SOCKET_FAMILY: AF_UNSPEC (either), AF_INET or AF_INET6.
int wanted_family() {
  const std::string f = env_str("PYCOLL_SOCKET_FAMILY");
  if (f.empty()) return AF_UNSPEC;
  if (f == "AF_INET" || f == "4" || f == "ipv4") return AF_INET;
  if (f == "AF_INET6" || f == "6" || f == "ipv6") return AF_INET6;
  PYC_THROW(InvalidArgument,
            "pycollectives: PYCOLL_SOCKET_FAMILY must be AF_INET or AF_INET6, not '" << f << "'");
}

// NCCL_SOCKET_IFNAME's syntax: "eth,ib" (prefixes), "=eth0" (exact), "^docker" (all but).
struct IfFilter {
  bool exclude = false, exact = false;
  std::vector<std::string> names;
  explicit IfFilter(std::string spec) {
    if (!spec.empty() && spec[0] == '^') {
      exclude = true;
      spec.erase(0, 1);
    }
    if (!spec.empty() && spec[0] == '=') {
      exact = true;
      spec.erase(0, 1);
    }
    std::stringstream ss(spec);
    for (std::string s; std::getline(ss, s, ',');)
      if (!s.empty()) names.push_back(s);
  }
  bool match(const std::string& ifname) const {
    bool hit = false;
    for (const auto& n : names)
      hit = hit || (exact ? ifname == n : ifname.compare(0, n.size(), n) == 0);
    return exclude ? !hit : hit;
  }
};

SockAddr from_sockaddr(const sockaddr* sa) {
  SockAddr a;
  a.len = sa->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
  std::memcpy(&a.ss, sa, a.len);
  return a;
}

struct IfAddr {
  std::string name;
  SockAddr addr;
  bool loopback;
};

std::vector<IfAddr> interfaces(int family) {
  ifaddrs* list = nullptr;
  PYC_SYSCHECK(getifaddrs(&list));
  std::vector<IfAddr> out;
  for (int pass = 0; pass < 2; ++pass) {  // IPv4 first, unless a family is asked for
    const int fam = family != AF_UNSPEC ? family : pass == 0 ? AF_INET : AF_INET6;
    if (family != AF_UNSPEC && pass == 1) break;
    for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != fam) continue;
      if (!(i->ifa_flags & IFF_UP) || !(i->ifa_flags & IFF_RUNNING)) continue;
      out.push_back({i->ifa_name, from_sockaddr(i->ifa_addr), (i->ifa_flags & IFF_LOOPBACK) != 0});
    }
  }
  freeifaddrs(list);
  return out;
}

// The local address the kernel would send from to reach `host` (no packet is sent).
bool route_source(const std::string& host, int family, SockAddr* out) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = family;
  hints.ai_socktype = SOCK_DGRAM;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr) return false;
  bool ok = false;
  const int fd = socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    *out = local_address(fd);
    ok = true;
  }
  close_quietly(fd);
  freeaddrinfo(res);
  return ok;
}

bool same_ip(const SockAddr& a, const SockAddr& b) {
  if (a.family() != b.family()) return false;
  if (a.family() == AF_INET)
    return reinterpret_cast<const sockaddr_in&>(a.ss).sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in&>(b.ss).sin_addr.s_addr;
  return std::memcmp(&reinterpret_cast<const sockaddr_in6&>(a.ss).sin6_addr,
                     &reinterpret_cast<const sockaddr_in6&>(b.ss).sin6_addr, 16) == 0;
}

void setopt(int fd, int level, int name, int value, const char* what) {
  if (setsockopt(fd, level, name, &value, sizeof(value)) != 0)
    detail::throw_sys(__FILE__, __LINE__, what, errno);
}

}  // namespace

NetConfig NetConfig::from_env() {
  NetConfig c;
  const std::string t = env_str("PYCOLL_NET_TIMEOUT");
  if (!t.empty()) {
    char* end = nullptr;
    const double v = std::strtod(t.c_str(), &end);
    if (end == t.c_str() || *end != '\0' || !std::isfinite(v) || v < 1 || v > 3600)
      PYC_THROW(InvalidArgument,
                "pycollectives: PYCOLL_NET_TIMEOUT must be a number of seconds "
                "in [1, 3600], not '"
                    << t << "'");
    c.timeout_s = v;
  }
  c.nsocks = static_cast<int>(env_size("PYCOLL_SOCKET_NSOCKS", 1, 1, 16));
  c.sock_buf = env_size("PYCOLL_SOCKET_BUFFER", 0, 0, size_t{1} << 30);
  c.spin_us = static_cast<int>(env_size("PYCOLL_NET_SPIN_US", 50, 0, 1000000));
  (void)wanted_family();  // checked at init
  return c;
}

int SockAddr::port() const {
  return family() == AF_INET6 ? ntohs(reinterpret_cast<const sockaddr_in6&>(ss).sin6_port)
                              : ntohs(reinterpret_cast<const sockaddr_in&>(ss).sin_port);
}

void SockAddr::set_port(int port) {
  if (family() == AF_INET6)
    reinterpret_cast<sockaddr_in6&>(ss).sin6_port = htons(static_cast<uint16_t>(port));
  else
    reinterpret_cast<sockaddr_in&>(ss).sin_port = htons(static_cast<uint16_t>(port));
}

bool SockAddr::loopback() const {
  if (family() == AF_INET)
    return (ntohl(reinterpret_cast<const sockaddr_in&>(ss).sin_addr.s_addr) >> 24) == 127;
  return IN6_IS_ADDR_LOOPBACK(&reinterpret_cast<const sockaddr_in6&>(ss).sin6_addr);
}

std::string SockAddr::str() const {
  char host[NI_MAXHOST];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&ss), len, host, sizeof(host), nullptr, 0,
                  NI_NUMERICHOST) != 0)
    return "?";
  std::ostringstream os;
  if (family() == AF_INET6)
    os << "[" << host << "]:" << port();
  else
    os << host << ":" << port();
  return os.str();
}

SockAddr SockAddr::parse(const std::string& s, const std::string& what) {
  std::string host, port;
  if (!s.empty() && s[0] == '[') {
    const size_t close = s.find("]:");
    if (close != std::string::npos) {
      host = s.substr(1, close - 1);
      port = s.substr(close + 2);
    }
  } else {
    const size_t colon = s.rfind(':');
    if (colon != std::string::npos) {
      host = s.substr(0, colon);
      port = s.substr(colon + 1);
    }
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  hints.ai_socktype = SOCK_STREAM;
  if (host.empty() || port.empty() || getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 ||
      res == nullptr)
    PYC_THROW(InvalidArgument,
              "pycollectives: " << what << ": '" << s << "' is not an address (ip:port)");
  SockAddr a = from_sockaddr(res->ai_addr);
  freeaddrinfo(res);
  return a;
}

SockAddr choose_address(const std::string& hint, std::string* iface) {
  const int family = wanted_family();
  const std::string spec = env_str("PYCOLL_SOCKET_IFNAME");
  const std::vector<IfAddr> all = interfaces(family);
  if (!spec.empty()) {
    const IfFilter filter(spec);
    for (const IfAddr& i : all) {
      if (!filter.match(i.name)) continue;
      // A link-local IPv6 address only with its scope: skip it when a global one exists.
      *iface = i.name;
      return i.addr;
    }
    PYC_THROW(InvalidArgument, "pycollectives: PYCOLL_SOCKET_IFNAME='"
                                   << spec << "' matches no interface that is up with an "
                                   << (family == AF_INET6  ? "IPv6"
                                       : family == AF_INET ? "IPv4"
                                                           : "IP")
                                   << " address");
  }
  SockAddr src;
  if (!hint.empty() && route_source(hint, family, &src)) {
    for (const IfAddr& i : all)
      if (same_ip(i.addr, src)) {
        *iface = i.name;
        return i.addr;
      }
    *iface = "?";
    src.set_port(0);
    return src;
  }
  for (const IfAddr& i : all)
    if (!i.loopback) {
      *iface = i.name;
      return i.addr;
    }
  for (const IfAddr& i : all) {
    *iface = i.name;
    return i.addr;
  }
  PYC_THROW(Error, "pycollectives: no network interface is up to listen on for other hosts");
}

SockAddr local_address(int fd) {
  SockAddr a;
  a.len = sizeof(a.ss);
  PYC_SYSCHECK(getsockname(fd, reinterpret_cast<sockaddr*>(&a.ss), &a.len));
  return a;
}

int tcp_listen(const SockAddr& a) {
  const int fd = socket(a.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  PYC_SYSCHECK(fd);
  try {
    setopt(fd, SOL_SOCKET, SO_REUSEADDR, 1, "setsockopt(SO_REUSEADDR)");
    PYC_SYSCHECK(bind(fd, reinterpret_cast<const sockaddr*>(&a.ss), a.len));
    PYC_SYSCHECK(listen(fd, 1024));
  } catch (...) {
    close_quietly(fd);
    throw;
  }
  return fd;
}

void tune_socket(int fd, const NetConfig& cfg) {
  const int flags = fcntl(fd, F_GETFL);
  PYC_SYSCHECK(flags);
  PYC_SYSCHECK(fcntl(fd, F_SETFL, flags | O_NONBLOCK));
  setopt(fd, IPPROTO_TCP, TCP_NODELAY, 1, "setsockopt(TCP_NODELAY)");
  // A host that dies or a link that goes down answers nothing: keepalive
  // probes find an idle connection dead, and TCP_USER_TIMEOUT one whose data
  // stays unacknowledged, within net_deadlines' time.
  const NetDeadlines d = net_deadlines(cfg.timeout_s);
  setopt(fd, SOL_SOCKET, SO_KEEPALIVE, 1, "setsockopt(SO_KEEPALIVE)");
  setopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, d.idle_s, "setsockopt(TCP_KEEPIDLE)");
  setopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, d.intvl_s, "setsockopt(TCP_KEEPINTVL)");
  setopt(fd, IPPROTO_TCP, TCP_KEEPCNT, 10, "setsockopt(TCP_KEEPCNT)");  // the user timeout rules
  setopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, d.user_ms, "setsockopt(TCP_USER_TIMEOUT)");
  if (cfg.sock_buf > 0) {
    const int b = static_cast<int>(std::min<size_t>(cfg.sock_buf, 1 << 30));
    setopt(fd, SOL_SOCKET, SO_SNDBUF, b, "setsockopt(SO_SNDBUF)");
    setopt(fd, SOL_SOCKET, SO_RCVBUF, b, "setsockopt(SO_RCVBUF)");
  }
}

NetDeadlines net_deadlines(double timeout_s) {
  // Whole seconds (keepalive's unit) of the budget: a second short of the timeout.
  const int b = std::max(1, static_cast<int>(std::floor(timeout_s - 1)));
  NetDeadlines d;
  d.user_ms = timeout_s >= 3 ? b * 1000 : std::max(500, static_cast<int>((timeout_s - 1) * 1000));
  // Probes at idle, then idle + intvl = b: the second finds the user timeout past.
  d.idle_s = std::max(1, (b + 1) / 2);
  d.intvl_s = std::max(1, b - d.idle_s);
  return d;
}

int tcp_connect_start(const SockAddr& a, const NetConfig& cfg) {
  const int fd = socket(a.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  PYC_SYSCHECK(fd);
  try {
    tune_socket(fd, cfg);
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&a.ss), a.len) != 0 &&
        errno != EINPROGRESS) {
      const int err = errno;
      close_quietly(fd);
      return -err;
    }
  } catch (...) {
    close_quietly(fd);
    throw;
  }
  return fd;
}

int socket_error(int fd) {
  int err = 0;
  socklen_t len = sizeof(err);
  PYC_SYSCHECK(getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len));
  return err;
}

void epoll_set(int ep, int op, int fd, uint32_t events, uint64_t data) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = data;
  if (epoll_ctl(ep, op, fd, &ev) != 0 &&
      !(op == EPOLL_CTL_DEL && (errno == ENOENT || errno == EBADF)))
    detail::throw_sys(__FILE__, __LINE__, "epoll_ctl", errno);
}

void close_quietly(int fd) {
  if (fd >= 0) (void)::close(fd);  // a socket we drop: nothing to do if close fails
}

}  // namespace pyc
