// Communicator: recovery from a lost rank on one host, as ULFM's
// MPIX_Comm_revoke / MPIX_Comm_agree / MPIX_Comm_shrink (see communicator.h).
//
// Revoke is the abort word every rank shares (control.cc) with its own kind.
//
// Agreement number k (each rank counts the agreements it enters; the ranks
// alive after agreement k-1 take part in k), in the segment (AgreeCtl):
// 1. a rank stores its flag, then `entered` = k;
// 2. it waits until every participant entered k or is gone (its robust mutex
//    released: died, or closed), or the timeout passes, or a decision for k
//    is already there;
// 3. it writes its proposal (proposal k % 2, a seqlock): each rank's verdict
//    (alive: entered and not gone now; died; closed; unresponsive: neither
//    entered nor gone at the timeout) and the AND of the alive ranks' flags;
// 4. one CAS of SegmentHeader::agreed, from any agreement before k to
//    (k, this rank), makes the first complete proposal the decision. A CAS on
//    shared memory is a consensus object: every rank adopts the one proposal
//    that won, whoever dies before, during or after its own CAS (the proposal
//    is complete before the CAS; a rank killed at any point leaves a whole
//    one or none).
// A rank that finds itself not alive in the decision (it was stopped past the
// timeout), or finds a later agreement decided without it, is fenced: it
// raises, and so does everything it tries on this communicator afterwards.
//
// Shrink: an agreement on the failed ranks (which also decides the name of
// the new segment), the survivors make the communicator (the first creates
// the segment, the others open it, connect() waits for all), then a second
// agreement on whether every survivor could. A rank that died or stopped in
// between makes the second agreement differ from the first: every survivor
// drops what it built and starts again without it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/process.h"

namespace pyc {
namespace {

// A rank's verdict in an agreement (AgreeCtl's verdict arrays).
constexpr uint8_t kAlive = 0, kDied = 1, kClosed = 2, kUnresponsive = 3, kMaxVerdict = 3;

const char* verdict_name(uint8_t v) {
  switch (v) {
    case kAlive:
      return "alive";
    case kDied:
      return "died";
    case kClosed:
      return "closed its communicator";
    default:
      return "unresponsive past the timeout";
  }
}

uint32_t number_of(uint64_t word) { return static_cast<uint32_t>(word >> 32); }

std::string list_failed(const std::vector<uint8_t>& v) {
  std::ostringstream os;
  os << "[";
  const char* sep = "";
  for (size_t p = 0; p < v.size(); ++p)
    if (v[p] != kAlive) {
      os << sep << p << " (" << verdict_name(v[p]) << ")";
      sep = ", ";
    }
  os << "]";
  return os.str();
}

}  // namespace

void Communicator::revoke(const std::string& msg) {
  if (closed_.load())
    PYC_THROW(Aborted, "pycollectives: rank " << rank_ << ": revoke on a closed communicator");
  set_abort(AbortKind::kRevoked, msg);
}

double Communicator::recovery_timeout(double timeout_s, const char* what) const {
  if (std::isnan(timeout_s) || timeout_s == 0)
    PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_ << ": " << what
                                                      << ": timeout must be > 0 seconds, not "
                                                      << timeout_s);
  return timeout_s < 0 ? timeout_s_ : timeout_s;
}

void Communicator::check_recovery(const char* what) const {
  if (fork_gen_ != fork_generation() || closed_.load())
    PYC_THROW(Aborted, "pycollectives: rank " << rank_ << ": " << what
                                              << " on a closed communicator (or one made by the "
                                                 "parent of this process)");
  if (multi_host())
    PYC_THROW(Error, "pycollectives: rank "
                         << rank_ << ": " << what
                         << ": across hosts, agree and shrink run through the job's store "
                            "(Communicator.agree, Communicator.shrink; docs/recovery.md)");
  if (!fenced_.empty()) throw Aborted(fenced_);
}

std::string Communicator::why_gone(int p) {
  if (p < 0 || p >= n_)
    PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_ << ": why_gone: rank " << p
                                                      << " is out of range [0, " << n_ << ")");
  if (p == rank_ || closed_.load()) return "";
  return peer_gone(p);
}

void Communicator::set_default_timeout(double timeout_s) {
  if (!(timeout_s > 0))
    PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_
                                                      << ": the default timeout must be > 0 s, not "
                                                      << timeout_s);
  timeout_s_ = timeout_s;
}

void Communicator::fence(const std::string& why) {
  fenced_ = why;
  if (!closed_.load()) set_abort(AbortKind::kRevoked, why);
}

void Communicator::fenced(const std::string& why) {
  fenced_ = why;
  set_abort(AbortKind::kRevoked, why);  // this rank's later operations raise it too
  throw Aborted(why);
}

