// Communicator: construction over shared memory, the issue checks, and
// closing (see communicator.h). Connecting the ranks: connect.cc; the
// operations: dispatch.cc (set-up and path choice), collectives.cc,
// point_to_point.cc, windows.cc; the watchdog: monitor.cc.
#include "comm/communicator.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>

#include "algo/prims.h"
#include "core/clock.h"
#include "core/env.h"
#include "core/error.h"
#include "core/process.h"
#include "transport/cma/ptracer.h"

namespace pyc {

CommConfig CommConfig::from_env() {
  // Every size is range-checked (env_size): a value that once wrapped the
  // segment's layout to a few bytes, or a slot count to 1, is refused naming
  // the variable. The ones read elsewhere are checked here too, so that a bad
  // value fails init rather than the first operation.
  CommConfig c;
  c.slot_bytes = env_size("PYCOLL_SLOT_BYTES", 0, 64, kMaxSlotBytes);
  c.nslots = static_cast<uint32_t>(env_size("PYCOLL_NSLOTS", 0, kMinSlots, kMaxNSlots));
  c.oneshot_bytes = env_size("PYCOLL_ONESHOT_BYTES", 0, 0, kMaxOneShotBytes);
  c.stream_bytes = env_size("PYCOLL_STREAM_BYTES", c.stream_bytes, 0, size_t{1} << 60);
  c.cma_tune = env_size("PYCOLL_CMA_TUNE", 1, 0, 1) != 0;
  (void)env_size("PYCOLL_CMA", 1, 0, 1);
  c.yield_us = static_cast<uint32_t>(env_size("PYCOLL_YIELD_US", 1000, 0, kMaxYieldUs));
  const char* a = std::getenv("PYCOLL_ALGO");
  std::string algo = a ? a : "auto";
  if (algo == "auto" || algo.empty())
    c.algo = Algo::kAuto;
  else if (algo == "ring")
    c.algo = Algo::kRing;
  else if (algo == "oneshot")
    c.algo = Algo::kOneShot;
  else if (algo == "cma")
    c.algo = Algo::kCma;
  else
    PYC_THROW(
        InvalidArgument,
        "pycollectives: PYCOLL_ALGO must be auto, ring, oneshot or cma, not '" << algo << "'");
  return c;
}

CommConfig CommConfig::resolved(int world_size) const {
  CommConfig c = *this;
  if (c.slot_bytes == 0)
    c.slot_bytes = world_size <= 4 ? 256 << 10 : world_size <= 8 ? 128 << 10 : 64 << 10;
  if (c.nslots == 0) c.nslots = 4;
  if (c.oneshot_bytes == 0) c.oneshot_bytes = 32 << 10;
  return c;
}

const char* Communicator::algo_name() const {
  switch (algo_) {
    case Algo::kRing:
      return "ring";
    case Algo::kOneShot:
      return "oneshot";
    case Algo::kCma:
      return "cma";
    default:
      return "auto";
  }
}

Communicator::Communicator(int rank, int n, const std::string& name, bool creator,
                           const CommConfig& cfg, double timeout_s, FunctionRef<void()> check,
                           const HostSetup* hosts)
    : rank_(rank),
      n_(n),
      timeout_s_(timeout_s),
      creator_(creator),
      fork_gen_(fork_generation()),
      stream_bytes_(cfg.stream_bytes),
      yield_us_(cfg.yield_us),
      cma_tuner_(cfg.cma_tune) {
  if (n < 1) PYC_THROW(InvalidArgument, "pycollectives: init: world_size must be >= 1, not " << n);
  if (rank < 0 || rank >= n)
    PYC_THROW(InvalidArgument,
              "pycollectives: init: rank " << rank << " is out of range for world_size " << n);
  if (!(timeout_s > 0))  // NaN too
    PYC_THROW(InvalidArgument, "pycollectives: init: timeout must be > 0, not " << timeout_s);
  if (hosts != nullptr && hosts->topo.size() != n)
    PYC_THROW(InvalidArgument, "pycollectives: init: the host list has "
                                   << hosts->topo.size() << " ranks, world_size is " << n);
  topo_ = hosts != nullptr ? hosts->topo : Topology::single(rank, n);
  locals_ = topo_.locals();
  nlocal_ = static_cast<int>(locals_.size());
  // Across hosts, the segment holds this host's ranks, by local index.
  const int li = topo_.local(rank);
  if (creator) {
    const CommConfig own = cfg.resolved(n);
    size_t slot = own.slot_bytes, oneshot = own.oneshot_bytes;
    uint32_t nslots = own.nslots;
    Algo algo = own.algo;
    if (hosts != nullptr) {  // rank 0's, resolved: every host's segment alike
      slot = hosts->slot_bytes;
      nslots = hosts->nslots;
      oneshot = hosts->oneshot_bytes;
      algo = hosts->algo;
    }
    layout_ = ShmLayout(nlocal_, nslots, slot, oneshot);
    seg_ = ShmSegment::create(name, layout_.total);
    fault_point("segment.created");
    hdr_ = layout_.header(seg_.data());
    hdr_->world_size = nlocal_;
    hdr_->nslots = layout_.nslots;
    hdr_->slot_bytes = layout_.slot_bytes;
    hdr_->oneshot_bytes = layout_.oneshot_bytes;
    hdr_->total_bytes = layout_.total;
    hdr_->algo = static_cast<uint32_t>(algo);
    pthread_mutexattr_t attr;
    PYC_ERRCHECK(pthread_mutexattr_init(&attr));
    PYC_ERRCHECK(pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED));
    PYC_ERRCHECK(pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST));
    for (int r = 0; r < nlocal_; ++r)
      PYC_ERRCHECK(pthread_mutex_init(&layout_.rank_ctl(seg_.data(), r)->alive, &attr));
    PYC_ERRCHECK(pthread_mutexattr_destroy(&attr));
    hdr_->magic = kShmMagic;
    hdr_->ready.store(1, std::memory_order_release);
  } else {
    open_segment(name, timeout_s, check);
  }
  algo_ = static_cast<Algo>(hdr_->algo);
  void* base = seg_.data();
  ctls_.resize(n);
  mirrors_.resize(n);
  send_.assign(n, nullptr);
  recv_.assign(n, nullptr);
  shm_send_.resize(n);
  shm_recv_.resize(n);
  for (int p = 0; p < n; ++p) {
    if (!topo_.same_host(p)) {
      mirrors_[p] = std::make_unique<RankCtl>();  // zeroed: nothing heard yet
      ctls_[p] = mirrors_[p].get();
      continue;
    }
    ctls_[p] = layout_.rank_ctl(base, topo_.local(p));
    if (p == rank) continue;
    shm_send_[p] = std::make_unique<ShmSendConn>(layout_, base, li, topo_.local(p), p);
    shm_recv_[p] = std::make_unique<ShmRecvConn>(layout_, base, topo_.local(p), li, p);
    send_[p] = shm_send_[p].get();
    recv_[p] = shm_recv_[p].get();
  }
  if (nlocal_ <= kMaxOneShotRanks) {  // the one-shot areas of this host's ranks, by local index
    oneshot_.bytes = layout_.oneshot_bytes;
    oneshot_.small_bytes = kOneShotInline;
    for (int par = 0; par < 2; ++par)
      for (int r = 0; r < nlocal_; ++r) {
        OneShotHeader* h = layout_.oneshot(base, r, par);
        oneshot_.flag[par][r] = &h->seq;
        oneshot_.sig[par][r] = &h->w0;
        oneshot_.payload[par][r] = reinterpret_cast<char*>(h) + sizeof(OneShotHeader);
        oneshot_.small[par][r] = h->inline_data;
      }
  }
  known_started_.assign(n, 0);
  p2p_sent_.assign(n, 0);
  p2p_recvd_.assign(n, 0);
  RankCtl* me = ctl(rank);
  me->pid = getpid();
  if (sched_getaffinity(0, sizeof(me->cpus), &me->cpus) != 0)  // unknown: assume plenty
    for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &me->cpus);
  // The probe word peers read in connect(): an address and a value no other
  // process holds there by chance.
  cma_token_ = std::chrono::steady_clock::now().time_since_epoch().count() ^
               (static_cast<uint64_t>(getpid()) << 32) ^ reinterpret_cast<uintptr_t>(this);
  me->cma_token = cma_token_;
  me->cma_addr = reinterpret_cast<uintptr_t>(&cma_token_);
  interrupt_hook_ = std::make_shared<InterruptHook>([this](const char* what) {
    const std::string msg = "pycollectives: rank " + std::to_string(rank_) +
                            " was interrupted (signal) while waiting for " + what;
    set_abort(AbortKind::kError, msg);  // the peers must not wait for this rank
    return msg;
  });
  // The engine's thread holds this rank's robust mutex for the communicator's
  // life: peers see EOWNERDEAD the moment this process dies, however it dies.
  // (on_stop runs last on that thread, where an exception would terminate the
  // process: unlocking a mutex the thread holds cannot fail.)
  engine_ = std::make_unique<ProgressEngine>([me] { PYC_ERRCHECK(pthread_mutex_lock(&me->alive)); },
                                             [me] {
                                               me->closed.store(1);
                                               (void)pthread_mutex_unlock(&me->alive);
                                             },
                                             interrupt_hook_);
  if (hosts != nullptr) {
    net_hint_ = hosts->hint;
    net_ = std::make_unique<TcpNet>(topo_, NetConfig::from_env(), hosts->comm_id, hosts->key,
                                    layout_.slot_bytes, layout_.nslots, *this, hosts->hint);
    for (int p = 0; p < n; ++p)
      if (!topo_.same_host(p)) {
        send_[p] = nullptr;  // set by connect(), once the addresses are known
        recv_[p] = nullptr;
      }
  }
  me->attached.store(1, std::memory_order_release);
}

