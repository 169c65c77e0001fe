// The CUDA path of a Communicator: the same collectives on device memory,
// stream-ordered like torch.distributed with NCCL. This header includes no
// CUDA header, so the bindings compile against it in every build; it is
// implemented (cuda/cuda_path.cc, cuda_setup.cc, cuda_ops.cc) only when PYCOLL_WITH_CUDA is
// defined.
//
// Stream semantics (see docs/cuda.md):
// - at issue, on the caller's thread, an event is recorded on the caller's
//   stream if it still has work queued; the operation runs after that work
//   (the direct path: a host wait, or its worker's stream waits; the staging
//   path: the communicator's stream waits), so it sees everything queued
//   before the call;
// - the operation's kernels run on the communicator's own non-blocking
//   stream, launched by the host thread that runs the operation (the progress
//   engine), which drives the handshakes with the peers;
// - CudaWork::wait_stream returns once a direct-path operation has completed
//   (every kernel of it, on every rank); for the staging path it blocks the
//   host only until the last kernel has been enqueued and the final event
//   recorded, then makes the given stream wait for that event.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>

#include "comm/communicator.h"

namespace pyc {

class CudaEvent;  // cuda/cuda_transport.h

// How a CUDA operation was called.
struct CudaCall {
  int device = -1;        // the device of every buffer of the call
  uintptr_t stream = 0;   // the caller's current cudaStream_t (0: legacy default stream)
  double timeout_s = -1;  // < 0: the communicator's default
  // The caller waits for the operation at once (a synchronous call): a
  // collective on the direct path, with nothing pending on the communicator,
  // then runs on the caller's thread, as a synchronous CPU operation does,
  // instead of a hand-off to the progress engine and back (two thread
  // wake-ups per operation).
  bool sync = false;
};

// Completion handle of one CUDA operation. `work` is null for a synchronous
// operation (CudaCall::sync), which has run by the time the call returns.
class CudaWork {
 public:
  // Blocks until the operation's final event is recorded (its last kernel is
  // enqueued), then makes `stream` wait for it; returns false if that did not
  // happen within timeout_s (< 0: no limit). Rethrows the operation's error
  // if it failed before that point, or if it has already failed.
  bool wait_stream(uintptr_t stream, double timeout_s);
  // Blocks until the host side has finished (every kernel of the operation
  // has completed); false on timeout. Rethrows the operation's error.
  bool wait_host(double timeout_s);
  bool is_completed();

  // Used by the CUDA path.
  // host_only: the operation completed on the host (every kernel of it has
  // finished): wait_stream needs no stream wait.
  void set_recorded(bool host_only);
  void set_failed();
  std::shared_ptr<Work> work;  // null: the operation ran synchronously
  // Recorded on the caller's stream at issue; null when that stream was idle.
  std::shared_ptr<CudaEvent> issue_event;
  // Recorded after the operation's last kernel (staging path only; null for
  // an operation completed on the host).
  std::shared_ptr<CudaEvent> final_event;
  int device = -1;

 private:
  std::mutex m_;
  std::condition_variable cv_;
  bool recorded_ = false, failed_ = false, host_only_ = false;
};

// Each validates its arguments on the calling thread (errors name the rank,
// the operation and the argument), records the issue event and queues the
// operation on `comm`'s progress engine; returns its handle. Buffers are
// device pointers on call.device (or memory of that device mapped otherwise:
// checked with cudaPointerGetAttributes). Counts, dtypes and ops as the CPU
// methods of Communicator.
std::shared_ptr<CudaWork> cuda_all_reduce(Communicator& comm, void* buf, size_t count, DataType dt,
                                          ReduceOp op, const CudaCall& call);
std::shared_ptr<CudaWork> cuda_reduce_scatter(Communicator& comm, void* out, const void* in,
                                              size_t count, DataType dt, ReduceOp op,
                                              const CudaCall& call);
std::shared_ptr<CudaWork> cuda_all_gather(Communicator& comm, void* out, const void* in,
                                          size_t count, DataType dt, const CudaCall& call);
std::shared_ptr<CudaWork> cuda_broadcast(Communicator& comm, void* buf, size_t count, DataType dt,
                                         int root, const CudaCall& call);
std::shared_ptr<CudaWork> cuda_reduce(Communicator& comm, void* buf, size_t count, DataType dt,
                                      ReduceOp op, int root, const CudaCall& call);
std::shared_ptr<CudaWork> cuda_all_to_all(Communicator& comm, void* out, const void* in,
                                          size_t count, DataType dt, const CudaCall& call);
// Point-to-point needs the CUDA transport, which the first CUDA collective
// sets up: send/recv before any CUDA collective raise InvalidArgument.
std::shared_ptr<CudaWork> cuda_send(Communicator& comm, const void* buf, size_t count, DataType dt,
                                    int peer, const CudaCall& call);
std::shared_ptr<CudaWork> cuda_recv(Communicator& comm, void* buf, size_t count, DataType dt,
                                    int peer, const CudaCall& call);

// The device that owns `ptr` (device or managed memory), or -1 for host
// memory / an unknown pointer. Throws "no CUDA device" without one.
int cuda_pointer_device(uintptr_t ptr);

}  // namespace pyc
