// One-shot collectives for small messages: every writer copies its data into
// its own shared area once and raises its flag; readers wait for the flags they
// need and read the areas directly. One handshake instead of the ring's
// 2(n-1) steps. An area is reused every other operation (by parity); the
// caller makes sure every peer has started operation seq-1, i.e. finished
// reading the areas of operation seq-2. A payload of up to a cache line's
// spare bytes travels in the flag's line (shm_layout.h, OneShotHeader).
#include "algo/algorithms.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {
namespace {

// Copies `bytes` of `src` into this rank's area for this operation and raises its flag.
void post_area(OpCtx& c, const OneShotAreas& a, const void* src, size_t bytes) {
  PYC_ASSERT(bytes <= a.bytes && c.nranks <= kMaxOneShotRanks);
  const int par = c.tag.seq & 1, r = c.rank;
  copy(a.area(par, r, bytes), nullptr, src, bytes);
  a.sig[par][r][0] = c.tag.w0;
  a.sig[par][r][1] = c.tag.w1;
  publish(*a.flag[par][r], c.tag.seq);
  c.bytes_sent += bytes;
}

// Waits for rank p's area of this operation, checks its tag, returns its payload.
const void* wait_area(OpCtx& c, const OneShotAreas& a, int p, size_t bytes) {
  const int par = c.tag.seq & 1;
  c.mon->peer = p;
  uint32_t got = wait_reached(*a.flag[par][p], c.tag.seq, *c.mon);
  SlotTag seen{got, a.sig[par][p][0], a.sig[par][p][1]};
  if (!(seen == c.tag)) c.links->tag_mismatch(p, seen, c.tag);
  c.bytes_recv += bytes;
  return a.area(par, p, bytes);
}

// Calls f(p) for every peer: first those pinned to this rank's CPU, which run
// only once this rank yields (it does so at once for them) and then post
// without delay, then the others, each group by rank. Waiting on a peer of
// another CPU first would spin while this CPU's late peer cannot run.
template <class F>
void for_peers(const OpCtx& c, F f) {
  for (int pass = 0; pass < 2; ++pass)
    for (int p = 0; p < c.nranks; ++p)
      if (p != c.rank && c.mon->shares_cpu_with(p) == (pass == 0)) f(p);
}

}  // namespace

void reduce_all(OpCtx& c, void* dst, const void* const* srcs, size_t count) {
  const bool avg = c.op == ReduceOp::kAvg;
  reduce(ReduceArgs{c.dtype, avg ? ReduceOp::kSum : c.op, dst, nullptr, srcs, c.nranks, count});
  if (avg) scale_avg(dst, c.dtype, count, c.avg_divisor());
}

bool oneshot_fits(const OneShotAreas& a, int nranks, size_t bytes) {
  return nranks > 1 && nranks <= kMaxOneShotRanks && bytes <= a.bytes;
}

void oneshot_all_reduce(OpCtx& c, const OneShotAreas& a, const void* in, void* out, size_t count) {
  const size_t bytes = count * c.esize();
  post_area(c, a, in, bytes);
  const void* srcs[kMaxOneShotRanks];
  srcs[c.rank] = a.area(c.tag.seq & 1, c.rank, bytes);
  for_peers(c, [&](int p) { srcs[p] = wait_area(c, a, p, bytes); });
  reduce_all(c, out, srcs, count);  // in rank order, whatever order the areas came in
}

void oneshot_reduce_scatter(OpCtx& c, const OneShotAreas& a, const void* in, void* out,
                            size_t count) {
  const size_t es = c.esize(), block = count * es;
  post_area(c, a, in, block * c.nranks);
  const void* srcs[kMaxOneShotRanks];
  const size_t posted = block * c.nranks;
  srcs[c.rank] = static_cast<const char*>(a.area(c.tag.seq & 1, c.rank, posted)) + c.rank * block;
  for_peers(c, [&](int p) {
    srcs[p] = static_cast<const char*>(wait_area(c, a, p, posted)) + c.rank * block;
  });
  reduce_all(c, out, srcs, count);
}

void oneshot_all_gather(OpCtx& c, const OneShotAreas& a, const void* in, void* out, size_t count) {
  const size_t block = count * c.esize();
  post_area(c, a, in, block);
  char* dst = static_cast<char*>(out);
  if (dst + c.rank * block != in) copy(dst + c.rank * block, nullptr, in, block);
  for_peers(c, [&](int p) { copy(dst + p * block, nullptr, wait_area(c, a, p, block), block); });
}

void oneshot_broadcast(OpCtx& c, const OneShotAreas& a, void* buf, size_t count, int root) {
  const size_t bytes = count * c.esize();
  if (c.rank == root)
    post_area(c, a, buf, bytes);
  else
    copy(buf, nullptr, wait_area(c, a, root, bytes), bytes);
}

}  // namespace pyc
