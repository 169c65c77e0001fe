// All-reduce in place on symmetric shared-memory windows: no slots, no copies
// in or out. Rank r owns part r of the buffer:
//   1. reduce part r of every rank's buffer (rank order) into its own buffer,
//      then raise `reduced`;
//   2. copy each peer's reduced part out of the peer's buffer (after its
//      `reduced`), then raise `gathered`;
//   3. wait for every peer's `gathered`: nobody reads this buffer any more, so
//      the caller may overwrite it.
// Per rank that is n/n reads + 1/n writes for the reduction and (n-1)/n reads
// and writes for the gather: for 2 ranks 1.5 S read + S written, against the
// ring's 2 S + 2 S through the slots. No part is written while another rank
// reads it: in step 1 every rank reads only its own part of each buffer, and
// a part of a peer's buffer is overwritten in step 2 only after its owner
// raised `reduced`, i.e. stopped reading it.
#include <algorithm>

#include "algo/algorithms.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {

void direct_all_reduce(OpCtx& c, const DirectView& v, size_t count) {
  const int n = c.nranks, r = c.rank;
  PYC_ASSERT(n <= kMaxDirectRanks);
  const size_t es = c.esize(), unit = 64 / es, units = (count + unit - 1) / unit;
  auto lo = [&](int p) { return std::min(count, units * p / n * unit); };
  const uint32_t seq = c.tag.seq;

  const size_t a = lo(r), len = lo(r + 1) - a;
  if (len > 0) {
    const void* srcs[kMaxDirectRanks];
    for (int p = 0; p < n; ++p) srcs[p] = v.data[p] + a * es;
    const bool avg = c.op == ReduceOp::kAvg;
    reduce(ReduceArgs{c.dtype, avg ? ReduceOp::kSum : c.op, v.data[r] + a * es, nullptr, srcs, n,
                      len});
    if (avg) scale_avg(v.data[r] + a * es, c.dtype, len, n);
  }
  publish(*v.reduced[r], seq);

  for (int s = 1; s < n; ++s) {
    const int p = (r + s) % n;
    const size_t pa = lo(p), plen = lo(p + 1) - pa;
    c.mon->peer = p;
    wait_reached(*v.reduced[p], seq, *c.mon);
    copy(v.data[r] + pa * es, nullptr, v.data[p] + pa * es, plen * es);
    c.bytes_recv += plen * es;
  }
  publish(*v.gathered[r], seq);
  for (int s = 1; s < n; ++s) {
    const int p = (r + s) % n;
    c.mon->peer = p;
    wait_reached(*v.gathered[p], seq, *c.mon);
  }
  c.bytes_sent += len * es;
}

}  // namespace pyc
