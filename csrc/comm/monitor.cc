// Timeouts, dead peers, mismatched collectives and the shared abort flag.
#include "comm/monitor.h"

#include <errno.h>

#include <cmath>
#include <cstring>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace pyc {
namespace {

constexpr auto kLivenessPeriod = std::chrono::milliseconds(50);

std::string op_name(const OpSig& sig, uint32_t seq, bool collective) {
  std::ostringstream os;
  os << sig.describe() << (collective ? " #" : " message #") << seq;
  return os.str();
}

}  // namespace

OpMonitor::OpMonitor(Communicator& comm, const OpSig& sig, uint32_t seq, bool collective,
                     double timeout_s)
    : c_(comm), sig_(sig), seq_(seq), collective_(collective), timeout_s_(timeout_s) {
  start_ = std::chrono::steady_clock::now();
  deadline_ = start_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(timeout_s));
  next_liveness_ = start_ + kLivenessPeriod;
  spin_polls = comm.spin_polls_;
  max_spin_polls = comm.max_spin_polls_;
}

OpMonitor::~OpMonitor() { c_.spin_polls_ = spin_polls; }

void OpMonitor::check_fast() {
  if (c_.hdr_->abort_state.load(std::memory_order_acquire) == 2) c_.throw_abort();
}

void OpMonitor::check_slow() {
  auto now = std::chrono::steady_clock::now();
  if (collective_) check_mismatch();
  if (now >= next_liveness_) {
    check_peers();
    next_liveness_ = now + kLivenessPeriod;
  }
  if (now >= deadline_) timed_out();
  if (InterruptCheck interrupted = interrupt_check(); interrupted != nullptr && interrupted()) {
    std::ostringstream os;
    os << "pycollectives: rank " << c_.rank_ << " was interrupted (signal) during "
       << op_name(sig_, seq_, collective_);
    c_.set_abort(AbortKind::kError, os.str());  // the peers must not wait for this rank
    throw Interrupted(os.str());
  }
}

void OpMonitor::peer_failed(int p) {
  // A peer's death shows in its `alive` mutex once the kernel has released
  // its robust futexes, which it does before the process's memory goes away
  // (what made the copy fail); the grace covers any other order.
  constexpr auto kGrace = std::chrono::milliseconds(100);
  // Only that peer: another may be gone too by now, having raised this very
  // error (the abort flag, checked first, then carries its report).
  peer = p;
  doing_ = "copying into or out of";
  const auto until = std::chrono::steady_clock::now() + kGrace;
  do {
    check_fast();
    check_peer(p);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  } while (std::chrono::steady_clock::now() < until);
}

void OpMonitor::timed_out() {
  std::ostringstream os;
  // torch's wording ("Timed out waiting <ms>ms for ..."), which gloo and NCCL
  // use and tools match.
  os << "pycollectives: rank " << c_.rank_ << ": " << op_name(sig_, seq_, collective_)
     << ": Timed out waiting " << std::llround(timeout_s_ * 1e3) << "ms for ";
  if (peer >= 0)
    os << "rank " << peer;
  else
    os << "its peers";
  if (collective_) {
    os << "; ranks that have not reached this operation: [";
    const char* sep = "";
    for (int p = 0; p < c_.n_; ++p) {
      uint32_t s = c_.layout_.rank_ctl(c_.seg_.data(), p)->started.value.load();
      if (!reached(s, seq_)) {
        os << sep << p;
        sep = ", ";
      }
    }
    os << "]";
  }
  c_.set_abort(AbortKind::kTimeout, os.str());
  throw TimeoutError(os.str());
}

void OpMonitor::check_mismatch() {
  const SlotTag mine{seq_, sig_.word0(), sig_.word1()};
  for (int p = 0; p < c_.n_; ++p) {
    if (p == c_.rank_) continue;
    SigEntry& e = c_.layout_.rank_ctl(c_.seg_.data(), p)->sig[seq_ % kSigHistory];
    if (e.seq.load(std::memory_order_acquire) != seq_) continue;
    SlotTag got{seq_, e.w0, e.w1};
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

// ---- Communicator: abort state, liveness and mismatch reports ----

bool Communicator::aborted() const {
  return hdr_->abort_state.load(std::memory_order_acquire) == 2;
}

void Communicator::set_abort(AbortKind kind, const std::string& msg) {
  uint32_t expect = 0;
  if (!hdr_->abort_state.compare_exchange_strong(expect, 1)) return;  // first error wins
  hdr_->abort_kind = static_cast<int32_t>(kind);
  hdr_->abort_rank = rank_;
  std::strncpy(hdr_->abort_msg, msg.c_str(), sizeof(hdr_->abort_msg) - 1);
  hdr_->abort_state.store(2, std::memory_order_release);
}

void Communicator::throw_abort() const {
  std::string msg(hdr_->abort_msg);
  if (hdr_->abort_rank != rank_)
    msg += " [reported by rank " + std::to_string(hdr_->abort_rank) + "; raised on rank " +
           std::to_string(rank_) + "]";
  switch (static_cast<AbortKind>(hdr_->abort_kind)) {
    case AbortKind::kTimeout:
      throw TimeoutError(msg);
    case AbortKind::kPeerFailure:
      throw PeerFailure(msg);
    case AbortKind::kMismatch:
      throw Mismatch(msg);
    default:
      throw Aborted(msg);
  }
}

std::string Communicator::peer_gone(int p) {
  RankCtl* ctl = layout_.rank_ctl(seg_.data(), p);
  int rc = pthread_mutex_trylock(&ctl->alive);
  if (rc == EBUSY) return "";
  if (rc == EOWNERDEAD) pthread_mutex_consistent(&ctl->alive);
  if (rc == 0 || rc == EOWNERDEAD) pthread_mutex_unlock(&ctl->alive);
  if (ctl->closed.load() != 0) return "closed its communicator";
  return "died (pid " + std::to_string(ctl->pid) + ", exited without closing the communicator)";
}

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
