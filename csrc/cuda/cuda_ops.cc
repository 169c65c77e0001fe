// The CUDA operations (see cuda_path.h): each checks its arguments on the
// caller's thread and issues a body that runs the direct path (kernels on the
// peers' own buffers) or the staging ring. CudaWork, their handle.
#include <chrono>
#include <memory>

#include "algo/algorithms.h"
#include "core/clock.h"
#include "cuda/check.h"
#include "cuda/cuda_path_impl.h"
#include "cuda/ipc_algos.h"

namespace pyc {

// ---- CudaWork ----

void CudaWork::set_recorded(bool host_only) {
  {
    std::lock_guard<std::mutex> lk(m_);
    recorded_ = true;
    host_only_ = host_only;
  }
  cv_.notify_all();
}

void CudaWork::set_failed() {
  {
    std::lock_guard<std::mutex> lk(m_);
    failed_ = true;
  }
  cv_.notify_all();
}

bool CudaWork::wait_stream(uintptr_t stream, double timeout_s) {
  bool recorded, host_only;
  {
    const auto deadline =
        timeout_s < 0 ? Clock::time_point::max() : deadline_after(Clock::now(), timeout_s);
    std::unique_lock<std::mutex> lk(m_);
    // The operation may also fail before its body runs (an abort, a peer's
    // error, the lead check): then only the core Work completes, so look at
    // it too, every millisecond; and for Ctrl-C, as Work::wait does.
    for (int polls = 1; work && !recorded_ && !failed_ && !work->is_completed(); ++polls) {
      if (Clock::now() >= deadline) return false;
      cv_.wait_for(lk, std::chrono::milliseconds(1));
      if (polls % 5 != 0) continue;
      lk.unlock();
      work->check_interrupt();
      lk.lock();
    }
    recorded = recorded_;
    host_only = host_only_;
  }
  // Failed before its last kernel was enqueued: Work::wait rethrows (the
  // engine finishes the Work right after the body throws). An error found
  // later (while draining) is rethrown once the Work has completed.
  if (work && (!recorded || work->is_completed())) work->wait(-1);
  if (!recorded || host_only) return true;  // host_only: complete, nothing to wait for
  DeviceGuard g(device);
  PYC_CUDA_CHECK(
      cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), final_event->get(), 0));
  return true;
}

bool CudaWork::wait_host(double timeout_s) { return !work || work->wait(timeout_s); }

bool CudaWork::is_completed() { return !work || work->is_completed(); }

// ---- operations ----

std::shared_ptr<CudaWork> cuda_all_reduce(Communicator& comm, void* buf, size_t count, DataType dt,
                                          ReduceOp op, const CudaCall& call) {
  auto path = CudaPath::get(comm, call, OpKind::kAllReduce);
  path->check_buffer(buf, count * dtype_size(dt), OpKind::kAllReduce, "tensor");
  OpSig sig{OpKind::kAllReduce, dt, op, -1, count};
  return path->issue(sig, call, -1, [buf, count](OpCtx& c, CudaPath& p) {
    const size_t b = count * c.esize();
    p.collective(
        c, buf, b, buf, b, [&](const IpcView& v) { ipc_all_reduce(c, v, count); },
        [&] { ring_all_reduce(c, buf, buf, count); });
  });
}

std::shared_ptr<CudaWork> cuda_reduce_scatter(Communicator& comm, void* out, const void* in,
                                              size_t count, DataType dt, ReduceOp op,
                                              const CudaCall& call) {
  auto path = CudaPath::get(comm, call, OpKind::kReduceScatter);
  const size_t bytes = count * dtype_size(dt);
  path->check_buffer(out, bytes, OpKind::kReduceScatter, "output");
  path->check_buffer(in, bytes * path->nranks(), OpKind::kReduceScatter, "input");
  OpSig sig{OpKind::kReduceScatter, dt, op, -1, count};
  return path->issue(sig, call, -1, [out, in, count](OpCtx& c, CudaPath& p) {
    const size_t b = count * c.esize();
    p.collective(
        c, in, b * c.nranks, out, b, [&](const IpcView& v) { ipc_reduce_scatter(c, v, count); },
        [&] { ring_reduce_scatter(c, in, out, count); });
  });
}

std::shared_ptr<CudaWork> cuda_all_gather(Communicator& comm, void* out, const void* in,
                                          size_t count, DataType dt, const CudaCall& call) {
  auto path = CudaPath::get(comm, call, OpKind::kAllGather);
  const size_t bytes = count * dtype_size(dt);
  path->check_buffer(out, bytes * path->nranks(), OpKind::kAllGather, "output");
  path->check_buffer(in, bytes, OpKind::kAllGather, "input");
  OpSig sig{OpKind::kAllGather, dt, ReduceOp::kSum, -1, count};
  return path->issue(sig, call, -1, [out, in, count](OpCtx& c, CudaPath& p) {
    const size_t b = count * c.esize();
    p.collective(
        c, in, b, out, b * c.nranks, [&](const IpcView& v) { ipc_all_gather(c, v, count); },
        [&] { ring_all_gather(c, in, out, count); });
  });
}

