// CUDA IPC transport between the ranks of one host: slot FIFOs whose payloads
// are device staging memory and whose control words (head/tail counters, slot
// tags) stay in host shared memory, driven entirely by the host.
//
// Each rank allocates one device buffer holding the slots of all its incoming
// FIFOs (cudaMalloc once per communicator, exported with cudaIpcGetMemHandle);
// a sender maps its receiver's buffer once (cudaIpcOpenMemHandle) and its
// kernels write the slots directly (NCCL's P2P write). No kernel ever waits
// for another process: the host learns that a kernel finished from an event
// and only then publishes the slot (SendConn::post) or hands it back
// (RecvConn::release). Both are deferred: recorded with the event of the last
// launch, completed in order as the events complete, by progress() inside
// every wait of the operation and by drain() at its end. Several chunks stay
// in flight, and ranks that time-slice one GPU never deadlock.
#pragma once

#include <cuda_runtime_api.h>

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "algo/context.h"
#include "reduce/reduce.h"
#include "transport/shm/shm_layout.h"

namespace pyc {

class Communicator;

// Sets the calling thread's current device for a scope and restores it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

class EventPool;

// Whether the work captured by `ev`'s last record has completed; throws
// pyc::Error for an error of that work (a sticky CUDA error).
bool event_done(cudaEvent_t ev);
// Calls done() until it returns true: spins, then yields the core, then sleeps
// in short slices; the monitor bounds the wait (timeout, dead peers, abort,
// Ctrl-C). Every host-side wait of the CUDA path goes through it.
void cuda_poll(const std::function<bool()>& done, WaitMonitor& mon);
// cuda_poll until `ev` has completed.
void wait_event(cudaEvent_t ev, WaitMonitor& mon);

// A pooled cudaEvent_t (cudaEventDisableTiming); returns to its pool when the
// last reference goes.
class CudaEvent {
 public:
  CudaEvent(cudaEvent_t ev, std::shared_ptr<EventPool> pool) : ev_(ev), pool_(std::move(pool)) {}
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t get() const { return ev_; }
  // Whether the work captured by the last record has completed (cached once
  // true). Throws on an error of that work (a sticky CUDA error).
  bool done();

 private:
  cudaEvent_t ev_;
  std::shared_ptr<EventPool> pool_;
  bool done_ = false;
};
using EventRef = std::shared_ptr<CudaEvent>;

class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool();
  // An event of this pool's device (created when none is free). Thread-safe.
  EventRef get();
  void put(cudaEvent_t ev) noexcept;

 private:
  int device_;
  std::mutex m_;
  std::vector<cudaEvent_t> free_;
};

// The kernel executor of a CUDA operation: every kernel on one stream, and
// the event that marks the last launch.
class CudaExec final : public KernelExec {
 public:
  CudaExec(cudaStream_t stream, std::shared_ptr<EventPool> pool)
      : stream_(stream), pool_(std::move(pool)) {}
  void reduce(const ReduceArgs& args) override;
  void scale_avg(void* x, DataType dtype, size_t count, int divisor) override;
  void copy(void* dst0, void* dst1, const void* src, size_t bytes) override;
  // An event that completes when every kernel launched so far has: recorded
  // anew only if something was launched since the last mark. Null when
  // nothing was launched in this operation (nothing to wait for).
  EventRef mark();
  // Called at the start of each operation.
  void begin() {
    last_.reset();
    dirty_ = false;
  }

 private:
  cudaStream_t stream_;
  std::shared_ptr<EventPool> pool_;
  EventRef last_;
  bool dirty_ = false;
};

// Control block of one directed FIFO in the transport's host segment.
struct CudaFifo {
  FifoCtl* ctl;      // tail: slots posted by the sender; head: released by the receiver
  SlotHeader* hdrs;  // nslots headers: the tag and size of each slot
  char* slots;       // nslots * slot_bytes of device memory (the receiver's)
};

class CudaLinks;

class CudaSendConn final : public SendConn {
 public:
  CudaSendConn(CudaLinks& links, const CudaFifo& f, int peer);
  size_t slot_bytes() const override;
  void* acquire(WaitMonitor& mon) override;
  bool ready() override;
  void post(const SlotTag& tag, size_t bytes) override;
  // Publishes the posts whose kernels have completed, in order; true when none is left.
  bool progress();

 private:
  struct Pending {
    EventRef ev;
    SlotTag tag;
    size_t bytes;
  };
  CudaLinks& l_;
  CudaFifo f_;
  int peer_;
  uint32_t posted_ = 0;     // slots handed to post() (published or pending)
  uint32_t published_ = 0;  // mirror of ctl->tail
  uint32_t head_cached_ = 0;
  std::deque<Pending> pending_;
};

class CudaRecvConn final : public RecvConn {
 public:
  CudaRecvConn(CudaLinks& links, const CudaFifo& f, int peer);
  size_t slot_bytes() const override;
  RecvSlot wait(WaitMonitor& mon) override;
  bool ready() override;
  void release() override;
  // Hands back the slots whose reading kernels have completed; true when none is left.
  bool progress();

 private:
  CudaLinks& l_;
  CudaFifo f_;
  int peer_;
  uint32_t consumed_ = 0;  // slots handed to release() (released or pending)
  uint32_t released_ = 0;  // mirror of ctl->head
  uint32_t tail_cached_ = 0;
  std::deque<EventRef> pending_;
};

// The links of a communicator's CUDA path. Owns the conns; every wait of an
// operation progresses every conn's deferred posts and releases.
class CudaLinks final : public Links {
 public:
  // out[p] / in[p]: the FIFO to / from peer p (ignored for p == rank).
  CudaLinks(Communicator& comm, int rank, int nranks, uint32_t nslots, size_t slot_bytes,
            CudaExec& exec, const std::vector<CudaFifo>& out, const std::vector<CudaFifo>& in);
  SendConn& send_to(int peer) override { return *send_[peer]; }
  RecvConn& recv_from(int peer) override { return *recv_[peer]; }
  [[noreturn]] void tag_mismatch(int peer, const SlotTag& got, const SlotTag& want) override;

  uint32_t nslots() const { return nslots_; }
  size_t slot_bytes() const { return slot_bytes_; }
  CudaExec& exec() { return exec_; }
  // Blocks until reached(ctr.value, target), progressing the deferred work
  // meanwhile; every wait goes through the operation's monitor (timeout, dead
  // peers, abort, Ctrl-C). Returns the value seen.
  uint32_t wait_counter(Counter& ctr, uint32_t target, WaitMonitor& mon, int peer);
  // Completes every deferred post and release of this rank (waits for its kernels).
  void drain(WaitMonitor& mon);
  // One pass over the conns; true when nothing is deferred.
  bool progress();

 private:
  Communicator& comm_;
  uint32_t nslots_;
  size_t slot_bytes_;
  CudaExec& exec_;
  std::vector<std::unique_ptr<CudaSendConn>> send_;
  std::vector<std::unique_ptr<CudaRecvConn>> recv_;
};

}  // namespace pyc
