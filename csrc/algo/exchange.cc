// Exchange all-reduce, for small messages between a few ranks (a rail across
// hosts): every rank sends its buffer to every other and reduces all of them
// in rank order, one message deep instead of the ring's 2(n-1) steps, as
// the one-shot path does through shared memory (oneshot.cc). Every rank
// folds the same inputs in the same order: the same bits everywhere.
#include <algorithm>

#include "algo/algorithms.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {

void exchange_all_reduce(OpCtx& c, void* buf, size_t count) {
  const int n = c.nranks, r = c.rank;
  if (n == 1) return;
  PYC_ASSERT(n <= kMaxExchangeRanks);
  const size_t es = c.esize();
  auto* data = static_cast<char*>(buf);
  const size_t chunk = c.links->send_to(c.mod(r + 1)).slot_bytes() / 64 * 64 / es;
  const void* srcs[kMaxExchangeRanks];
  size_t off = 0;
  do {  // at least once: an empty buffer still exchanges its tags
    const size_t len = std::min(chunk, count - off), bytes = len * es;
    char* mine = data + off * es;
    for (int k = 1; k < n; ++k) {
      SendConn& out = c.links->send_to(c.mod(r + k));
      copy(out.acquire(*c.mon), nullptr, mine, bytes);
      out.post(c.tag, bytes);
      c.bytes_sent += bytes;
    }
    for (int k = 0; k < n; ++k) {
      if (k == r) {
        srcs[k] = mine;
        continue;
      }
      const RecvSlot s = c.links->recv_from(k).wait(*c.mon);
      if (!(s.tag == c.tag)) c.links->tag_mismatch(k, s.tag, c.tag);
      PYC_ASSERT(s.bytes == bytes);  // equal tags, equal counts
      srcs[k] = s.data;
      c.bytes_recv += bytes;
    }
    reduce_all(c, mine, srcs, len);  // mine is srcs[r]: the kernels allow it
    for (int k = 0; k < n; ++k)
      if (k != r) c.links->recv_from(k).release();
    off += chunk;
  } while (off < count);
}

}  // namespace pyc
