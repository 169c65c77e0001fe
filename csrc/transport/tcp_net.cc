// The network thread, the listening socket and the control connections of a
// communicator that spans hosts (see tcp_net.h).
#include "transport/tcp_net.h"

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace pyc {
namespace {

enum Tag : uint64_t { kListen = 1, kWake, kPending, kControl, kDataOut };
uint64_t tag(Tag t, size_t i) { return static_cast<uint64_t>(t) << 32 | i; }

constexpr auto kHandshakeTime = std::chrono::seconds(10);
constexpr size_t kMaxPending = 256;

void close_quietly(int fd) {
  if (fd >= 0) (void)::close(fd);  // a socket we drop: nothing to do if close fails
}

void epoll_set(int ep, int op, int fd, uint32_t events, uint64_t data) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = data;
  if (epoll_ctl(ep, op, fd, &ev) != 0 &&
      !(op == EPOLL_CTL_DEL && (errno == ENOENT || errno == EBADF)))
    detail::throw_sys(__FILE__, __LINE__, "epoll_ctl", errno);
}

// Sends what it can without blocking: bytes sent (0 on EAGAIN), or -1 on error.
ssize_t send_nb(int fd, const char* p, size_t n) {
  for (;;) {
    const ssize_t r = ::send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r >= 0) return r;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : -1;
  }
}

// connect()'s waits: bounded by the deadline, running the caller's check.
class StartMonitor final : public WaitMonitor {
 public:
  StartMonitor(int rank, Clock::time_point deadline, FunctionRef<void()> check)
      : rank_(rank), deadline_(deadline), check_(check) {}
  void check_fast() override {}
  void check_slow() override {
    const auto now = Clock::now();
    if (now > deadline_)
      PYC_THROW(TimeoutError, "pycollectives: rank " << rank_ << ": init: rank " << peer
                                                     << " did not make its TCP connection in time");
    if (now >= next_) {
      check_();
      next_ = now + std::chrono::milliseconds(10);
    }
  }
  void peer_failed(int) override {}

 private:
  int rank_;
  Clock::time_point deadline_, next_{};
  FunctionRef<void()> check_;
};

}  // namespace

struct TcpNet::Ctl {
  int peer = -1;
  int fd = -1;
  std::mutex tx_mu;  // out, fd
  std::string out;   // bytes not yet taken by the kernel
  std::string in;    // bytes of frames not yet whole (the thread's)
};

struct TcpNet::Pending {
  int fd = -1;
  std::string from;  // the peer's address, for the log
  Hello hello{};
  size_t got = 0;
  Clock::time_point deadline;
};

TcpNet::TcpNet(const Topology& topo, const NetConfig& cfg, const uint8_t comm_id[16],
               size_t slot_bytes, uint32_t nslots, NetHost& host, const std::string& hint)
    : topo_(topo), rank_(topo.rank()), host_(host) {
  env_.rank = rank_;
  env_.world_size = topo.size();
  std::memcpy(env_.comm_id, comm_id, 16);
  env_.cfg = cfg;
  env_.slot_bytes = slot_bytes;
  env_.nslots = nslots;
  try {
    listen_addr_ = choose_address(hint, &iface_);
    listen_fd_ = tcp_listen(listen_addr_);
    address_ = local_address(listen_fd_).str();
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    PYC_SYSCHECK(epoll_fd_);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    PYC_SYSCHECK(wake_fd_);
    epoll_set(epoll_fd_, EPOLL_CTL_ADD, listen_fd_, EPOLLIN, tag(kListen, 0));
    epoll_set(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, EPOLLIN, tag(kWake, 0));
  } catch (...) {
    close_quietly(listen_fd_);
    close_quietly(epoll_fd_);
    close_quietly(wake_fd_);
    throw;
  }
  const int n = topo.size();
  peers_.resize(n);
  for (int p = 0; p < n; ++p) peers_[p] = std::make_unique<PeerNet>();
  send_.resize(n);
  recv_.resize(n);
  ctl_.resize(n);
  xpeers_ = topo.xpeers(rank_);
}

TcpNet::~TcpNet() { close(); }

std::string TcpNet::host_note(int p) const { return "ranks on its host: " + topo_.host_ranks(p); }

