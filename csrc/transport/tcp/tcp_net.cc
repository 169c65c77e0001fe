// The network thread, the listening socket and the control connections of a
// communicator that spans hosts (see tcp_net.h).
#include "transport/tcp/tcp_net.h"

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

TcpNet::TcpNet(const Topology& topo, const NetConfig& cfg, const uint8_t comm_id[16],
               const NetKey& key, size_t slot_bytes, uint32_t nslots, NetHost& host,
               const std::string& hint)
    : topo_(topo), rank_(topo.rank()), host_(host) {
  env_.rank = rank_;
  env_.world_size = topo.size();
  std::memcpy(env_.comm_id, comm_id, 16);
  env_.key = key;
  env_.cfg = cfg;
  env_.slot_bytes = slot_bytes;
  env_.nslots = nslots;
  try {
    const SockAddr where = choose_address(hint, &iface_);
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    PYC_SYSCHECK(epoll_fd_);
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    PYC_SYSCHECK(wake_fd_);
    epoll_set(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, EPOLLIN, tag(kWake, 0));
    listener_ = std::make_unique<TcpListener>(rank_, where, key, cfg, epoll_fd_, tag(kListen, 0),
                                              tag(kPending, 0), *this);
    address_ = listener_->address().str();
  } catch (...) {
    listener_.reset();
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
  // What this rank accepts: a control connection from each lower control
  // peer, every stripe of a data connection from every rank of another host.
  for (int q : xpeers_) expected_in_ += q < rank_ ? 1 : 0;
  for (int p = 0; p < n; ++p) expected_in_ += topo.same_host(p) ? 0 : cfg.nsocks;
}

TcpNet::~TcpNet() { close(); }

std::string TcpNet::host_note(int p) const { return "ranks on its host: " + topo_.host_ranks(p); }

Hello TcpNet::hello(ConnKind kind, int to, int stripe) const {
  Hello h{};
  h.magic = kNetMagic;
  h.version = kNetVersion;
  h.kind = static_cast<uint32_t>(kind);
  std::memcpy(h.comm_id, env_.comm_id, 16);
  h.from = rank_;
  h.to = to;
  h.stripe = stripe;
  h.world_size = topo_.size();
  return h;
}

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
    DialFailure why;
    const int fd =
        pyc::dial(addrs_[q], hello(ConnKind::kControl, q, 0), env_.key, env_.cfg, mon, &why);
    if (fd < 0) {
      std::ostringstream os;
      os << "pycollectives: rank " << rank_ << ": init: could not connect to rank " << q << " at "
         << addrs_[q].str() << " (interface " << iface_ << "): " << why.text();
      if (why.auth()) throw Error(os.str());  // not a failure of the peer: an attack, or a setup
      os << (why.status != 0 ? " (another communicator or job at that address?)"
                             : " (it died, or the address is not reachable from here: see "
                               "PYCOLL_SOCKET_IFNAME)");
      throw PeerFailure(os.str());
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
            listener_->on_accept();
            break;
          case kWake: {
            uint64_t v;
            if (::read(wake_fd_, &v, sizeof(v)) < 0 && errno != EAGAIN)
              detail::throw_sys(__FILE__, __LINE__, "read(eventfd)", errno);
            push_pending_writes();
            break;
          }
          case kPending:
            listener_->on_pending(idx);
            break;
          case kControl:
            on_control(static_cast<int>(idx), evs[i].events);
            break;
          case kDataOut:
            on_data_out(static_cast<int>(idx));
            break;
        }
      }
      listener_->expire();
      if (adopted_in_ == expected_in_ && listener_->listening()) {
        listener_->stop();  // every expected connection is in: no open port
        listening_.store(false);
      }
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

