// Links between hosts over TCP (see tcp_conn.h).
#include "transport/tcp/tcp_conn.h"

#include <poll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <sstream>

#include "core/clock.h"
#include "core/error.h"
#include "transport/tcp/tcp_net.h"

namespace pyc {
namespace {

constexpr size_t kHdr = sizeof(DataHeader);

size_t round64(size_t x) { return (x + 63) / 64 * 64; }

char* align64(char* p) {
  return reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) / 64 * 64);
}

// Sends what it can of [p, p + n) without blocking; returns the bytes sent,
// or -errno (0 bytes on EAGAIN).
ssize_t send_some(int fd, const void* p, size_t n) {
  for (;;) {
    const ssize_t r = ::send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r >= 0) return r;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return -errno;
  }
}

// Receives what has arrived, up to n bytes, without blocking: bytes read, 0
// on EAGAIN, -errno, or kEof at the end of the stream.
constexpr ssize_t kEof = -100000;
ssize_t recv_some(int fd, void* p, size_t n) {
  for (;;) {
    const ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) return r;
    if (r == 0) return kEof;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return -errno;
  }
}

std::string errno_text(int err) {
  if (err == -1) return "the connection closed";
  std::ostringstream os;
  os << std::strerror(err) << " (errno " << err << ")";
  return os.str();
}

}  // namespace

bool unreachable_errno(int err) {
  return err == ETIMEDOUT || err == EHOSTUNREACH || err == ENETUNREACH || err == EHOSTDOWN ||
         err == ENETDOWN;
}

void PeerNet::fail(PeerState s, const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  if (state.load() != static_cast<int>(PeerState::kAlive)) return;  // the first verdict stays
  why_ = why;
  state.store(static_cast<int>(s), std::memory_order_release);
}

std::string PeerNet::why() {
  std::lock_guard<std::mutex> lk(mu_);
  return why_;
}

void net_wait(FunctionRef<bool()> try_op, FunctionRef<int()> fd, short events, WaitMonitor& mon,
              int spin_us) {
  const auto spin_end = Clock::now() + std::chrono::microseconds(spin_us);
  for (int i = 1;; ++i) {
    if (try_op()) return;
    mon.check_fast();
    if ((i & 7) == 0 && Clock::now() >= spin_end) break;
  }
  auto slow_at = Clock::now();
  for (;;) {
    const int f = fd();
    if (f >= 0) {
      pollfd p{f, events, 0};
      if (::poll(&p, 1, 1) < 0 && errno != EINTR)
        detail::throw_sys(__FILE__, __LINE__, "poll", errno);
    } else {
      const timespec nap{0, 50000};
      nanosleep(&nap, nullptr);
    }
    if (try_op()) return;
    mon.check_fast();
    const auto now = Clock::now();
    if (now >= slow_at) {
      mon.check_slow();
      slow_at = now + std::chrono::milliseconds(1);
    }
  }
}

// ---- sending ----

TcpSendConn::TcpSendConn(const TcpLinkEnv& env, TcpNet& net, PeerNet& state, int peer,
                         SockAddr addr)
    : env_(env), net_(net), state_(state), peer_(peer), addr_(addr) {}

TcpSendConn::~TcpSendConn() { close_sockets(); }

void TcpSendConn::close_sockets() {
  std::lock_guard<std::mutex> lk(mu_);
  for (int& fd : fds_) {
    if (fd >= 0) (void)::close(fd);  // nothing to do about a failed close of a socket we drop
    fd = -1;
  }
}

void TcpSendConn::fail(int err, WaitMonitor& mon, const char* what) {
  if (err == -1) err = ECONNRESET;
  if (unreachable_errno(err))
    state_.fail(PeerState::kUnreachable, "is unreachable (" + std::string(what) +
                                             " to it from rank " + std::to_string(env_.rank) +
                                             " failed: " + errno_text(err) +
                                             ": a link down or its host dead)");
  else if (err == EPIPE || err == ECONNRESET)
    state_.fail(PeerState::kDied, "died (its TCP connection from rank " +
                                      std::to_string(env_.rank) + " was reset: " + errno_text(err) +
                                      ")");
  mon.peer_failed(peer_);  // throws, naming the operation, once the peer's state shows
  PYC_THROW(PeerFailure, "pycollectives: rank "
                             << env_.rank << ": " << what << " to rank " << peer_ << " at "
                             << addr_.str() << " failed: " << errno_text(err)
                             << (err == ECONNREFUSED ? " (it closed its communicator or died, "
                                                       "or this address is not its: see "
                                                       "PYCOLL_SOCKET_IFNAME)"
                                                     : ""));
}

