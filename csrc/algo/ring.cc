// Ring reduce-scatter, all-gather and all-reduce (NCCL's runRing schedule):
//   send; (n-2) x recvReduceSend; recvReduceCopySend; (n-2) x recvCopySend; recv.
// Every rank runs the same sequence of steps, so the j-th slot a rank posts is
// the j-th slot its successor receives.
#include <algorithm>

#include "algo/algorithms.h"
#include "algo/prims.h"
#include "reduce/reduce.h"

namespace pyc {
namespace {

const char* at(const void* p, size_t elems, size_t esize) {
  return static_cast<const char*>(p) + elems * esize;
}
char* at(void* p, size_t elems, size_t esize) { return static_cast<char*>(p) + elems * esize; }

}  // namespace

// Each iteration moves n chunks of at most one slot each. The post-only first
// send of iteration k+1 is issued before the receive-only last step of
// iteration k: swapping a post-only and a receive-only step keeps both FIFO
// orders, and it gives the next rank a chunk of slack instead of a lockstep.
void ring_all_reduce(OpCtx& c, const void* in, void* out, size_t count) {
  const int n = c.nranks, r = c.rank;
  const size_t es = c.esize();
  if (n == 1) {
    if (in != out) exec_copy(c, out, nullptr, in, count * es);
    return;
  }
  Prims p(c, c.mod(r + 1), c.mod(r - 1));
  const size_t slot = p.chunk_elems();
  const size_t align = std::max<size_t>(1, 64 / es);
  const size_t step = n * slot;
  struct Chunks {  // the n chunks of one iteration, each rounded to 64 bytes
    size_t off, rem, cs;
  };
  auto iteration = [&](size_t off) {
    const size_t rem = std::min(step, count - off);
    return Chunks{off, rem, std::min(slot, (rem + n - 1) / n + align - 1) / align * align};
  };
  auto begin = [&](const Chunks& it, long i) {
    return it.off + std::min(c.mod(i) * it.cs, it.rem);
  };
  auto len = [&](const Chunks& it, long i) {
    return std::min(it.cs, it.rem - std::min(c.mod(i) * it.cs, it.rem));
  };
  if (count == 0) return;
  Chunks it = iteration(0);
  p.send(at(in, begin(it, r - 1), es), len(it, r - 1));
  for (size_t off = 0; off < count; off += step) {
    it = iteration(off);
    for (int s = 1; s < n - 1; ++s)
      p.recv_reduce_send(at(in, begin(it, r - 1 - s), es), len(it, r - 1 - s));
    p.recv_reduce_copy_send(at(in, begin(it, r), es), at(out, begin(it, r), es), len(it, r));
    for (int s = 1; s < n - 1; ++s) p.recv_copy_send(at(out, begin(it, r - s), es), len(it, r - s));
    if (off + step < count) {
      Chunks next = iteration(off + step);
      p.send(at(in, begin(next, r - 1), es), len(next, r - 1));
    }
    p.recv(at(out, begin(it, r + 1), es), len(it, r + 1));
  }
}

void ring_reduce_scatter(OpCtx& c, const void* in, void* out, size_t count) {
  const int n = c.nranks, r = c.rank;
  const size_t es = c.esize();
  if (n == 1) {
    if (in != out) exec_copy(c, out, nullptr, in, count * es);
    return;
  }
  Prims p(c, c.mod(r + 1), c.mod(r - 1));
  const size_t slot = p.chunk_elems();
  auto block = [&](long i, size_t off) { return at(in, c.mod(i) * count + off, es); };
  if (count == 0) return;
  p.send(block(r - 1, 0), std::min(slot, count));
  for (size_t off = 0; off < count; off += slot) {
    const size_t len = std::min(slot, count - off);
    for (int s = 1; s < n - 1; ++s) p.recv_reduce_send(block(r - 1 - s, off), len);
    if (off + slot < count) p.send(block(r - 1, off + slot), std::min(slot, count - off - slot));
    p.recv_reduce_copy(block(r, off), at(out, off, es), len);
  }
}

void ring_all_gather(OpCtx& c, const void* in, void* out, size_t count) {
  const int n = c.nranks, r = c.rank;
  const size_t es = c.esize();
  if (n == 1) {
    if (in != out) exec_copy(c, out, nullptr, in, count * es);
    return;
  }
  Prims p(c, c.mod(r + 1), c.mod(r - 1));
  const size_t slot = p.chunk_elems();
  auto block = [&](long i, size_t off) { return at(out, c.mod(i) * count + off, es); };
  if (count == 0) return;
  p.copy_send(in, block(r, 0), std::min(slot, count));
  for (size_t off = 0; off < count; off += slot) {
    const size_t len = std::min(slot, count - off);
    for (int s = 1; s < n - 1; ++s) p.recv_copy_send(block(r - s, off), len);
    if (off + slot < count)
      p.copy_send(at(in, off + slot, es), block(r, off + slot), std::min(slot, count - off - slot));
    p.recv(block(r + 1, off), len);
  }
}

}  // namespace pyc
