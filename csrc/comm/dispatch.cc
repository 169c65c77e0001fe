// Communicator: how one operation is set up and run (numbered, announced,
// monitored), and the choice of its path: one-shot, direct (windows), single
// copy (CMA) or the slots (see communicator.h).
#include <atomic>
#include <cstdint>
#include <thread>

#include "algo/prims.h"
#include "comm/cma_choice.h"
#include "comm/communicator.h"
#include "comm/monitor.h"
#include "comm/traffic.h"
#include "core/clock.h"
#include "core/error.h"

namespace pyc {

void Communicator::announce(uint32_t seq, const OpSig& sig, uint64_t where, uint64_t addr,
                            uint64_t out) {
  // A seqlock: readers (OpMonitor::check_mismatch) may read the entry while
  // it changes, and then see the sequence number change under them.
  RankCtl* me = ctl(rank_);
  SigEntry& e = me->sig[seq % kSigHistory];
  e.seq.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  e.w0.store(sig.word0(), std::memory_order_relaxed);
  e.w1.store(sig.word1(), std::memory_order_relaxed);
  e.where.store(where, std::memory_order_relaxed);
  e.addr.store(addr, std::memory_order_relaxed);
  e.out.store(out, std::memory_order_relaxed);
  e.seq.store(seq, std::memory_order_release);
  publish(me->started, seq);
}

void Communicator::wait_started(uint32_t seq, WaitMonitor& mon) {
  for (int p : locals_) {  // this host's ranks (another host's do not announce here)
    if (p == rank_ || reached(known_started_[p], seq)) continue;
    mon.peer = p;
    known_started_[p] = wait_reached(ctl(p)->started, seq, mon);
  }
}

namespace {
// Operations run one at a time (the engine's busy flag, handed over under its
// lock), so each counter has one writer at a time and stats() only reads: a
// plain load and store, not a locked read-modify-write (~8 per operation).
void bump(std::atomic<uint64_t>& a, uint64_t v) {
  a.store(a.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
}
}  // namespace

void Communicator::account(const OpSig& sig, const OpCtx& c, uint64_t ns) {
  OpStats& s = stats_[static_cast<int>(sig.kind)];
  Traffic t{c.bytes_sent, c.bytes_recv};   // point to point: its messages
  collective_traffic(sig, rank_, n_, &t);  // a collective: by definition, whatever the path
  bump(s.calls, 1);
  bump(s.bytes_sent, t.sent);
  bump(s.bytes_recv, t.received);
  bump(s.bytes_out, c.bytes_sent);
  bump(s.bytes_in, c.bytes_recv);
  bump(s.time_ns, ns);
  bump(s.taken_over, c.taken_over);
  bump(s.paths[static_cast<int>(c.path)], 1);
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
  // A collective's end, for a closing peer's idea of who is absent.
  struct Done {
    RankCtl* me;
    uint32_t seq;
    bool collective;
    ~Done() {
      if (collective) me->done.store(seq, std::memory_order_release);
    }
  } done{ctl(rank_), seq, collective};
  try {
    body(c);
  } catch (const std::exception& e) {
    // The peers must not wait for a rank that gave up: abort them all. The
    // monitor and the transport have usually recorded the error already (the
    // first one wins), this covers every other failure.
    set_abort(AbortKind::kError, e.what());
    // Peers may be writing into this rank's buffers (single copy), which the
    // caller may free once this raises.
    if (collective &&
        ctl(rank_)->sig[seq % kSigHistory].addr.load(std::memory_order_relaxed) != 0) {
      before_block();
      wait_peers_copied(seq);
    }
    throw;
  }
  account(sig, c, elapsed_ns(mon.start()));
}

bool Communicator::oneshot(OpCtx& c, size_t bytes) {
  // c.nranks: this host's ranks, or all of them on one host (the areas are this host's).
  if (algo_ == Algo::kRing || (algo_ == Algo::kCma && cma_) ||
      !oneshot_fits(oneshot_, c.nranks, bytes) || c.nranks != nlocal_)
    return false;
  wait_started(c.tag.seq - 1, *c.mon);  // peers are done reading our area of op seq-2
  return true;
}

void Communicator::saw_flags(uint32_t seq, int only) {
  for (int p : locals_)
    if (only < 0 || p == only) known_started_[p] = seq;  // a peer's flag means it started seq
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
  const SigEntry& mine = ctl(rank_)->sig[c.tag.seq % kSigHistory];
  return mine.addr.load(std::memory_order_relaxed) != 0 &&
         announced_alike(c, [](const SigEntry& e) { return e.addr.load() != 0; });
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

CmaView Communicator::cma_view(uint32_t seq) {
  constexpr size_t kChunk = 256 << 10;  // a chunk of every rank stays in L2 while it is reduced
  if (!cma_scratch_) {
    cma_scratch_.reset(new char[n_ * kChunk + 64]);
  }
  CmaView v;
  for (int p = 0; p < n_; ++p) {
    RankCtl* rc = ctl(p);
    v.pid[p] = peer_pid_[p];  // checked at connect, never re-read from the segment
    const SigEntry& e = rc->sig[seq % kSigHistory];
    v.addr[p] = e.addr.load(std::memory_order_relaxed);
    v.out[p] = e.out.load(std::memory_order_relaxed);
    v.next[p] = &rc->cma_next;
    v.gathered[p] = &rc->gathered;
    if (p != rank_) {
      v.from[p] = &layout_.fifo_ctl(seg_.data(), p, rank_)->cma_next;
      v.to[p] = &layout_.fifo_ctl(seg_.data(), rank_, p)->cma_next;
    }
  }
  const auto base = reinterpret_cast<uintptr_t>(cma_scratch_.get());
  v.scratch = reinterpret_cast<char*>((base + 63) / 64 * 64);
  v.chunk = kChunk;
  v.busy = &ctl(rank_)->cma_busy;
  return v;
}

void Communicator::wait_peers_copied(uint32_t seq) {
  // A peer sees the abort before its next chunk (algo/cma.cc checks before
  // each), so it stops within one chunk's copy, ~0.1 ms. The bound covers a
  // peer that is stopped or descheduled between its check and its copy:
  // past it this rank gives up, and such a peer may still write one chunk
  // (up to 256 KiB) into a buffer the caller has let go. Dead or closed
  // peers copy nothing.
  constexpr auto kGrace = std::chrono::seconds(2);
  const uint64_t busy = uint64_t{seq} << 1 | 1;
  std::atomic_thread_fence(std::memory_order_seq_cst);  // the abort, then the peers' flags
  const auto until = Clock::now() + kGrace;
  for (int p = 0; p < n_; ++p) {
    if (p == rank_) continue;
    while (ctl(p)->cma_busy.load(std::memory_order_seq_cst) == busy && peer_gone(p).empty() &&
           Clock::now() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void Communicator::confirm_alike(OpCtx& c) {
  if (multi_host()) return confirm_hosts(c);
  const uint32_t seq = c.tag.seq;
  wait_started(seq, *c.mon);
  for (int p = 0; p < n_; ++p) {
    if (p == rank_) continue;
    const SigEntry& e = ctl(p)->sig[seq % kSigHistory];
    // Announced before `started` (acquired above), overwritten only 64
    // operations later, past the lead any rank may take (kMaxLead).
    if (e.seq.load(std::memory_order_acquire) != seq) continue;
    const SlotTag got{seq, e.w0.load(std::memory_order_relaxed),
                      e.w1.load(std::memory_order_relaxed)};
    if (!(got == c.tag)) tag_mismatch(p, got, c.tag);
  }
}

char* Communicator::scratch(size_t bytes) {
  if (scratch_.size() < bytes + 64) scratch_.resize(bytes + 64);
  const auto p = reinterpret_cast<uintptr_t>(scratch_.data());
  return reinterpret_cast<char*>((p + 63) / 64 * 64);
}

void Communicator::confirm_hosts(OpCtx& c) {
  const uint32_t seq = c.tag.seq;
  wait_started(seq, *c.mon);  // this host's ranks, as confirm_alike
  for (int p : locals_) {
    if (p == rank_) continue;
    const SigEntry& e = ctl(p)->sig[seq % kSigHistory];
    if (e.seq.load(std::memory_order_acquire) != seq) continue;
    const SlotTag got{seq, e.w0.load(std::memory_order_relaxed),
                      e.w1.load(std::memory_order_relaxed)};
    if (!(got == c.tag)) tag_mismatch(p, got, c.tag);
  }
  // Every cross-host peer sent its tag after its own host's ranks had all
  // started: once every one came, every rank of every host has started this
  // operation, alike (the peers link every pair of hosts).
  const std::vector<int> peers = topo_.xpeers(rank_);
  for (int q : peers) {
    SendConn& s = send_to(q);
    (void)s.acquire(*c.mon);
    s.post(c.tag, 0);
  }
  for (int q : peers) {
    RecvConn& r = recv_from(q);
    const RecvSlot s = r.wait(*c.mon);
    if (!(s.tag == c.tag)) tag_mismatch(q, s.tag, c.tag);
    r.release();
  }
}

void Communicator::sync(const OpSig& sig, double timeout_s) {
  collective(sig, timeout_s, false, [this](OpCtx& c) { confirm_alike(c); });
}

bool Communicator::symmetric(OpCtx& c, uint64_t where) {
  return announced_alike(c, [where](const SigEntry& e) { return e.where.load() == where; });
}

template <class Also>
bool Communicator::announced_alike(OpCtx& c, Also also) {
  if (n_ > kMaxDirectRanks) return false;
  const uint32_t seq = c.tag.seq;
  wait_started(seq, *c.mon);  // every peer's buffer is in place and its op announced
  for (int p = 0; p < n_; ++p) {
    const SigEntry& e = ctl(p)->sig[seq % kSigHistory];
    if (e.seq.load(std::memory_order_acquire) != seq ||
        e.w0.load(std::memory_order_relaxed) != c.tag.w0 ||
        e.w1.load(std::memory_order_relaxed) != c.tag.w1 || !also(e))
      return false;  // the ring runs (and reports a mismatched operation)
  }
  return true;
}

}  // namespace pyc