void TcpSendConn::connect(WaitMonitor& mon) {
  const size_t stride = 64 + round64(env_.slot_bytes);
  mem_.reset(new char[stride * env_.nslots + 64]);
  base_ = align64(mem_.get());
  stride_ = stride;
  queue_.assign(env_.cfg.nsocks, {});
  for (uint32_t i = 0; i < env_.nslots; ++i) free_.push_back(static_cast<int>(env_.nslots - 1 - i));
  for (int s = 0; s < env_.cfg.nsocks; ++s) {
    Hello h{};
    h.magic = kNetMagic;
    h.version = kNetVersion;
    h.kind = static_cast<uint32_t>(ConnKind::kData);
    std::memcpy(h.comm_id, env_.comm_id, sizeof(h.comm_id));
    h.from = env_.rank;
    h.to = peer_;
    h.stripe = s;
    h.world_size = env_.world_size;
    DialFailure why;
    const int fd = dial(addr_, h, env_.key, env_.cfg, mon, &why);
    if (fd < 0) refused(why, mon);
    std::lock_guard<std::mutex> lk(mu_);
    fds_.push_back(fd);
  }
  connected_ = true;
}

void TcpSendConn::refused(const DialFailure& why, WaitMonitor& mon) {
  // A peer whose death its control connection reported is named as dead;
  // any other failure is the connection's, named as such: the peer may well
  // be alive (a flooded listener, an impostor at its address).
  mon.peer_failed(peer_);  // throws, naming the operation, once the peer's state shows
  std::ostringstream os;
  os << "pycollectives: rank " << env_.rank << ": a data connection to rank " << peer_
     << " was refused by rank " << peer_ << " at " << addr_.str() << ": " << why.text();
  if (why.auth()) throw Error(os.str());
  if (why.err == ECONNREFUSED)
    os << " (nothing listens there: it closed its communicator, or this address is not its: see "
          "PYCOLL_SOCKET_IFNAME)";
  throw PeerFailure(os.str());
}

void* TcpSendConn::acquire(WaitMonitor& mon) {
  mon.peer = peer_;
  if (!connected_) connect(mon);
  int err = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (free_.empty()) push_locked();
    err = error_;
    if (err == 0 && !free_.empty()) {
      current_ = free_.back();
      free_.pop_back();
      return base_ + current_ * stride_ + 64;
    }
  }
  if (err != 0) fail(err, mon, "sending");
  net_wait(
      [&] {
        std::lock_guard<std::mutex> lk(mu_);
        push_locked();
        return error_ != 0 || !free_.empty();
      },
      [&] {
        std::lock_guard<std::mutex> lk(mu_);
        for (size_t s = 0; s < queue_.size(); ++s)
          if (!queue_[s].empty()) return fds_[s];
        return -1;
      },
      POLLOUT, mon, env_.cfg.spin_us);
  {
    std::lock_guard<std::mutex> lk(mu_);
    err = error_;
    if (err == 0) {
      current_ = free_.back();
      free_.pop_back();
      return base_ + current_ * stride_ + 64;
    }
  }
  fail(err, mon, "sending");
}

bool TcpSendConn::ready() {
  if (!connected_) return true;
  std::lock_guard<std::mutex> lk(mu_);
  if (free_.empty()) push_locked();
  return error_ != 0 || !free_.empty();
}

void TcpSendConn::post(const SlotTag& tag, size_t bytes) {
  PYC_ASSERT(current_ >= 0 && bytes <= env_.slot_bytes);
  char* frame = base_ + current_ * stride_ + 64 - kHdr;
  DataHeader h{tag.seq, 0, tag.w0, tag.w1, bytes};
  std::memcpy(frame, &h, kHdr);
  bool more = false;
  int err = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_[stripe_].push_back(Frame{current_, 0, kHdr + bytes});
    stripe_ = (stripe_ + 1) % static_cast<int>(queue_.size());
    current_ = -1;
    sent_.fetch_add(bytes, std::memory_order_relaxed);
    err = push_locked();
    for (const auto& q : queue_) more = more || !q.empty();
  }
  // A failed socket: the peer's state says why (the next wait raises it).
  if (err != 0)
    state_.fail(unreachable_errno(err) ? PeerState::kUnreachable : PeerState::kDied,
                std::string(unreachable_errno(err) ? "is unreachable" : "died") +
                    " (sending to it from rank " + std::to_string(env_.rank) +
                    " failed: " + errno_text(err) + ")");
  else if (more)
    net_.want_write(peer_);
}

int TcpSendConn::push_locked() {
  if (error_ != 0) return error_;
  for (size_t s = 0; s < queue_.size(); ++s) {
    auto& q = queue_[s];
    while (!q.empty()) {
      Frame& f = q.front();
      const char* p = base_ + f.slot * stride_ + 64 - kHdr + f.off;
      const ssize_t n = send_some(fds_[s], p, f.len - f.off);
      if (n < 0) return error_ = static_cast<int>(-n);
      if (n == 0) break;
      f.off += static_cast<size_t>(n);
      if (f.off == f.len) {
        free_.push_back(f.slot);
        q.pop_front();
      }
    }
  }
  return 0;
}

