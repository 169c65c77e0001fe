// Ring primitives over any SendConn / RecvConn (see prims.h).
#include "algo/prims.h"

#include <algorithm>

#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {
namespace {

// The kernels run inline on host memory unless the operation has an executor
// (CUDA); one predictable branch per chunk.
inline void do_reduce(OpCtx& c, const ReduceArgs& a) {
  if (c.exec)
    c.exec->reduce(a);
  else
    reduce(a);
}
inline void do_scale_avg(OpCtx& c, void* x, size_t n) {
  if (c.exec)
    c.exec->scale_avg(x, c.dtype, n, c.avg_divisor());
  else
    scale_avg(x, c.dtype, n, c.avg_divisor());
}
// dst0_store applies on the CPU only (a device copy goes to device memory).
inline void do_copy(OpCtx& c, void* dst0, void* dst1, const void* src, size_t bytes,
                    Store dst0_store = Store::kCached) {
  if (c.exec)
    c.exec->copy(dst0, dst1, src, bytes);
  else
    copy(dst0, dst1, src, bytes, dst0_store);
}

}  // namespace

void exec_copy(OpCtx& c, void* dst0, void* dst1, const void* src, size_t bytes) {
  do_copy(c, dst0, dst1, src, bytes, c.out_store);
}

Prims::Prims(OpCtx& ctx, int send_peer, int recv_peer)
    : c_(ctx),
      send_(send_peer >= 0 ? &ctx.links->send_to(send_peer) : nullptr),
      recv_(recv_peer >= 0 ? &ctx.links->recv_from(recv_peer) : nullptr),
      send_peer_(send_peer),
      recv_peer_(recv_peer) {
  size_t slot = send_ ? send_->slot_bytes() : recv_ ? recv_->slot_bytes() : 1 << 20;
  if (send_ && recv_) slot = std::min(send_->slot_bytes(), recv_->slot_bytes());
  chunk_elems_ = (slot / 64 * 64) / ctx.esize();
}

const void* Prims::wait_in(size_t bytes) {
  RecvSlot s = recv_->wait(*c_.mon);
  if (!(s.tag == c_.tag)) c_.links->tag_mismatch(recv_peer_, s.tag, c_.tag);
  PYC_ASSERT(s.bytes == bytes);  // equal tags imply equal counts, hence equal chunking
  c_.bytes_recv += bytes;
  return s.data;
}

void Prims::release_in() { recv_->release(); }

void* Prims::acquire_out() { return send_->acquire(*c_.mon); }

void Prims::post_out(size_t bytes) {
  send_->post(c_.tag, bytes);
  c_.bytes_sent += bytes;
}

void Prims::reduce2(void* dst0, void* dst1, const void* a, const void* b, size_t n, bool final) {
  const void* srcs[2] = {a, b};
  const bool avg = final && c_.op == ReduceOp::kAvg;
  ReduceArgs args{c_.dtype, c_.op == ReduceOp::kAvg ? ReduceOp::kSum : c_.op,
                  dst0,     avg ? nullptr : dst1,
                  srcs,     2,
                  n};
  do_reduce(c_, args);
  if (avg) {
    do_scale_avg(c_, dst0, n);
    if (dst1) do_copy(c_, dst1, nullptr, dst0, n * c_.esize());
  }
}

void Prims::send(const void* src, size_t n) {
  const size_t b = n * c_.esize();
  void* out = acquire_out();
  do_copy(c_, out, nullptr, src, b);
  post_out(b);
}

void Prims::copy_send(const void* src, void* dst, size_t n) {
  const size_t b = n * c_.esize();
  void* out = acquire_out();
  if (src == dst)
    do_copy(c_, out, nullptr, src, b);
  else
    do_copy(c_, dst, out, src, b, c_.out_store);
  post_out(b);
}

void Prims::recv(void* dst, size_t n) {
  const size_t b = n * c_.esize();
  const void* in = wait_in(b);
  do_copy(c_, dst, nullptr, in, b, c_.out_store);
  release_in();
}

void Prims::recv_reduce_send(const void* src, size_t n) {
  const size_t b = n * c_.esize();
  const void* in = wait_in(b);
  void* out = acquire_out();
  reduce2(out, nullptr, in, src, n, false);
  release_in();
  post_out(b);
}

void Prims::recv_reduce_copy(const void* src, void* dst, size_t n) {
  const void* in = wait_in(n * c_.esize());
  reduce2(dst, nullptr, in, src, n, true);
  release_in();
}

void Prims::recv_reduce_copy_send(const void* src, void* dst, size_t n) {
  const size_t b = n * c_.esize();
  const void* in = wait_in(b);
  void* out = acquire_out();
  reduce2(dst, out, in, src, n, true);
  release_in();
  post_out(b);
}

void Prims::recv_copy_send(void* dst, size_t n) {
  const size_t b = n * c_.esize();
  const void* in = wait_in(b);
  void* out = acquire_out();
  do_copy(c_, dst, out, in, b, c_.out_store);
  release_in();
  post_out(b);
}

}  // namespace pyc