void Communicator::open_segment(const std::string& name, double timeout_s,
                                FunctionRef<void()> check) {
  seg_ = ShmSegment::open(name, sizeof(SegmentHeader), timeout_s, check);
  hdr_ = reinterpret_cast<SegmentHeader*>(seg_.data());
  const auto deadline = deadline_after(Clock::now(), timeout_s);
  for (auto next_check = Clock::now(); hdr_->ready.load(std::memory_order_acquire) == 0;) {
    const auto now = Clock::now();
    if (now > deadline)
      PYC_THROW(TimeoutError, "pycollectives: rank " << rank_ << ": init: segment " << name
                                                     << " was not initialized within " << timeout_s
                                                     << " s");
    if (now >= next_check) {
      check();
      next_check = now + std::chrono::milliseconds(10);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // The header is this user's (ShmSegment::open checked), but its sizes
  // still decide every offset: check them as any input.
  const SegmentHeader& h = *hdr_;
  if (h.magic != kShmMagic)
    PYC_THROW(Error, "pycollectives: " << name << " is not a pycollectives segment");
  if (static_cast<int>(h.world_size) != nlocal_)
    PYC_THROW(InvalidArgument, "pycollectives: rank "
                                   << rank_ << ": init: " << nlocal_ << " ranks on this host ("
                                   << (multi_host() ? "by the host ids" : "world_size")
                                   << ") differs from the segment's " << h.world_size);
  if (h.nslots < kMinSlots || h.nslots > kMaxNSlots || h.slot_bytes < 64 ||
      h.slot_bytes > kMaxSlotBytes || h.oneshot_bytes > kMaxOneShotBytes ||
      h.algo > static_cast<uint32_t>(Algo::kCma))
    PYC_THROW(Error, "pycollectives: rank "
                         << rank_ << ": init: segment " << name << " has an invalid header ("
                         << h.nslots << " slots of " << h.slot_bytes << " bytes, one-shot "
                         << h.oneshot_bytes << " bytes, algorithm " << h.algo << ")");
  layout_ = ShmLayout(nlocal_, h.nslots, h.slot_bytes, h.oneshot_bytes);
  if (layout_.total != h.total_bytes || seg_.size() < layout_.total)
    PYC_THROW(Error, "pycollectives: rank " << rank_ << ": init: segment " << name << " has "
                                            << seg_.size() << " bytes, its header says "
                                            << h.total_bytes << ", its sizes make "
                                            << layout_.total);
}

Communicator::~Communicator() {
  try {
    close();
  } catch (...) {
  }
}

std::vector<std::string> Communicator::close() {
  if (fork_gen_ != fork_generation()) {
    release_in_child();
    return {};
  }
  if (closed_.exchange(true)) return {};
  // Pending operations that wait for a peer that will not come abort now
  // instead of at their timeout (OpMonitor::check_closing).
  closing_.store(true);
  std::vector<std::string> failed = engine_->shutdown();
  interrupt_hook_->clear();
  if (net_) net_->close();  // after the operations: they may still need the network
  {
    std::lock_guard<std::mutex> lk(cuda_mu_);
    cuda_.reset();  // the engine has stopped: no kernel of ours is in flight
  }
  ptracer_.reset();  // the last communicator that needed it resets the process's setting
  return failed;
}

void Communicator::release_in_child() {
  // fork() copied this communicator, not its threads: the progress thread
  // (and any waiter on the engine's condition variable, which glibc's
  // destroy would wait for) is the parent's, and so are the robust mutex it
  // holds and the segment's state. Nothing here may be joined, unlocked or
  // written: this process's copies are forgotten (leaked), the mappings go
  // with the process.
  if (closed_.exchange(true)) return;
  (void)engine_.release();
  (void)net_.release();  // its thread is the parent's
  if (cuda_) new std::shared_ptr<CudaPath>(std::move(cuda_));
  if (ptracer_) ptracer_->forget();
  interrupt_hook_->clear();
}

void Communicator::check_issue_slow(OpKind kind, uint64_t self) {
  if (fork_gen_ != fork_generation())
    PYC_THROW(Aborted, "pycollectives: rank "
                           << rank_ << ": " << op_kind_name(kind)
                           << ": this communicator was made by the parent of this process (a "
                              "fork() does not copy its threads or its place among the ranks); "
                              "create one in this process");
  if (closed_.load())
    PYC_THROW(Aborted, "pycollectives: rank " << rank_ << ": " << op_kind_name(kind)
                                              << " on a closed communicator");
  if (any_thread_) return;
  uint64_t first = 0;
  if (issuer_.compare_exchange_strong(first, self) || first == self) return;
  // Operations are numbered in issue order on each rank: two threads issuing
  // at once would pair different calls across ranks (docs/api.md).
  PYC_THROW(InvalidArgument, "pycollectives: rank "
                                 << rank_ << ": " << op_kind_name(kind)
                                 << ": issued from a second thread; one thread issues the "
                                    "operations of a communicator (the first one that issued: "
                                    "ranks pair operations by their order of issue, which two "
                                    "threads would make differ). Use a communicator per thread "
                                    "(split), or serialize the calls");
}

double Communicator::op_timeout(double timeout_s, OpKind kind) const {
  if (std::isnan(timeout_s))
    PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_ << ": " << op_kind_name(kind)
                                                      << ": timeout must be > 0 seconds, not nan");
  return timeout_s < 0 ? timeout_s_ : timeout_s;
}

void Communicator::check_rank(int r, const char* what, OpKind kind) const {
  if (r < 0 || r >= n_)
    PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_ << ": " << op_kind_name(kind) << ": "
                                                      << what << "=" << r << " is out of range [0, "
                                                      << n_ << ")");
}

}  // namespace pyc
