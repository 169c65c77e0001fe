// Collectives on symmetric shared-memory windows: every rank reads and writes
// its peers' buffers in place, with no slots and no copies in or out.
//
// All-reduce. Rank r owns part r of the buffer:
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
//
// Reduce-scatter (inputs in the windows): rank r reduces block r of every
// rank's input into its output, raises `gathered` and waits for every peer's:
// per rank S read and S/n written, one synchronisation.
//
// All-gather (outputs in the windows): rank r writes its input into block r of
// every rank's output (one read of the input, chunk by chunk so that it stays
// in cache), raises `gathered` and waits for every peer's, which means every
// block of its own output has arrived.
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
    reduce_all(c, v.data[r] + a * es, srcs, len);
  }
  publish(*v.reduced[r], seq);

  for (int s = 1; s < n; ++s) {
    const int p = (r + s) % n;
    const size_t pa = lo(p), plen = lo(p + 1) - pa;
    c.mon->peer = p;
    wait_reached(*v.reduced[p], seq, *c.mon);
    copy(v.data[r] + pa * es, nullptr, v.data[p] + pa * es, plen * es, c.out_store);
    c.bytes_recv += plen * es;
  }
  c.bytes_sent += len * es;
  finish_gathered(c, v.gathered);
}

void finish_gathered(OpCtx& c, Counter* const* gathered) {
  publish(*gathered[c.rank], c.tag.seq);
  for (int s = 1; s < c.nranks; ++s) {
    const int p = (c.rank + s) % c.nranks;
    c.mon->peer = p;
    wait_reached(*gathered[p], c.tag.seq, *c.mon);
  }
}

void direct_reduce_scatter(OpCtx& c, const DirectView& v, void* out, size_t count) {
  const int n = c.nranks;
  PYC_ASSERT(n <= kMaxDirectRanks);
  const size_t es = c.esize(), off = static_cast<size_t>(c.rank) * count * es;
  if (count > 0) {
    const void* srcs[kMaxDirectRanks];
    for (int p = 0; p < n; ++p) srcs[p] = v.data[p] + off;
    reduce_all(c, out, srcs, count);
  }
  c.bytes_recv += (n - 1) * count * es;
  finish_gathered(c, v.gathered);
}

void direct_all_gather(OpCtx& c, const DirectView& v, const void* in, size_t count) {
  const int n = c.nranks, r = c.rank;
  PYC_ASSERT(n <= kMaxDirectRanks);
  const size_t bytes = count * c.esize(), off = static_cast<size_t>(r) * bytes;
  constexpr size_t kChunk = 256 << 10;  // the input's chunk stays in L2 across its n copies
  const char* src = static_cast<const char*>(in);
  for (size_t a = 0; a < bytes; a += kChunk) {
    const size_t len = std::min(kChunk, bytes - a);
    char* dst[kMaxDirectRanks];
    int nd = 0;
    for (int s = 0; s < n; ++s) {  // this rank's own output first, then the peers' in ring order
      char* d = v.data[(r + s) % n] + off + a;
      if (d != src + a) dst[nd++] = d;  // in place: the input already is this block
    }
    if (c.out_store == Store::kStreaming) {  // every output streamed; the chunk is read from L2
      for (int i = 0; i < nd; ++i) copy(dst[i], nullptr, src + a, len, Store::kStreaming);
    } else {
      for (int i = 0; i < nd; i += 2) copy(dst[i], i + 1 < nd ? dst[i + 1] : nullptr, src + a, len);
    }
  }
  c.bytes_sent += (n - 1) * bytes;
  finish_gathered(c, v.gathered);
}

}  // namespace pyc