void TcpNet::dial(const std::vector<std::string>& addrs, Clock::time_point deadline,
                  FunctionRef<void()> check) {
  const int n = topo_.size();
  PYC_ASSERT(static_cast<int>(addrs.size()) == n);
  addrs_.resize(n);
  for (int p = 0; p < n; ++p) {
    if (topo_.same_host(p)) continue;
    addrs_[p] = SockAddr::parse(addrs[p], "the address rank " + std::to_string(p) + " published");
    send_[p] = std::make_unique<TcpSendConn>(env_, *this, *peers_[p], p, addrs_[p]);
    recv_[p] = std::make_unique<TcpRecvConn>(env_, *peers_[p], p);
  }
  thread_ = std::thread([this] { loop(); });
  StartMonitor mon(rank_, deadline, check);
  for (int q : xpeers_) {
    if (q < rank_) continue;  // the lower rank connects
    mon.peer = q;
    const int fd = tcp_connect_start(addrs_[q], env_.cfg);
    int err = fd < 0 ? -fd : 0;
    HelloAck ack{};
    if (err == 0) {
      Hello h{};
      h.magic = kNetMagic;
      h.version = kNetVersion;
      h.kind = static_cast<uint32_t>(ConnKind::kControl);
      std::memcpy(h.comm_id, env_.comm_id, 16);
      h.from = rank_;
      h.to = q;
      h.world_size = n;
      try {
        err = handshake(fd, h, &ack, mon, env_.cfg.spin_us);
      } catch (...) {
        close_quietly(fd);
        throw;
      }
    }
    if (err != 0 || ack.status != 0 || ack.rank != q ||
        std::memcmp(ack.comm_id, env_.comm_id, 16) != 0) {
      close_quietly(fd);
      PYC_THROW(PeerFailure, "pycollectives: rank "
                                 << rank_ << ": init: could not connect to rank " << q << " at "
                                 << addrs_[q].str() << " (interface " << iface_ << "): "
                                 << (err == -1  ? "it closed the connection"
                                     : err != 0 ? std::strerror(err)
                                                : "it refused the handshake")
                                 << " (it died, or the address is not reachable from here: see "
                                    "PYCOLL_SOCKET_IFNAME)");
    }
    register_ctl(q, fd);
  }
}

void TcpNet::await_peers(Clock::time_point deadline, FunctionRef<void()> check) {
  StartMonitor mon(rank_, deadline, check);
  for (int q : xpeers_) {  // the higher ranks' connections, accepted by the thread
    mon.peer = q;
    net_wait(
        [&] {
          std::lock_guard<std::mutex> lk(ctl_mu_);
          return ctl_[q] != nullptr;
        },
        [] { return -1; }, 0, mon, 0);
  }
}

void TcpNet::register_ctl(int peer, int fd) {
  auto c = std::make_unique<Ctl>();
  c->peer = peer;
  c->fd = fd;
  std::lock_guard<std::mutex> lk(ctl_mu_);
  PYC_ASSERT(ctl_[peer] == nullptr);
  ctl_[peer] = std::move(c);
  epoll_set(epoll_fd_, EPOLL_CTL_ADD, fd, EPOLLIN, tag(kControl, peer));
}

void TcpNet::wake() {
  const uint64_t one = 1;
  // EAGAIN: the counter is already raised, the thread will wake anyway.
  if (::write(wake_fd_, &one, sizeof(one)) < 0 && errno != EAGAIN)
    detail::throw_sys(__FILE__, __LINE__, "write(eventfd)", errno);
}

void TcpNet::want_write(int peer) {
  {
    std::lock_guard<std::mutex> lk(write_mu_);
    want_write_.push_back(peer);
  }
  wake();
}

void TcpNet::loop() {
  epoll_event evs[64];
  try {
    while (!stop_.load()) {
      const int n = epoll_wait(epoll_fd_, evs, 64, 100);
      if (n < 0 && errno != EINTR) detail::throw_sys(__FILE__, __LINE__, "epoll_wait", errno);
      for (int i = 0; i < n; ++i) {
        const auto t = static_cast<Tag>(evs[i].data.u64 >> 32);
        const auto idx = static_cast<size_t>(evs[i].data.u64 & 0xffffffffu);
        switch (t) {
          case kListen:
            on_accept();
            break;
          case kWake: {
            uint64_t v;
            if (::read(wake_fd_, &v, sizeof(v)) < 0 && errno != EAGAIN)
              detail::throw_sys(__FILE__, __LINE__, "read(eventfd)", errno);
            push_pending_writes();
            break;
          }
          case kPending:
            on_pending(idx);
            break;
          case kControl:
            on_control(static_cast<int>(idx), evs[i].events);
            break;
          case kDataOut:
            on_data_out(static_cast<int>(idx));
            break;
        }
      }
      expire_pending();
    }
  } catch (const std::exception& e) {
    // Nothing can be raised from this thread: every peer becomes unreachable
    // from here, which the next wait of an operation reports.
    std::lock_guard<std::mutex> lk(fatal_mu_);
    fatal_ = std::string("is unreachable: rank ") + std::to_string(rank_) +
             "'s network thread failed: " + e.what();
    std::fprintf(stderr, "pycollectives: rank %d: network thread failed: %s\n", rank_, e.what());
  }
}

