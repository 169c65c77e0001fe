// The listening socket and the accepting side of the handshakes (see
// tcp_listener.h).
#include "transport/tcp/tcp_listener.h"

#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <map>

#include "core/error.h"

namespace pyc {
namespace {

// Sends all of [p, p + n) at once or reports failure (a handshake's answer
// is far smaller than any socket's buffer).
bool send_all_nb(int fd, const void* p, size_t n) {
  for (;;) {
    const ssize_t r = ::send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (r >= 0) return static_cast<size_t>(r) == n;
    if (errno != EINTR) return false;
  }
}

// An address without its port: the unit of the per-source limit.
std::string source_of(const SockAddr& a) {
  if (a.family() == AF_INET6) {
    const auto& s6 = reinterpret_cast<const sockaddr_in6&>(a.ss);
    return std::string(reinterpret_cast<const char*>(&s6.sin6_addr), 16);
  }
  const auto& s4 = reinterpret_cast<const sockaddr_in&>(a.ss);
  return std::string(reinterpret_cast<const char*>(&s4.sin_addr), 4);
}

}  // namespace

struct TcpListener::Pending {
  int fd = -1;
  std::string source;  // source_of(its address)
  std::string from;    // its address, for the log
  uint64_t order = 0;  // accept order: lower is older
  Clock::time_point deadline;
  bool challenged = false;  // the Challenge went: reading the Proof
  size_t got = 0;           // bytes of the Hello, then of the Proof
  Hello hello{};
  Proof proof{};
  uint8_t nonce[kNonceBytes] = {};
};

TcpListener::TcpListener(int rank, const SockAddr& addr, const NetKey& key, const NetConfig& cfg,
                         int epoll_fd, uint64_t listen_tag, uint64_t pending_tag,
                         ListenerHost& host)
    : rank_(rank),
      key_(key),
      cfg_(cfg),
      epoll_fd_(epoll_fd),
      pending_tag_(pending_tag),
      host_(host) {
  fd_ = tcp_listen(addr);
  try {
    addr_ = local_address(fd_);
    epoll_set(epoll_fd_, EPOLL_CTL_ADD, fd_, EPOLLIN, listen_tag);
  } catch (...) {
    close_quietly(fd_);
    throw;
  }
}

TcpListener::~TcpListener() {
  flush_log();
  for (auto& p : pending_)
    if (p) close_quietly(p->fd);
  close_quietly(fd_);
  wipe(key_.bytes, sizeof(key_.bytes));
}

void TcpListener::flush_log() {
  if (log_held_ == 0) return;
  std::fprintf(stderr, "pycollectives: rank %d: refused %llu more connections, not shown\n", rank_,
               static_cast<unsigned long long>(log_held_));
  log_held_ = 0;
}

void TcpListener::stop() {
  if (fd_ < 0) return;
  flush_log();
  epoll_set(epoll_fd_, EPOLL_CTL_DEL, fd_, 0, 0);
  close_quietly(fd_);
  fd_ = -1;
  for (auto& p : pending_)
    if (p) {
      epoll_set(epoll_fd_, EPOLL_CTL_DEL, p->fd, 0, 0);
      close_quietly(p->fd);
      p.reset();
    }
}

void TcpListener::log(const std::string& from, const std::string& why) {
  // A token bucket: kLogBurst lines at once, then one a second.
  const auto now = Clock::now();
  log_tokens_ = std::min<double>(
      kLogBurst, log_tokens_ + std::chrono::duration<double>(now - log_last_).count());
  log_last_ = now;
  if (log_tokens_ < 1) {
    ++log_held_;
    return;
  }
  log_tokens_ -= 1;
  std::string held;
  if (log_held_ > 0)
    held = " (" + std::to_string(log_held_) + " more refused since the last report, not shown)";
  log_held_ = 0;
  std::fprintf(stderr, "pycollectives: rank %d: refused a connection from %s: %s%s\n", rank_,
               from.c_str(), why.c_str(), held.c_str());
}

void TcpListener::refuse(size_t slot, Refusal status, const std::string& why) {
  Pending& p = *pending_[slot];
  if (status != Refusal::kNone) {  // best effort: the peer learns why
    if (p.challenged) {
      const HelloAck nack{kNetMagic, rank_, static_cast<int32_t>(status)};
      (void)send_all_nb(p.fd, &nack, sizeof(nack));
    } else {
      Challenge nack{};
      nack.magic = kNetMagic;
      nack.rank = rank_;
      nack.status = static_cast<int32_t>(status);
      (void)send_all_nb(p.fd, &nack, sizeof(nack));
    }
  }
  refused_.fetch_add(1);
  log(p.from, why);
  finish(slot);
}

void TcpListener::finish(size_t slot) {
  Pending& p = *pending_[slot];
  if (p.fd >= 0) {
    epoll_set(epoll_fd_, EPOLL_CTL_DEL, p.fd, 0, 0);
    close_quietly(p.fd);
  }
  pending_[slot].reset();
}

void TcpListener::evict_for(const std::string& source) {
  std::map<std::string, size_t> count;
  size_t total = 0;
  for (const auto& p : pending_)
    if (p) {
      ++count[p->source];
      ++total;
    }
  std::string from;  // the address to evict from
  if (count[source] >= kMaxPerSource) {
    from = source;
  } else if (total >= kMaxPending) {
    size_t most = 0;
    for (const auto& [s, k] : count)
      if (k > most) most = k, from = s;
  } else {
    return;
  }
  size_t victim = pending_.size();
  for (size_t i = 0; i < pending_.size(); ++i)
    if (pending_[i] && pending_[i]->source == from &&
        (victim == pending_.size() || pending_[i]->order < pending_[victim]->order))
      victim = i;
  refuse(victim, Refusal::kNone,
         "evicted before its handshake was complete, to make room for a newer connection (" +
             std::to_string(count[from]) + " pending from its address, " + std::to_string(total) +
             " in all; limits " + std::to_string(kMaxPerSource) + " and " +
             std::to_string(kMaxPending) + ")");
}

void TcpListener::on_accept() {
  for (int k = 0; k < 64 && fd_ >= 0; ++k) {  // then the thread's other work, then more
    SockAddr from;
    from.len = sizeof(from.ss);
    const int fd = accept4(fd_, reinterpret_cast<sockaddr*>(&from.ss), &from.len,
                           SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        refused_.fetch_add(1);
        log("an unknown address", std::string("accept4 failed: ") + std::strerror(errno));
        return;
      }
      detail::throw_sys(__FILE__, __LINE__, "accept4", errno);
    }
    auto p = std::make_unique<Pending>();
    p->fd = fd;
    p->source = source_of(from);
    p->from = from.str();
    p->order = ++accepted_;
    p->deadline = Clock::now() + kHandshakeTime;
    evict_for(p->source);
    try {
      tune_socket(fd, cfg_);
    } catch (const std::exception& e) {
      close_quietly(fd);
      refused_.fetch_add(1);
      log(p->from, e.what());
      continue;
    }
    size_t slot = 0;
    while (slot < pending_.size() && pending_[slot]) ++slot;
    if (slot == pending_.size()) pending_.emplace_back();
    epoll_set(epoll_fd_, EPOLL_CTL_ADD, fd, EPOLLIN, pending_tag_ + slot);
    pending_[slot] = std::move(p);
  }
}

