// Timeouts, dead peers and mismatched collectives (the abort word they set: control.cc).
#include "comm/monitor.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <thread>
#include <vector>

#include "core/clock.h"
#include "core/error.h"

namespace pyc {
namespace {

constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);
// A rank in an operation that has not checked in for this long (a quarter
// of the timeout, within these bounds) is not waiting there: it is stopped
// (SIGSTOP, a debugger), descheduled, or busy. A waiting rank checks in about
// every millisecond.
constexpr double kMinStaleS = 0.02, kMaxStaleS = 0.25;

std::string op_name(const OpSig& sig, uint32_t seq, bool collective) {
  std::ostringstream os;
  os << sig.describe() << (collective ? " #" : " message #") << seq;
  return os.str();
}

int64_t now_ns(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace

OpMonitor::OpMonitor(Communicator& comm, const OpSig& sig, uint32_t seq, bool collective,
                     double timeout_s)
    : c_(comm), sig_(sig), seq_(seq), collective_(collective), timeout_s_(timeout_s) {
  start_ = Clock::now();
  deadline_ = deadline_after(start_, timeout_s);
  next_liveness_ = start_ + kLivenessPeriod;
  spin_polls = comm.spin_polls_;
  max_spin_polls = comm.max_spin_polls_;
  // (by global rank: where every rank is on this host, contexts use those)
  if (comm.n_ == comm.nlocal_ && !comm.shares_cpu_.empty()) shares_cpu = comm.shares_cpu_.data();
  spin_only = comm.spin_only_;
  yield_us = comm.yield_us_;
}

OpMonitor::~OpMonitor() {
  c_.spin_polls_ = spin_polls;
  if (published_) c_.ctl(c_.rank_)->waiting.store(0, std::memory_order_relaxed);
}

void OpMonitor::check_fast() {
  if (c_.hdr_->abort_rank.load(std::memory_order_acquire) != 0) c_.throw_abort();
}

void OpMonitor::check_slow() {
  const auto now = Clock::now();
  if (collective_) {
    publish_wait(now);
    check_mismatch();
  }
  if (now >= next_liveness_) {
    check_peers();
    next_liveness_ = now + kLivenessPeriod;
  }
  if (c_.closing_.load(std::memory_order_relaxed)) check_closing(now);
  if (now >= deadline_) timed_out();
  if (InterruptCheck interrupted = interrupt_check(); interrupted != nullptr && interrupted()) {
    std::ostringstream os;
    os << "pycollectives: rank " << c_.rank_ << " was interrupted (signal) during "
       << op_name(sig_, seq_, collective_);
    c_.set_abort(AbortKind::kError, os.str());  // the peers must not wait for this rank
    throw Interrupted(os.str());
  }
}

void OpMonitor::publish_wait(Clock::time_point now) {
  RankCtl* me = c_.ctl(c_.rank_);
  me->waiting.store(uint64_t{seq_} << 32 | static_cast<uint32_t>(peer + 1),
                    std::memory_order_relaxed);
  me->beat_ns.store(now_ns(now), std::memory_order_relaxed);
  published_ = true;
}

void OpMonitor::peer_failed(int p) {
  // A peer's death shows in its `alive` mutex once the kernel has released
  // its robust futexes, which it does before the process's memory goes away
  // (what made the copy fail); the grace covers any other order.
  constexpr auto kGrace = std::chrono::milliseconds(100);
  // Only that peer: another may be gone too by now, having raised this very
  // error (the abort word, checked first, then carries its report).
  peer = p;
  doing_ = "copying into or out of";
  const auto until = Clock::now() + kGrace;
  do {
    check_fast();
    check_peer(p);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  } while (Clock::now() < until);
}

int OpMonitor::culprit(std::string* why) const {
  const int n = c_.n_;
  std::vector<int> late;
  for (int p = 0; p < n; ++p)
    if (c_.heard(p) && !reached(c_.ctl(p)->started.value.load(std::memory_order_acquire), seq_))
      late.push_back(p);
  if (!late.empty()) {  // the one this rank waits for if it is late, else the first
    for (int p : late)
      if (p == peer) return p;
    return late.front();
  }
  // Every rank is in the operation: follow who waits for whom.
  const int64_t now = now_ns(Clock::now());
  const auto stale_ns =
      static_cast<int64_t>(1e9 * std::min(kMaxStaleS, std::max(kMinStaleS, timeout_s_ / 4)));
  std::vector<bool> seen(n, false);
  seen[c_.rank_] = true;
  for (int p = peer; p >= 0 && p < n;) {
    if (seen[p]) {
      *why = " (the ranks in this operation wait for each other)";
      return p;
    }
    seen[p] = true;
    if (!c_.heard(p)) {
      *why = c_.silent_note(p);
      return p;
    }
    const RankCtl* ctl = c_.ctl(p);
    const uint64_t w = ctl->waiting.load(std::memory_order_relaxed);
    const int64_t idle = now - ctl->beat_ns.load(std::memory_order_relaxed);
    if (static_cast<uint32_t>(w >> 32) != seq_ || idle > stale_ns) {
      std::ostringstream os;
      os << " (it reached this operation but has not waited or made progress in it for "
         << (static_cast<uint32_t>(w >> 32) == seq_ ? std::to_string(idle / 1000000) + " ms"
                                                    : std::string("a while"))
         << ": stopped, descheduled or busy)";
      *why = os.str();
      return p;
    }
    p = static_cast<int>(static_cast<uint32_t>(w)) - 1;  // whom p waits for
  }
  return peer;
}

void OpMonitor::timed_out() {
  std::ostringstream os;
  // torch's wording ("Timed out waiting <ms>ms for ..."), which gloo and NCCL
  // use and tools match.
  os << "pycollectives: rank " << c_.rank_ << ": " << op_name(sig_, seq_, collective_)
     << ": Timed out waiting " << std::llround(timeout_s_ * 1e3) << "ms for ";
  std::string why;
  // Where the ranks of other hosts are: their hosts' answer (bounded).
  if (collective_) c_.refresh_remote(std::chrono::milliseconds(300));
  const int blamed = collective_ ? culprit(&why) : peer;
  if (blamed >= 0)
    os << "rank " << blamed << why;
  else
    os << "its peers";
  if (collective_) {
    os << "; ranks that have not reached this operation: [";
    const char* sep = "";
    // Another host's ranks this rank did not hear from: the one it asked
    // (silent: stopped or stuck), and the others of its host (unknown: only
    // that one speaks for them to this rank).
    std::vector<int> silent, unknown;
    for (int p = 0; p < c_.n_; ++p) {
      if (!c_.heard(p)) {
        (c_.silent_link(p) == p ? silent : unknown).push_back(p);
      } else if (!reached(c_.ctl(p)->started.value.load(), seq_)) {
        os << sep << p;
        sep = ", ";
      }
    }
    os << "]";
    auto list = [&](const char* what, const std::vector<int>& ranks) {
      if (ranks.empty()) return;
      os << "; " << what << ": [";
      for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
      os << "]";
    };
    list("ranks of other hosts that did not answer (stopped or stuck)", silent);
    list("ranks not heard from (their host's link to this rank did not answer)", unknown);
  }
  c_.set_abort(AbortKind::kTimeout, os.str());
  throw TimeoutError(os.str());
}

void OpMonitor::check_mismatch() {
  // This host's ranks (another host's mismatch shows in the tags of its data).
  const SlotTag mine{seq_, sig_.word0(), sig_.word1()};
  for (int p : c_.locals_) {
    if (p == c_.rank_) continue;
    SigEntry& e = c_.ctl(p)->sig[seq_ % kSigHistory];
    if (e.seq.load(std::memory_order_acquire) != seq_) continue;
    SlotTag got{seq_, e.w0.load(std::memory_order_relaxed), e.w1.load(std::memory_order_relaxed)};
    std::atomic_thread_fence(std::memory_order_acquire);
    if (e.seq.load(std::memory_order_relaxed) != seq_) continue;  // overwritten meanwhile
    if (!(got == mine)) c_.tag_mismatch(p, got, mine);
  }
}

void OpMonitor::check_peers() {
  for (int p = 0; p < c_.n_; ++p)
    if (p != c_.rank_) check_peer(p);
}

void OpMonitor::check_peer(int p) {
  std::string gone = c_.peer_gone(p);
  if (gone.empty()) return;
  std::ostringstream os;
  os << "pycollectives: rank " << p << " " << gone << " while rank " << c_.rank_ << " was in "
     << op_name(sig_, seq_, collective_) << " (" << doing_ << " ";
  if (peer >= 0)
    os << "rank " << peer << ")";
  else
    os << "its peers)";
  c_.set_abort(AbortKind::kPeerFailure, os.str());
  throw PeerFailure(os.str());
}

void OpMonitor::check_closing(Clock::time_point now) {
  // Ranks reach an operation, and close, at times that differ by the skew of
  // their programs: only a peer that stays away this long, idle between
  // operations (it finished every collective it started) and short of this
  // one, is taken as absent, instead of one that is merely late (and what
  // close() waits for then is only the pending work, never the timeout).
  constexpr auto kGrace = std::chrono::seconds(1);
  if (closing_since_ == Clock::time_point{}) closing_since_ = now;
  if (now - closing_since_ < kGrace) return;
  int absent = -1;
  if (collective_) {
    if (c_.multi_host() && now >= next_refresh_) {  // where the other hosts' ranks are
      c_.refresh_remote(std::chrono::milliseconds(200));
      next_refresh_ = Clock::now() + std::chrono::milliseconds(500);
    }
    for (int p = 0; p < c_.n_ && absent < 0; ++p) {
      if (!c_.heard(p)) continue;
      const RankCtl* rc = c_.ctl(p);
      const uint32_t started = rc->started.value.load(std::memory_order_acquire);
      if (!reached(started, seq_) && rc->done.load(std::memory_order_acquire) == started)
        absent = p;
    }
    if (absent < 0) return;  // every rank is in it, or on its way: it finishes, or times out
  }
  std::ostringstream os;
  os << "pycollectives: rank " << c_.rank_ << " closed its communicator with "
     << op_name(sig_, seq_, collective_) << " pending";
  if (collective_)
    os << ", which rank " << absent << " has not reached";
  else if (peer >= 0)
    os << " (waiting for rank " << peer << ")";
  c_.set_abort(AbortKind::kError, os.str());
  throw Aborted(os.str());
}

// ---- Communicator: mismatch reports ----

void Communicator::tag_mismatch(int peer, const SlotTag& got, const SlotTag& want) {
  OpSig g = OpSig::unpack(got.w0, got.w1), w = OpSig::unpack(want.w0, want.w1);
  std::ostringstream os;
  if (w.kind == OpKind::kSend) {  // a receive checks the sender's tag
    OpSig as_recv = w;
    as_recv.kind = OpKind::kRecv;
    as_recv.root = peer;
    os << "pycollectives: send/recv mismatch: rank " << rank_ << " called " << as_recv.describe()
       << " (message #" << want.seq << " from rank " << peer << ") but rank " << peer << " called "
       << g.describe() << " (message #" << got.seq << ")";
  } else if (got.seq != want.seq) {
    os << "pycollectives: collective mismatch: rank " << rank_ << " is in " << w.describe() << " #"
       << want.seq << " but received data of " << g.describe() << " #" << got.seq << " from rank "
       << peer;
  } else {
    os << "pycollectives: collective mismatch at operation #" << want.seq << ": rank " << rank_
       << " called " << w.describe() << " but rank " << peer << " called " << g.describe();
  }
  set_abort(AbortKind::kMismatch, os.str());
  throw Mismatch(os.str());
}

}  // namespace pyc
