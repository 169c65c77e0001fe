// All-reduce between two ranks (a rail of two hosts), pipelined `depth`
// chunks deep. Rank r owns half r of the buffer: it sends the other half to
// its peer in chunks of a slot, sums each chunk of its own half as the peer's
// arrives and sends the sum back; the peer copies it. One stream per
// direction carries, in this order,
//   raw 0 .. raw depth-1, then sum k, raw k+depth for k = 0, 1, ...
// and each rank reads its peer's stream in that order. The ring all-reduce
// (ring.cc) on two ranks sends raw chunk k+2 only once the sum of chunk k
// came back, and the ring reduce-scatter one chunk ahead of its receive: over
// TCP, where a frame leaves the kernel only when its receiver waits for it,
// a link then carries a chunk or two at a time, each waiting a round trip.
// Here a rank's raw chunks run `depth` ahead of what it has received, and the
// sums follow as each chunk arrives, both directions busy throughout.
//
// No deadlock with `depth` <= slots / 2, even with no kernel buffering: a
// rank has posted at most 2 depth frames more than it has read of its peer's
// stream, so both ranks waiting for a free slot at once would need each to
// have nslots frames unread by the other, more than the 4 depth - 2 the
// schedule ever leaves outstanding in both directions together.
//
// The same bits on both ranks: each chunk is summed once, by its owner, in
// rank order, and copied by the other.
#include <algorithm>

#include "algo/algorithms.h"
#include "algo/prims.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {

void pair_all_reduce(OpCtx& c, void* buf, size_t count, int depth) {
  PYC_ASSERT(c.nranks == 2 && depth >= 1);
  const int r = c.rank, peer = 1 - r;
  const size_t es = c.esize();
  auto* data = static_cast<char*>(buf);
  SendConn& out = c.links->send_to(peer);
  RecvConn& in = c.links->recv_from(peer);
  const size_t chunk = std::max<size_t>(1, out.slot_bytes() / 64 * 64 / es);
  // Half 0 is [0, h), half 1 [h, count): h a multiple of 64 bytes.
  const size_t align = std::max<size_t>(1, 64 / es);
  const size_t h = std::min(count, ((count + 1) / 2 + align - 1) / align * align);
  const size_t start[2] = {0, h}, len[2] = {h, count - h};
  const size_t nchunks = std::max<size_t>(1, (h + chunk - 1) / chunk);  // half 0 is the longer
  auto off = [&](int half, size_t k) { return start[half] + std::min(k * chunk, len[half]); };
  auto n = [&](int half, size_t k) {
    return std::min(chunk, len[half] - std::min(k * chunk, len[half]));
  };
  auto post = [&](const void* src, size_t elems) {
    copy(out.acquire(*c.mon), nullptr, src, elems * es);
    out.post(c.tag, elems * es);
    c.bytes_sent += elems * es;
  };
  auto next = [&](size_t elems) {
    const RecvSlot s = in.wait(*c.mon);
    if (!(s.tag == c.tag)) c.links->tag_mismatch(peer, s.tag, c.tag);
    PYC_ASSERT(s.bytes == elems * es);  // equal tags, equal counts
    c.bytes_recv += s.bytes;
    return s.data;
  };
  // The peer's sum of chunk k of its half: into this rank's buffer.
  auto take_sum = [&](size_t k) {
    const size_t m = n(peer, k);
    const void* sum = next(m);
    copy(data + off(peer, k) * es, nullptr, sum, m * es, c.out_store);
    in.release();
  };
  const size_t d = static_cast<size_t>(depth);
  for (size_t k = 0; k < std::min(d, nchunks); ++k) post(data + off(peer, k) * es, n(peer, k));
  for (size_t k = 0; k < nchunks; ++k) {
    if (k >= d) take_sum(k - d);
    const size_t m = n(r, k);
    char* mine = data + off(r, k) * es;
    const void* theirs = next(m);
    const void* srcs[2];
    srcs[r] = mine;
    srcs[peer] = theirs;
    void* slot = out.acquire(*c.mon);
    const bool avg = c.op == ReduceOp::kAvg;
    reduce(
        ReduceArgs{c.dtype, avg ? ReduceOp::kSum : c.op, mine, avg ? nullptr : slot, srcs, 2, m});
    if (avg) {
      scale_avg(mine, c.dtype, m, c.avg_divisor());
      copy(slot, nullptr, mine, m * es);
    }
    in.release();
    out.post(c.tag, m * es);
    c.bytes_sent += m * es;
    if (k + d < nchunks) post(data + off(peer, k + d) * es, n(peer, k + d));
  }
  for (size_t k = nchunks - std::min(d, nchunks); k < nchunks; ++k) take_sum(k);
}

}  // namespace pyc