bool TcpListener::answer(Pending& p) {
  random_bytes(p.nonce, sizeof(p.nonce));
  Challenge ch{};
  ch.magic = kNetMagic;
  ch.rank = rank_;
  std::memcpy(ch.nonce, p.nonce, sizeof(p.nonce));
  const Digest mac = handshake_mac(key_, true, p.hello, p.nonce, addr_);
  std::memcpy(ch.mac, mac.data(), mac.size());
  p.challenged = true;
  p.got = 0;
  return send_all_nb(p.fd, &ch, sizeof(ch));
}

void TcpListener::on_pending(size_t slot) {
  if (slot >= pending_.size() || !pending_[slot]) return;
  Pending& p = *pending_[slot];
  for (;;) {
    char* dst =
        p.challenged ? reinterpret_cast<char*>(&p.proof) : reinterpret_cast<char*>(&p.hello);
    const size_t want = p.challenged ? sizeof(Proof) : sizeof(Hello);
    const ssize_t r = ::recv(p.fd, dst + p.got, want - p.got, MSG_DONTWAIT);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (r <= 0)
      return refuse(slot, Refusal::kNone,
                    "it closed before its handshake was complete" +
                        (r < 0 ? std::string(" (") + std::strerror(errno) + ")" : ""));
    p.got += static_cast<size_t>(r);
    if (!p.challenged) {
      if (p.got >= sizeof(uint64_t) && p.hello.magic != kNetMagic)
        return refuse(slot, Refusal::kNone, "not the pycollectives protocol");
      if (p.got >= offsetof(Hello, version) + sizeof(uint32_t) && p.hello.version != kNetVersion)
        return refuse(slot, Refusal::kVersion,
                      "protocol version " + std::to_string(p.hello.version) +
                          ", this rank speaks " + std::to_string(kNetVersion));
      if (p.got < sizeof(Hello)) continue;
      std::string why;
      const Refusal r = host_.vet(p.hello, &why);
      if (r != Refusal::kNone) return refuse(slot, r, why);
      if (!answer(p))
        return refuse(slot, Refusal::kNone, "the challenge to its handshake could not be sent");
      continue;
    }
    if (p.got < sizeof(Proof)) continue;
    const Digest want_mac = handshake_mac(key_, false, p.hello, p.nonce, addr_);
    if (!equal_ct(want_mac.data(), p.proof.mac, want_mac.size()))
      return refuse(slot, Refusal::kAuth,
                    "it claims to be rank " + std::to_string(p.hello.from) +
                        ", but its proof of the communicator's key did not verify (not a rank "
                        "of this job)");
    epoll_set(epoll_fd_, EPOLL_CTL_DEL, p.fd, 0, 0);
    std::string why;
    const Refusal a = host_.adopt(p.hello, p.fd, &why);
    if (a != Refusal::kNone) return refuse(slot, a, why);
    // Adopted (a data connection is read from now on: its peer sends only
    // after this answer). A failed send shows on the connection itself.
    const HelloAck ack{kNetMagic, rank_, 0};
    (void)send_all_nb(p.fd, &ack, sizeof(ack));
    p.fd = -1;
    pending_[slot].reset();
    return;
  }
}

void TcpListener::expire() {
  const auto now = Clock::now();
  for (size_t i = 0; i < pending_.size(); ++i)
    if (pending_[i] && now > pending_[i]->deadline)
      refuse(i, Refusal::kNone, "no complete handshake within 1 s");
}

}  // namespace pyc
