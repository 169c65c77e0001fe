// Ring reduce-scatter and all-gather over blocks laid out by a BlockMap: a
// rank's block is a list of segments anywhere in the buffer, of any length
// (the schedules of ring.cc, where block b is the b-th run of `count`
// elements). The hierarchical collectives (algo/hierarchical.cc) use them for a
// host's part of a world-sized buffer (its ranks' blocks of every host), or
// for shards of uneven length.
//
// Every rank walks the same positions (segment s, element offset off) in the
// same order, with chunks of the same length (an empty one where a block's
// segment is shorter), so the j-th slot a rank posts is the j-th its
// successor receives, as in ring.cc.
#include <algorithm>

#include "algo/algorithms.h"
#include "algo/prims.h"

namespace pyc {
namespace {

struct Pos {
  int seg;
  size_t off;
};

// The positions of the map, in order; false once past the last.
bool next_pos(const BlockMap& m, size_t chunk, Pos* p) {
  p->off += chunk;
  while (p->seg < m.nsegs && p->off >= m.seg_max(p->seg)) {
    ++p->seg;
    p->off = 0;
  }
  return p->seg < m.nsegs;
}

// Chunk q of block b (the ring's blocks are numbered modulo the ranks): its
// length (0 past the end of the block's segment) and its first element.
struct Chunks {
  const OpCtx& c;
  const BlockMap& m;
  size_t chunk;
  size_t seg_len(long b, const Pos& q) const { return m.len[c.mod(b) * m.nsegs + q.seg]; }
  size_t len(long b, const Pos& q) const {
    const size_t l = seg_len(b, q);
    return q.off >= l ? size_t{0} : std::min(chunk, l - q.off);
  }
  size_t first(long b, const Pos& q) const {
    return m.off[c.mod(b) * m.nsegs + q.seg] + std::min(q.off, seg_len(b, q));
  }
};

bool first_pos(const BlockMap& m, Pos* p) {
  p->seg = 0;
  p->off = 0;
  while (p->seg < m.nsegs && m.seg_max(p->seg) == 0) ++p->seg;
  return p->seg < m.nsegs;
}

}  // namespace

size_t BlockMap::seg_max(int s) const {
  size_t most = 0;
  for (size_t b = static_cast<size_t>(s); b < len.size(); b += static_cast<size_t>(nsegs))
    most = std::max(most, len[b]);
  return most;
}

void ring_reduce_scatter_map(OpCtx& c, const void* in, void* out, const BlockMap& m,
                             const size_t* out_off) {
  const int n = c.nranks, r = c.rank;
  const size_t es = c.esize();
  auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  if (n == 1) {
    for (int s = 0; s < m.nsegs; ++s)
      if (m.len[s] && src + m.off[s] * es != dst + out_off[s] * es)
        exec_copy(c, dst + out_off[s] * es, nullptr, src + m.off[s] * es, m.len[s] * es);
    return;
  }
  Prims p(c, c.mod(r + 1), c.mod(r - 1));
  const size_t chunk = p.chunk_elems();
  const Chunks ch{c, m, chunk};
  auto len = [&](long b, const Pos& q) { return ch.len(b, q); };
  auto at = [&](long b, const Pos& q) { return src + ch.first(b, q) * es; };
  Pos q;
  if (!first_pos(m, &q)) return;
  p.send(at(r - 1, q), len(r - 1, q));
  for (;;) {
    for (int s = 1; s < n - 1; ++s) p.recv_reduce_send(at(r - 1 - s, q), len(r - 1 - s, q));
    const Pos cur = q;
    const bool more = next_pos(m, chunk, &q);
    if (more) p.send(at(r - 1, q), len(r - 1, q));
    const size_t l = len(r, cur);
    const size_t o = out_off[cur.seg] + std::min(cur.off, m.len[r * m.nsegs + cur.seg]);
    p.recv_reduce_copy(at(r, cur), dst + o * es, l);
    if (!more) return;
  }
}

void ring_all_gather_map(OpCtx& c, void* buf, const BlockMap& m) {
  const int n = c.nranks, r = c.rank;
  if (n == 1) return;
  const size_t es = c.esize();
  auto* base = static_cast<char*>(buf);
  Prims p(c, c.mod(r + 1), c.mod(r - 1));
  const size_t chunk = p.chunk_elems();
  const Chunks ch{c, m, chunk};
  auto len = [&](long b, const Pos& q) { return ch.len(b, q); };
  auto at = [&](long b, const Pos& q) { return base + ch.first(b, q) * es; };
  Pos q;
  if (!first_pos(m, &q)) return;
  p.send(at(r, q), len(r, q));
  for (;;) {
    for (int s = 1; s < n - 1; ++s) p.recv_copy_send(at(r - s, q), len(r - s, q));
    const Pos cur = q;
    const bool more = next_pos(m, chunk, &q);
    if (more) p.send(at(r, q), len(r, q));
    p.recv(at(r + 1, cur), len(r + 1, cur));
    if (!more) return;
  }
}

}  // namespace pyc
