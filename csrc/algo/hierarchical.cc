// Communicator (comm/communicator.h): the collectives of ranks on several hosts, and what the
// network thread asks of the communicator (errors of other hosts, where this
// host's ranks are).
//
// Within a host the ranks keep the shared-memory slots and one-shot areas;
// between hosts, TCP. Under PYCOLL_ALGO=auto the collectives are
// hierarchical (Path::kHier) where every host has as many ranks (rank i of
// every host forms rail i):
// - all-reduce: reduce-scatter within the host (shard i to local rank i),
//   all-reduce of shard i across the hosts by rail i (all rails at once),
//   all-gather within the host. The bytes a host sends to other hosts are
//   2 S (h-1)/h for h hosts, the least any all-reduce sends; a flat ring over
//   every rank sends 2 S (n-1)/n out of each host. Small messages (up to
//   PYCOLL_ONESHOT_BYTES): the one-shot all-reduce within the host, then an
//   exchange of the host's sums along each rail (exchange.cc), one message
//   deep.
// - reduce-scatter: within the host first (each rank gets, for every host,
//   its own index's block summed over this host), then across hosts along
//   the rail; all-gather the reverse: along the rail, then within the host.
//   Both send each byte across hosts once.
// - broadcast and reduce: a chain that visits the hosts one after another,
//   entering each once (small broadcasts: along the root's rail, then the
//   one-shot areas within each host).
// PYCOLL_ALGO=ring, and hosts with different numbers of ranks, take one ring
// (or chain) over every rank instead, host by host (Path::kFlat). All-to-all
// and point-to-point go straight between the two ranks, over whichever link
// joins them. Every schedule is the same on every rank, so the ranks of all
// hosts get the same bits, as on one host.
#include <algorithm>
#include <cstring>
#include <limits>

#include "algo/algorithms.h"
#include "algo/prims.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {

// A schedule over some of the ranks (members, in schedule order): its
// context numbers them 0..members-1, its links are theirs.
struct Communicator::Group final : public Links {
  Group(Communicator& comm, const OpCtx& c, std::vector<int> members)
      : comm_(comm), members_(std::move(members)) {
    ctx = c;
    ctx.links = this;
    ctx.nranks = static_cast<int>(members_.size());
    ctx.rank = static_cast<int>(std::find(members_.begin(), members_.end(), comm.rank_) -
                                members_.begin());
    PYC_ASSERT(ctx.rank < ctx.nranks);
    ctx.bytes_sent = ctx.bytes_recv = 0;
  }
  SendConn& send_to(int i) override { return comm_.send_to(members_[i]); }
  RecvConn& recv_from(int i) override { return comm_.recv_from(members_[i]); }
  [[noreturn]] void tag_mismatch(int i, const SlotTag& got, const SlotTag& want) override {
    comm_.tag_mismatch(members_[i], got, want);
  }
  // Adds what the schedule moved to the operation's counts.
  void done(OpCtx& c) {
    c.bytes_sent += ctx.bytes_sent;
    c.bytes_recv += ctx.bytes_recv;
    ctx.bytes_sent = ctx.bytes_recv = 0;
  }
  OpCtx ctx;

 private:
  Communicator& comm_;
  std::vector<int> members_;
};

namespace {

// Shards of `count` elements for `parts` ranks, each a multiple of 64 bytes
// (the last ones shorter, or empty).
BlockMap shards(size_t count, int parts, size_t es) {
  const size_t align = std::max<size_t>(1, 64 / es);
  const size_t q = ((count + parts - 1) / parts + align - 1) / align * align;
  BlockMap m;
  for (int b = 0; b < parts; ++b) {
    const size_t off = std::min(count, b * q);
    m.off.push_back(off);
    m.len.push_back(std::min(q, count - off));
  }
  return m;
}

// Block map of a world-sized buffer (rank r's block at r * count) for a
// schedule over `order`: block b is rank order[b]'s.
BlockMap blocks_of(const std::vector<int>& order, size_t count) {
  BlockMap m;
  for (int r : order) {
    m.off.push_back(static_cast<size_t>(r) * count);
    m.len.push_back(count);
  }
  return m;
}

}  // namespace

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

