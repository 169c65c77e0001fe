// The collectives of ranks on several hosts (hierarchical.cc): schedules over
// the links of every rank (c.links, by global rank; shared memory within a
// host, TCP between hosts) and the hosts' Topology, built from the one-host
// schedules of algorithms.h run over some of the ranks (a host's, a rail).
#pragma once

#include <cstddef>
#include <cstdint>

#include "algo/algorithms.h"
#include "core/topology.h"

namespace pyc {

// What the schedules need of their communicator besides its links: this
// host's one-shot areas, a scratch buffer, and the check that every rank of
// every host runs the same operation.
class HierHost {
 public:
  virtual ~HierHost() = default;
  // Whether an operation of `bytes` per rank over this host's ranks (`local`:
  // a context over them) takes the one-shot areas; if so, first waits until
  // every peer of this host has started operation seq-1.
  virtual bool oneshot(OpCtx& local, size_t bytes) = 0;
  // This host's one-shot areas.
  virtual const OneShotAreas& oneshot_areas() const = 0;
  // Records that this host's peers (or just `only`) were seen in operation `seq`.
  virtual void saw_flags(uint32_t seq, int only) = 0;
  // A scratch buffer of at least `bytes`, 64-byte aligned (kept by the host).
  virtual char* scratch(size_t bytes) = 0;
  // Every rank of this host announced operation c.tag.seq alike, and every
  // cross-host peer sent the same tag: the ranks of every host alike, for
  // operations that move no data across (barrier, empty ones, the roots'
  // check of broadcast and reduce).
  virtual void confirm_hosts(OpCtx& c) = 0;
};

// Where a hierarchical schedule runs.
struct Hier {
  const Topology& topo;
  HierHost& host;
  // PYCOLL_ALGO=ring: one ring (or chain) over every rank, host by host (Path::kFlat).
  bool flat = false;
  // Up to this many bytes per rank, the small-message schedules (PYCOLL_ONESHOT_BYTES).
  size_t oneshot_bytes = 0;
};

// c: the operation's context over every rank (c.rank, c.nranks and c.links global).
// Counts are in elements of c.dtype, as in algorithms.h; c.path says the path taken.
void hier_all_reduce(OpCtx& c, const Hier& h, void* buf, size_t count);
// in: nranks blocks of `count`; out: `count`.
void hier_reduce_scatter(OpCtx& c, const Hier& h, void* out, const void* in, size_t count);
// in: `count` (may be out's own block); out: nranks blocks of `count`.
void hier_all_gather(OpCtx& c, const Hier& h, void* out, const void* in, size_t count);
void hier_broadcast(OpCtx& c, const Hier& h, void* buf, size_t count, int root);
// The result lands in the root's buf only.
void hier_reduce(OpCtx& c, const Hier& h, void* buf, size_t count, int root);

}  // namespace pyc