int TcpSendConn::push(bool* more) {
  std::lock_guard<std::mutex> lk(mu_);
  const int err = push_locked();
  *more = false;
  for (const auto& q : queue_) *more = *more || !q.empty();
  return err;
}

std::vector<int> TcpSendConn::pending_fds() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<int> out;
  for (size_t s = 0; s < queue_.size(); ++s)
    if (!queue_[s].empty() && error_ == 0) out.push_back(fds_[s]);
  return out;
}

std::vector<int> TcpSendConn::fds() {
  std::lock_guard<std::mutex> lk(mu_);
  return fds_;
}

bool TcpSendConn::drained() {
  std::lock_guard<std::mutex> lk(mu_);
  if (error_ != 0) return true;
  for (const auto& q : queue_)
    if (!q.empty()) return false;
  return true;
}

// ---- receiving ----

TcpRecvConn::TcpRecvConn(const TcpLinkEnv& env, PeerNet& state, int peer)
    : env_(env), state_(state), peer_(peer), fds_(env.cfg.nsocks) {
  for (auto& f : fds_) f.store(-1);
  mem_.reset(new char[round64(env.slot_bytes) + 64]);
  buf_ = align64(mem_.get());
}

TcpRecvConn::~TcpRecvConn() { close_sockets(); }

void TcpRecvConn::close_sockets() {
  for (auto& f : fds_) {
    const int fd = f.exchange(-1);
    if (fd >= 0) (void)::close(fd);  // nothing to do about a failed close of a socket we drop
  }
}

bool TcpRecvConn::adopt(int stripe, int fd) {
  int none = -1;
  if (stripe < 0 || stripe >= static_cast<int>(fds_.size()) ||
      !fds_[stripe].compare_exchange_strong(none, fd, std::memory_order_acq_rel))
    return false;
  state_.data_in.fetch_add(1);
  return true;
}

bool TcpRecvConn::progress() {
  if (held_) return true;
  if (error_ != 0) return false;
  const int fd = fds_[stripe_].load(std::memory_order_acquire);
  if (fd < 0) return false;
  for (;;) {
    const size_t want = got_ < kHdr ? kHdr : kHdr + hdr_.bytes;
    char* dst = got_ < kHdr ? reinterpret_cast<char*>(&hdr_) + got_ : buf_ + (got_ - kHdr);
    const ssize_t n = recv_some(fd, dst, want - got_);
    if (n == 0) return false;
    if (n < 0) {
      error_ = n == kEof ? -1 : static_cast<int>(-n);
      return false;
    }
    got_ += static_cast<size_t>(n);
    if (got_ == kHdr && hdr_.bytes > env_.slot_bytes) {
      error_ = EPROTO;
      return false;
    }
    if (got_ >= kHdr && got_ == kHdr + hdr_.bytes) {
      recvd_.fetch_add(hdr_.bytes, std::memory_order_relaxed);
      held_ = true;
      return true;
    }
  }
}

void TcpRecvConn::fail(WaitMonitor& mon) {
  if (error_ == EPROTO)
    PYC_THROW(Error, "pycollectives: rank " << env_.rank << ": rank " << peer_
                                            << " sent a frame of " << hdr_.bytes
                                            << " bytes, more than a slot (" << env_.slot_bytes
                                            << "): it does not run this communicator's settings");
  if (error_ == -1) {
    state_.data_eof.fetch_add(1);
  } else if (unreachable_errno(error_)) {
    state_.fail(PeerState::kUnreachable,
                "is unreachable (its connection to rank " + std::to_string(env_.rank) +
                    " failed: " + errno_text(error_) + ": a link down or its host dead)");
  } else {
    state_.fail(PeerState::kDied, "died (its connection to rank " + std::to_string(env_.rank) +
                                      " failed: " + errno_text(error_) + ")");
  }
  mon.peer_failed(peer_);  // throws, naming the operation, once the peer's state shows
  PYC_THROW(PeerFailure, "pycollectives: rank " << peer_ << " closed its connection to rank "
                                                << env_.rank << " in the middle of an operation ("
                                                << errno_text(error_)
                                                << "): it closed its communicator or died");
}

RecvSlot TcpRecvConn::wait(WaitMonitor& mon) {
  mon.peer = peer_;
  if (!progress()) {
    if (error_ != 0) fail(mon);
    net_wait([&] { return progress() || error_ != 0; },
             [&] { return fds_[stripe_].load(std::memory_order_acquire); }, POLLIN, mon,
             env_.cfg.spin_us);
    if (!held_) fail(mon);
  }
  RecvSlot s;
  s.data = buf_;
  s.bytes = hdr_.bytes;
  s.tag = SlotTag{hdr_.seq, hdr_.w0, hdr_.w1};
  return s;
}

// A failed connection counts as ready: wait() then raises its error.
bool TcpRecvConn::ready() { return progress() || error_ != 0; }

void TcpRecvConn::release() {
  held_ = false;
  got_ = 0;
  stripe_ = (stripe_ + 1) % static_cast<int>(fds_.size());
}

}  // namespace pyc
