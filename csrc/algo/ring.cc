// Ring reduce-scatter, all-gather and all-reduce (NCCL's runRing schedule):
//   send; (n-2) x recvReduceSend; recvReduceCopySend; (n-2) x recvCopySend; recv.
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

void ring_all_reduce(OpCtx& c, const void* in, void* out, size_t count) {
  const int n = c.nranks, r = c.rank;
  const size_t es = c.esize();
  if (n == 1) {
    if (in != out) copy(out, nullptr, in, count * es);
    return;
  }
  Prims p(c, c.mod(r + 1), c.mod(r - 1));
  const size_t slot = p.chunk_elems();
  const size_t align = std::max<size_t>(1, 64 / es);
  for (size_t off = 0; off < count; off += n * slot) {
    const size_t rem = std::min(n * slot, count - off);
    const size_t cs = std::min(slot, (rem + n - 1) / n + align - 1) / align * align;
    auto begin = [&](long i) { return off + std::min(c.mod(i) * cs, rem); };
    auto len = [&](long i) { return std::min(cs, rem - std::min(c.mod(i) * cs, rem)); };

    p.send(at(in, begin(r - 1), es), len(r - 1));
    for (int s = 1; s < n - 1; ++s)
      p.recv_reduce_send(at(in, begin(r - 1 - s), es), len(r - 1 - s));
    p.recv_reduce_copy_send(at(in, begin(r), es), at(out, begin(r), es), len(r));
    for (int s = 1; s < n - 1; ++s) p.recv_copy_send(at(out, begin(r - s), es), len(r - s));
    p.recv(at(out, begin(r + 1), es), len(r + 1));
  }
}

void ring_reduce_scatter(OpCtx& c, const void* in, void* out, size_t count) {
  const int n = c.nranks, r = c.rank;
  const size_t es = c.esize();
  if (n == 1) {
    if (in != out) copy(out, nullptr, in, count * es);
    return;
  }
  Prims p(c, c.mod(r + 1), c.mod(r - 1));
  const size_t slot = p.chunk_elems();
  for (size_t off = 0; off < count; off += slot) {
    const size_t len = std::min(slot, count - off);
    auto block = [&](long i) { return at(in, c.mod(i) * count + off, es); };
    p.send(block(r - 1), len);
    for (int s = 1; s < n - 1; ++s) p.recv_reduce_send(block(r - 1 - s), len);
    p.recv_reduce_copy(block(r), at(out, off, es), len);
  }
}

void ring_all_gather(OpCtx& c, const void* in, void* out, size_t count) {
  const int n = c.nranks, r = c.rank;
  const size_t es = c.esize();
  if (n == 1) {
    if (in != out) copy(out, nullptr, in, count * es);
    return;
  }
  Prims p(c, c.mod(r + 1), c.mod(r - 1));
  const size_t slot = p.chunk_elems();
  for (size_t off = 0; off < count; off += slot) {
    const size_t len = std::min(slot, count - off);
    auto block = [&](long i) { return at(out, c.mod(i) * count + off, es); };
    p.copy_send(at(in, off, es), block(r), len);
    for (int s = 1; s < n - 1; ++s) p.recv_copy_send(block(r - s), len);
    p.recv(block(r + 1), len);
  }
}

}  // namespace pyc
