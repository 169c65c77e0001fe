// Communicator: its control plane. The abort word that every rank of a host
// shares (the first error wins, and becomes every rank's exception), whether
// a peer is gone (died, closed with a goodbye, or its host unreachable), and
// across hosts the frames of the control connections that the network thread
// hands up (transport/tcp/tcp_net.h, NetHost): errors reported on other hosts,
// passed on to the rest, and the questions a timeout asks of another host
// (where its ranks are: StatusQuery, control.h) and their answers.
#include "comm/control.h"

#include <errno.h>
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "core/clock.h"
#include "core/error.h"

namespace pyc {

// ---- the abort word every rank shares, and liveness ----

bool Communicator::aborted() const { return hdr_->abort_rank.load(std::memory_order_acquire) != 0; }

void Communicator::set_abort(AbortKind kind, const std::string& msg) {
  // The record goes into this rank's own control block, then one CAS of the
  // header's word publishes it: a rank killed at any point leaves no abort
  // (its death is seen through its mutex) or a complete one, never a claim
  // that blocks every later abort. The record is written only while no abort
  // is set, and only by this process (the lock: its threads), so nobody reads
  // it while it changes.
  {
    std::lock_guard<std::mutex> lk(abort_mu_);
    if (aborted()) return;  // the first error wins
    RankCtl* me = ctl(rank_);
    me->abort_kind = static_cast<int32_t>(kind);
    me->abort_from = rank_;
    std::strncpy(me->abort_msg, msg.c_str(), sizeof(me->abort_msg) - 1);
    me->abort_msg[sizeof(me->abort_msg) - 1] = '\0';
    uint32_t expect = 0;
    // seq_cst: an aborting rank then reads its peers' cma_busy (wait_peers_copied).
    if (!hdr_->abort_rank.compare_exchange_strong(expect, static_cast<uint32_t>(rank_) + 1)) return;
  }
  // The other hosts raise it too (each passes it on to the ranks of its host).
  if (net_) send_abort(static_cast<int>(kind), rank_, msg);
}

void Communicator::abort(const std::string& msg) {
  if (closed_.load()) return;
  set_abort(AbortKind::kError, msg);
}

void Communicator::throw_abort() const {
  const uint32_t word = hdr_->abort_rank.load(std::memory_order_acquire);
  PYC_ASSERT(word != 0 && word <= static_cast<uint32_t>(n_));
  const RankCtl* rec = ctl(static_cast<int>(word) - 1);  // a rank of this host
  const int from = rec->abort_from;                      // the rank that reported it
  std::string msg(rec->abort_msg, strnlen(rec->abort_msg, sizeof(rec->abort_msg)));
  if (from != rank_)
    msg += " [reported by rank " + std::to_string(from) + "; raised on rank " +
           std::to_string(rank_) + "]";
  switch (static_cast<AbortKind>(rec->abort_kind)) {
    case AbortKind::kTimeout:
      throw TimeoutError(msg);
    case AbortKind::kPeerFailure:
      throw PeerFailure(msg);
    case AbortKind::kMismatch:
      throw Mismatch(msg);
    case AbortKind::kRevoked:
      throw Revoked(msg);
    default:
      throw Aborted(msg);
  }
}

std::string Communicator::peer_gone(int p) {
  if (!topo_.same_host(p)) return net_ ? net_->peer_gone(p) : "";
  RankCtl* c = ctl(p);
  const int rc = pthread_mutex_trylock(&c->alive);
  if (rc == EBUSY) return "";
  if (rc != 0 && rc != EOWNERDEAD)
    detail::throw_sys(__FILE__, __LINE__, "pthread_mutex_trylock", rc);
  if (rc == EOWNERDEAD) PYC_ERRCHECK(pthread_mutex_consistent(&c->alive));
  PYC_ERRCHECK(pthread_mutex_unlock(&c->alive));
  if (c->closed.load() != 0) return "closed its communicator";
  return "died (pid " + std::to_string(c->pid) + ", exited without closing the communicator)";
}

// ---- across hosts: the frames of the control connections (NetHost) ----

void Communicator::on_control(int peer, uint32_t type, const char* body, uint32_t bytes) {
  switch (static_cast<CtlType>(type)) {
    case CtlType::kAbort: {
      if (bytes < sizeof(CtlAbort)) return;
      CtlAbort a;
      std::memcpy(&a, body, sizeof(a));
      const std::string msg(body + sizeof(a), bytes - sizeof(a));
      if (a.from >= 0 && a.from < topo_.size() && adopt_abort(a.kind, a.from, msg))
        send_abort(a.kind, a.from, msg, peer);  // on to the other hosts
      return;
    }
    case CtlType::kQuery: {
      if (bytes < sizeof(CtlQuery)) return;
      const std::vector<CtlStatusEntry> st = host_status();
      net_->send_ctl(peer, static_cast<uint32_t>(CtlType::kStatus), body, sizeof(CtlQuery),
                     st.data(), static_cast<uint32_t>(st.size() * sizeof(CtlStatusEntry)));
      return;
    }
    case CtlType::kStatus:
      query_.answer(topo_, peer, body, bytes, [this](const CtlStatusEntry& e) { peer_status(e); });
      return;
    case CtlType::kClose:  // the transport's own (TcpNet::peer_gone)
      return;
  }
}

void Communicator::send_abort(int kind, int from, const std::string& msg, int except) {
  CtlAbort a{kind, from};
  const uint32_t len = static_cast<uint32_t>(std::min<size_t>(msg.size(), 4096));
  for (int q : net_->control_peers())
    if (q != except)
      net_->send_ctl(q, static_cast<uint32_t>(CtlType::kAbort), &a, sizeof(a), msg.data(), len);
}

bool Communicator::adopt_abort(int kind, int from, const std::string& msg) {
  std::lock_guard<std::mutex> lk(abort_mu_);
  if (aborted()) return false;
  if (kind <= static_cast<int>(AbortKind::kNone) || kind > static_cast<int>(AbortKind::kRevoked))
    kind = static_cast<int>(AbortKind::kError);
  RankCtl* me = ctl(rank_);
  me->abort_kind = kind;
  me->abort_from = from;
  std::strncpy(me->abort_msg, msg.c_str(), sizeof(me->abort_msg) - 1);
  me->abort_msg[sizeof(me->abort_msg) - 1] = '\0';
  uint32_t expect = 0;
  return hdr_->abort_rank.compare_exchange_strong(expect, static_cast<uint32_t>(rank_) + 1);
}

std::vector<CtlStatusEntry> Communicator::host_status() {
  const int64_t now =
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  std::vector<CtlStatusEntry> out;
  for (int p : locals_) {
    const RankCtl* r = ctl(p);
    CtlStatusEntry e{};
    e.rank = p;
    e.started = r->started.value.load(std::memory_order_acquire);
    e.done = r->done.load(std::memory_order_acquire);
    e.waiting = r->waiting.load(std::memory_order_relaxed);
    const int64_t beat = r->beat_ns.load(std::memory_order_relaxed);
    e.idle_ns = beat != 0 ? now - beat : std::numeric_limits<int64_t>::max() / 2;
    out.push_back(e);
  }
  return out;
}

void Communicator::peer_status(const CtlStatusEntry& e) {
  const int64_t now =
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  // idle_ns comes from another host: clamped to [0, a day] (a longer idle
  // reads the same), so that the subtraction cannot overflow.
  constexpr int64_t kMaxIdleNs = int64_t{86400} * 1000000000;
  const int64_t idle = std::min(std::max(e.idle_ns, int64_t{0}), kMaxIdleNs);
  RankCtl* m = mirrors_[e.rank].get();
  m->started.value.store(e.started, std::memory_order_relaxed);
  m->done.store(e.done, std::memory_order_relaxed);
  m->waiting.store(e.waiting, std::memory_order_relaxed);
  m->beat_ns.store(now - idle, std::memory_order_relaxed);
  m->attached.store(1, std::memory_order_release);  // heard from
}

std::string Communicator::silent_note(int p) {
  const int link = net_ ? silent_link(p) : -2;
  if (link == p)
    return " (on another host: it did not answer this rank's question over TCP though its "
           "connection is up: stopped, or its process stuck)";
  if (link >= 0)
    return " (on another host: not heard from, as rank " + std::to_string(link) +
           ", this rank's link to its host, did not answer)";
  return " (on another host: not heard from, this rank's connection to its host being gone)";
}

void Communicator::refresh_remote(std::chrono::milliseconds wait) {
  if (!net_) return;
  for (auto& m : mirrors_)
    if (m) m->attached.store(0, std::memory_order_relaxed);
  query_.ask(*net_, topo_, Clock::now() + wait);
}

// ---- StatusQuery ----

void StatusQuery::ask(TcpNet& net, const Topology& topo, Clock::time_point deadline) {
  int asked = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    const CtlQuery q{id_.fetch_add(1) + 1};
    answers_.store(0);
    asked_.assign(topo.nhosts(), -2);
    answered_.assign(topo.nhosts(), false);
    for (int p : net.control_peers()) {  // one control peer per host (its first alive one)
      const int h = topo.host(p);
      if (asked_[h] >= 0 || !net.peer_alive(p)) continue;
      asked_[h] = p;
      net.send_ctl(p, static_cast<uint32_t>(CtlType::kQuery), &q, sizeof(q));
      ++asked;
    }
  }
  while (answers_.load() < asked && Clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void StatusQuery::answer(const Topology& topo, int peer, const char* body, uint32_t bytes,
                         FunctionRef<void(const CtlStatusEntry&)> take) {
  if (bytes < sizeof(CtlQuery)) return;
  CtlQuery q;
  std::memcpy(&q, body, sizeof(q));
  const int h = topo.host(peer);
  std::lock_guard<std::mutex> lk(mu_);
  // Only the answer to the latest question, from the rank it asked, once.
  if (q.id != id_.load() || asked_.empty() || asked_[h] != peer || answered_[h]) return;
  for (size_t off = sizeof(q); off + sizeof(CtlStatusEntry) <= bytes;
       off += sizeof(CtlStatusEntry)) {
    CtlStatusEntry e;
    std::memcpy(&e, body + off, sizeof(e));
    // Only its own host's ranks: it speaks for no other.
    if (e.rank >= 0 && e.rank < topo.size() && topo.host(e.rank) == h) take(e);
  }
  answered_[h] = true;
  answers_.fetch_add(1);
}

int StatusQuery::silent_link(const Topology& topo, int p) {
  if (topo.same_host(p)) return -1;
  std::lock_guard<std::mutex> lk(mu_);
  if (asked_.empty()) return -2;
  const int h = topo.host(p);
  return answered_[h] ? -1 : asked_[h];
}

}  // namespace pyc