void Communicator::propose(uint32_t k, uint32_t flag) {
  // Verdicts from now: a rank that entered and is still there is alive (its
  // flag counts); one that is gone failed, whenever it went.
  AgreeCtl* me = layout_.agree(seg_.data(), rank_);
  AgreeCtl::Proposal& prop = me->prop[k % 2];
  uint8_t* out = layout_.verdicts(seg_.data(), rank_, static_cast<int>(k % 2));
  prop.number.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  uint32_t value = flag;
  for (int p = 0; p < n_; ++p) {
    uint8_t v = verdicts_.empty() ? kAlive : verdicts_[p];
    if (v == kAlive && p != rank_) {
      const AgreeCtl* a = layout_.agree(seg_.data(), p);
      const bool in = reached(a->entered.load(std::memory_order_acquire), k);
      const uint32_t f = a->flag.load(std::memory_order_relaxed);
      const std::string gone = peer_gone(p);
      if (!gone.empty())
        v = ctl(p)->closed.load() != 0 ? kClosed : kDied;
      else if (!in)
        v = kUnresponsive;
      else
        value &= f;
    }
    out[p] = v;
  }
  prop.value.store(value, std::memory_order_relaxed);
  const std::string name = ShmSegment::unique_name();
  std::memset(prop.name, 0, sizeof(prop.name));
  std::memcpy(prop.name, name.data(), std::min(name.size(), sizeof(prop.name) - 1));
  prop.number.store(k, std::memory_order_release);
  fault_point("agree.proposed");
  const uint64_t mine = uint64_t{k} << 32 | static_cast<uint32_t>(rank_ + 1);
  uint64_t w = hdr_->agreed.load(std::memory_order_acquire);
  while (number_of(w) < k && !hdr_->agreed.compare_exchange_weak(w, mine)) {
  }
  fault_point("agree.decided");
}

Communicator::Agreement Communicator::adopt(uint32_t k) {
  const uint64_t w = hdr_->agreed.load(std::memory_order_acquire);
  const uint32_t got = number_of(w);
  const int d = static_cast<int>(static_cast<uint32_t>(w)) - 1;
  std::ostringstream behind;
  behind << "pycollectives: rank " << rank_ << " was fenced out of its communicator: its peers "
         << "decided agreement #" << got << " while it was in #" << k
         << " (it was stopped or too slow past the timeout, and was declared failed); its "
            "operations on this communicator raise from now on: leave the job (exit), the "
            "survivors go on without this rank";
  if (got != k || d < 0 || d >= n_) fenced(behind.str());
  const AgreeCtl::Proposal& prop = layout_.agree(seg_.data(), d)->prop[k % 2];
  const uint8_t* in = layout_.verdicts(seg_.data(), d, static_cast<int>(k % 2));
  Agreement a;
  a.number = k;
  const uint32_t before = prop.number.load(std::memory_order_acquire);
  a.value = prop.value.load(std::memory_order_relaxed);
  a.verdicts.assign(in, in + n_);
  a.name.assign(prop.name, strnlen(prop.name, sizeof(prop.name)));
  std::atomic_thread_fence(std::memory_order_acquire);
  if (before != k || prop.number.load(std::memory_order_relaxed) != k)
    fenced(behind.str());  // rewritten for agreement k+2: decided without this rank
  for (uint8_t v : a.verdicts)
    if (v > kMaxVerdict)
      PYC_THROW(Error, "pycollectives: rank " << rank_ << ": agreement #" << k << ": rank " << d
                                              << "'s decision holds an invalid verdict " << int{v});
  if (a.verdicts[rank_] != kAlive) {
    std::ostringstream os;
    os << "pycollectives: rank " << rank_ << " was fenced out of its communicator: agreement #" << k
       << " declared it " << verdict_name(a.verdicts[rank_])
       << " (it did not take part within the timeout); its operations on this communicator "
          "raise from now on: leave the job (exit), the survivors go on without this rank";
    fenced(os.str());
  }
  fault_point("agree.adopted");
  const bool any_failed =
      std::any_of(a.verdicts.begin(), a.verdicts.end(), [](uint8_t v) { return v != kAlive; });
  verdicts_ = a.verdicts;
  if (any_failed) {
    // The survivors go on elsewhere: whatever is still pending here, or a
    // fenced rank's operation once it comes back, must fail.
    std::ostringstream os;
    os << "pycollectives: the communicator was revoked: agreement #" << k << " found ranks "
       << list_failed(a.verdicts) << " failed";
    set_abort(AbortKind::kRevoked, os.str());
  }
  return a;
}

