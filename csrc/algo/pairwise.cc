// All-to-all as n-1 pairwise exchange steps (step s: send to rank+s, receive
// from rank-s, chunk by chunk).
#include <algorithm>

#include "algo/algorithms.h"
#include "algo/prims.h"
#include "reduce/reduce.h"

namespace pyc {

void pairwise_all_to_all(OpCtx& c, const void* in, void* out, size_t count) {
  const int n = c.nranks, r = c.rank;
  const size_t es = c.esize();
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  exec_copy(c, dst + r * count * es, nullptr, src + r * count * es, count * es);
  for (int s = 1; s < n; ++s) {
    const int to = c.mod(r + s), from = c.mod(r - s);
    Prims p(c, to, from);
    const size_t slot = p.chunk_elems();
    for (size_t off = 0; off < count; off += slot) {
      const size_t len = std::min(slot, count - off);
      p.send(src + (to * count + off) * es, len);
      p.recv(dst + (from * count + off) * es, len);
    }
  }
}

}  // namespace pyc