void Communicator::mh_all_reduce(OpCtx& c, void* buf, size_t count) {
  if (count == 0) return confirm_hosts(c);
  const size_t es = c.esize();
  if (algo_ == Algo::kRing || !topo_.uniform()) {
    c.path = Path::kFlat;
    Group w(*this, c, topo_.host_order());
    ring_all_reduce(w.ctx, buf, buf, count);
    return w.done(c);
  }
  c.path = Path::kHier;
  const ReduceOp local_op = c.op == ReduceOp::kAvg ? ReduceOp::kSum : c.op;
  Group rail(*this, c, topo_.rail(rank_));
  rail.ctx.avg_div = n_;  // the rail finishes the average of every rank
  if (count * es <= layout_.oneshot_bytes && rail.ctx.nranks <= kMaxExchangeRanks) {
    if (nlocal_ > 1) {
      Group local(*this, c, locals_);
      local.ctx.op = local_op;
      if (oneshot(local.ctx, count * es)) {
        oneshot_all_reduce(local.ctx, oneshot_, buf, buf, count);
        saw_flags(c.tag.seq);
      } else {  // PYCOLL_ALGO=oneshot areas too small, say
        ring_all_reduce(local.ctx, buf, buf, count);
      }
      local.done(c);
    }
    exchange_all_reduce(rail.ctx, buf, count);
    return rail.done(c);
  }
  const int li = topo_.local(rank_);
  const BlockMap m = shards(count, nlocal_, es);
  char* shard = static_cast<char*>(buf) + m.off[li] * es;
  if (nlocal_ > 1) {
    Group local(*this, c, locals_);
    local.ctx.op = local_op;
    ring_reduce_scatter_map(local.ctx, buf, buf, m, &m.off[li]);
    local.done(c);
  }
  ring_all_reduce(rail.ctx, shard, shard, m.len[li]);
  rail.done(c);
  if (nlocal_ > 1) {
    Group local(*this, c, locals_);
    ring_all_gather_map(local.ctx, buf, m);
    local.done(c);
  }
}

void Communicator::mh_reduce_scatter(OpCtx& c, void* out, const void* in, size_t count) {
  if (count == 0) return confirm_hosts(c);
  const size_t es = c.esize();
  if (algo_ == Algo::kRing || !topo_.uniform()) {
    c.path = Path::kFlat;
    const std::vector<int> order = topo_.host_order();
    Group w(*this, c, order);
    const size_t zero = 0;
    ring_reduce_scatter_map(w.ctx, in, out, blocks_of(order, count), &zero);
    return w.done(c);
  }
  if (count * n_ * es <= layout_.oneshot_bytes) {  // small: all of it, then this rank's block
    char* tmp = scratch(count * n_ * es);
    std::memcpy(tmp, in, count * n_ * es);
    mh_all_reduce(c, tmp, count * n_);
    std::memcpy(out, tmp + rank_ * count * es, count * es);
    return;
  }
  c.path = Path::kHier;
  const std::vector<int> rail = topo_.rail(rank_);
  const int nh = topo_.nhosts();
  Group across(*this, c, rail);
  across.ctx.avg_div = n_;
  if (nlocal_ == 1) {
    const size_t zero = 0;
    ring_reduce_scatter_map(across.ctx, in, out, blocks_of(rail, count), &zero);
    return across.done(c);
  }
  // Within the host: local rank j's block is rank (h, j)'s block of every
  // host h; this rank gets this host's sums of its rail's blocks, in host order.
  BlockMap m;
  m.nsegs = nh;
  for (int j = 0; j < nlocal_; ++j)
    for (int h = 0; h < nh; ++h) {
      m.off.push_back(static_cast<size_t>(topo_.members(h)[j]) * count);
      m.len.push_back(count);
    }
  std::vector<size_t> out_off(nh);
  for (int h = 0; h < nh; ++h) out_off[h] = h * count;
  char* tmp = scratch(count * nh * es);
  Group local(*this, c, locals_);
  local.ctx.op = c.op == ReduceOp::kAvg ? ReduceOp::kSum : c.op;
  ring_reduce_scatter_map(local.ctx, in, tmp, m, out_off.data());
  local.done(c);
  ring_reduce_scatter(across.ctx, tmp, out, count);
  across.done(c);
}

