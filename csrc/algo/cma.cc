// Single-copy collectives on plain buffers: every rank reads its peers'
// buffers straight out of their processes with process_vm_readv (CMA), so a
// byte crosses once, where the slots take two copies (one in, one out).
//
// Reduce-scatter: rank r reads block r of every peer's input, a chunk at a
// time into scratch that stays in cache, and reduces those chunks and its own
// (in rank order, so every rank gets the same bits) into its output; then
// raises `gathered` and waits for every peer's, after which nobody reads its
// input any more.
//
// All-reduce = that reduce-scatter over part r of the buffer, in place, then
// `reduced`; then each peer's reduced part is read out of the peer's buffer
// (after its `reduced`), then `gathered` as above. A part of this rank's
// buffer is overwritten only after its owner raised `reduced`, i.e. stopped
// reading it.
//
// All-gather: rank r copies its input into block r of its output and reads
// every peer's input into the peer's block; then `gathered`.
#include "transport/cma.h"

#include <algorithm>

#include "algo/algorithms.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {
namespace {

// Reduces `count` elements of every rank's buffer, `off` bytes into it (this
// rank's at `own`), into `dst`.
void reduce_pulled(OpCtx& c, const CmaView& v, size_t off, const char* own, char* dst,
                   size_t count) {
  const int n = c.nranks, r = c.rank;
  const size_t es = c.esize(), step = v.chunk / es;
  const bool avg = c.op == ReduceOp::kAvg;
  for (size_t a = 0; a < count; a += step) {
    const size_t len = std::min(step, count - a), at = a * es;
    const void* srcs[kMaxDirectRanks];
    char* tmp = v.scratch;
    for (int p = 0; p < n; ++p) {
      if (p == r) {
        srcs[p] = own + at;
        continue;
      }
      cma_read(v.pid[p], p, tmp, v.addr[p] + off + at, len * es);
      srcs[p] = tmp;
      tmp += v.chunk;
    }
    reduce(ReduceArgs{c.dtype, avg ? ReduceOp::kSum : c.op, dst + at, nullptr, srcs, n, len});
    if (avg) scale_avg(dst + at, c.dtype, len, n);
  }
  c.bytes_recv += (n - 1) * count * es;
}

}  // namespace

void cma_all_reduce(OpCtx& c, const CmaView& v, void* buf, size_t count) {
  const int n = c.nranks, r = c.rank;
  PYC_ASSERT(n <= kMaxDirectRanks);
  const size_t es = c.esize(), unit = 64 / es, units = (count + unit - 1) / unit;
  auto lo = [&](int p) { return std::min(count, units * p / n * unit); };
  char* b = static_cast<char*>(buf);

  const size_t a = lo(r), len = lo(r + 1) - a;
  reduce_pulled(c, v, a * es, b + a * es, b + a * es, len);
  publish(*v.reduced[r], c.tag.seq);
  for (int s = 1; s < n; ++s) {
    const int p = (r + s) % n;
    const size_t pa = lo(p), plen = lo(p + 1) - pa;
    c.mon->peer = p;
    wait_reached(*v.reduced[p], c.tag.seq, *c.mon);
    cma_read(v.pid[p], p, b + pa * es, v.addr[p] + pa * es, plen * es);
    c.bytes_recv += plen * es;
  }
  finish_gathered(c, v.gathered);
}

void cma_reduce_scatter(OpCtx& c, const CmaView& v, const void* in, void* out, size_t count) {
  PYC_ASSERT(c.nranks <= kMaxDirectRanks);
  const size_t off = static_cast<size_t>(c.rank) * count * c.esize();
  reduce_pulled(c, v, off, static_cast<const char*>(in) + off, static_cast<char*>(out), count);
  finish_gathered(c, v.gathered);
}

void cma_all_gather(OpCtx& c, const CmaView& v, const void* in, void* out, size_t count) {
  const int n = c.nranks, r = c.rank;
  PYC_ASSERT(n <= kMaxDirectRanks);
  const size_t bytes = count * c.esize();
  char* o = static_cast<char*>(out);
  if (o + r * bytes != in) copy(o + r * bytes, nullptr, in, bytes);
  for (int s = 1; s < n; ++s) {
    const int p = (r + s) % n;
    cma_read(v.pid[p], p, o + p * bytes, v.addr[p], bytes);
    c.bytes_recv += bytes;
  }
  finish_gathered(c, v.gathered);
}

}  // namespace pyc
