// Pipelined chains for the rooted collectives: broadcast flows root -> root+1
// -> ... -> root-1; reduce flows root+1 -> ... -> root-1 -> root.
#include <algorithm>

#include "algo/algorithms.h"
#include "algo/prims.h"

namespace pyc {

void chain_broadcast(OpCtx& c, void* buf, size_t count, int root) {
  const int n = c.nranks, r = c.rank;
  if (n == 1) return;
  const int pos = c.mod(r - root);  // 0 = root, n-1 = last
  Prims p(c, pos == n - 1 ? -1 : c.mod(r + 1), pos == 0 ? -1 : c.mod(r - 1));
  const size_t slot = p.chunk_elems(), es = c.esize();
  for (size_t off = 0; off < count; off += slot) {
    const size_t len = std::min(slot, count - off);
    char* chunk = static_cast<char*>(buf) + off * es;
    if (pos == 0)
      p.send(chunk, len);
    else if (pos == n - 1)
      p.recv(chunk, len);
    else
      p.recv_copy_send(chunk, len);
  }
}

void chain_reduce(OpCtx& c, void* buf, size_t count, int root) {
  const int n = c.nranks, r = c.rank;
  if (n == 1) {
    return;  // AVG over one rank is the identity
  }
  const int pos = c.mod(r - root - 1);  // 0 = first (root+1), n-1 = root
  Prims p(c, pos == n - 1 ? -1 : c.mod(r + 1), pos == 0 ? -1 : c.mod(r - 1));
  const size_t slot = p.chunk_elems(), es = c.esize();
  for (size_t off = 0; off < count; off += slot) {
    const size_t len = std::min(slot, count - off);
    char* chunk = static_cast<char*>(buf) + off * es;
    if (pos == 0)
      p.send(chunk, len);
    else if (pos == n - 1)
      p.recv_reduce_copy(chunk, chunk, len);
    else
      p.recv_reduce_send(chunk, len);
  }
}

}  // namespace pyc
