// Communicator: point-to-point operations (send, recv, recv from any source,
// batches), numbered per pair of ranks as they run and not announced.
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "algo/algorithms.h"
#include "comm/cma_choice.h"
#include "comm/communicator.h"
#include "core/clock.h"
#include "core/error.h"

namespace pyc {

// batch_p2p messages from this size on are read by the receiver straight out
// of the sender's buffer (single copy) instead of crossing the slots.
constexpr size_t kP2PCmaMinBytes = 64 << 10;

std::shared_ptr<Work> Communicator::point_to_point(const OpSig& sig, int peer, double timeout_s,
                                                   bool async, Body body) {
  check_issue(sig.kind);
  timeout_s = op_timeout(timeout_s, sig.kind);
  const bool is_send = sig.kind == OpKind::kSend;
  return engine_->submit([] { return 0u; },
                         [this, sig, peer, is_send, timeout_s, body = std::move(body)](uint32_t) {
                           const uint32_t seq = is_send ? ++p2p_sent_[peer] : ++p2p_recvd_[peer];
                           run_op(sig, seq, timeout_s, false, body);
                         },
                         async, op_kind_name(sig.kind));
}

P2PCma Communicator::p2p_cma(int peer, bool send) {
  P2PCma c;
  c.pid = peer_pid_[peer];  // checked at connect, never re-read from the segment
  c.done = send ? &layout_.fifo_ctl(seg_.data(), rank_, peer)->cma_done
                : &layout_.fifo_ctl(seg_.data(), peer, rank_)->cma_done;
  return c;
}

std::shared_ptr<Work> Communicator::send(const void* buf, size_t count, DataType dt, int peer,
                                         bool async, double timeout_s) {
  check_rank(peer, "dst", OpKind::kSend);
  if (peer == rank_)
    PYC_THROW(InvalidArgument,
              "pycollectives: rank " << rank_ << ": send: dst=" << peer << " is this rank");
  OpSig sig{OpKind::kSend, dt, ReduceOp::kSum, peer, count};
  // Always through the slots: the sender copies in while the receiver copies
  // out, two cores at work, where single copy would leave the sender waiting
  // (2 ranks, 8 / 32 MiB send -> recv: 12.6 / 12.8 GB/s through the slots,
  // 11.1 / 7.8-9.9 GB/s read across). A batch, whose ranks all copy, reads
  // its large messages across (batch_p2p).
  return point_to_point(sig, peer, timeout_s, async,
                        [buf, count, peer](OpCtx& c) { p2p_send(c, buf, count, peer); });
}

std::shared_ptr<Work> Communicator::recv(void* buf, size_t count, DataType dt, int peer, bool async,
                                         double timeout_s) {
  check_rank(peer, "src", OpKind::kRecv);
  if (peer == rank_)
    PYC_THROW(InvalidArgument,
              "pycollectives: rank " << rank_ << ": recv: src=" << peer << " is this rank");
  OpSig sig{OpKind::kRecv, dt, ReduceOp::kSum, peer, count};
  // The sender may be a batch that chose single copy: with CMA on, the
  // receive takes either.
  const P2PCma cma = cma_ ? p2p_cma(peer, false) : P2PCma{};
  return point_to_point(sig, peer, timeout_s, async, [this, buf, count, peer, dt, cma](OpCtx& c) {
    OpSig expect{OpKind::kSend, dt, ReduceOp::kSum, rank_, count};
    p2p_recv(c, buf, count, peer, SlotTag{c.tag.seq, expect.word0(), expect.word1()},
             cma.done != nullptr ? &cma : nullptr);
  });
}

std::shared_ptr<Work> Communicator::recv_any(void* buf, size_t count, DataType dt, bool async,
                                             double timeout_s, int* source) {
  check_issue(OpKind::kRecv);
  if (n_ < 2)
    PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_
                                                      << ": recv: from any source needs a peer "
                                                         "(world size 1)");
  timeout_s = op_timeout(timeout_s, OpKind::kRecv);
  OpSig sig{OpKind::kRecv, dt, ReduceOp::kSum, -1, count};  // root -1: any peer
  auto src = std::make_shared<std::atomic<int>>(-1);
  std::shared_ptr<Work> work = engine_->submit(
      [] { return 0u; },
      [this, sig, buf, count, dt, timeout_s, src](uint32_t) {
        run_op(sig, 0, timeout_s, false, [&](OpCtx& c) {
          std::vector<uint32_t> next(n_);
          for (int p = 0; p < n_; ++p) next[p] = p2p_recvd_[p] + 1;
          const int peer = p2p_probe_any(c, next.data(), any_next_);
          any_next_ = (peer + 1) % n_;
          c.tag.seq = ++p2p_recvd_[peer];
          // From here on, a receive from `peer`, as Communicator::recv's.
          OpSig expect{OpKind::kSend, dt, ReduceOp::kSum, rank_, count};
          const P2PCma cma = cma_ ? p2p_cma(peer, false) : P2PCma{};
          p2p_recv(c, buf, count, peer, SlotTag{c.tag.seq, expect.word0(), expect.word1()},
                   cma.done != nullptr ? &cma : nullptr);
          src->store(peer);
        });
      },
      async, "recv");
  if (work) {
    work->set_source(src);
  } else if (source != nullptr) {
    *source = src->load();
  }
  return work;
}

