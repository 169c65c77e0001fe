// A batch of sends and receives that progress together (ncclGroupStart/End,
// torch's batch_isend_irecv, MPI's Isend/Irecv + Waitall): each moves as far as
// its connection lets it, none waits for another.
//
// Messages between two ranks share one slot FIFO per direction, so each FIFO
// carries its messages one after the other, in list order: the k-th message
// from a to b is the k-th on both sides however either side groups its calls
// into batches (one batch against single calls, or against several batches,
// matches as the messages are numbered). Every FIFO progresses on its own: a
// send posts its next chunk whenever a slot is free, a receive takes its next
// chunk whenever one has arrived; the batch polls all of them and waits (spin,
// yield, nap: wait_until) only when none can move.
//
// Why any matched pattern completes: a batch that cannot move waits for a peer
// to free a slot or to send a chunk. A peer in the same batch pattern polls
// its own FIFOs the same way, so the messages it still owes progress as long
// as any of its FIFOs can; a peer whose counterpart message lies in a later
// operation (a batch of its own after this one) reaches it once its current
// operation completes, which needs nothing from the blocked rank that the
// blocked rank is not still offering (its posted sends are in the FIFOs, its
// receives take whatever arrives). Only operations issued one by one, each a
// blocking send before its receive on both sides, can wait for each other:
// that is what a batch is for.
//
// A single-copy message (P2POp::cma on the send) is one slot: the send posts
// a descriptor (its buffer's address and size), the receive reads the bytes
// out of the sender's process and acknowledges them through the pair's counter
// (p2p.cc). Only the sender knows which path a message takes (its tuner
// chose), so a receive that may come across looks at its first slot: a
// descriptor ends it there, chunks keep it going. The senders wait for the
// acknowledgements only after every FIFO is done, so nothing waits on a rank
// that is waiting for them.
#include <algorithm>
#include <vector>

#include "algo/algorithms.h"
#include "algo/prims.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {
namespace {

// One remote message of a batch and how far it has got.
struct Msg {
  const P2POp* op;
  size_t chunk = 0;  // elements per slot (a single-copy send: all of them)
  size_t slots = 0;  // slots it takes
  size_t next = 0;   // slots posted or taken so far
};

// The messages of one FIFO (a peer and a direction), in list order, and the
// first one not yet done.
struct Fifo {
  std::vector<size_t> msgs;
  size_t head = 0;
  bool done() const { return head == msgs.size(); }
};

}  // namespace

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

  // One context (tag, dtype, byte counters) and one Prims per remote message.
  std::vector<Msg> msgs;
  for (const P2POp& op : ops)
    if (op.peer != c.rank) msgs.push_back(Msg{&op});
  std::vector<OpCtx> ctx(msgs.size(), c);
  std::vector<Prims> prims;
  prims.reserve(msgs.size());
  std::vector<Fifo> to(c.nranks), from(c.nranks);
  for (size_t i = 0; i < msgs.size(); ++i) {
    Msg& m = msgs[i];
    const P2POp& op = *m.op;
    ctx[i].dtype = op.dtype;
    ctx[i].tag = op.tag;
    ctx[i].bytes_sent = ctx[i].bytes_recv = 0;
    prims.emplace_back(ctx[i], op.send ? op.peer : -1, op.send ? -1 : op.peer);
    m.chunk = op.cma && op.send ? std::max<size_t>(op.count, 1) : prims.back().chunk_elems();
    m.slots = p2p_slots(op.count, m.chunk);
    (op.send ? to[op.peer] : from[op.peer]).msgs.push_back(i);
  }

  // Moves message i as far as its connection lets it; true if it moved.
  auto advance = [&](size_t i) {
    Msg& m = msgs[i];
    const P2POp& op = *m.op;
    const int peer = op.peer;
    bool moved = false;
    if (op.send) {
      SendConn& out = c.links->send_to(peer);
      while (m.next < m.slots && out.ready()) {
        if (op.cma) {
          c.path = Path::kCma;
          p2p_cma_post(ctx[i], op.buf, op.count * dtype_size(op.dtype), peer);
        } else {
          const size_t off = m.next * m.chunk;
          prims[i].send(static_cast<const char*>(op.buf) + off * dtype_size(op.dtype),
                        std::min(m.chunk, op.count - off));
        }
        ++m.next;
        moved = true;
      }
      return moved;
    }
    RecvConn& in = c.links->recv_from(peer);
    while (m.next < m.slots && in.ready()) {
      if (m.next == 0 && op.cma &&
          p2p_recv_across(ctx[i], op.buf, op.count, peer, op.tag, op.across)) {
        c.path = Path::kCma;
        m.next = m.slots;
        return true;
      }
      const size_t off = m.next * m.chunk;
      prims[i].recv(static_cast<char*>(op.buf) + off * dtype_size(op.dtype),
                    std::min(m.chunk, op.count - off));
      ++m.next;
      moved = true;
    }
    return moved;
  };
  // Whether the head message of FIFO f could move now.
  auto movable = [&](const Fifo& f) {
    const P2POp& op = *msgs[f.msgs[f.head]].op;
    return op.send ? c.links->send_to(op.peer).ready() : c.links->recv_from(op.peer).ready();
  };

  for (;;) {
    bool moved = false, left = false;
    int waiting_for = -1;               // the only peer still owed something, or -1 (several)
    for (auto* fifos : {&to, &from}) {  // sends first: their slots feed the peers
      for (int p = 0; p < c.nranks; ++p) {
        Fifo& f = (*fifos)[p];
        while (!f.done()) {
          const size_t i = f.msgs[f.head];
          moved |= advance(i);
          if (msgs[i].next < msgs[i].slots) break;
          ++f.head;
        }
        if (f.done()) continue;
        waiting_for = left && waiting_for != p ? -1 : p;
        left = true;
      }
    }
    if (!left) break;
    if (moved) continue;
    c.mon->peer = waiting_for;
    wait_until(
        [&] {
          for (const auto* fifos : {&to, &from})
            for (const Fifo& f : *fifos)
              if (!f.done() && movable(f)) return true;
          return false;
        },
        *c.mon);
  }
  // The single-copy sends' buffers stay untouched until their receivers have read them.
  for (const Msg& m : msgs) {
    const P2POp& op = *m.op;
    if (!op.cma || !op.send || op.count == 0) continue;
    c.mon->peer = op.peer;
    wait_reached(*op.across.done, op.tag.seq, *c.mon);
  }
  for (const OpCtx& x : ctx) {
    c.bytes_sent += x.bytes_sent;
    c.bytes_recv += x.bytes_recv;
  }
}

}  // namespace pyc
