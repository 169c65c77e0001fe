// The collectives of ranks on several hosts (hierarchical.h).
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
#include "algo/hierarchical.h"

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "algo/algorithms.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {
namespace {

// A schedule over some of the ranks (members, global ranks in schedule
// order): its context numbers them 0..members-1, its links are theirs.
struct Group final : public Links {
  Group(const OpCtx& c, std::vector<int> members) : world_(*c.links), members_(std::move(members)) {
    ctx = c;
    ctx.links = this;
    ctx.nranks = static_cast<int>(members_.size());
    ctx.rank =
        static_cast<int>(std::find(members_.begin(), members_.end(), c.rank) - members_.begin());
    PYC_ASSERT(ctx.rank < ctx.nranks);
    ctx.bytes_sent = ctx.bytes_recv = 0;
  }
  SendConn& send_to(int i) override { return world_.send_to(members_[i]); }
  RecvConn& recv_from(int i) override { return world_.recv_from(members_[i]); }
  [[noreturn]] void tag_mismatch(int i, const SlotTag& got, const SlotTag& want) override {
    world_.tag_mismatch(members_[i], got, want);
    __builtin_unreachable();  // a [[noreturn]] virtual: GCC does not carry it through the call
  }
  // Adds what the schedule moved to the operation's counts.
  void done(OpCtx& c) {
    c.bytes_sent += ctx.bytes_sent;
    c.bytes_recv += ctx.bytes_recv;
    ctx.bytes_sent = ctx.bytes_recv = 0;
  }
  OpCtx ctx;

