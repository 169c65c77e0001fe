// Communicator: the collectives, each a body that picks its path (one-shot,
// direct, single copy or the slots) once every rank has announced it.
#include <cstdint>
#include <memory>

#include "algo/algorithms.h"
#include "comm/communicator.h"

namespace pyc {

std::shared_ptr<Work> Communicator::all_reduce(void* buf, size_t count, DataType dt, ReduceOp op,
                                               bool async, double timeout_s) {
  OpSig sig{OpKind::kAllReduce, dt, op, -1, count};
  prefetch_oneshot(count * dtype_size(dt));
  uint64_t where = 0;
  std::shared_ptr<ShmWindow> win = find_window(buf, count * dtype_size(dt), &where);
  return collective(
      sig, timeout_s, async,
      [this, buf, count, win, where](OpCtx& c) {
        if (multi_host()) return hier_all_reduce(c, hier(), buf, count);
        const size_t bytes = count * c.esize();
        // One-shot first: its one handshake beats the direct path's two as long as
        // the whole buffer fits the one-shot areas.
        if (oneshot(c, bytes)) {
          c.path = Path::kOneShot;
          oneshot_all_reduce(c, oneshot_, buf, buf, count);
          saw_flags(c.tag.seq);
        } else if (direct(c, win.get(), bytes, where)) {
          c.path = Path::kDirect;
          direct_all_reduce(c, direct_view(*win, where), count);
        } else if (cma(c)) {
          c.path = Path::kCma;
          cma_all_reduce(c, cma_view(c.tag.seq), buf, count);
        } else {
          ring_all_reduce(c, buf, buf, count);
        }
      },
      where, buf, buf);
}

std::shared_ptr<Work> Communicator::reduce_scatter(void* out, const void* in, size_t count,
                                                   DataType dt, ReduceOp op, bool async,
                                                   double timeout_s) {
  OpSig sig{OpKind::kReduceScatter, dt, op, -1, count};
  uint64_t where = 0;  // the input's window placement: peers read it in place
  std::shared_ptr<ShmWindow> win = find_window(in, count * dtype_size(dt) * n_, &where);
  return collective(
      sig, timeout_s, async,
      [this, out, in, count, win, where](OpCtx& c) {
        if (multi_host()) return hier_reduce_scatter(c, hier(), out, in, count);
        const size_t bytes = count * c.esize();
        if (direct(c, win.get(), bytes, where)) {
          c.path = Path::kDirect;
          direct_reduce_scatter(c, direct_view(*win, where), out, count);
        } else if (oneshot(c, bytes * n_)) {
          c.path = Path::kOneShot;
          oneshot_reduce_scatter(c, oneshot_, in, out, count);
          saw_flags(c.tag.seq);
        } else if (cma(c)) {
          c.path = Path::kCma;
          cma_reduce_scatter(c, cma_view(c.tag.seq), in, out, count);
        } else {
          ring_reduce_scatter(c, in, out, count);
        }
      },
      where, in, out);
}

std::shared_ptr<Work> Communicator::all_gather(void* out, const void* in, size_t count, DataType dt,
                                               bool async, double timeout_s) {
  OpSig sig{OpKind::kAllGather, dt, ReduceOp::kSum, -1, count};
  uint64_t where = 0;  // the output's window placement: peers write their blocks into it
  std::shared_ptr<ShmWindow> win = find_window(out, count * dtype_size(dt) * n_, &where);
  return collective(
      sig, timeout_s, async,
      [this, out, in, count, win, where](OpCtx& c) {
        if (multi_host()) return hier_all_gather(c, hier(), out, in, count);
        const size_t bytes = count * c.esize();
        // Single copy before one-shot: from 32 KiB per rank (with 2 ranks)
        // one kernel copy per peer beats the one-shot areas' copy in and out.
        if (direct(c, win.get(), bytes, where)) {
          c.path = Path::kDirect;
          direct_all_gather(c, direct_view(*win, where), in, count);
        } else if (cma(c)) {
          c.path = Path::kCma;
          cma_all_gather(c, cma_view(c.tag.seq), in, out, count);
        } else if (oneshot(c, bytes)) {
          c.path = Path::kOneShot;
          oneshot_all_gather(c, oneshot_, in, out, count);
          saw_flags(c.tag.seq);
        } else {
          ring_all_gather(c, in, out, count);
        }
      },
      where, in, out);
}

std::shared_ptr<Work> Communicator::broadcast(void* buf, size_t count, DataType dt, int root,
                                              bool async, double timeout_s) {
  check_rank(root, "src", OpKind::kBroadcast);
  OpSig sig{OpKind::kBroadcast, dt, ReduceOp::kSum, root, count};
  return collective(
      sig, timeout_s, async,
      [this, buf, count, root](OpCtx& c) {
        if (multi_host()) return hier_broadcast(c, hier(), buf, count, root);
        const size_t bytes = count * c.esize();
        if (cma(c)) {  // every rank announced the same operation, root included
          c.path = Path::kCma;
          cma_broadcast(c, cma_view(c.tag.seq), count, root);
          return;
        }
        if (oneshot(c, bytes)) {
          c.path = Path::kOneShot;
          oneshot_broadcast(c, oneshot_, buf, count, root);
          if (c.rank != root) saw_flags(c.tag.seq, root);
        } else {
          chain_broadcast(c, buf, count, root);
        }
        // A root only sends, and two ranks that each think they are the root
        // only send: without this, each would keep its own data silently.
        confirm_alike(c);
      },
      0, buf, buf);
}

std::shared_ptr<Work> Communicator::reduce(void* buf, size_t count, DataType dt, ReduceOp op,
                                           int root, bool async, double timeout_s) {
  check_rank(root, "dst", OpKind::kReduce);
  OpSig sig{OpKind::kReduce, dt, op, root, count};
  return collective(
      sig, timeout_s, async,
      [this, buf, count, root](OpCtx& c) {
        if (multi_host()) return hier_reduce(c, hier(), buf, count, root);
        if (cma(c)) {
          c.path = Path::kCma;
          cma_reduce(c, cma_view(c.tag.seq), buf, count, root);
        } else {
          chain_reduce(c, buf, count, root);
        }
      },
      0, buf, buf);
}

std::shared_ptr<Work> Communicator::all_to_all(void* out, const void* in, size_t count, DataType dt,
                                               bool async, double timeout_s) {
  OpSig sig{OpKind::kAllToAll, dt, ReduceOp::kSum, -1, count};
  return collective(
      sig, timeout_s, async,
      [this, out, in, count](OpCtx& c) {
        if (multi_host() && count == 0) return confirm_hosts(c);  // nothing else crosses
        if (cma(c)) {
          c.path = Path::kCma;
          cma_all_to_all(c, cma_view(c.tag.seq), count);
        } else {
          pairwise_all_to_all(c, in, out, count);
        }
      },
      0, in, out);
}

std::shared_ptr<Work> Communicator::barrier(bool async, double timeout_s) {
  OpSig sig{OpKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, -1, 0};
  // Every peer started this operation, and announced a barrier too.
  return collective(sig, timeout_s, async, [this](OpCtx& c) { confirm_alike(c); });
}

}  // namespace pyc