Communicator::Agreement Communicator::agree(uint32_t flag, double timeout_s) {
  check_recovery("agree");
  timeout_s = recovery_timeout(timeout_s, "agree");
  const uint32_t k = ++agreements_;
  AgreeCtl* me = layout_.agree(seg_.data(), rank_);
  me->flag.store(flag, std::memory_order_relaxed);
  me->entered.store(k, std::memory_order_release);
  fault_point("agree.entered");
  const auto deadline = deadline_after(Clock::now(), timeout_s);
  for (int polls = 0;;) {
    if (reached(number_of(hdr_->agreed.load(std::memory_order_acquire)), k)) break;
    bool all = true;
    for (int p = 0; p < n_ && all; ++p) {
      if (p == rank_ || (!verdicts_.empty() && verdicts_[p] != kAlive)) continue;
      if (reached(layout_.agree(seg_.data(), p)->entered.load(std::memory_order_acquire), k))
        continue;
      all = !peer_gone(p).empty();
    }
    if (all || Clock::now() >= deadline) {
      propose(k, flag);
      break;
    }
    if (InterruptCheck interrupted = interrupt_check(); interrupted != nullptr && interrupted())
      throw Interrupted("pycollectives: rank " + std::to_string(rank_) +
                        " was interrupted (signal) in agreement #" + std::to_string(k));
    // Yield first (the others usually enter within microseconds: a healthy
    // agreement then costs a few of them), then sleep between looks.
    if (++polls < 200)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  return adopt(k);
}

Communicator::Shrunk Communicator::shrink(double timeout_s) {
  check_recovery("shrink");
  timeout_s = recovery_timeout(timeout_s, "shrink");
  std::string errors;  // what failed in the rounds before
  for (int round = 0; round < n_; ++round) {
    const Agreement a = agree(1, timeout_s);
    std::vector<int> survivors;
    int new_rank = -1;
    for (int p = 0; p < n_; ++p)
      if (a.verdicts[p] == kAlive) {
        if (p == rank_) new_rank = static_cast<int>(survivors.size());
        survivors.push_back(p);
      }
    // While building: a survivor that died, or that gave up and went on to
    // the second agreement with flag 0, ends the wait at once; the build as a
    // whole is bounded by this timeout (the new communicator's own is the
    // parent's). A survivor that went on with flag 1 built its part: one
    // faster than this rank gets there while this rank still connects, and
    // must not fail it (a loaded machine made every survivor but the fastest
    // raise "could not join" and the shrink fail).
    const auto build_deadline = deadline_after(Clock::now(), timeout_s);
    auto check = [&] {
      if (Clock::now() > build_deadline)
        PYC_THROW(TimeoutError, "pycollectives: rank "
                                    << rank_ << ": shrink: the survivors did not all join the new "
                                    << "communicator within " << timeout_s << " s");
      for (int p : survivors) {
        if (p == rank_) continue;
        const std::string gone = peer_gone(p);
        if (!gone.empty())
          PYC_THROW(PeerFailure, "pycollectives: rank " << p << " " << gone << " during shrink");
        const AgreeCtl* ctl = layout_.agree(seg_.data(), p);
        // `flag` is stored before `entered` (release): read after it, it is
        // that agreement's, and p cannot enter another one before this rank
        // enters the second (or is declared failed in it).
        if (reached(ctl->entered.load(std::memory_order_acquire), a.number + 1) &&
            ctl->flag.load(std::memory_order_relaxed) == 0)
          PYC_THROW(Error,
                    "pycollectives: rank " << p << " could not join the shrunk communicator");
      }
    };
    std::shared_ptr<Communicator> child;
    uint32_t ok = 1;
    try {
      child = std::make_shared<Communicator>(new_rank, static_cast<int>(survivors.size()), a.name,
                                             survivors[0] == rank_, CommConfig::from_env(),
                                             timeout_s_, check);
      fault_point("shrink.created");
      child->connect(check);
      fault_point("shrink.connected");
    } catch (const Interrupted&) {
      throw;
    } catch (const std::exception& e) {
      child.reset();  // a creator's child, going, removes its segment
      ok = 0;
      errors += std::string(errors.empty() ? "" : "; ") + e.what();
    }
    const Agreement b = agree(ok, timeout_s);
    if (b.value != 0 && b.verdicts == a.verdicts)
      return Shrunk{std::move(child), std::move(survivors), b.verdicts};
    child.reset();
    if (b.verdicts == a.verdicts)  // nobody else failed: a failure that will not go away
      PYC_THROW(Error, "pycollectives: rank "
                           << rank_ << ": shrink: with ranks " << list_failed(a.verdicts)
                           << " failed, the survivors could not build the new communicator: "
                           << (errors.empty() ? "another rank could not" : errors));
  }
  PYC_THROW(Error, "pycollectives: rank " << rank_ << ": shrink: ranks kept failing while the "
                                          << "survivors rebuilt: " << list_failed(verdicts_)
                                          << "; last errors: " << errors);
}

}  // namespace pyc
