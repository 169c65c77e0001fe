// Collective traffic by definition (see traffic.h).
#include "comm/traffic.h"

namespace pyc {

bool collective_traffic(const OpSig& sig, int rank, int n, Traffic* t) {
  const uint64_t es = dtype_size(sig.dtype), bytes = sig.count * es, others = n - 1;
  switch (sig.kind) {
    case OpKind::kAllReduce: {
      const uint64_t own = (sig.count * (rank + 1) / n - sig.count * rank / n) * es;
      t->sent = t->received = 2 * (bytes - own);
      return true;
    }
    case OpKind::kReduceScatter:  // count: elements per rank
    case OpKind::kAllGather:
    case OpKind::kAllToAll:
      t->sent = t->received = others * bytes;
      return true;
    case OpKind::kBroadcast:
      t->sent = rank == sig.root ? others * bytes : 0;
      t->received = rank == sig.root ? 0 : bytes;
      return true;
    case OpKind::kReduce:
      t->sent = rank == sig.root ? 0 : bytes;
      t->received = rank == sig.root ? others * bytes : 0;
      return true;
    default:
      return false;
  }
}

}  // namespace pyc
