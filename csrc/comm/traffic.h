// The bytes one rank moves to and from its peers in a collective, by what the
// collective is rather than by how it ran: the ring, the one-shot areas, the
// windows and single copy move the same data with different copies (which a
// rank's own copies count: OpStats::bytes_out / bytes_in), so this is what
// stays comparable across paths and strategies (ZeRO's ledger: 2P(N-1)/N).
#pragma once

#include <cstdint>

#include "core/types.h"

namespace pyc {

struct Traffic {
  uint64_t sent = 0, received = 0;
};

// The traffic of collective `sig` on `rank` of `n` (a bandwidth-optimal
// schedule's: each rank owns block r of an all-reduce, elements
// [count*r/n, count*(r+1)/n), and sends and receives everything but its
// block twice). False for operations whose messages are their traffic (send,
// recv, batch_p2p) and for those that move no data (barrier, split,
// alloc_shared).
bool collective_traffic(const OpSig& sig, int rank, int n, Traffic* t);

}  // namespace pyc
