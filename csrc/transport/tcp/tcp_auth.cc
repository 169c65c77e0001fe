// The authenticated handshake of the TCP transport: the MACs, and the
// connecting side (see tcp_auth.h; the accepting side is tcp_listener.cc).
#include "transport/tcp/tcp_auth.h"

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <sstream>

#include "core/clock.h"
#include "core/error.h"
#include "transport/tcp/tcp_conn.h"

namespace pyc {
namespace {

constexpr char kKeyLabel[] = "pycollectives/2 communicator key";
constexpr char kServerLabel[] = "pycollectives/2 accepting side";
constexpr char kClientLabel[] = "pycollectives/2 connecting side";
constexpr int kTries = 10;  // a connection dropped before its answer: tried this often

// The listening address as the MAC binds it: family, port, IP (16 bytes; an
// IPv4 address in the first 4). The scope of a link-local IPv6 address is
// left out: it names an interface, differently on each host.
void bind_address(HmacSha256& h, const SockAddr& a) {
  uint8_t b[20] = {};
  b[0] = a.family() == AF_INET6 ? 6 : 4;
  b[2] = static_cast<uint8_t>(a.port() >> 8);
  b[3] = static_cast<uint8_t>(a.port());
  if (a.family() == AF_INET6)
    std::memcpy(b + 4, &reinterpret_cast<const sockaddr_in6&>(a.ss).sin6_addr, 16);
  else
    std::memcpy(b + 4, &reinterpret_cast<const sockaddr_in&>(a.ss).sin_addr, 4);
  h.update(b, sizeof(b));
}

// Sends or receives all of [p, p + n) on a non-blocking socket, waiting
// through `mon`; returns 0, the errno that failed it, or -1 at the end of the
// stream. `early` (receiving) sees the bytes so far and may stop it (returns
// false).
int transfer(
    int fd, bool out, void* p, size_t n, WaitMonitor& mon, int spin_us,
    FunctionRef<bool(size_t)> early = [](size_t) { return true; }) {
  size_t done = 0;
  int err = 0;
  net_wait(
      [&] {
        for (;;) {
          char* at = static_cast<char*>(p) + done;
          const ssize_t r = out ? ::send(fd, at, n - done, MSG_DONTWAIT | MSG_NOSIGNAL)
                                : ::recv(fd, at, n - done, MSG_DONTWAIT);
          if (r > 0) {
            done += static_cast<size_t>(r);
            if (!out && !early(done)) return true;
            if (done == n) return true;
            continue;
          }
          if (r == 0 && !out) {
            err = -1;
            return true;
          }
          if (r < 0 && errno == EINTR) continue;
          if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
          err = r < 0 ? errno : EPIPE;
          return true;
        }
      },
      [&] { return fd; }, out ? POLLOUT : POLLIN, mon, spin_us);
  return err;
}

// One try: true once the peer adopted the connection.
bool attempt(int fd, const SockAddr& addr, Hello& hello, const NetKey& key, int spin_us,
             WaitMonitor& mon, DialFailure* why) {
  pollfd pf{fd, POLLOUT, 0};
  net_wait([&] { return ::poll(&pf, 1, 0) > 0; }, [&] { return fd; }, POLLOUT, mon, spin_us);
  if ((why->err = socket_error(fd)) != 0) return false;
  random_bytes(hello.nonce, sizeof(hello.nonce));
  if ((why->err = transfer(fd, true, &hello, sizeof(hello), mon, spin_us)) != 0) return false;
  Challenge ch{};
  auto magic_ok = [&](size_t got) {
    return got < sizeof(uint64_t) || ch.magic == kNetMagic;  // not the protocol: stop reading
  };
  if ((why->err = transfer(fd, false, &ch, sizeof(ch), mon, spin_us, magic_ok)) != 0) return false;
  if (ch.magic != kNetMagic) return why->bad_peer = true, false;
  if (ch.status != 0) return why->status = ch.status, false;
  const Digest want = handshake_mac(key, true, hello, ch.nonce, addr);
  if (ch.rank != hello.to || !equal_ct(want.data(), ch.mac, want.size()))
    return why->bad_peer = true, false;
  Proof proof{};
  const Digest mine = handshake_mac(key, false, hello, ch.nonce, addr);
  std::memcpy(proof.mac, mine.data(), mine.size());
  if ((why->err = transfer(fd, true, &proof, sizeof(proof), mon, spin_us)) != 0) return false;
  HelloAck ack{};
  why->err = transfer(fd, false, &ack, sizeof(ack), mon, spin_us);
  if (why->err != 0) return why->after_auth = true, false;
  if (ack.magic != kNetMagic || ack.rank != hello.to) return why->bad_peer = true, false;
  why->status = ack.status;
  return ack.status == 0;
}

}  // namespace

NetKey derive_key(const void* secret, size_t secret_bytes, const uint8_t comm_id[16]) {
  HmacSha256 h(secret, secret_bytes);
  h.update(kKeyLabel, sizeof(kKeyLabel));
  h.update(comm_id, 16);
  const Digest d = h.finish();
  NetKey k;
  std::memcpy(k.bytes, d.data(), d.size());
  return k;
}

Digest handshake_mac(const NetKey& key, bool server, const Hello& hello,
                     const uint8_t nonce_s[kNonceBytes], const SockAddr& listen_addr) {
  HmacSha256 h(key.bytes, sizeof(key.bytes));
  if (server)
    h.update(kServerLabel, sizeof(kServerLabel));
  else
    h.update(kClientLabel, sizeof(kClientLabel));
  h.update(&hello, sizeof(hello));
  h.update(nonce_s, kNonceBytes);
  bind_address(h, listen_addr);
  return h.finish();
}

std::string refusal_text(int32_t status) {
  switch (static_cast<Refusal>(status)) {
    case Refusal::kNone:
      return "accepted";
    case Refusal::kVersion:
      return "another version of the pycollectives protocol";
    case Refusal::kOtherComm:
      return "another communicator's id";
    case Refusal::kNotForMe:
      return "meant for another rank or world size";
    case Refusal::kNotExpected:
      return "no such connection is expected from this rank";
    case Refusal::kAuth:
      return "this rank's proof of the key did not verify";
    case Refusal::kDuplicate:
      return "that connection is made already (a second one is never adopted)";
  }
  return "status " + std::to_string(status);
}

std::string DialFailure::text() const {
  std::ostringstream os;
  if (bad_peer)
    os << "it failed authentication: its answer does not prove that it holds this communicator's "
          "key (not a rank of this job: an impostor or a relay at that address, or another "
          "PYCOLL_AUTH_KEY)";
  else if (status != 0)
    os << "it refused the connection: " << refusal_text(status);
  else if (err == -1 || err == ECONNRESET || err == EPIPE)
    os << "it closed the connection before the handshake was complete"
       << (tries > 1 ? ", " + std::to_string(tries) +
                           " times (its listener is flooded with connections, or it is going)"
                     : std::string());
  else
    os << std::strerror(err) << " (errno " << err << ")";
  return os.str();
}

int dial(const SockAddr& addr, Hello hello, const NetKey& key, const NetConfig& cfg,
         WaitMonitor& mon, DialFailure* why) {
  for (int t = 1;; ++t) {
    *why = DialFailure{};
    why->tries = t;
    const int fd = tcp_connect_start(addr, cfg);
    if (fd < 0) {
      why->err = -fd;
      return -1;
    }
    bool ok = false;
    try {
      ok = attempt(fd, addr, hello, key, cfg.spin_us, mon, why);
    } catch (...) {
      (void)::close(fd);  // a socket we drop: nothing to do if close fails
      throw;
    }
    if (ok) return fd;
    (void)::close(fd);
    const bool dropped = why->status == 0 && !why->bad_peer &&
                         (why->err == -1 || why->err == ECONNRESET || why->err == EPIPE);
    if (!dropped || t == kTries) return -1;
    const auto until = Clock::now() + std::chrono::milliseconds(std::min(100, 2 << t));
    net_wait([&] { return Clock::now() >= until; }, [] { return -1; }, 0, mon, 0);
  }
}

}  // namespace pyc
