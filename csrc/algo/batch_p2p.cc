// A batch of sends and receives that progress together (ncclGroupStart/End,
// torch's batch_isend_irecv): chunk k of every send goes out before chunk k of
// every receive is taken in, for k = 0, 1, ...
//
// Why this cannot deadlock when every send is matched by a receive of the same
// size on its peer (and the pairs' ops are listed in the same order): a rank
// blocked in iteration k waits either to send chunk k, which needs the
// receiver to have consumed chunk k - nslots (so the receiver is in an
// iteration < k), or to receive chunk k from a sender that has not sent it
// yet; that sender, in iteration <= k, is itself blocked in a send (sends come
// first in an iteration). Following the waits, iterations never increase and
// strictly decrease at every send, so the chain cannot close into a cycle.
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
    chunk[i] = prims.back().chunk_elems();
    rounds = std::max(rounds, (op.count + chunk[i] - 1) / chunk[i]);
  }
  for (size_t k = 0; k < rounds; ++k) {
    for (int sends = 1; sends >= 0; --sends) {
      for (size_t i = 0; i < remote.size(); ++i) {
        const P2POp& op = *remote[i];
        const size_t off = k * chunk[i];
        if (op.send != static_cast<bool>(sends) || off >= op.count) continue;
        const size_t len = std::min(chunk[i], op.count - off);
        char* p = static_cast<char*>(op.buf) + off * dtype_size(op.dtype);
        if (op.send)
          prims[i].send(p, len);
        else
          prims[i].recv(p, len);
      }
    }
  }
  for (const OpCtx& x : ctx) {
    c.bytes_sent += x.bytes_sent;
    c.bytes_recv += x.bytes_recv;
  }
}

}  // namespace pyc
