// Collectives over buffers that every rank can address (see ipc_algos.h).
#include "cuda/ipc_algos.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cuda/kernels.h"

namespace pyc {
namespace {

// Rank i's part [*b, *e) of count elements: equal parts whose bounds are
// multiples of 256 bytes, so that every part keeps the buffers' alignment;
// with one worker, rank 0's part is everything.
void part(const OpCtx& c, const IpcView& v, size_t count, int i, size_t* b, size_t* e) {
  if (v.one_worker) {
    *b = i == 0 ? 0 : count;
    *e = count;
    return;
  }
  const size_t grain = std::max<size_t>(1, 256 / c.esize());
  const size_t per = (count + c.nranks - 1) / c.nranks;
  const size_t step = (per + grain - 1) / grain * grain;
  *b = std::min(count, static_cast<size_t>(i) * step);
  *e = std::min(count, *b + step);
}

// The ranks whose share of a block-wise operation this rank does.
std::vector<int> shares(const OpCtx& c, const IpcView& v) {
  std::vector<int> w;
  if (!v.one_worker)
    w.push_back(c.rank);
  else if (c.rank == 0)
    for (int p = 0; p < c.nranks; ++p) w.push_back(p);
  return w;
}

// Copies `bytes` from src to every destination, two per kernel.
void fan_out(KernelExec& x, const char* src, size_t bytes, const std::vector<char*>& dsts) {
  for (size_t i = 0; i < dsts.size(); i += 2)
    x.copy(dsts[i], i + 1 < dsts.size() ? dsts[i + 1] : nullptr, src, bytes);
}

// dst = op(bufs[0][off..], ..., bufs[nranks-1][off..]) over `count` elements
// (and the same into dst1 unless null); AVG divides dst afterwards (then dst1
// must be null).
void reduce_into(OpCtx& c, const char* const* bufs, size_t off, size_t count, char* dst,
                 char* dst1) {
  const char* srcs[cuda::kMaxSrcs];
  PYC_ASSERT(c.nranks <= cuda::kMaxSrcs);
  for (int p = 0; p < c.nranks; ++p) srcs[p] = bufs[p] + off;
  const bool avg = c.op == ReduceOp::kAvg;
  PYC_ASSERT(!avg || dst1 == nullptr);
  ReduceArgs a{c.dtype,
               avg ? ReduceOp::kSum : c.op,
               dst,
               dst1,
               reinterpret_cast<const void* const*>(srcs),
               c.nranks,
               count};
  c.exec->reduce(a);
  if (avg) c.exec->scale_avg(dst, c.dtype, count, c.nranks);
}

}  // namespace

void ipc_all_reduce(OpCtx& c, const IpcView& v, size_t count) {
  const int r = c.rank, n = c.nranks;
  size_t b, e;
  part(c, v, count, r, &b, &e);
  if (b == e) return;
  const size_t off = b * c.esize(), bytes = (e - b) * c.esize();
  char* mine = v.out[r] + off;
  // The first peer is written by the reduction itself unless AVG must divide first.
  const bool avg = c.op == ReduceOp::kAvg;
  char* first = avg ? nullptr : v.out[(r + 1) % n] + off;
  reduce_into(c, v.out.data(), off, e - b, mine, first);
  std::vector<char*> rest;
  for (int k = avg ? 1 : 2; k < n; ++k) rest.push_back(v.out[(r + k) % n] + off);
  fan_out(*c.exec, mine, bytes, rest);
  c.bytes_recv += (n - 1) * bytes;
  c.bytes_sent += (n - 1) * bytes;
}

void ipc_reduce_scatter(OpCtx& c, const IpcView& v, size_t count) {
  const size_t bytes = count * c.esize();
  for (int w : shares(c, v)) {
    reduce_into(c, v.in.data(), w * bytes, count, v.out[w], nullptr);
    c.bytes_recv += (c.nranks - 1) * bytes;
  }
}

void ipc_all_gather(OpCtx& c, const IpcView& v, size_t count) {
  const size_t bytes = count * c.esize();
  for (int w : shares(c, v)) {
    std::vector<char*> dsts;
    for (int k = 0; k < c.nranks; ++k) dsts.push_back(v.out[(w + k) % c.nranks] + w * bytes);
    fan_out(*c.exec, v.in[w], bytes, dsts);
    c.bytes_sent += (c.nranks - 1) * bytes;
  }
}

void ipc_broadcast(OpCtx& c, const IpcView& v, size_t count, int root) {
  const size_t bytes = count * c.esize();
  for (int w : shares(c, v)) {
    if (w == root) continue;
    c.exec->copy(v.out[w], nullptr, v.out[root], bytes);
    c.bytes_recv += bytes;
  }
}

void ipc_reduce(OpCtx& c, const IpcView& v, size_t count, int root) {
  size_t b, e;
  part(c, v, count, c.rank, &b, &e);
  if (b == e) return;
  const size_t off = b * c.esize();
  reduce_into(c, v.out.data(), off, e - b, v.out[root] + off, nullptr);
  c.bytes_recv += (c.nranks - 1) * (e - b) * c.esize();
  if (c.rank != root) c.bytes_sent += (e - b) * c.esize();
}

void ipc_all_to_all(OpCtx& c, const IpcView& v, size_t count) {
  const size_t bytes = count * c.esize();
  for (int w : shares(c, v)) {
    for (int k = 0; k < c.nranks; ++k) {
      const int p = (w + k) % c.nranks;
      c.exec->copy(v.out[p] + w * bytes, nullptr, v.in[w] + p * bytes, bytes);
    }
    c.bytes_sent += (c.nranks - 1) * bytes;
  }
}

}  // namespace pyc
