// Communicator: construction over shared memory, connecting the ranks (the
// segment's mapping, single copy's agreement) and closing (see communicator.h).
// The operations: dispatch.cc (set-up and path choice), collectives.cc,
// point_to_point.cc, windows.cc; the watchdog: monitor.cc.
#include "comm/communicator.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>

#include "algo/prims.h"
#include "core/clock.h"
#include "core/env.h"
#include "core/error.h"
#include "transport/cma.h"

namespace pyc {

CommConfig CommConfig::from_env() {
  CommConfig c;
  c.slot_bytes = env_size("PYCOLL_SLOT_BYTES", 0);
  c.nslots = static_cast<uint32_t>(env_size("PYCOLL_NSLOTS", 0, kMinSlots));
  c.oneshot_bytes = env_size("PYCOLL_ONESHOT_BYTES", 0);
  c.stream_bytes = env_size("PYCOLL_STREAM_BYTES", c.stream_bytes);
  c.cma_tune = env_size("PYCOLL_CMA_TUNE", 1) != 0;
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
                           const CommConfig& cfg, double timeout_s)
    : rank_(rank),
      n_(n),
      timeout_s_(timeout_s),
      creator_(creator),
      stream_bytes_(cfg.stream_bytes),
      cma_tuner_(cfg.cma_tune) {
  if (n < 1) PYC_THROW(InvalidArgument, "pycollectives: init: world_size must be >= 1, not " << n);
  if (rank < 0 || rank >= n)
    PYC_THROW(InvalidArgument,
              "pycollectives: init: rank " << rank << " is out of range for world_size " << n);
  if (timeout_s <= 0)
    PYC_THROW(InvalidArgument, "pycollectives: init: timeout must be > 0, not " << timeout_s);
  if (creator) {
    size_t slot = cfg.slot_bytes ? cfg.slot_bytes
                  : n <= 4       ? 256 << 10
                  : n <= 8       ? 128 << 10
                                 : 64 << 10;
    uint32_t nslots = cfg.nslots ? cfg.nslots : 4;
    size_t oneshot = cfg.oneshot_bytes ? cfg.oneshot_bytes : 32 << 10;
    if (slot < 64) PYC_THROW(InvalidArgument, "pycollectives: PYCOLL_SLOT_BYTES must be >= 64");
    layout_ = ShmLayout(n, nslots, slot, oneshot);
    seg_ = ShmSegment::create(name, layout_.total);
    hdr_ = layout_.header(seg_.data());
    hdr_->world_size = n;
    hdr_->nslots = layout_.nslots;
    hdr_->slot_bytes = layout_.slot_bytes;
    hdr_->oneshot_bytes = layout_.oneshot_bytes;
    hdr_->total_bytes = layout_.total;
    hdr_->algo = static_cast<uint32_t>(cfg.algo);
    pthread_mutexattr_t attr;
    PYC_ERRCHECK(pthread_mutexattr_init(&attr));
    PYC_ERRCHECK(pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED));
    PYC_ERRCHECK(pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST));
    for (int r = 0; r < n; ++r)
      PYC_ERRCHECK(pthread_mutex_init(&layout_.rank_ctl(seg_.data(), r)->alive, &attr));
    pthread_mutexattr_destroy(&attr);
    hdr_->magic = kShmMagic;
    hdr_->ready.store(1, std::memory_order_release);
  } else {
    seg_ = ShmSegment::open(name, sizeof(SegmentHeader), timeout_s);
    hdr_ = reinterpret_cast<SegmentHeader*>(seg_.data());
    auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    while (hdr_->ready.load(std::memory_order_acquire) == 0) {
      if (Clock::now() > deadline)
        PYC_THROW(TimeoutError, "pycollectives: rank " << rank << ": init: segment " << name
                                                       << " was not initialized within "
                                                       << timeout_s << " s");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (hdr_->magic != kShmMagic)
      PYC_THROW(Error, "pycollectives: " << name << " is not a pycollectives segment");
    if (static_cast<int>(hdr_->world_size) != n)
      PYC_THROW(InvalidArgument, "pycollectives: rank " << rank << ": init: world_size " << n
                                                        << " differs from rank 0's "
                                                        << hdr_->world_size);
    layout_ = ShmLayout(n, hdr_->nslots, hdr_->slot_bytes, hdr_->oneshot_bytes);
    PYC_ASSERT(layout_.total == hdr_->total_bytes && seg_.size() >= layout_.total);
  }
  algo_ = static_cast<Algo>(hdr_->algo);
  void* base = seg_.data();
  send_.resize(n);
  recv_.resize(n);
  for (int p = 0; p < n; ++p) {
    if (p == rank) continue;
    send_[p] = std::make_unique<ShmSendConn>(layout_, base, rank, p);
    recv_[p] = std::make_unique<ShmRecvConn>(layout_, base, p, rank);
  }
  if (n <= kMaxOneShotRanks) {
    oneshot_.bytes = layout_.oneshot_bytes;
    for (int par = 0; par < 2; ++par)
      for (int r = 0; r < n; ++r) {
        OneShotHeader* h = layout_.oneshot(base, r, par);
        oneshot_.flag[par][r] = &h->seq;
        oneshot_.sig[par][r] = &h->w0;
        oneshot_.payload[par][r] = reinterpret_cast<char*>(h) + sizeof(OneShotHeader);
      }
  }
  known_started_.assign(n, 0);
  p2p_sent_.assign(n, 0);
  p2p_recvd_.assign(n, 0);
  RankCtl* me = layout_.rank_ctl(base, rank);
  me->pid = getpid();
  if (sched_getaffinity(0, sizeof(me->cpus), &me->cpus) != 0)  // unknown: assume plenty
    for (int c = 0; c < CPU_SETSIZE; ++c) CPU_SET(c, &me->cpus);
  // The probe word peers read in connect(): an address and a value no other
  // process holds there by chance.
  cma_token_ = std::chrono::steady_clock::now().time_since_epoch().count() ^
               (static_cast<uint64_t>(getpid()) << 32) ^ reinterpret_cast<uintptr_t>(this);
  me->cma_token = cma_token_;
  me->cma_addr = reinterpret_cast<uintptr_t>(&cma_token_);
  if (cma_wanted()) cma_allow_peers();
  // The engine's thread holds this rank's robust mutex for the communicator's
  // life: peers see EOWNERDEAD the moment this process dies, however it dies.
  engine_ = std::make_unique<ProgressEngine>([me] { PYC_ERRCHECK(pthread_mutex_lock(&me->alive)); },
                                             [me] {
                                               me->closed.store(1);
                                               pthread_mutex_unlock(&me->alive);
                                             });
  hdr_->attached.fetch_add(1);
}

