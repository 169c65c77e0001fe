// Single-copy collectives on plain buffers: ranks read and write each other's
// buffers inside their processes with process_vm_readv / process_vm_writev
// (CMA), so a byte crosses in one kernel copy where the slots take two.
//
// The work is shared out in chunks of v.chunk bytes rather than fixed per
// rank. An operation's chunks fall into nranks parts, and part p is claimed
// through rank p's counter (claim below). A rank first claims the chunks of
// its own part, then whatever the others have left unclaimed, in ring order
// (broadcast and all-to-all: only where it is one end of the copy, below).
// A descheduled rank's buffers can be read and written without it running, so
// when ranks outnumber cores (or one rank is slow to get there) the ranks that
// run do the work of those that do not. Whoever claims a chunk does all of it:
//
// - All-reduce (part p: the p-th n-th of the buffer): read the chunk of every
//   peer into scratch, reduce those and this rank's (in rank order) into this
//   rank's buffer, then write the result into every peer's buffer. Every
//   element is reduced once, so every rank holds the same bits.
// - Reduce-scatter (part p: block p, i.e. rank p's output): read block p's
//   chunk of every peer's input, reduce with this rank's into rank p's output
//   (through scratch and a write when p is a peer).
// - All-gather (part p: rank p's input): the chunk goes into block p of every
//   rank's output; a rank other than p reads it out of rank p first.
// - Reduce (part p: the p-th n-th of the buffer): as all-reduce, but the
//   result goes into the root's buffer only.
// - Broadcast (part p: rank p's buffer; the root has none) and all-to-all
//   (part p: rank p's output, block by block) copy each chunk from where it is
//   to where it goes (relay). Only the two ends of a copy claim it, so that it
//   takes one: a third rank would read into scratch and write from there.
//
// Only the claimer touches a chunk's bytes, in every rank's buffers, so in
// place operations need no more ordering than that. A rank that finds nothing
// left to claim raises `gathered` and waits for every peer's: after that all
// chunks are done and nobody reads or writes its buffers any more.
//
// If a rank aborts instead (an error, a timeout, Ctrl-C), its caller may free
// its buffers once the error is raised: so every rank looks at the abort word
// before each chunk it copies, and says while it may still copy (v.busy);
// the aborting rank waits for its peers' flags to drop (Communicator::
// wait_peers_copied).
#include "transport/cma/cma.h"

#include <algorithm>
#include <atomic>

#include "algo/algorithms.h"
#include "core/error.h"
#include "reduce/reduce.h"

namespace pyc {
namespace {

// The next unclaimed chunk of operation `seq` in the part counted by `next`,
// or `total` once all are taken. Every rank started `seq` before anyone claims
// (the caller waited for that), so nobody still claims an earlier operation's
// chunks: the first claim of `seq` finds an older sequence number in the word
// and starts the count afresh.
uint32_t claim(std::atomic<uint64_t>& next, uint32_t seq, uint32_t total) {
  uint64_t v = next.load(std::memory_order_relaxed);
  for (;;) {
    const uint32_t i = static_cast<uint32_t>(v >> 32) == seq ? static_cast<uint32_t>(v) : 0;
    if (i >= total) return total;
    if (next.compare_exchange_weak(v, uint64_t{seq} << 32 | (i + 1), std::memory_order_relaxed))
      return i;
  }
}

// While it lives, this rank may copy into its peers' buffers for operation
// c.tag.seq (v.busy).
class Busy {
 public:
  Busy(const OpCtx& c, const CmaView& v) : busy_(v.busy), seq_(c.tag.seq) {
    // seq_cst, as the aborting rank's abort word: either it sees this flag,
    // or this rank's next look at the abort word sees its abort.
    busy_->store(uint64_t{seq_} << 1 | 1, std::memory_order_seq_cst);
  }
  ~Busy() { busy_->store(uint64_t{seq_} << 1, std::memory_order_release); }
  Busy(const Busy&) = delete;
  Busy& operator=(const Busy&) = delete;

