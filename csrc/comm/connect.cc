// Communicator::connect: every rank mapped the segment (its name goes), and
// single copy is agreed (see communicator.h). Every wait watches the peers'
// liveness, the abort word and the caller's check, so a rank that fails or
// dies here is named at once instead of at the timeout.
#include <sched.h>
#include <unistd.h>

#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "comm/communicator.h"
#include "core/env.h"
#include "core/error.h"
#include "core/process.h"
#include "transport/cma/cma.h"
#include "transport/cma/ptracer.h"

namespace pyc {

template <class Ready>
void Communicator::wait_all(const char* what, Clock::time_point deadline, FunctionRef<void()> check,
                            Ready ready) {
  auto next_check = Clock::now();
  for (int p : locals_) {  // this host's ranks: the segment's
    while (!ready(p)) {
      if (aborted()) throw_abort();
      // A rank that attached holds its robust mutex: its death shows there.
      if (p != rank_ && ctl(p)->attached.load(std::memory_order_acquire) != 0) {
        const std::string gone = peer_gone(p);
        if (!gone.empty())
          PYC_THROW(PeerFailure, "pycollectives: rank " << p << " " << gone << " while rank "
                                                        << rank_ << " was connecting (" << what
                                                        << ")");
      }
      const auto now = Clock::now();
      if (now > deadline)
        PYC_THROW(TimeoutError, "pycollectives: rank " << rank_ << ": init: rank " << p
                                                       << " did not finish connecting (" << what
                                                       << ") within " << timeout_s_ << " s");
      if (now >= next_check) {
        check();
        next_check = now + std::chrono::milliseconds(10);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

void Communicator::connect(FunctionRef<void()> check, const std::vector<std::string>& addrs) {
  connect_out(check, addrs);
  connect_in(check);
}

void Communicator::connect_out(FunctionRef<void()> check, const std::vector<std::string>& addrs) {
  const auto deadline = connect_deadline_ = deadline_after(Clock::now(), timeout_s_);
  if (multi_host() && static_cast<int>(addrs.size()) != n_)
    PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_ << ": init: " << addrs.size()
                                                      << " addresses for " << n_ << " ranks");
  wait_all("attaching", deadline, check,
           [this](int p) { return ctl(p)->attached.load(std::memory_order_acquire) != 0; });
  // Every rank has it mapped: the name goes, so nothing stays in /dev/shm.
  // Every rank removes it (the first succeeds), so a creator that dies now
  // leaves nothing behind either.
  if (creator_)
    seg_.unlink();
  else
    ShmSegment::unlink_name(seg_.name());
  // More ranks than the CPUs they may run on between them (not: than this
  // rank's CPUs, which is one for every rank pinned to its own): spin
  // briefly, then give the core to a peer.
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int p : locals_) CPU_OR(&all, &all, &ctl(p)->cpus);
  if (CPU_COUNT(&all) < nlocal_) spin_polls_ = max_spin_polls_ = 16;
  // A peer pinned to the very CPU this rank is pinned to runs only once this
  // rank gives that CPU up: waits on it yield at once (WaitMonitor::shares_cpu).
  shares_cpu_.assign(n_, 0);
  const cpu_set_t& mine = ctl(rank_)->cpus;
  if (CPU_COUNT(&mine) == 1)
    for (int p : locals_)
      if (p != rank_ && CPU_EQUAL(&mine, &ctl(p)->cpus)) shares_cpu_[p] = 1;
  // No other rank may run on this rank's CPUs: waits spin instead of yielding
  // (WaitMonitor::spin_only), as MPI's do with a core per rank.
  spin_only_ = true;
  for (int p : locals_) {
    cpu_set_t both;
    CPU_AND(&both, &mine, &ctl(p)->cpus);
    if (p != rank_ && CPU_COUNT(&both) != 0) spin_only_ = false;
  }
  if (!multi_host()) return;
  // Across hosts: the TCP connections to the other hosts (tcp_net.h). Single
  // copy stays off (its paths assume every rank on this host).
  net_->dial(addrs, deadline, check);
}

void Communicator::connect_in(FunctionRef<void()> check) {
  const auto deadline = connect_deadline_;
  if (!multi_host()) return agree_cma(deadline, check);
  net_->await_peers(deadline, check);
  for (int p = 0; p < n_; ++p)
    if (!topo_.same_host(p)) {
      send_[p] = net_->send_conn(p);
      recv_[p] = net_->recv_conn(p);
    }
}

bool Communicator::cma_wanted() const {
  return n_ > 1 && n_ <= kMaxDirectRanks && algo_ != Algo::kRing && algo_ != Algo::kOneShot &&
         env_size("PYCOLL_CMA", 1, 0, 1) != 0;
}

void Communicator::agree_cma(Clock::time_point deadline, FunctionRef<void()> check) {
  RankCtl* me = ctl(rank_);
  auto all_say = [&](std::atomic<uint32_t> RankCtl::* word, const char* what) {
    bool yes = true;
    wait_all(what, deadline, check,
             [&](int p) { return (ctl(p)->*word).load(std::memory_order_acquire) != 0; });
    for (int p = 0; p < n_; ++p) yes = yes && (ctl(p)->*word).load() == 1;
    return yes;
  };
  // 1. Does every rank want it? Nothing is opened to anyone otherwise.
  me->cma_want.store(cma_wanted() ? 1 : 2, std::memory_order_release);
  bool ok = all_say(&RankCtl::cma_want, "single copy: wanted");
  // 2. Every peer runs as this user: a kernel copy goes to no process whose
  // pid came from shared memory unchecked. The pids are kept here from now
  // on; a peer's later writes to the segment cannot redirect a copy.
  std::vector<pid_t> pids(n_, 0);
  for (int p = 0; p < n_ && ok; ++p) {
    if (p == rank_) continue;
    pids[p] = ctl(p)->pid;
    std::string why;
    // The peer holds its mutex (alive) after its pid was pinned: the pid was
    // still the peer's, not one reused by another process.
    ok = same_user(pids[p], &why) && peer_gone(p).empty();
  }
  if (ok) {  // let the peers access this process (Yama), scoped to them
    std::vector<pid_t> peers;
    for (int p = 0; p < n_; ++p)
      if (p != rank_) peers.push_back(pids[p]);
    ptracer_ = std::make_unique<PtracerGrant>(peers);
  }
  me->cma_ready.store(ok ? 1 : 2, std::memory_order_release);
  ok = all_say(&RankCtl::cma_ready, "single copy: peers checked");
  // 3. Can every rank read and write every peer? (seccomp, namespaces)
  for (int p = 0; p < n_ && ok; ++p)
    if (p != rank_) ok = cma_probe(pids[p], ctl(p)->cma_addr, ctl(p)->cma_token);
  me->cma_state.store(ok ? 1 : 2, std::memory_order_release);
  cma_ = all_say(&RankCtl::cma_state, "single copy: probed");
  if (cma_)
    peer_pid_ = std::move(pids);
  else
    ptracer_.reset();  // nobody copies: nobody needs access
}

}  // namespace pyc