Communicator::~Communicator() {
  try {
    close();
  } catch (...) {
  }
}

void Communicator::connect() {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s_));
  while (static_cast<int>(hdr_->attached.load()) < n_) {
    if (Clock::now() > deadline)
      PYC_THROW(TimeoutError, "pycollectives: rank "
                                  << rank_ << ": init: only " << hdr_->attached.load() << " of "
                                  << n_ << " ranks attached within " << timeout_s_ << " s");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (creator_) seg_.unlink();  // every rank has it mapped: nothing stays in /dev/shm
  // More ranks than the CPUs they may run on between them (not: than this
  // rank's CPUs, which is one for every rank pinned to its own): spin
  // briefly, then give the core to a peer.
  cpu_set_t all;
  CPU_ZERO(&all);
  for (int p = 0; p < n_; ++p) CPU_OR(&all, &all, &layout_.rank_ctl(seg_.data(), p)->cpus);
  if (CPU_COUNT(&all) < n_) spin_polls_ = max_spin_polls_ = 16;
  agree_cma(deadline);
}

bool Communicator::cma_wanted() const {
  return n_ > 1 && n_ <= kMaxDirectRanks && algo_ != Algo::kRing && algo_ != Algo::kOneShot &&
         env_size("PYCOLL_CMA", 1) != 0;
}

void Communicator::agree_cma(Clock::time_point deadline) {
  RankCtl* me = layout_.rank_ctl(seg_.data(), rank_);
  bool ok = cma_wanted();
  for (int p = 0; p < n_ && ok; ++p) {
    const RankCtl* peer = layout_.rank_ctl(seg_.data(), p);
    if (p != rank_) ok = cma_probe(peer->pid, peer->cma_addr, peer->cma_token);
  }
  me->cma_state.store(ok ? 1 : 2, std::memory_order_release);
  bool all = true;  // every rank decides alike: CMA only if every rank reached every peer
  for (int p = 0; p < n_; ++p) {
    const RankCtl* peer = layout_.rank_ctl(seg_.data(), p);
    uint32_t st;
    while ((st = peer->cma_state.load(std::memory_order_acquire)) == 0) {
      if (Clock::now() > deadline)
        PYC_THROW(TimeoutError, "pycollectives: rank " << rank_ << ": init: rank " << p
                                                       << " did not finish connecting within "
                                                       << timeout_s_ << " s");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    all = all && st == 1;
  }
  cma_ = all;
}

void Communicator::close() {
  if (closed_.exchange(true)) return;
  engine_->shutdown();
  std::lock_guard<std::mutex> lk(cuda_mu_);
  cuda_.reset();  // the engine has stopped: no kernel of ours is in flight
}

void Communicator::check_open(OpKind kind) const {
  if (closed_.load())
    PYC_THROW(Aborted, "pycollectives: rank " << rank_ << ": " << op_kind_name(kind)
                                              << " on a closed communicator");
}

void Communicator::check_rank(int r, const char* what, OpKind kind) const {
  if (r < 0 || r >= n_)
    PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_ << ": " << op_kind_name(kind) << ": "
                                                      << what << "=" << r << " is out of range [0, "
                                                      << n_ << ")");
}

}  // namespace pyc