 private:
  Links& world_;
  std::vector<int> members_;
};

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

void hier_all_reduce(OpCtx& c, const Hier& hier, void* buf, size_t count) {
  const int n = c.nranks;
  const Topology& topo = hier.topo;
  const std::vector<int>& locals = topo.locals();
  const int nlocal = static_cast<int>(locals.size());
  if (count == 0) return hier.host.confirm_hosts(c);
  const size_t es = c.esize();
  if (hier.flat || !topo.uniform()) {
    c.path = Path::kFlat;
    Group w(c, topo.host_order());
    ring_all_reduce(w.ctx, buf, buf, count);
    return w.done(c);
  }
  c.path = Path::kHier;
  const ReduceOp local_op = c.op == ReduceOp::kAvg ? ReduceOp::kSum : c.op;
  Group rail(c, topo.rail(c.rank));
  rail.ctx.avg_div = n;  // the rail finishes the average of every rank
  if (count * es <= hier.oneshot_bytes && rail.ctx.nranks <= kMaxExchangeRanks) {
    if (nlocal > 1) {
      Group local(c, locals);
      local.ctx.op = local_op;
      if (hier.host.oneshot(local.ctx, count * es)) {
        oneshot_all_reduce(local.ctx, hier.host.oneshot_areas(), buf, buf, count);
        hier.host.saw_flags(c.tag.seq, -1);
      } else {  // PYCOLL_ALGO=oneshot areas too small, say
        ring_all_reduce(local.ctx, buf, buf, count);
      }
      local.done(c);
    }
    exchange_all_reduce(rail.ctx, buf, count);
    return rail.done(c);
  }
  const int li = topo.local(c.rank);
  const BlockMap m = shards(count, nlocal, es);
  char* shard = static_cast<char*>(buf) + m.off[li] * es;
  if (nlocal > 1) {
    Group local(c, locals);
    local.ctx.op = local_op;
    ring_reduce_scatter_map(local.ctx, buf, buf, m, &m.off[li]);
    local.done(c);
  }
  ring_all_reduce(rail.ctx, shard, shard, m.len[li]);
  rail.done(c);
  if (nlocal > 1) {
    Group local(c, locals);
    ring_all_gather_map(local.ctx, buf, m);
    local.done(c);
  }
}

void hier_reduce_scatter(OpCtx& c, const Hier& hier, void* out, const void* in, size_t count) {
  const int n = c.nranks;
  const Topology& topo = hier.topo;
  const std::vector<int>& locals = topo.locals();
  const int nlocal = static_cast<int>(locals.size());
  if (count == 0) return hier.host.confirm_hosts(c);
  const size_t es = c.esize();
  if (hier.flat || !topo.uniform()) {
    c.path = Path::kFlat;
    const std::vector<int> order = topo.host_order();
    Group w(c, order);
    const size_t zero = 0;
    ring_reduce_scatter_map(w.ctx, in, out, blocks_of(order, count), &zero);
    return w.done(c);
  }
  if (count * n * es <= hier.oneshot_bytes) {  // small: all of it, then this rank's block
    char* tmp = hier.host.scratch(count * n * es);
    std::memcpy(tmp, in, count * n * es);
    hier_all_reduce(c, hier, tmp, count * n);
    std::memcpy(out, tmp + c.rank * count * es, count * es);
    return;
  }
  c.path = Path::kHier;
  const std::vector<int> rail = topo.rail(c.rank);
  const int nh = topo.nhosts();
  Group across(c, rail);
  across.ctx.avg_div = n;
  if (nlocal == 1) {
    const size_t zero = 0;
    ring_reduce_scatter_map(across.ctx, in, out, blocks_of(rail, count), &zero);
    return across.done(c);
  }
  // Within the host: local rank j's block is rank (h, j)'s block of every
  // host h; this rank gets this host's sums of its rail's blocks, in host order.
  BlockMap m;
  m.nsegs = nh;
  for (int j = 0; j < nlocal; ++j)
    for (int h = 0; h < nh; ++h) {
      m.off.push_back(static_cast<size_t>(topo.members(h)[j]) * count);
      m.len.push_back(count);
    }
  std::vector<size_t> out_off(nh);
  for (int h = 0; h < nh; ++h) out_off[h] = h * count;
  char* tmp = hier.host.scratch(count * nh * es);
  Group local(c, locals);
  local.ctx.op = c.op == ReduceOp::kAvg ? ReduceOp::kSum : c.op;
  ring_reduce_scatter_map(local.ctx, in, tmp, m, out_off.data());
  local.done(c);
  ring_reduce_scatter(across.ctx, tmp, out, count);
  across.done(c);
}

void hier_all_gather(OpCtx& c, const Hier& hier, void* out, const void* in, size_t count) {
  const Topology& topo = hier.topo;
  const std::vector<int>& locals = topo.locals();
  const int nlocal = static_cast<int>(locals.size());
  if (count == 0) return hier.host.confirm_hosts(c);
  const size_t es = c.esize();
  char* mine = static_cast<char*>(out) + c.rank * count * es;
  if (mine != in) copy(mine, nullptr, in, count * es, c.out_store);
  if (hier.flat || !topo.uniform()) {
    c.path = Path::kFlat;
    const std::vector<int> order = topo.host_order();
    Group w(c, order);
    ring_all_gather_map(w.ctx, out, blocks_of(order, count));
    return w.done(c);
  }
  c.path = Path::kHier;
  const std::vector<int> rail = topo.rail(c.rank);
  Group across(c, rail);
  ring_all_gather_map(across.ctx, out, blocks_of(rail, count));
  across.done(c);
  if (nlocal == 1) return;
  const int nh = topo.nhosts();
  BlockMap m;  // local rank j's block: rank (h, j)'s of every host h
  m.nsegs = nh;
  for (int j = 0; j < nlocal; ++j)
    for (int h = 0; h < nh; ++h) {
      m.off.push_back(static_cast<size_t>(topo.members(h)[j]) * count);
      m.len.push_back(count);
    }
  Group local(c, locals);
  ring_all_gather_map(local.ctx, out, m);
  local.done(c);
}

void hier_broadcast(OpCtx& c, const Hier& hier, void* buf, size_t count, int root) {
  const Topology& topo = hier.topo;
  const std::vector<int>& locals = topo.locals();
  const int nlocal = static_cast<int>(locals.size());
  hier.host.confirm_hosts(c);  // every rank agrees on the root before any data moves
  if (count == 0) return;
  if (hier.flat) {
    c.path = Path::kFlat;
    return chain_broadcast(c, buf, count, root);
  }
  c.path = Path::kHier;
  const size_t bytes = count * c.esize();
  const int i0 = topo.local(root), h0 = topo.host(root);
  if (topo.uniform() && bytes <= hier.oneshot_bytes) {
    if (topo.local(c.rank) == i0) {  // the root's rail: one message per host
      Group across(c, topo.rail(c.rank));
      chain_broadcast(across.ctx, buf, count, h0);
      across.done(c);
    }
    if (nlocal == 1) return;
    Group local(c, locals);
    if (hier.host.oneshot(local.ctx, bytes)) {
      oneshot_broadcast(local.ctx, hier.host.oneshot_areas(), buf, count, i0);
      if (topo.local(c.rank) != i0) hier.host.saw_flags(c.tag.seq, locals[i0]);
    } else {
      chain_broadcast(local.ctx, buf, count, i0);
    }
    return local.done(c);
  }
  // A pipelined chain: the root, its host's ranks, then host after host.
  std::vector<int> order = {root};
  for (int p : topo.members(h0))
    if (p != root) order.push_back(p);
  for (int h = 0; h < topo.nhosts(); ++h)
    if (h != h0) order.insert(order.end(), topo.members(h).begin(), topo.members(h).end());
  Group w(c, order);
  chain_broadcast(w.ctx, buf, count, 0);
  w.done(c);
}

void hier_reduce(OpCtx& c, const Hier& hier, void* buf, size_t count, int root) {
  const int n = c.nranks;
  const Topology& topo = hier.topo;
  hier.host.confirm_hosts(c);
  if (count == 0) return;
  if (hier.flat) {
    c.path = Path::kFlat;
    return chain_reduce(c, buf, count, root);
  }
  // A pipelined chain that ends at the root: host after host, the root's last.
  c.path = Path::kHier;
  const int h0 = topo.host(root);
  std::vector<int> order;
  for (int h = 0; h < topo.nhosts(); ++h)
    if (h != h0) order.insert(order.end(), topo.members(h).begin(), topo.members(h).end());
  for (int p : topo.members(h0))
    if (p != root) order.push_back(p);
  order.push_back(root);
  Group w(c, order);
  chain_reduce(w.ctx, buf, count, n - 1);
  w.done(c);
}

}  // namespace pyc
