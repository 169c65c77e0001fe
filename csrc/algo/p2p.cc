// Point-to-point send and receive, through the slots or in single copy.
//
// A single-copy message is one slot holding a descriptor (the send buffer's
// address and size), tagged like the message with kCmaMark added; the
// receiver reads the bytes straight out of the sender's process and raises
// the pair's acknowledgement counter to the message's sequence number, which
// the sender waits for before its buffer may change. Which of the two a
// message takes is the sender's choice (a batch by size and by its tuner, a
// single send always the slots), so a receive looks at the first slot and
// takes either: a batch on one side and single calls on the other pair up, as
// NCCL's grouped and single calls do.
#include <algorithm>
#include <cstring>

#include "algo/algorithms.h"
#include "algo/prims.h"
#include "core/error.h"
#include "transport/cma/cma.h"

namespace pyc {
namespace {

// Marks a single-copy descriptor in its slot tag: a bit of the signature's
// unused byte (core/types.cc), so the tag still names the message's call.
constexpr uint64_t kCmaMark = uint64_t{1} << 24;

struct CmaDesc {
  uint64_t addr;   // the send buffer, in the sender's process
  uint64_t bytes;  // its size
};

// Reads a descriptor's message (the slot `s`, still held) into `buf` and
// acknowledges it.
void take_across(OpCtx& c, RecvConn& in, const RecvSlot& s, void* buf, size_t bytes, int peer,
                 const P2PCma& cma) {
  CmaDesc d;
  PYC_ASSERT(s.bytes == sizeof(d));
  std::memcpy(&d, s.data, sizeof(d));
  PYC_ASSERT(d.bytes == bytes);  // the tag carries the count and dtype
  in.release();
  cma_read(cma.pid, peer, buf, d.addr, bytes, *c.mon);
  // A sender that aborted meanwhile may have let its buffer go: what was read
  // is not its message.
  c.mon->check_fast();
  c.bytes_recv += bytes;
  publish(*cma.done, s.tag.seq);
}

}  // namespace

void p2p_cma_post(OpCtx& c, const void* buf, size_t bytes, int peer) {
  SendConn& out = c.links->send_to(peer);
  auto* d = static_cast<CmaDesc*>(out.acquire(*c.mon));
  d->addr = reinterpret_cast<uintptr_t>(buf);
  d->bytes = bytes;
  SlotTag tag = c.tag;
  tag.w0 |= kCmaMark;
  out.post(tag, sizeof(CmaDesc));
  c.bytes_sent += bytes;
}

void p2p_send(OpCtx& c, const void* buf, size_t count, int peer) {
  Prims p(c, peer, -1);
  const size_t slot = p.chunk_elems(), es = c.esize();
  size_t off = 0;
  do {  // an empty message takes one empty slot (p2p_slots)
    p.send(static_cast<const char*>(buf) + off * es, std::min(slot, count - off));
    off += slot;
  } while (off < count);
}

bool p2p_recv_across(OpCtx& c, void* buf, size_t count, int peer, const SlotTag& expect,
                     const P2PCma& cma) {
  RecvConn& in = c.links->recv_from(peer);
  c.mon->peer = peer;
  const RecvSlot s = in.wait(*c.mon);  // held: the slots' receive takes it again if it is data
  SlotTag plain = s.tag;
  plain.w0 &= ~kCmaMark;
  if (!(plain == expect)) c.links->tag_mismatch(peer, s.tag, expect);
  if (!(s.tag.w0 & kCmaMark)) return false;
  c.path = Path::kCma;
  take_across(c, in, s, buf, count * c.esize(), peer, cma);
  return true;
}

int p2p_probe_any(OpCtx& c, const uint32_t* next_seq, int first) {
  int found = -1;
  auto starts_message = [&](int p) {
    RecvConn& in = c.links->recv_from(p);
    if (!in.ready()) return false;
    const RecvSlot s = in.wait(*c.mon);  // returns at once; stays held for p2p_recv
    const OpSig sig = OpSig::unpack(s.tag.w0 & ~kCmaMark, s.tag.w1);
    return sig.kind == OpKind::kSend && sig.root == c.rank && s.tag.seq == next_seq[p];
  };
  c.mon->peer = -1;  // several: a timeout names none
  wait_until(
      [&] {
        for (int k = 0; k < c.nranks; ++k) {
          const int p = c.mod(first + k);
          if (p != c.rank && starts_message(p)) {
            found = p;
            return true;
          }
        }
        return false;
      },
      *c.mon);
  return found;
}

void p2p_recv(OpCtx& c, void* buf, size_t count, int peer, const SlotTag& expect,
              const P2PCma* cma) {
  if (cma != nullptr && p2p_recv_across(c, buf, count, peer, expect, *cma)) return;
  SlotTag own = c.tag;
  c.tag = expect;  // the receiver checks the sender's tag
  Prims p(c, -1, peer);
  const size_t slot = p.chunk_elems(), es = c.esize();
  size_t off = 0;
  do {
    p.recv(static_cast<char*>(buf) + off * es, std::min(slot, count - off));
    off += slot;
  } while (off < count);
  c.tag = own;
}

}  // namespace pyc