Refusal TcpNet::vet(const Hello& h, std::string* why) {
  const int n = topo_.size();
  const auto kind = static_cast<ConnKind>(h.kind);
  std::ostringstream os;
  Refusal r = Refusal::kNone;
  if (!equal_ct(h.comm_id, env_.comm_id, 16)) {
    r = Refusal::kOtherComm;
    os << "it carries another communicator's id";
  } else if (h.to != rank_ || h.world_size != n) {
    r = Refusal::kNotForMe;
    os << "it is meant for rank " << h.to << " of " << h.world_size << ", this is rank " << rank_
       << " of " << n;
  } else if (h.from < 0 || h.from >= n || topo_.same_host(h.from)) {
    r = Refusal::kNotExpected;
    os << "it claims to come from rank " << h.from << ", which is not a rank of another host";
  } else if (kind != ConnKind::kControl && kind != ConnKind::kData) {
    r = Refusal::kNotExpected;
    os << "unknown connection kind " << h.kind;
  } else if (kind == ConnKind::kControl &&
             (h.from > rank_ ||
              std::find(xpeers_.begin(), xpeers_.end(), h.from) == xpeers_.end())) {
    r = Refusal::kNotExpected;
    os << "rank " << h.from << " does not open a control connection to this rank";
  } else if (kind == ConnKind::kData && (h.stripe < 0 || h.stripe >= env_.cfg.nsocks)) {
    r = Refusal::kNotExpected;
    os << "stripe " << h.stripe << " is out of range (PYCOLL_SOCKET_NSOCKS=" << env_.cfg.nsocks
       << " here)";
  }
  *why = os.str();
  return r;
}

Refusal TcpNet::adopt(const Hello& h, int fd, std::string* why) {
  const bool control = h.kind == static_cast<uint32_t>(ConnKind::kControl);
  const std::string what =
      (control ? "the control connection" : "data connection " + std::to_string(h.stripe)) +
      " from rank " + std::to_string(h.from);
  bool fresh;
  if (control) {
    std::lock_guard<std::mutex> lk(ctl_mu_);
    fresh = ctl_[h.from] == nullptr;
  } else {
    fresh = recv_[h.from] && recv_[h.from]->adopt(h.stripe, fd);
  }
  if (!fresh) {
    *why = "it passed the handshake, but " + what +
           " is connected already: a second one is never adopted";
    return Refusal::kDuplicate;
  }
  if (control) register_ctl(h.from, fd);
  ++adopted_in_;
  return Refusal::kNone;
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
  // Frames are parsed as they arrive, and no more is read than completes the
  // largest frame, so the buffer never holds more than that however fast the
  // peer sends; a header past the limit fails the connection at once.
  constexpr size_t kCap = sizeof(NetCtlHeader) + kMaxCtlBody;
  auto parse = [&] {  // false: a malformed header
    size_t off = 0;
    bool ok = true;
    while (c->in.size() - off >= sizeof(NetCtlHeader)) {
      NetCtlHeader h;
      std::memcpy(&h, c->in.data() + off, sizeof(h));
      if (h.bytes > kMaxCtlBody) {
        ok = false;
        break;
      }
      if (c->in.size() - off < sizeof(h) + h.bytes) break;
      handle_frame(peer, h.type, c->in.data() + off + sizeof(h), h.bytes);
      off += sizeof(h) + h.bytes;
    }
    c->in.erase(0, off);
    return ok;
  };
  char buf[16384];
  for (int reads = 0; reads < 64; ++reads) {  // then the thread's other work (epoll comes back)
    const size_t room = std::min(sizeof(buf), kCap - c->in.size());
    const ssize_t r = ::recv(c->fd, buf, room, MSG_DONTWAIT);
    if (r > 0) {
      c->in.append(buf, static_cast<size_t>(r));
      if (c->in.size() > ctl_in_peak_.load(std::memory_order_relaxed))
        ctl_in_peak_.store(c->in.size(), std::memory_order_relaxed);
      if (!parse()) return control_failed(peer, EPROTO);
      continue;
    }
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    // Frames that came before the end still count (a goodbye, an error).
    const int err = r == 0 ? -1 : errno;
    (void)parse();
    return control_failed(peer, err);
  }
}

void TcpNet::handle_frame(int peer, uint32_t type, const char* body, uint32_t bytes) {
  if (static_cast<CtlType>(type) == CtlType::kClose)
    peers_[peer]->fail(PeerState::kClosed, "closed its communicator");
  else
    host_.on_control(peer, type, body, bytes);
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

bool TcpNet::peer_alive(int p) const {
  return peers_[p]->state.load() == static_cast<int>(PeerState::kAlive);
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
  listener_->stop();  // its socket and the pending handshakes (the counts stay)
  listening_.store(false);
  close_quietly(epoll_fd_);
  close_quietly(wake_fd_);
  epoll_fd_ = wake_fd_ = -1;
}

}  // namespace pyc