void Communicator::mh_all_gather(OpCtx& c, void* out, const void* in, size_t count) {
  if (count == 0) return confirm_hosts(c);
  const size_t es = c.esize();
  char* mine = static_cast<char*>(out) + rank_ * count * es;
  if (mine != in) copy(mine, nullptr, in, count * es, c.out_store);
  if (algo_ == Algo::kRing || !topo_.uniform()) {
    c.path = Path::kFlat;
    const std::vector<int> order = topo_.host_order();
    Group w(*this, c, order);
    ring_all_gather_map(w.ctx, out, blocks_of(order, count));
    return w.done(c);
  }
  c.path = Path::kHier;
  const std::vector<int> rail = topo_.rail(rank_);
  Group across(*this, c, rail);
  ring_all_gather_map(across.ctx, out, blocks_of(rail, count));
  across.done(c);
  if (nlocal_ == 1) return;
  const int nh = topo_.nhosts();
  BlockMap m;  // local rank j's block: rank (h, j)'s of every host h
  m.nsegs = nh;
  for (int j = 0; j < nlocal_; ++j)
    for (int h = 0; h < nh; ++h) {
      m.off.push_back(static_cast<size_t>(topo_.members(h)[j]) * count);
      m.len.push_back(count);
    }
  Group local(*this, c, locals_);
  ring_all_gather_map(local.ctx, out, m);
  local.done(c);
}

void Communicator::mh_broadcast(OpCtx& c, void* buf, size_t count, int root) {
  confirm_hosts(c);  // every rank agrees on the root before any data moves
  if (count == 0) return;
  if (algo_ == Algo::kRing) {
    c.path = Path::kFlat;
    return chain_broadcast(c, buf, count, root);
  }
  c.path = Path::kHier;
  const size_t bytes = count * c.esize();
  const int i0 = topo_.local(root), h0 = topo_.host(root);
  if (topo_.uniform() && bytes <= layout_.oneshot_bytes) {
    if (topo_.local(rank_) == i0) {  // the root's rail: one message per host
      Group across(*this, c, topo_.rail(rank_));
      chain_broadcast(across.ctx, buf, count, h0);
      across.done(c);
    }
    if (nlocal_ == 1) return;
    Group local(*this, c, locals_);
    if (oneshot(local.ctx, bytes)) {
      oneshot_broadcast(local.ctx, oneshot_, buf, count, i0);
      if (topo_.local(rank_) != i0) saw_flags(c.tag.seq, locals_[i0]);
    } else {
      chain_broadcast(local.ctx, buf, count, i0);
    }
    return local.done(c);
  }
  // A pipelined chain: the root, its host's ranks, then host after host.
  std::vector<int> order = {root};
  for (int p : topo_.members(h0))
    if (p != root) order.push_back(p);
  for (int h = 0; h < topo_.nhosts(); ++h)
    if (h != h0) order.insert(order.end(), topo_.members(h).begin(), topo_.members(h).end());
  Group w(*this, c, order);
  chain_broadcast(w.ctx, buf, count, 0);
  w.done(c);
}

void Communicator::mh_reduce(OpCtx& c, void* buf, size_t count, int root) {
  confirm_hosts(c);
  if (count == 0) return;
  if (algo_ == Algo::kRing) {
    c.path = Path::kFlat;
    return chain_reduce(c, buf, count, root);
  }
  // A pipelined chain that ends at the root: host after host, the root's last.
  c.path = Path::kHier;
  const int h0 = topo_.host(root);
  std::vector<int> order;
  for (int h = 0; h < topo_.nhosts(); ++h)
    if (h != h0) order.insert(order.end(), topo_.members(h).begin(), topo_.members(h).end());
  for (int p : topo_.members(h0))
    if (p != root) order.push_back(p);
  order.push_back(root);
  Group w(*this, c, order);
  chain_reduce(w.ctx, buf, count, n_ - 1);
  w.done(c);
}

// ---- what the network thread asks ----

bool Communicator::adopt_abort(int kind, int from, const std::string& msg) {
  std::lock_guard<std::mutex> lk(abort_mu_);
  if (aborted()) return false;
  if (kind <= static_cast<int>(AbortKind::kNone) || kind > static_cast<int>(AbortKind::kMismatch))
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
  const int link = net_ ? net_->silent_link(p) : -2;
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
  net_->query_status(Clock::now() + wait);
}

}  // namespace pyc