std::shared_ptr<CudaWork> cuda_broadcast(Communicator& comm, void* buf, size_t count, DataType dt,
                                         int root, const CudaCall& call) {
  auto path = CudaPath::get(comm, call, OpKind::kBroadcast);
  path->check_rank(root, "src", OpKind::kBroadcast);
  path->check_buffer(buf, count * dtype_size(dt), OpKind::kBroadcast, "tensor");
  OpSig sig{OpKind::kBroadcast, dt, ReduceOp::kSum, root, count};
  return path->issue(sig, call, -1, [buf, count, root](OpCtx& c, CudaPath& p) {
    const size_t b = count * c.esize();
    p.collective(
        c, buf, b, buf, b, [&](const IpcView& v) { ipc_broadcast(c, v, count, root); },
        [&] { chain_broadcast(c, buf, count, root); });
  });
}

std::shared_ptr<CudaWork> cuda_reduce(Communicator& comm, void* buf, size_t count, DataType dt,
                                      ReduceOp op, int root, const CudaCall& call) {
  auto path = CudaPath::get(comm, call, OpKind::kReduce);
  path->check_rank(root, "dst", OpKind::kReduce);
  path->check_buffer(buf, count * dtype_size(dt), OpKind::kReduce, "tensor");
  OpSig sig{OpKind::kReduce, dt, op, root, count};
  return path->issue(sig, call, -1, [buf, count, root](OpCtx& c, CudaPath& p) {
    const size_t b = count * c.esize();
    p.collective(
        c, buf, b, buf, b, [&](const IpcView& v) { ipc_reduce(c, v, count, root); },
        [&] { chain_reduce(c, buf, count, root); });
  });
}

std::shared_ptr<CudaWork> cuda_all_to_all(Communicator& comm, void* out, const void* in,
                                          size_t count, DataType dt, const CudaCall& call) {
  auto path = CudaPath::get(comm, call, OpKind::kAllToAll);
  const size_t bytes = count * dtype_size(dt) * path->nranks();
  path->check_buffer(out, bytes, OpKind::kAllToAll, "output");
  path->check_buffer(in, bytes, OpKind::kAllToAll, "input");
  OpSig sig{OpKind::kAllToAll, dt, ReduceOp::kSum, -1, count};
  return path->issue(sig, call, -1, [out, in, count](OpCtx& c, CudaPath& p) {
    const size_t b = count * c.esize() * c.nranks;
    p.collective(
        c, in, b, out, b, [&](const IpcView& v) { ipc_all_to_all(c, v, count); },
        [&] { pairwise_all_to_all(c, in, out, count); });
  });
}

std::shared_ptr<CudaWork> cuda_send(Communicator& comm, const void* buf, size_t count, DataType dt,
                                    int peer, const CudaCall& call) {
  auto path = CudaPath::get(comm, call, OpKind::kSend);
  path->check_peer(peer, "dst", OpKind::kSend);
  path->check_buffer(buf, count * dtype_size(dt), OpKind::kSend, "tensor");
  OpSig sig{OpKind::kSend, dt, ReduceOp::kSum, peer, count};
  return path->issue(sig, call, peer, [buf, count, peer](OpCtx& c, CudaPath& p) {
    p.after_issue();
    p2p_send(c, buf, count, peer);
  });
}

std::shared_ptr<CudaWork> cuda_recv(Communicator& comm, void* buf, size_t count, DataType dt,
                                    int peer, const CudaCall& call) {
  auto path = CudaPath::get(comm, call, OpKind::kRecv);
  path->check_peer(peer, "src", OpKind::kRecv);
  path->check_buffer(buf, count * dtype_size(dt), OpKind::kRecv, "tensor");
  OpSig sig{OpKind::kRecv, dt, ReduceOp::kSum, peer, count};
  const int me = path->rank();
  return path->issue(sig, call, peer, [buf, count, peer, dt, me](OpCtx& c, CudaPath& p) {
    p.after_issue();
    OpSig expect{OpKind::kSend, dt, ReduceOp::kSum, me, count};  // as Communicator::recv
    p2p_recv(c, buf, count, peer, SlotTag{c.tag.seq, expect.word0(), expect.word1()});
  });
}

int cuda_pointer_device(uintptr_t ptr) {
  cuda::require_device("locating a CUDA buffer");
  cudaPointerAttributes a{};
  const cudaError_t err = cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(ptr));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return -1;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

}  // namespace pyc