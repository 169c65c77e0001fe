// A batch of sends and receives that progress together (ncclGroupStart/End,
// torch's batch_isend_irecv): chunk k of every send goes out before chunk k of
// every receive is taken in, for k = 0, 1, ...
//
// Several messages between the same two ranks share one slot FIFO, so an
// iteration is split into steps: step g of iteration k sends chunk k of the
// g-th message (still active in iteration k) to each peer, then receives chunk
// k of the g-th message from each peer. At most one chunk per FIFO per step.
//
// Why this cannot deadlock when every send is matched by a receive of the same
// size on its peer (and the pairs' ops are listed in the same order, so both
// ends number a pair's messages alike): a rank blocked in step s waits either
// to send, which needs the receiver to have consumed a chunk of an earlier
// step (one chunk per FIFO per step, and the FIFO holds at least one), so the
// receiver is in an earlier step, or to receive a chunk from a sender that has
// not sent it yet; that sender, in a step <= s, is itself blocked in a send
// (sends come first in a step). Following the waits, steps never increase and
// strictly decrease at every send, so the chain cannot close into a cycle.
//
// A single-copy message (P2POp::cma on the send) is one chunk in iteration 0:
// the send posts a descriptor (its buffer's address and size) through the
// slots, the receive reads the bytes out of the sender's process and
// acknowledges them through the pair's counter (p2p.cc). The senders wait for
// those acknowledgements only after their last iteration, so nothing waits on
// a rank that is waiting for them and the argument above still holds. Only the
// sender knows which path a message takes (its tuner chose), so a receive that
// may come across is scheduled as chunks through the slots and looks at its
// first slot in iteration 0: a descriptor ends it there, as its sender's
// message ends; chunks keep it going chunk by chunk, as its sender's. Both
// ends thus list the same messages as active in every iteration.
#include <algorithm>
#include <vector>

#include "algo/algorithms.h"
#include "algo/prims.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {

void p2p_batch(OpCtx& c, const std::vector<P2POp>& ops) {
  // A send to this rank pairs with the next receive from this rank, in order.
  std::vector<const P2POp*> self_sends, self_recvs;
  for (const P2POp& op : ops) {
    if (op.peer != c.rank) continue;
    (op.send ? self_sends : self_recvs).push_back(&op);
  }
  PYC_ASSERT(self_sends.size() == self_recvs.size());  // checked at issue
  for (size_t i = 0; i < self_sends.size(); ++i)
    copy(self_recvs[i]->buf, nullptr, self_sends[i]->buf,
         self_sends[i]->count * dtype_size(self_sends[i]->dtype));

  // One context (tag, dtype, byte counters) and one Prims per remote op.
  std::vector<OpCtx> ctx;
  std::vector<const P2POp*> remote;
  for (const P2POp& op : ops)
    if (op.peer != c.rank) remote.push_back(&op);
  ctx.reserve(remote.size());
  std::vector<Prims> prims;
  prims.reserve(remote.size());
  std::vector<size_t> chunk(remote.size());
  size_t rounds = 0;
  for (size_t i = 0; i < remote.size(); ++i) {
    const P2POp& op = *remote[i];
    ctx.push_back(c);
    ctx.back().dtype = op.dtype;
    ctx.back().tag = op.tag;
    ctx.back().bytes_sent = ctx.back().bytes_recv = 0;
    prims.emplace_back(ctx.back(), op.send ? op.peer : -1, op.send ? -1 : op.peer);
    chunk[i] = op.cma && op.send ? std::max<size_t>(op.count, 1) : prims.back().chunk_elems();
    rounds = std::max(rounds, p2p_slots(op.count, chunk[i]));
  }
  // The ops active in an iteration, per peer and direction, in list order
  // (refilled every iteration, allocated once).
  std::vector<std::vector<size_t>> to(c.nranks), from(c.nranks);
  std::vector<char> came_across(remote.size(), 0);  // receives that ended in iteration 0
  for (size_t k = 0; k < rounds; ++k) {
    for (int p = 0; p < c.nranks; ++p) {
      to[p].clear();
      from[p].clear();
    }
    size_t steps = 0;
    for (size_t i = 0; i < remote.size(); ++i) {
      const P2POp& op = *remote[i];
      if (k >= p2p_slots(op.count, chunk[i]) || came_across[i]) continue;
      auto& list = op.send ? to[op.peer] : from[op.peer];
      list.push_back(i);
      steps = std::max(steps, list.size());
    }
    for (size_t g = 0; g < steps; ++g) {
      for (const auto* lists : {&to, &from}) {  // sends first
        for (const auto& list : *lists) {
          if (g >= list.size()) continue;
          const size_t i = list[g];
          const P2POp& op = *remote[i];
          if (op.cma && op.send) {
            c.path = Path::kCma;
            p2p_cma_post(ctx[i], op.buf, op.count * dtype_size(op.dtype), op.peer);
            continue;
          }
          if (op.cma && k == 0 &&
              p2p_recv_across(ctx[i], op.buf, op.count, op.peer, op.tag, op.across)) {
            c.path = Path::kCma;
            came_across[i] = 1;
            continue;
          }
          const size_t off = k * chunk[i];
          const size_t len = std::min(chunk[i], op.count - off);
          char* p = static_cast<char*>(op.buf) + off * dtype_size(op.dtype);
          if (op.send)
            prims[i].send(p, len);
          else
            prims[i].recv(p, len);
        }
      }
    }
  }
  // The single-copy sends' buffers stay untouched until their receivers have read them.
  for (const P2POp* op : remote) {
    if (!op->cma || !op->send || op->count == 0) continue;
    c.mon->peer = op->peer;
    wait_reached(*op->across.done, op->tag.seq, *c.mon);
  }
  for (const OpCtx& x : ctx) {
    c.bytes_sent += x.bytes_sent;
    c.bytes_recv += x.bytes_recv;
  }
}

}  // namespace pyc