void TcpNet::on_accept() {
  for (;;) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    const int fd =
        accept4(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        std::fprintf(stderr, "pycollectives: rank %d: accept: %s\n", rank_, std::strerror(errno));
        return;
      }
      detail::throw_sys(__FILE__, __LINE__, "accept4", errno);
    }
    SockAddr from;
    std::memcpy(&from.ss, &ss, len);
    from.len = len;
    size_t slot = 0;
    while (slot < pending_.size() && pending_[slot]) ++slot;
    if (slot == kMaxPending) {  // a flood: refuse without reading
      rejected_.fetch_add(1);
      close_quietly(fd);
      continue;
    }
    try {
      tune_socket(fd, env_.cfg);
    } catch (const std::exception&) {
      close_quietly(fd);
      continue;
    }
    auto p = std::make_unique<Pending>();
    p->fd = fd;
    p->from = from.str();
    p->deadline = Clock::now() + kHandshakeTime;
    if (slot == pending_.size()) pending_.emplace_back();
    epoll_set(epoll_fd_, EPOLL_CTL_ADD, fd, EPOLLIN, tag(kPending, slot));
    pending_[slot] = std::move(p);
  }
}

void TcpNet::reject(Pending& p, const std::string& why) {
  HelloAck nack{};
  nack.magic = kNetMagic;
  nack.rank = rank_;
  nack.status = 1;
  (void)send_nb(p.fd, reinterpret_cast<const char*>(&nack), sizeof(nack));  // best effort
  epoll_set(epoll_fd_, EPOLL_CTL_DEL, p.fd, 0, 0);
  close_quietly(p.fd);
  p.fd = -1;
  rejected_.fetch_add(1);
  std::fprintf(stderr, "pycollectives: rank %d: refused a connection from %s: %s\n", rank_,
               p.from.c_str(), why.c_str());
}