std::shared_ptr<Work> Communicator::batch_p2p(std::vector<P2PItem> items, bool async,
                                              double timeout_s) {
  const OpKind kind = OpKind::kBatchP2P;
  check_issue(kind);
  int self_balance = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const P2PItem& it = items[i];
    if (it.peer < 0 || it.peer >= n_)
      PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_ << ": batch_p2p: op " << i
                                                        << ": peer=" << it.peer
                                                        << " is out of range [0, " << n_ << ")");
    if (it.peer == rank_) self_balance += it.send ? 1 : -1;
  }
  if (self_balance != 0)
    PYC_THROW(InvalidArgument, "pycollectives: rank "
                                   << rank_
                                   << ": batch_p2p: the sends to this rank and the receives from "
                                      "this rank do not pair up");
  {  // a send to self and the receive it pairs with must agree on size and dtype
    std::vector<const P2PItem*> s, r;
    for (const P2PItem& it : items)
      if (it.peer == rank_) (it.send ? s : r).push_back(&it);
    for (size_t i = 0; i < s.size(); ++i)
      if (s[i]->count != r[i]->count || s[i]->dtype != r[i]->dtype)
        PYC_THROW(InvalidArgument, "pycollectives: rank "
                                       << rank_ << ": batch_p2p: send to self #" << i << " ("
                                       << s[i]->count << " x " << dtype_name(s[i]->dtype)
                                       << ") does not match receive from self #" << i << " ("
                                       << r[i]->count << " x " << dtype_name(r[i]->dtype) << ")");
  }
  timeout_s = op_timeout(timeout_s, kind);
  OpSig sig{kind, DataType::kUInt8, ReduceOp::kSum, -1, items.size()};
  return engine_->submit(
      [] { return 0u; },
      [this, sig, items = std::move(items), timeout_s](uint32_t) {
        // Numbered as it runs, like single sends and receives: the k-th
        // message from a to b carries sequence number k on both sides.
        std::vector<P2POp> ops(items.size());
        uint32_t first = 0;
        for (size_t i = 0; i < items.size(); ++i) {
          const P2PItem& it = items[i];
          P2POp& op = ops[i];
          op.send = it.send;
          op.buf = it.buf;
          op.count = it.count;
          op.dtype = it.dtype;
          op.peer = it.peer;
          if (it.peer == rank_) continue;
          const uint32_t seq = it.send ? ++p2p_sent_[it.peer] : ++p2p_recvd_[it.peer];
          // A send's slots carry its own signature; a receive expects the
          // sender's, whose root is this rank.
          OpSig s{OpKind::kSend, it.dtype, ReduceOp::kSum, it.send ? it.peer : rank_, it.count};
          op.tag = SlotTag{seq, s.word0(), s.word1()};
          // Single copy from kP2PCmaMinBytes on, every non-empty message with
          // PYCOLL_ALGO=cma: a receive may come across, a send goes across if
          // the tuner prefers it when the batch runs (below). A receive takes
          // whichever its sender chose (batch_p2p.cc).
          const size_t bytes = it.count * dtype_size(it.dtype);
          op.cma = cma_ && bytes > 0 && (algo_ == Algo::kCma || bytes >= kP2PCmaMinBytes);
          if (op.cma) op.across = p2p_cma(it.peer, it.send);
          if (first == 0) first = seq;
        }
        // This rank's sends of single-copy size go across where its tuner,
        // timing whole batches by the bytes of those sends, prefers it (chosen
        // here, on the engine's thread in the order operations run).
        size_t total = 0;
        for (const P2POp& op : ops)
          if (op.send && op.cma) total += op.count * dtype_size(op.dtype);
        const CmaTuner::Choice cma = cma_choice(OpKind::kBatchP2P, total, 0);
        if (!cma.cma)
          for (P2POp& op : ops) op.cma = op.cma && !op.send;
        const auto t0 = cma.timed ? Clock::now() : Clock::time_point{};
        run_op(sig, first, timeout_s, false, [&ops](OpCtx& c) { p2p_batch(c, ops); });
        if (cma.timed) cma_tuner_.record(OpKind::kBatchP2P, total, cma.cma, elapsed_ns(t0));
      },
      async, "batch_p2p");
}

}  // namespace pyc
