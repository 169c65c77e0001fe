// The collective algorithms. Each is a schedule of steps over Links (ring,
// chain, pairwise) or over the shared-memory one-shot areas; none knows how
// bytes move. Counts are in elements of ctx.dtype.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "algo/context.h"

namespace pyc {

// Ring all-reduce = ring reduce-scatter + ring all-gather, chunked through the
// slots. `in` and `out` may be the same buffer.
void ring_all_reduce(OpCtx& c, const void* in, void* out, size_t count);
// in: nranks blocks of `count`; out: `count` (may be in's own block).
void ring_reduce_scatter(OpCtx& c, const void* in, void* out, size_t count);
// in: `count` (may be out's own block); out: nranks blocks of `count`.
void ring_all_gather(OpCtx& c, const void* in, void* out, size_t count);
// Blocks anywhere in a buffer, for the ring schedules below: block b (one
// per rank of the ring, in ring order) is nsegs segments, segment s starting
// at element off[b * nsegs + s] with len[b * nsegs + s] elements.
struct BlockMap {
  int nsegs = 1;
  std::vector<size_t> off, len;
  size_t seg_max(int s) const;  // the longest segment s of any block
};
// Ring reduce-scatter (ring_map.cc): segment s of this rank's block, reduced
// over every rank, lands at out + out_off[s] (elements; it may be where the
// segment is in `in`).
void ring_reduce_scatter_map(OpCtx& c, const void* in, void* out, const BlockMap& m,
                             const size_t* out_off);
// Ring all-gather in place: this rank's block is in buf; after it every block is.
void ring_all_gather_map(OpCtx& c, void* buf, const BlockMap& m);
// Every rank sends its buffer to every other and reduces all in rank order
// (exchange.cc): small messages between a few ranks.
constexpr int kMaxExchangeRanks = 64;
void exchange_all_reduce(OpCtx& c, void* buf, size_t count);
// Pipelined chain from root through root+1, ..., root-1.
void chain_broadcast(OpCtx& c, void* buf, size_t count, int root);
// Pipelined chain from root+1 through ..., root-1 into root.
void chain_reduce(OpCtx& c, void* buf, size_t count, int root);
// n-1 pairwise exchange steps; in and out hold nranks blocks of `count`.
void pairwise_all_to_all(OpCtx& c, const void* in, void* out, size_t count);
// Single copy between two ranks: the peer's process and the pair's
// acknowledgement counter (the receiver raises it to a message's sequence
// number once it has read the bytes; shm_layout.h FifoCtl::cma_done).
struct P2PCma {
  int pid = 0;
  Counter* done = nullptr;
};
// How many slots a point-to-point message of `count` elements takes in
// chunks of `chunk`: at least one, so that an empty message still matches a
// receive (which checks its count) and a receive from any source sees it.
inline size_t p2p_slots(size_t count, size_t chunk) {
  return count == 0 ? 1 : (count + chunk - 1) / chunk;
}
// A send through the slots.
void p2p_send(OpCtx& c, const void* buf, size_t count, int peer);
// A receive of whichever the sender chose, the slots' chunks or a single-copy
// descriptor (a batch's; read across with `cma`, required where CMA is on).
void p2p_recv(OpCtx& c, void* buf, size_t count, int peer, const SlotTag& expect,
              const P2PCma* cma = nullptr);
// The first step of such a receive: waits for the message's first slot; a
// descriptor is read across and acknowledged (true), a chunk stays in its slot
// for the slots' receive (false). Raises on a tag that is not `expect`.
bool p2p_recv_across(OpCtx& c, void* buf, size_t count, int peer, const SlotTag& expect,
                     const P2PCma& cma);
// The source of a receive from any peer: waits until a peer's next slot to
// this rank is the start of a point-to-point message, the one numbered
// next_seq[p] from peer p, and returns that peer (the slot stays where it is,
// for p2p_recv). Peers are looked at from `first` on, round robin, so one
// busy sender cannot starve the others. A peer whose next slot belongs to
// another operation (a collective it has started) is passed over.
int p2p_probe_any(OpCtx& c, const uint32_t* next_seq, int first);
// Posts a single-copy descriptor of `bytes` at `buf` to `peer` (c.tag, marked);
// the caller waits for the acknowledgement before the buffer may change.
void p2p_cma_post(OpCtx& c, const void* buf, size_t bytes, int peer);

// Collectives on symmetric windows (see direct.cc): data[p] is the
// operation's window buffer of rank p, mapped here; reduced/gathered are rank
// p's progress counters. Every rank passes the same offset and count.
constexpr int kMaxDirectRanks = 64;
struct DirectView {
  char* data[kMaxDirectRanks];
  Counter* reduced[kMaxDirectRanks];
  Counter* gathered[kMaxDirectRanks];
};
void direct_all_reduce(OpCtx& c, const DirectView& v, size_t count);
// data[p]: rank p's input (nranks blocks of `count`); `out` may be this rank's block.
void direct_reduce_scatter(OpCtx& c, const DirectView& v, void* out, size_t count);
// data[p]: rank p's output (nranks blocks of `count`); `in` may be this rank's block.
void direct_all_gather(OpCtx& c, const DirectView& v, const void* in, size_t count);

// dst = c.op over srcs[0..c.nranks) in rank order (the same bits on every rank
// that folds the same sources), AVG as a sum divided once; count elements.
// Shared by the one-shot, direct and single-copy paths (defined in oneshot.cc).
void reduce_all(OpCtx& c, void* dst, const void* const* srcs, size_t count);

// Raises this rank's `gathered[rank]` for operation c.tag.seq and waits for
// every peer's: after it, no peer reads or writes this rank's buffers.
void finish_gathered(OpCtx& c, Counter* const* gathered);

// Single-copy collectives on plain buffers (see cma.cc): ranks read and write
// each other's buffers with process_vm_readv/writev (transport/cma/cma.h), sharing
// the work out in chunks. addr[p] and out[p] are rank p's input and output in
// its own process (all-reduce: both the buffer); next[p] counts the claimed
// chunks of part p. scratch: nranks * chunk bytes of this rank's.
struct CmaView {
  int pid[kMaxDirectRanks];
  uint64_t addr[kMaxDirectRanks];
  uint64_t out[kMaxDirectRanks];
  std::atomic<uint64_t>* next[kMaxDirectRanks];
  // All-to-all: the claim counters of the pairs (p -> this rank) and (this rank -> p).
  std::atomic<uint64_t>* from[kMaxDirectRanks];
  std::atomic<uint64_t>* to[kMaxDirectRanks];
  Counter* gathered[kMaxDirectRanks];
  char* scratch;
  size_t chunk;
  // This rank's RankCtl::cma_busy: seq << 1 | 1 while it may copy into its
  // peers' buffers (an aborting peer waits for it to drop).
  std::atomic<uint64_t>* busy;
};
void cma_all_reduce(OpCtx& c, const CmaView& v, void* buf, size_t count);
// in (this rank's, = addr[rank]): nranks blocks of `count`; out may be in's own block.
void cma_reduce_scatter(OpCtx& c, const CmaView& v, const void* in, void* out, size_t count);
// out: nranks blocks of `count`; in (= addr[rank]) may be out's own block.
void cma_all_gather(OpCtx& c, const CmaView& v, const void* in, void* out, size_t count);
// buf (= addr[rank]): the result lands in the root's only.
void cma_reduce(OpCtx& c, const CmaView& v, void* buf, size_t count, int root);
// addr[p]: rank p's buffer.
void cma_broadcast(OpCtx& c, const CmaView& v, size_t count, int root);
// addr[p] and out[p]: rank p's input and output, nranks blocks of `count` each
// (they do not overlap).
void cma_all_to_all(OpCtx& c, const CmaView& v, size_t count);

// One send or receive of a batch. `tag`: what a send's slots carry, or what a
// receive expects from its sender.
struct P2POp {
  bool send = true;
  void* buf = nullptr;  // read-only for a send
  size_t count = 0;
  DataType dtype = DataType::kFloat32;
  int peer = 0;  // may be this rank: sends to self pair with receives from self in order
  SlotTag tag;
  // Single copy: the send posts only the buffer's address through its slots;
  // the receive reads the bytes straight out of the sender's process
  // (transport/cma/cma.h) and raises the pair's counter to the message's sequence
  // number, which the send waits for before its buffer may change. On a send:
  // it goes across (the sender's choice: by size, then its tuner; a single
  // send, p2p_send, always takes the slots). On a receive: it may come across
  // (by size), and takes whichever the sender chose.
  bool cma = false;
  P2PCma across;  // the pair's process and counter, set where CMA is on
};
// Runs every op of the batch concurrently, each as far as its connection lets
// it (see batch_p2p.cc).
void p2p_batch(OpCtx& c, const std::vector<P2POp>& ops);

// One-shot collectives over per-rank shared areas (small messages): each
// writer copies its data once and raises a flag; readers read the areas
// directly. Reductions fold all ranks in rank order, so every rank gets the
// same bits. The caller waits until every peer has started operation seq-1.
struct OneShotAreas {
  void* payload[2][64];  // [parity][rank]: at most kMaxOneShotRanks ranks
  void* small[2][64];    // the same area's payload of at most small_bytes, in the flag's line
  Flag* flag[2][64];     // the sequence-number flag of each area
  uint64_t* sig[2][64];  // two words after the flag: the writer's OpSig
  size_t bytes = 0;      // payload capacity
  size_t small_bytes = 0;
  // Where a payload of `n` bytes goes in rank r's area of parity `par`.
  void* area(int par, int r, size_t n) const {
    return n <= small_bytes ? small[par][r] : payload[par][r];
  }
};
constexpr int kMaxOneShotRanks = 64;
// Whether `bytes` per rank fit the areas (and one-shot applies at all).
bool oneshot_fits(const OneShotAreas& a, int nranks, size_t bytes);
void oneshot_all_reduce(OpCtx& c, const OneShotAreas& a, const void* in, void* out, size_t count);
// in: nranks blocks of `count` (all of it is posted); out: `count`.
void oneshot_reduce_scatter(OpCtx& c, const OneShotAreas& a, const void* in, void* out,
                            size_t count);
void oneshot_all_gather(OpCtx& c, const OneShotAreas& a, const void* in, void* out, size_t count);
void oneshot_broadcast(OpCtx& c, const OneShotAreas& a, void* buf, size_t count, int root);

}  // namespace pyc
