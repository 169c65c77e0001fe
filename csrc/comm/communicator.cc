// Communicator: construction over shared memory, and the operations, each a
// numbered, announced, monitored run of one algorithm (see communicator.h).
#include "comm/communicator.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <thread>

#include "algo/prims.h"
#include "comm/cma_choice.h"
#include "comm/monitor.h"
#include "core/env.h"
#include "core/error.h"
#include "transport/cma.h"

namespace pyc {
namespace {

using Clock = std::chrono::steady_clock;

uint64_t elapsed_ns(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

}  // namespace

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

void Communicator::announce(uint32_t seq, const OpSig& sig, uint64_t where, uint64_t addr,
                            uint64_t out) {
  RankCtl* me = layout_.rank_ctl(seg_.data(), rank_);
  SigEntry& e = me->sig[seq % kSigHistory];
  e.seq.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  e.w0 = sig.word0();
  e.w1 = sig.word1();
  e.where = where;
  e.addr = addr;
  e.out = out;
  e.seq.store(seq, std::memory_order_release);
  publish(me->started, seq);
}

void Communicator::wait_started(uint32_t seq, WaitMonitor& mon) {
  for (int p = 0; p < n_; ++p) {
    if (p == rank_ || reached(known_started_[p], seq)) continue;
    mon.peer = p;
    known_started_[p] = wait_reached(layout_.rank_ctl(seg_.data(), p)->started, seq, mon);
  }
}

void Communicator::account(OpKind kind, const OpCtx& c, uint64_t ns) {
  OpStats& s = stats_[static_cast<int>(kind)];
  s.calls.fetch_add(1, std::memory_order_relaxed);
  s.bytes_sent.fetch_add(c.bytes_sent, std::memory_order_relaxed);
  s.bytes_recv.fetch_add(c.bytes_recv, std::memory_order_relaxed);
  s.time_ns.fetch_add(ns, std::memory_order_relaxed);
  s.taken_over.fetch_add(c.taken_over, std::memory_order_relaxed);
  s.paths[static_cast<int>(c.path)].fetch_add(1, std::memory_order_relaxed);
}

void Communicator::run_collective(const OpSig& sig, uint32_t seq, double timeout_s, BodyRef body,
                                  uint64_t where, uint64_t addr, uint64_t out) {
  // Chosen here, on the engine's thread in the order operations run, after
  // the previous one's time was recorded.
  const size_t total = cma_total(sig, n_);
  const CmaTuner::Choice cma = cma_choice(sig.kind, total, where);
  if (!cma.cma) addr = out = 0;
  const auto t0 = cma.timed ? Clock::now() : Clock::time_point{};
  bool ran_cma = false;
  run_op(sig, seq, timeout_s, true, [&](OpCtx& c) {
    announce(seq, sig, where, addr, out);
    if (seq > static_cast<uint32_t>(kMaxLead)) wait_started(seq - kMaxLead, *c.mon);
    body(c);
    ran_cma = c.path == Path::kCma;
  });
  if (cma.timed) cma_tuner_.record(sig.kind, total, ran_cma, elapsed_ns(t0));
}

void Communicator::run_op(const OpSig& sig, uint32_t seq, double timeout_s, bool collective,
                          BodyRef body) {
  if (aborted()) throw_abort();
  OpMonitor mon(*this, sig, seq, collective, timeout_s);
  OpCtx c;
  c.rank = rank_;
  c.nranks = n_;
  c.dtype = sig.dtype;
  c.op = sig.op;
  c.tag = SlotTag{seq, sig.word0(), sig.word1()};
  c.links = this;
  c.mon = &mon;
  if (collective) c.out_store = output_store(sig);
  try {
    body(c);
  } catch (const std::exception& e) {
    // The peers must not wait for a rank that gave up: abort them all. The
    // monitor and the transport have usually recorded the error already (the
    // first one wins), this covers every other failure.
    set_abort(AbortKind::kError, e.what());
    throw;
  }
  account(sig.kind, c, elapsed_ns(mon.start()));
}

std::shared_ptr<Work> Communicator::point_to_point(const OpSig& sig, int peer, double timeout_s,
                                                   bool async, Body body) {
  check_open(sig.kind);
  if (timeout_s < 0) timeout_s = timeout_s_;
  const bool is_send = sig.kind == OpKind::kSend;
  return engine_->submit([] { return 0u; },
                         [this, sig, peer, is_send, timeout_s, body = std::move(body)](uint32_t) {
                           const uint32_t seq = is_send ? ++p2p_sent_[peer] : ++p2p_recvd_[peer];
                           run_op(sig, seq, timeout_s, false, body);
                         },
                         async);
}

// ---- operations ----

bool Communicator::oneshot(OpCtx& c, size_t bytes) {
  if (algo_ == Algo::kRing || (algo_ == Algo::kCma && cma_) || !oneshot_fits(oneshot_, n_, bytes))
    return false;
  wait_started(c.tag.seq - 1, *c.mon);  // peers are done reading our area of op seq-2
  return true;
}

void Communicator::saw_flags(uint32_t seq, int only) {
  for (int p = 0; p < n_; ++p)
    if (only < 0 || p == only) known_started_[p] = seq;  // a peer's flag means it started seq
}

std::shared_ptr<Work> Communicator::all_reduce(void* buf, size_t count, DataType dt, ReduceOp op,
                                               bool async, double timeout_s) {
  OpSig sig{OpKind::kAllReduce, dt, op, -1, count};
  uint64_t where = 0;
  std::shared_ptr<ShmWindow> win = find_window(buf, count * dtype_size(dt), &where);
  return collective(
      sig, timeout_s, async,
      [this, buf, count, win, where](OpCtx& c) {
        const size_t bytes = count * c.esize();
        // One-shot first: its one handshake beats the direct path's two as long as
        // the whole buffer fits the one-shot areas.
        if (oneshot(c, bytes)) {
          c.path = Path::kOneShot;
          oneshot_all_reduce(c, oneshot_, buf, buf, count);
          saw_flags(c.tag.seq);
        } else if (direct(c, win.get(), bytes, where)) {
          c.path = Path::kDirect;
          direct_all_reduce(c, direct_view(*win, where), count);
        } else if (cma(c)) {
          c.path = Path::kCma;
          cma_all_reduce(c, cma_view(c.tag.seq), buf, count);
        } else {
          ring_all_reduce(c, buf, buf, count);
        }
      },
      where, buf, buf);
}

std::shared_ptr<ShmWindow> Communicator::find_window(const void* p, size_t n, uint64_t* where) {
  *where = 0;
  if (n == 0 || algo_ == Algo::kRing || !any_window_.load(std::memory_order_acquire))
    return nullptr;
  std::lock_guard<std::mutex> lk(windows_mu_);
  for (const auto& w : windows_) {
    std::shared_ptr<ShmWindow> win = w.lock();
    size_t off = 0;
    if (win && win->contains(p, n, &off) && off < (uint64_t{1} << 40)) {
      *where = static_cast<uint64_t>(win->id() + 1) << 40 | off;
      return win;
    }
  }
  return nullptr;
}

bool Communicator::direct(OpCtx& c, const ShmWindow* win, size_t bytes, uint64_t where) {
  // Below a few KiB per rank the one-shot path's single handshake beats the
  // direct path's two; above, the direct reduce-scatter and all-gather move
  // less (every rank decides alike: the size is part of the signature).
  constexpr size_t kDirectMinBytes = 4096;
  return win && bytes >= kDirectMinBytes && symmetric(c, where);
}

CmaTuner::Choice Communicator::cma_choice(OpKind kind, size_t total, uint64_t where) {
  if (!cma_) return {false, false};
  if (algo_ == Algo::kCma) return {total > 0, false};
  if (!cma_band(kind, n_, total)) return {false, false};
  // A buffer in a window takes the direct path wherever every rank placed it
  // alike: its times would say nothing about single copy.
  return where ? CmaTuner::Choice{true, false} : cma_tuner_.choose(kind, total);
}

bool Communicator::cma(OpCtx& c) {
  // A rank announces an address only where it prefers single copy
  // (run_collective); else it need not wait for the peers' announcements.
  const SigEntry& mine = layout_.rank_ctl(seg_.data(), rank_)->sig[c.tag.seq % kSigHistory];
  return mine.addr != 0 && announced_alike(c, [](const SigEntry& e) { return e.addr != 0; });
}

Store Communicator::output_store(const OpSig& sig) const {
  // An output this large is out of the caches before the caller reads it, so
  // ordinary stores would only add a read of every line they write (docs/
  // benchmarks.md, "Streaming stores into the output"). Below, it stays where
  // the caller reads it.
  const bool blocks = sig.kind == OpKind::kAllGather || sig.kind == OpKind::kAllToAll;
  const uint64_t bytes = sig.count * dtype_size(sig.dtype) * (blocks ? n_ : 1);
  return bytes >= stream_bytes_ ? Store::kStreaming : Store::kCached;
}

// batch_p2p messages from this size on are read by the receiver straight out
// of the sender's buffer (single copy) instead of crossing the slots.
constexpr size_t kP2PCmaMinBytes = 64 << 10;

P2PCma Communicator::p2p_cma(int peer, bool send) {
  P2PCma c;
  c.pid = layout_.rank_ctl(seg_.data(), peer)->pid;
  c.done = send ? &layout_.fifo_ctl(seg_.data(), rank_, peer)->cma_done
                : &layout_.fifo_ctl(seg_.data(), peer, rank_)->cma_done;
  return c;
}

CmaView Communicator::cma_view(uint32_t seq) {
  constexpr size_t kChunk = 256 << 10;  // a chunk of every rank stays in L2 while it is reduced
  if (!cma_scratch_) {
    cma_scratch_.reset(new char[n_ * kChunk + 64]);
  }
  CmaView v;
  for (int p = 0; p < n_; ++p) {
    RankCtl* ctl = layout_.rank_ctl(seg_.data(), p);
    v.pid[p] = ctl->pid;
    const SigEntry& e = ctl->sig[seq % kSigHistory];
    v.addr[p] = e.addr;
    v.out[p] = e.out;
    v.next[p] = &ctl->cma_next;
    v.gathered[p] = &ctl->gathered;
    if (p != rank_) {
      v.from[p] = &layout_.fifo_ctl(seg_.data(), p, rank_)->cma_next;
      v.to[p] = &layout_.fifo_ctl(seg_.data(), rank_, p)->cma_next;
    }
  }
  const auto base = reinterpret_cast<uintptr_t>(cma_scratch_.get());
  v.scratch = reinterpret_cast<char*>((base + 63) / 64 * 64);
  v.chunk = kChunk;
  return v;
}

DirectView Communicator::direct_view(const ShmWindow& win, uint64_t where) {
  DirectView v;
  const size_t off = where & ((uint64_t{1} << 40) - 1);
  for (int p = 0; p < n_; ++p) {
    RankCtl* ctl = layout_.rank_ctl(seg_.data(), p);
    v.data[p] = win.base(p) + off;
    v.reduced[p] = &ctl->reduced;
    v.gathered[p] = &ctl->gathered;
  }
  return v;
}

bool Communicator::symmetric(OpCtx& c, uint64_t where) {
  return announced_alike(c, [where](const SigEntry& e) { return e.where == where; });
}

template <class Also>
bool Communicator::announced_alike(OpCtx& c, Also also) {
  if (n_ > kMaxDirectRanks) return false;
  const uint32_t seq = c.tag.seq;
  wait_started(seq, *c.mon);  // every peer's buffer is in place and its op announced
  for (int p = 0; p < n_; ++p) {
    const SigEntry& e = layout_.rank_ctl(seg_.data(), p)->sig[seq % kSigHistory];
    if (e.seq.load(std::memory_order_acquire) != seq || e.w0 != c.tag.w0 || e.w1 != c.tag.w1 ||
        !also(e))
      return false;  // the ring runs (and reports a mismatched operation)
  }
  return true;
}

std::shared_ptr<ShmWindow> Communicator::alloc_window(size_t bytes, double timeout_s) {
  check_open(OpKind::kBarrier);
  if (timeout_s < 0) timeout_s = timeout_s_;
  const size_t page = 4096, size = std::max<size_t>(page, (bytes + page - 1) / page * page);
  const int id = next_window_++;
  auto name = [&](int r) {
    std::ostringstream os;
    os << seg_.name() << ".w" << id << "." << r;
    return os.str();
  };
  std::vector<ShmSegment> segs(n_);
  try {
    segs[rank_] = ShmSegment::create(name(rank_), size);
  } catch (const std::exception& e) {
    set_abort(AbortKind::kError, e.what());  // the peers must not wait for this window
    throw;
  }
  barrier(false, timeout_s);  // every rank created its buffer
  try {
    for (int p = 0; p < n_; ++p)
      if (p != rank_) segs[p] = ShmSegment::open(name(p), size, timeout_s);
  } catch (const std::exception& e) {
    set_abort(AbortKind::kError, e.what());
    throw;
  }
  barrier(false, timeout_s);  // every rank mapped every buffer: no name is needed any more
  segs[rank_].unlink();
  auto win = std::make_shared<ShmWindow>(id, rank_, bytes, std::move(segs));
  std::lock_guard<std::mutex> lk(windows_mu_);
  windows_.erase(std::remove_if(windows_.begin(), windows_.end(),
                                [](const std::weak_ptr<ShmWindow>& w) { return w.expired(); }),
                 windows_.end());
  windows_.push_back(win);
  any_window_.store(true, std::memory_order_release);
  return win;
}

std::shared_ptr<Work> Communicator::reduce_scatter(void* out, const void* in, size_t count,
                                                   DataType dt, ReduceOp op, bool async,
                                                   double timeout_s) {
  OpSig sig{OpKind::kReduceScatter, dt, op, -1, count};
  uint64_t where = 0;  // the input's window placement: peers read it in place
  std::shared_ptr<ShmWindow> win = find_window(in, count * dtype_size(dt) * n_, &where);
  return collective(
      sig, timeout_s, async,
      [this, out, in, count, win, where](OpCtx& c) {
        const size_t bytes = count * c.esize();
        if (direct(c, win.get(), bytes, where)) {
          c.path = Path::kDirect;
          direct_reduce_scatter(c, direct_view(*win, where), out, count);
        } else if (oneshot(c, bytes * n_)) {
          c.path = Path::kOneShot;
          oneshot_reduce_scatter(c, oneshot_, in, out, count);
          saw_flags(c.tag.seq);
        } else if (cma(c)) {
          c.path = Path::kCma;
          cma_reduce_scatter(c, cma_view(c.tag.seq), in, out, count);
        } else {
          ring_reduce_scatter(c, in, out, count);
        }
      },
      where, in, out);
}

std::shared_ptr<Work> Communicator::all_gather(void* out, const void* in, size_t count, DataType dt,
                                               bool async, double timeout_s) {
  OpSig sig{OpKind::kAllGather, dt, ReduceOp::kSum, -1, count};
  uint64_t where = 0;  // the output's window placement: peers write their blocks into it
  std::shared_ptr<ShmWindow> win = find_window(out, count * dtype_size(dt) * n_, &where);
  return collective(
      sig, timeout_s, async,
      [this, out, in, count, win, where](OpCtx& c) {
        const size_t bytes = count * c.esize();
        // Single copy before one-shot: from 32 KiB per rank (with 2 ranks)
        // one kernel copy per peer beats the one-shot areas' copy in and out.
        if (direct(c, win.get(), bytes, where)) {
          c.path = Path::kDirect;
          direct_all_gather(c, direct_view(*win, where), in, count);
        } else if (cma(c)) {
          c.path = Path::kCma;
          cma_all_gather(c, cma_view(c.tag.seq), in, out, count);
        } else if (oneshot(c, bytes)) {
          c.path = Path::kOneShot;
          oneshot_all_gather(c, oneshot_, in, out, count);
          saw_flags(c.tag.seq);
        } else {
          ring_all_gather(c, in, out, count);
        }
      },
      where, in, out);
}

std::shared_ptr<Work> Communicator::broadcast(void* buf, size_t count, DataType dt, int root,
                                              bool async, double timeout_s) {
  check_rank(root, "src", OpKind::kBroadcast);
  OpSig sig{OpKind::kBroadcast, dt, ReduceOp::kSum, root, count};
  return collective(
      sig, timeout_s, async,
      [this, buf, count, root](OpCtx& c) {
        const size_t bytes = count * c.esize();
        if (cma(c)) {
          c.path = Path::kCma;
          cma_broadcast(c, cma_view(c.tag.seq), count, root);
        } else if (oneshot(c, bytes)) {
          c.path = Path::kOneShot;
          oneshot_broadcast(c, oneshot_, buf, count, root);
          if (c.rank != root) saw_flags(c.tag.seq, root);
        } else {
          chain_broadcast(c, buf, count, root);
        }
      },
      0, buf, buf);
}

std::shared_ptr<Work> Communicator::reduce(void* buf, size_t count, DataType dt, ReduceOp op,
                                           int root, bool async, double timeout_s) {
  check_rank(root, "dst", OpKind::kReduce);
  OpSig sig{OpKind::kReduce, dt, op, root, count};
  return collective(
      sig, timeout_s, async,
      [this, buf, count, root](OpCtx& c) {
        if (cma(c)) {
          c.path = Path::kCma;
          cma_reduce(c, cma_view(c.tag.seq), buf, count, root);
        } else {
          chain_reduce(c, buf, count, root);
        }
      },
      0, buf, buf);
}

std::shared_ptr<Work> Communicator::all_to_all(void* out, const void* in, size_t count, DataType dt,
                                               bool async, double timeout_s) {
  OpSig sig{OpKind::kAllToAll, dt, ReduceOp::kSum, -1, count};
  return collective(
      sig, timeout_s, async,
      [this, out, in, count](OpCtx& c) {
        if (cma(c)) {
          c.path = Path::kCma;
          cma_all_to_all(c, cma_view(c.tag.seq), count);
        } else {
          pairwise_all_to_all(c, in, out, count);
        }
      },
      0, in, out);
}

std::shared_ptr<Work> Communicator::barrier(bool async, double timeout_s) {
  OpSig sig{OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0};
  return collective(sig, timeout_s, async, [this](OpCtx& c) {
    wait_started(c.tag.seq, *c.mon);
    static_cast<OpMonitor*>(c.mon)->check_slow();  // a peer may have started another collective
  });
}

std::shared_ptr<Work> Communicator::send(const void* buf, size_t count, DataType dt, int peer,
                                         bool async, double timeout_s) {
  check_rank(peer, "dst", OpKind::kSend);
  if (peer == rank_)
    PYC_THROW(InvalidArgument,
              "pycollectives: rank " << rank_ << ": send: dst=" << peer << " is this rank");
  OpSig sig{OpKind::kSend, dt, ReduceOp::kSum, peer, count};
  // Always through the slots: the sender copies in while the receiver copies
  // out, two cores at work, where single copy would leave the sender waiting
  // (2 ranks, 8 / 32 MiB send -> recv: 12.6 / 12.8 GB/s through the slots,
  // 11.1 / 7.8-9.9 GB/s read across). A batch, whose ranks all copy, reads
  // its large messages across (batch_p2p).
  return point_to_point(sig, peer, timeout_s, async,
                        [buf, count, peer](OpCtx& c) { p2p_send(c, buf, count, peer); });
}

std::shared_ptr<Work> Communicator::recv(void* buf, size_t count, DataType dt, int peer, bool async,
                                         double timeout_s) {
  check_rank(peer, "src", OpKind::kRecv);
  if (peer == rank_)
    PYC_THROW(InvalidArgument,
              "pycollectives: rank " << rank_ << ": recv: src=" << peer << " is this rank");
  OpSig sig{OpKind::kRecv, dt, ReduceOp::kSum, peer, count};
  // The sender may be a batch that chose single copy: with CMA on, the
  // receive takes either.
  const P2PCma cma = cma_ ? p2p_cma(peer, false) : P2PCma{};
  return point_to_point(sig, peer, timeout_s, async, [this, buf, count, peer, dt, cma](OpCtx& c) {
    OpSig expect{OpKind::kSend, dt, ReduceOp::kSum, rank_, count};
    p2p_recv(c, buf, count, peer, SlotTag{c.tag.seq, expect.word0(), expect.word1()},
             cma.done != nullptr ? &cma : nullptr);
  });
}

std::shared_ptr<Work> Communicator::recv_any(void* buf, size_t count, DataType dt, bool async,
                                             double timeout_s, int* source) {
  check_open(OpKind::kRecv);
  if (n_ < 2)
    PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_
                                                      << ": recv: from any source needs a peer "
                                                         "(world size 1)");
  if (timeout_s < 0) timeout_s = timeout_s_;
  OpSig sig{OpKind::kRecv, dt, ReduceOp::kSum, -1, count};  // root -1: any peer
  auto src = std::make_shared<std::atomic<int>>(-1);
  std::shared_ptr<Work> work = engine_->submit(
      [] { return 0u; },
      [this, sig, buf, count, dt, timeout_s, src](uint32_t) {
        run_op(sig, 0, timeout_s, false, [&](OpCtx& c) {
          std::vector<uint32_t> next(n_);
          for (int p = 0; p < n_; ++p) next[p] = p2p_recvd_[p] + 1;
          const int peer = p2p_probe_any(c, next.data(), any_next_);
          any_next_ = (peer + 1) % n_;
          c.tag.seq = ++p2p_recvd_[peer];
          // From here on, a receive from `peer`, as Communicator::recv's.
          OpSig expect{OpKind::kSend, dt, ReduceOp::kSum, rank_, count};
          const P2PCma cma = cma_ ? p2p_cma(peer, false) : P2PCma{};
          p2p_recv(c, buf, count, peer, SlotTag{c.tag.seq, expect.word0(), expect.word1()},
                   cma.done != nullptr ? &cma : nullptr);
          src->store(peer);
        });
      },
      async);
  if (work) {
    work->set_source(src);
  } else if (source != nullptr) {
    *source = src->load();
  }
  return work;
}

std::shared_ptr<Work> Communicator::batch_p2p(std::vector<P2PItem> items, bool async,
                                              double timeout_s) {
  const OpKind kind = OpKind::kBatchP2P;
  check_open(kind);
  int self_balance = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const P2PItem& it = items[i];
    if (it.peer < 0 || it.peer >= n_)
      PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_ << ": batch_p2p: op " << i
                                                        << ": peer=" << it.peer
                                                        << " is out of range [0, " << n_ << ")");
    if (it.peer == rank_) self_balance += it.send ? 1 : -1;
  }
  if (self_balance != 0)
    PYC_THROW(InvalidArgument, "pycollectives: rank "
                                   << rank_
                                   << ": batch_p2p: the sends to this rank and the receives from "
                                      "this rank do not pair up");
  {  // a send to self and the receive it pairs with must agree on size and dtype
    std::vector<const P2PItem*> s, r;
    for (const P2PItem& it : items)
      if (it.peer == rank_) (it.send ? s : r).push_back(&it);
    for (size_t i = 0; i < s.size(); ++i)
      if (s[i]->count != r[i]->count || s[i]->dtype != r[i]->dtype)
        PYC_THROW(InvalidArgument, "pycollectives: rank "
                                       << rank_ << ": batch_p2p: send to self #" << i << " ("
                                       << s[i]->count << " x " << dtype_name(s[i]->dtype)
                                       << ") does not match receive from self #" << i << " ("
                                       << r[i]->count << " x " << dtype_name(r[i]->dtype) << ")");
  }
  if (timeout_s < 0) timeout_s = timeout_s_;
  OpSig sig{kind, DataType::kUInt8, ReduceOp::kSum, -1, items.size()};
  return engine_->submit(
      [] { return 0u; },
      [this, sig, items = std::move(items), timeout_s](uint32_t) {
        // Numbered as it runs, like single sends and receives: the k-th
        // message from a to b carries sequence number k on both sides.
        std::vector<P2POp> ops(items.size());
        uint32_t first = 0;
        for (size_t i = 0; i < items.size(); ++i) {
          const P2PItem& it = items[i];
          P2POp& op = ops[i];
          op.send = it.send;
          op.buf = it.buf;
          op.count = it.count;
          op.dtype = it.dtype;
          op.peer = it.peer;
          if (it.peer == rank_) continue;
          const uint32_t seq = it.send ? ++p2p_sent_[it.peer] : ++p2p_recvd_[it.peer];
          // A send's slots carry its own signature; a receive expects the
          // sender's, whose root is this rank.
          OpSig s{OpKind::kSend, it.dtype, ReduceOp::kSum, it.send ? it.peer : rank_, it.count};
          op.tag = SlotTag{seq, s.word0(), s.word1()};
          // Single copy from kP2PCmaMinBytes on, every non-empty message with
          // PYCOLL_ALGO=cma: a receive may come across, a send goes across if
          // the tuner prefers it when the batch runs (below). A receive takes
          // whichever its sender chose (batch_p2p.cc).
          const size_t bytes = it.count * dtype_size(it.dtype);
          op.cma = cma_ && bytes > 0 && (algo_ == Algo::kCma || bytes >= kP2PCmaMinBytes);
          if (op.cma) op.across = p2p_cma(it.peer, it.send);
          if (first == 0) first = seq;
        }
        // This rank's sends of single-copy size go across where its tuner,
        // timing whole batches by the bytes of those sends, prefers it (chosen
        // here, on the engine's thread in the order operations run).
        size_t total = 0;
        for (const P2POp& op : ops)
          if (op.send && op.cma) total += op.count * dtype_size(op.dtype);
        const CmaTuner::Choice cma = cma_choice(OpKind::kBatchP2P, total, 0);
        if (!cma.cma)
          for (P2POp& op : ops) op.cma = op.cma && !op.send;
        const auto t0 = cma.timed ? Clock::now() : Clock::time_point{};
        run_op(sig, first, timeout_s, false, [&ops](OpCtx& c) { p2p_batch(c, ops); });
        if (cma.timed) cma_tuner_.record(OpKind::kBatchP2P, total, cma.cma, elapsed_ns(t0));
      },
      async);
}

}  // namespace pyc