void TcpNet::on_pending(size_t i) {
  if (i >= pending_.size() || !pending_[i]) return;
  Pending& p = *pending_[i];
  auto done = [&] { pending_[i].reset(); };
  char* dst = reinterpret_cast<char*>(&p.hello);
  for (;;) {
    const ssize_t r = ::recv(p.fd, dst + p.got, sizeof(Hello) - p.got, MSG_DONTWAIT);
    if (r > 0) {
      p.got += static_cast<size_t>(r);
      if (p.got >= sizeof(uint64_t) && p.hello.magic != kNetMagic) {
        reject(p, "not the pycollectives protocol");
        return done();
      }
      if (p.got == sizeof(Hello)) break;
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    reject(p, "it closed before its handshake was complete");
    return done();
  }
  const Hello& h = p.hello;
  const int n = topo_.size();
  std::ostringstream why;
  const auto kind = static_cast<ConnKind>(h.kind);
  if (h.version != kNetVersion)
    why << "protocol version " << h.version << ", this rank speaks " << kNetVersion;
  else if (std::memcmp(h.comm_id, env_.comm_id, 16) != 0)
    why << "it carries another communicator's id";
  else if (h.to != rank_ || h.world_size != n)
    why << "it is meant for rank " << h.to << " of " << h.world_size << ", this is rank " << rank_
        << " of " << n;
  else if (h.from < 0 || h.from >= n || topo_.same_host(h.from))
    why << "it claims to come from rank " << h.from << ", which is not a rank of another host";
  else if (kind == ConnKind::kControl &&
           std::find(xpeers_.begin(), xpeers_.end(), h.from) == xpeers_.end())
    why << "rank " << h.from << " is not a control peer of this rank";
  else if (kind != ConnKind::kControl && kind != ConnKind::kData)
    why << "unknown connection kind " << h.kind;
  if (why.str().empty() && kind == ConnKind::kControl) {
    std::lock_guard<std::mutex> lk(ctl_mu_);
    if (ctl_[h.from]) why << "rank " << h.from << " has a control connection already";
  }
  if (!why.str().empty()) {
    reject(p, why.str());
    return done();
  }
  HelloAck ack{};
  ack.magic = kNetMagic;
  std::memcpy(ack.comm_id, env_.comm_id, 16);
  ack.rank = rank_;
  epoll_set(epoll_fd_, EPOLL_CTL_DEL, p.fd, 0, 0);
  // Registered before the answer goes: the peer sends data only after it.
  if (kind == ConnKind::kData && !(recv_[h.from] && recv_[h.from]->adopt(h.stripe, p.fd))) {
    reject(p, "a data connection for this stripe exists already, or the stripe is out of range");
    return done();
  }
  if (send_nb(p.fd, reinterpret_cast<const char*>(&ack), sizeof(ack)) != sizeof(ack) &&
      kind == ConnKind::kControl) {
    reject(p, "the answer to its handshake could not be sent");
    return done();
  }
  if (kind == ConnKind::kControl) register_ctl(h.from, p.fd);
  p.fd = -1;
  done();
}

void TcpNet::expire_pending() {
  const auto now = Clock::now();
  for (auto& p : pending_)
    if (p && now > p->deadline) {
      reject(*p, "no complete handshake within 10 s");
      p.reset();
    }
}

void TcpNet::on_control(int peer, uint32_t events) {
  Ctl* c;
  {
    std::lock_guard<std::mutex> lk(ctl_mu_);
    c = ctl_[peer].get();
  }
  if (c == nullptr || c->fd < 0) return;
  if (events & EPOLLOUT) flush_ctl(*c);
  if (!(events & (EPOLLIN | EPOLLERR | EPOLLHUP))) return;
  char buf[16384];
  for (;;) {
    const ssize_t r = ::recv(c->fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r > 0) {
      c->in.append(buf, static_cast<size_t>(r));
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    // Frames that came before the end still count (a goodbye, an error).
    while (c->in.size() >= sizeof(NetCtlHeader)) {
      NetCtlHeader h;
      std::memcpy(&h, c->in.data(), sizeof(h));
      if (h.bytes > kMaxCtlBody || c->in.size() < sizeof(h) + h.bytes) break;
      handle_frame(peer, h.type, c->in.data() + sizeof(h), h.bytes);
      c->in.erase(0, sizeof(h) + h.bytes);
    }
    return control_failed(peer, r == 0 ? -1 : errno);
  }
  while (c->in.size() >= sizeof(NetCtlHeader)) {
    NetCtlHeader h;
    std::memcpy(&h, c->in.data(), sizeof(h));
    if (h.bytes > kMaxCtlBody) return control_failed(peer, EPROTO);
    if (c->in.size() < sizeof(h) + h.bytes) break;
    handle_frame(peer, h.type, c->in.data() + sizeof(h), h.bytes);
    c->in.erase(0, sizeof(h) + h.bytes);
  }
}

void TcpNet::handle_frame(int peer, uint32_t type, const char* body, uint32_t bytes) {
  switch (static_cast<CtlType>(type)) {
    case CtlType::kAbort: {
      if (bytes < sizeof(CtlAbort)) return;
      CtlAbort a;
      std::memcpy(&a, body, sizeof(a));
      const std::string msg(body + sizeof(a), bytes - sizeof(a));
      if (a.from >= 0 && a.from < topo_.size() && host_.adopt_abort(a.kind, a.from, msg))
        send_abort(a.kind, a.from, msg, peer);  // on to the other hosts
      return;
    }
    case CtlType::kClose:
      peers_[peer]->fail(PeerState::kClosed, "closed its communicator");
      return;
    case CtlType::kQuery: {
      if (bytes < sizeof(CtlQuery)) return;
      const std::vector<CtlStatusEntry> st = host_.host_status();
      send_ctl(peer, static_cast<uint32_t>(CtlType::kStatus), body, sizeof(CtlQuery), st.data(),
               static_cast<uint32_t>(st.size() * sizeof(CtlStatusEntry)));
      return;
    }
    case CtlType::kStatus: {
      if (bytes < sizeof(CtlQuery)) return;
      CtlQuery q;
      std::memcpy(&q, body, sizeof(q));
      if (q.id != query_id_.load()) return;  // an earlier question's late answer
      for (size_t off = sizeof(q); off + sizeof(CtlStatusEntry) <= bytes;
           off += sizeof(CtlStatusEntry)) {
        CtlStatusEntry e;
        std::memcpy(&e, body + off, sizeof(e));
        if (e.rank >= 0 && e.rank < topo_.size() && !topo_.same_host(e.rank)) host_.peer_status(e);
      }
      answers_.fetch_add(1);
      return;
    }
  }
}

void TcpNet::control_failed(int peer, int err) {
  PeerNet& s = *peers_[peer];
  const std::string r = std::to_string(rank_);
  if (err == -1)
    s.fail(PeerState::kDied, "died (its control connection with rank " + r +
                                 " ended without a goodbye: the process exited or was killed; " +
                                 host_note(peer) + ")");
  else if (unreachable_errno(err))
    s.fail(PeerState::kUnreachable,
           "is unreachable (no answer over TCP to rank " + r + " for PYCOLL_NET_TIMEOUT=" +
               std::to_string(static_cast<int>(env_.cfg.timeout_s)) + "s: " + std::strerror(err) +
               "; a link down or its host dead; " + host_note(peer) + ")");
  else if (err == EPROTO)
    s.fail(PeerState::kDied, "sent a malformed control frame to rank " + r);
  else
    s.fail(PeerState::kDied, "died (its control connection with rank " + r +
                                 " failed: " + std::strerror(err) + "; " + host_note(peer) + ")");
  std::lock_guard<std::mutex> lk(ctl_mu_);
  Ctl& c = *ctl_[peer];
  std::lock_guard<std::mutex> tx(c.tx_mu);
  epoll_set(epoll_fd_, EPOLL_CTL_DEL, c.fd, 0, 0);
  close_quietly(c.fd);
  c.fd = -1;
}

void TcpNet::send_ctl(int peer, uint32_t type, const void* body, uint32_t bytes, const void* more,
                      uint32_t more_bytes) {
  Ctl* c;
  {
    std::lock_guard<std::mutex> lk(ctl_mu_);
    c = ctl_[peer].get();
  }
  if (c == nullptr) return;
  const NetCtlHeader h{type, bytes + more_bytes};
  std::lock_guard<std::mutex> lk(c->tx_mu);
  if (c->fd < 0) return;
  const size_t was = c->out.size();
  c->out.append(reinterpret_cast<const char*>(&h), sizeof(h));
  if (bytes) c->out.append(static_cast<const char*>(body), bytes);
  if (more_bytes) c->out.append(static_cast<const char*>(more), more_bytes);
  if (was > 0) return;  // the thread writes it after what is queued
  const ssize_t r = send_nb(c->fd, c->out.data(), c->out.size());
  if (r > 0) c->out.erase(0, static_cast<size_t>(r));
  // An error shows on the read side, where the thread reports it.
  if (r >= 0 && !c->out.empty())
    epoll_set(epoll_fd_, EPOLL_CTL_MOD, c->fd, EPOLLIN | EPOLLOUT, tag(kControl, peer));
}

void TcpNet::flush_ctl(Ctl& c) {
  std::lock_guard<std::mutex> lk(c.tx_mu);
  if (c.fd < 0) return;
  const ssize_t r = send_nb(c.fd, c.out.data(), c.out.size());
  if (r > 0) c.out.erase(0, static_cast<size_t>(r));
  if (r < 0 || c.out.empty())
    epoll_set(epoll_fd_, EPOLL_CTL_MOD, c.fd, EPOLLIN, tag(kControl, c.peer));
}

void TcpNet::push_pending_writes() {
  std::vector<int> peers;
  {
    std::lock_guard<std::mutex> lk(write_mu_);
    peers.swap(want_write_);
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  for (int p : peers) on_data_out(p);
}

void TcpNet::on_data_out(int peer) {
  TcpSendConn& s = *send_[peer];
  bool more = false;
  const int err = s.push(&more);
  if (err != 0)
    peers_[peer]->fail(unreachable_errno(err) ? PeerState::kUnreachable : PeerState::kDied,
                       std::string(unreachable_errno(err) ? "is unreachable" : "died") +
                           " (sending to it from rank " + std::to_string(rank_) +
                           " failed: " + std::strerror(err) + "; " + host_note(peer) + ")");
  const std::vector<int> pending = more ? s.pending_fds() : std::vector<int>{};
  for (int fd : s.fds()) {
    const bool want = std::find(pending.begin(), pending.end(), fd) != pending.end();
    epoll_event ev{};
    ev.events = EPOLLOUT;
    ev.data.u64 = tag(kDataOut, peer);
    if (want) {
      if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0 && errno == EEXIST)
        epoll_set(epoll_fd_, EPOLL_CTL_MOD, fd, EPOLLOUT, tag(kDataOut, peer));
    } else {
      epoll_set(epoll_fd_, EPOLL_CTL_DEL, fd, 0, 0);
    }
  }
}

std::pair<uint64_t, uint64_t> TcpNet::bytes() const {
  uint64_t s = 0, r = 0;
  for (const auto& c : send_)
    if (c) s += c->bytes_sent();
  for (const auto& c : recv_)
    if (c) r += c->bytes_received();
  return {s, r};
}

std::string TcpNet::peer_gone(int p) {
  PeerNet& s = *peers_[p];
  const auto st = static_cast<PeerState>(s.state.load(std::memory_order_acquire));
  if (st == PeerState::kAlive) {
    std::lock_guard<std::mutex> lk(fatal_mu_);
    return fatal_;
  }
  // What it sent before its goodbye may still be unread here: it closed
  // only once this rank read its connections to the end (or it has none).
  if (st == PeerState::kClosed)
    return s.data_eof.load() < s.data_in.load() ? "" : "closed its communicator";
  return s.why();
}

void TcpNet::send_abort(int kind, int from, const std::string& msg, int except) {
  CtlAbort a{kind, from};
  const uint32_t len = static_cast<uint32_t>(std::min<size_t>(msg.size(), 4096));
  for (int q : xpeers_)
    if (q != except)
      send_ctl(q, static_cast<uint32_t>(CtlType::kAbort), &a, sizeof(a), msg.data(), len);
}

void TcpNet::query_status(Clock::time_point deadline) {
  const CtlQuery q{query_id_.fetch_add(1) + 1};
  answers_.store(0);
  std::vector<int> asked_hosts;
  int asked = 0;
  for (int p : xpeers_) {
    const int h = topo_.host(p);
    if (std::find(asked_hosts.begin(), asked_hosts.end(), h) != asked_hosts.end()) continue;
    if (peers_[p]->state.load() != static_cast<int>(PeerState::kAlive)) continue;
    asked_hosts.push_back(h);
    send_ctl(p, static_cast<uint32_t>(CtlType::kQuery), &q, sizeof(q));
    ++asked;
  }
  while (answers_.load() < asked && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void TcpNet::close() {
  if (closed_.exchange(true)) return;
  if (thread_.joinable()) {
    // What the operations queued goes first (bounded: a peer that reads
    // nothing more is gone or going).
    const auto until = Clock::now() + std::chrono::seconds(1);
    for (auto& s : send_)
      while (s && !s->drained() && Clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    for (int q : xpeers_) send_ctl(q, static_cast<uint32_t>(CtlType::kClose), nullptr, 0);
    for (int q : xpeers_) {  // the goodbyes go before the sockets close
      Ctl* c;
      {
        std::lock_guard<std::mutex> lk(ctl_mu_);
        c = ctl_[q].get();
      }
      while (c != nullptr && Clock::now() < until) {
        {
          std::lock_guard<std::mutex> lk(c->tx_mu);
          if (c->fd < 0 || c->out.empty()) break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
    stop_.store(true);
    try {
      wake();
    } catch (const std::exception&) {  // the thread notices stop_ within 100 ms anyway
    }
    thread_.join();
  }
  for (auto& s : send_)
    if (s) s->close_sockets();
  for (auto& r : recv_)
    if (r) r->close_sockets();
  for (auto& c : ctl_)
    if (c) {
      close_quietly(c->fd);
      c->fd = -1;
    }
  for (auto& p : pending_)
    if (p) close_quietly(p->fd);
  pending_.clear();
  close_quietly(listen_fd_);
  close_quietly(epoll_fd_);
  close_quietly(wake_fd_);
  listen_fd_ = epoll_fd_ = wake_fd_ = -1;
}

}  // namespace pyc
