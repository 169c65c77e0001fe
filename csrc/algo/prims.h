// Ring primitives, named by what they do (as NCCL's): each moves one chunk of
// at most chunk_elems() elements through one slot, touching each byte once.
// A Prims sends to one peer and receives from another.
#pragma once

#include "algo/context.h"

namespace pyc {

// dst0 (and dst1) = src on the operation's memory: the CPU kernel inline, or
// the operation's executor (CUDA) when it has one. For the algorithms' local
// copies into the caller's buffer, so that they serve every transport; dst0
// is written as c.out_store says.
void exec_copy(OpCtx& c, void* dst0, void* dst1, const void* src, size_t bytes);

// The fewest slots a connection may have: the ring schedules (ring.cc) post
// the next iteration's first send before their last receive, so with one
// slot every rank would wait for its successor to free it, and none would.
constexpr uint32_t kMinSlots = 2;

class Prims {
 public:
  Prims(OpCtx& ctx, int send_peer, int recv_peer);

  // Elements that fit one slot, a multiple of 64 bytes.
  size_t chunk_elems() const { return chunk_elems_; }

  void send(const void* src, size_t n);
  void copy_send(const void* src, void* dst, size_t n);  // dst = src; send src
  void recv(void* dst, size_t n);
  void recv_reduce_send(const void* src, size_t n);                  // send(in op src)
  void recv_reduce_copy(const void* src, void* dst, size_t n);       // dst = in op src
  void recv_reduce_copy_send(const void* src, void* dst, size_t n);  // dst = in op src; send dst
  void recv_copy_send(void* dst, size_t n);                          // dst = in; send in

 private:
  const void* wait_in(size_t bytes);
  void release_in();
  void* acquire_out();
  void post_out(size_t bytes);
  // dst0 (and dst1) = a op b, finished (divided for AVG) when `final`.
  void reduce2(void* dst0, void* dst1, const void* a, const void* b, size_t n, bool final);

  OpCtx& c_;
  SendConn* send_;
  RecvConn* recv_;
  int send_peer_, recv_peer_;
  size_t chunk_elems_;
};

}  // namespace pyc