 private:
  std::atomic<uint64_t>* busy_;
  uint32_t seq_;
};

// Runs work(p, i) for every chunk i < chunks(p) of every part p that this rank
// claims (its own part first), then waits until every rank has run out.
template <class Chunks, class Work>
void share(OpCtx& c, const CmaView& v, Chunks chunks, Work work) {
  {
    Busy busy(c, v);
    for (int s = 0; s < c.nranks; ++s) {
      const int p = (c.rank + s) % c.nranks;
      const auto total = static_cast<uint32_t>(chunks(p));
      for (uint32_t i; (i = claim(*v.next[p], c.tag.seq, total)) < total;) {
        c.mon->check_fast();  // an aborted peer's buffers are no longer its caller's
        work(p, i);
        if (p != c.rank) ++c.taken_over;
      }
    }
  }
  finish_gathered(c, v.gathered);
}

// Reduces `count` elements (at most one chunk), `off` bytes into every rank's
// addr buffer (this rank's at `own`), in rank order into `dst`.
void reduce_pulled(OpCtx& c, const CmaView& v, size_t off, const char* own, char* dst,
                   size_t count) {
  const int n = c.nranks, r = c.rank;
  const size_t bytes = count * c.esize();
  const void* srcs[kMaxDirectRanks];
  char* tmp = v.scratch;
  for (int p = 0; p < n; ++p) {
    if (p == r) {
      srcs[p] = own;
      continue;
    }
    cma_read(v.pid[p], p, tmp, v.addr[p] + off, bytes, *c.mon);
    srcs[p] = tmp;
    tmp += v.chunk;
  }
  reduce_all(c, dst, srcs, count);
  c.bytes_recv += (n - 1) * bytes;
}

// Writes `bytes` at `src` into rank p's process at address `dst`.
void write_out_at(OpCtx& c, const CmaView& v, int p, uint64_t dst, const char* src, size_t bytes) {
  cma_write(v.pid[p], p, dst, src, bytes, *c.mon);
  c.bytes_sent += bytes;
}

// Writes `bytes` at `src` into rank p's output at out[p] + off.
void write_out(OpCtx& c, const CmaView& v, int p, size_t off, const char* src, size_t bytes) {
  write_out_at(c, v, p, v.out[p] + off, src, bytes);
}

// Writes `bytes` at `src` into every peer's output at out[p] + off, except
// rank `skip`'s.
void push(OpCtx& c, const CmaView& v, const char* src, size_t off, size_t bytes, int skip) {
  for (int s = 1; s < c.nranks; ++s) {
    const int p = (c.rank + s) % c.nranks;
    if (p != skip) write_out(c, v, p, off, src, bytes);
  }
}

// Copies `bytes` at address `src` in rank `from`'s process to address `dst` in
// rank `to`'s (either may be this rank).
void relay(OpCtx& c, const CmaView& v, int from, uint64_t src, int to, uint64_t dst, size_t bytes) {
  auto here = [](uint64_t a) { return reinterpret_cast<char*>(static_cast<uintptr_t>(a)); };
  const int r = c.rank;
  if (from == r && to == r) {
    copy(here(dst), nullptr, here(src), bytes, c.out_store);
    return;
  }
  char* via = to == r ? here(dst) : from == r ? here(src) : v.scratch;
  if (from != r) {
    cma_read(v.pid[from], from, via, src, bytes, *c.mon);
    c.bytes_recv += bytes;
  }
  if (to != r) write_out_at(c, v, to, dst, via, bytes);
}

// All-reduce (root < 0) and reduce: part p is the p-th n-th of the buffer's
// chunks; the claimer reduces a chunk of every rank's buffer and writes the
// result into every rank's (all-reduce) or the root's only.
void reduce_chunks(OpCtx& c, const CmaView& v, void* buf, size_t count, int root) {
  const int n = c.nranks, r = c.rank;
  PYC_ASSERT(n <= kMaxDirectRanks);
  const size_t es = c.esize(), step = v.chunk / es, chunks = (count + step - 1) / step;
  char* b = static_cast<char*>(buf);
  char* result = v.scratch + (n - 1) * v.chunk;  // the root's chunk, before it is written there
  auto first = [&](int p) { return chunks * p / n; };  // part p: chunks [first(p), first(p + 1))
  share(
      c, v, [&](int p) { return first(p + 1) - first(p); },
      [&](int p, size_t i) {
        const size_t k = first(p) + i, at = k * step * es, len = std::min(step, count - k * step);
        char* dst = root < 0 || r == root ? b + at : result;
        reduce_pulled(c, v, at, b + at, dst, len);
        if (root < 0)
          push(c, v, dst, at, len * es, -1);
        else if (r != root)
          write_out(c, v, root, at, dst, len * es);
      });
}

}  // namespace

void cma_all_reduce(OpCtx& c, const CmaView& v, void* buf, size_t count) {
  reduce_chunks(c, v, buf, count, -1);
}

void cma_reduce(OpCtx& c, const CmaView& v, void* buf, size_t count, int root) {
  reduce_chunks(c, v, buf, count, root);
}

void cma_broadcast(OpCtx& c, const CmaView& v, size_t count, int root) {
  const int n = c.nranks, r = c.rank;
  PYC_ASSERT(n <= kMaxDirectRanks);
  const size_t es = c.esize();
  // About two chunks per rank (of 16 KiB to v.chunk), so that every rank
  // copies, the root too.
  const size_t want = ((n - 1) * count * es / (2 * n) + 4095) / 4096 * 4096;
  const size_t step = std::min(v.chunk, std::max<size_t>(16 << 10, want)) / es;
  const size_t chunks = (count + step - 1) / step;
  // Part p (rank p's buffer) is claimed by its two ends only, the root writing
  // and rank p reading: a third rank would copy a chunk twice.
  share(
      c, v, [&](int p) { return p != root && (r == root || r == p) ? chunks : 0; },
      [&](int p, size_t i) {
        const size_t at = i * step * es, len = std::min(step, count - i * step) * es;
        relay(c, v, root, v.addr[root] + at, p, v.addr[p] + at, len);
      });
}

void cma_all_to_all(OpCtx& c, const CmaView& v, size_t count) {
  const int n = c.nranks, r = c.rank;
  PYC_ASSERT(n <= kMaxDirectRanks);
  const size_t es = c.esize(), bytes = count * es, step = v.chunk / es;
  const auto chunks = static_cast<uint32_t>((count + step - 1) / step);
  auto at = [&](uint32_t i) { return i * step * es; };
  auto len = [&](uint32_t i) { return std::min(step, count - i * step) * es; };
  relay(c, v, r, v.addr[r] + r * bytes, r, v.out[r] + r * bytes, bytes);
  // Pair (q -> p) carries block p of rank q's input into block q of rank p's
  // output. Only its two ends claim its chunks, each in one copy (the receiver
  // reads, the sender writes); a third rank would need two. Step s pairs this
  // rank with the ranks s away on either side, as receiver and as sender.
  {
    Busy busy(c, v);
    for (int s = 1; s < n; ++s) {
      const int q = (r + s) % n, p = (r + n - s) % n;
      for (uint32_t i; (i = claim(*v.from[q], c.tag.seq, chunks)) < chunks;) {
        c.mon->check_fast();
        relay(c, v, q, v.addr[q] + r * bytes + at(i), r, v.out[r] + q * bytes + at(i), len(i));
      }
      for (uint32_t i; (i = claim(*v.to[p], c.tag.seq, chunks)) < chunks; ++c.taken_over) {
        c.mon->check_fast();
        relay(c, v, r, v.addr[r] + p * bytes + at(i), p, v.out[p] + r * bytes + at(i), len(i));
      }
    }
  }
  finish_gathered(c, v.gathered);
}

void cma_reduce_scatter(OpCtx& c, const CmaView& v, const void* in, void* out, size_t count) {
  const int n = c.nranks, r = c.rank;
  PYC_ASSERT(n <= kMaxDirectRanks);
  const size_t es = c.esize(), step = v.chunk / es, chunks = (count + step - 1) / step;
  const char* src = static_cast<const char*>(in);
  char* result = v.scratch + (n - 1) * v.chunk;  // a peer's chunk, before it is written there
  share(
      c, v, [&](int) { return chunks; },
      [&](int p, size_t i) {
        const size_t at = i * step * es, len = std::min(step, count - i * step);
        const size_t off = p * count * es + at;
        char* dst = p == r ? static_cast<char*>(out) + at : result;
        reduce_pulled(c, v, off, src + off, dst, len);
        if (p != r) write_out(c, v, p, at, dst, len * es);
      });
}

void cma_all_gather(OpCtx& c, const CmaView& v, const void* in, void* out, size_t count) {
  const int n = c.nranks, r = c.rank;
  PYC_ASSERT(n <= kMaxDirectRanks);
  const size_t es = c.esize(), bytes = count * es, step = v.chunk / es;
  const size_t chunks = (count + step - 1) / step;
  char* o = static_cast<char*>(out);
  // Rank p's block p of its output already holds the input when it gathers in place.
  auto in_place = [&](int p) { return v.out[p] + p * bytes == v.addr[p]; };
  share(
      c, v, [&](int) { return chunks; },
      [&](int p, size_t i) {
        const size_t at = i * step * es, len = std::min(step, count - i * step) * es;
        char* blk = o + p * bytes + at;
        if (p == r) {
          const char* src = static_cast<const char*>(in) + at;
          if (blk != src) copy(blk, nullptr, src, len, c.out_store);
          push(c, v, src, p * bytes + at, len, -1);
        } else {
          cma_read(v.pid[p], p, blk, v.addr[p] + at, len, *c.mon);
          c.bytes_recv += len;
          push(c, v, blk, p * bytes + at, len, in_place(p) ? p : -1);
        }
      });
}

}  // namespace pyc
