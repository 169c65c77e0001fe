// The direct CUDA IPC path: kernels address the callers' own buffers on every
// rank, mapped with CUDA IPC, so that a collective is one or two kernels with
// no staging copy. The ranks synchronise through host flags only, after the
// host has seen the GPU work complete; no kernel waits, and no stream waits
// for another process's work:
//
//   1. export the call's buffers (cudaIpcGetMemHandle of their allocation);
//      once the caller's earlier work on its stream has completed (a host
//      poll of the issue event; a worker that only touches its own buffer
//      through its own stream waits on the stream instead), publish the
//      handles and the `ready` flag;
//   2. wait (host) for every peer's `ready` flag; a worker maps the peers'
//      buffers (cached), launches its kernels and polls their completion;
//   3. publish the `done` flag and wait (host) for every peer's.
//
// After step 3 every kernel of the operation has completed, so the operation
// is complete on the host and no rank's stream has to wait for anything.
//
// Who works: when every rank drives the same GPU, rank 0 alone (one worker)
// runs every rank's part. Kernels of different processes time-slice one GPU,
// and switching between the ranks' contexts costs far more than a small
// collective: on an H100, a 2-rank all-reduce of 8 B took 290-330 us and a
// 4-rank one 600-900 us while every rank's context had GPU work (even only
// event records) in each operation, and mostly 52-66 us once only rank 0's did. So
// the other ranks enqueue nothing at all. Across GPUs every rank does its own
// part (see ipc_algos.h), in parallel.
//
// If any rank cannot export its buffers (memory not from cudaMalloc: a
// stream-ordered pool, expandable segments), every rank sees that at step 2,
// launches nothing, completes step 3 and runs the staging path instead.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/wait.h"

namespace pyc {

// One rank's record in the CUDA control segment (host shared memory).
struct alignas(64) DirectCtl {
  Counter ready;            // direct operations whose buffers are below and ready
  Counter done;             // direct operations whose kernels (on this rank) have completed
  alignas(64) uint32_t ok;  // 1: the buffers below were exported
  uint32_t pad;
  uint64_t in_off, out_off;  // offsets of the buffers in their allocations
  cudaIpcMemHandle_t in_mem, out_mem;
};

// One operation's buffers, as addresses valid in this process: in[p] / out[p]
// are rank p's (this rank's own for p == rank).
struct IpcView {
  std::vector<const char*> in;
  std::vector<char*> out;
  bool one_worker = false;  // rank 0 does every rank's part
};

class IpcDirect {
 public:
  // one_worker: every rank drives the same GPU (decided alike on every rank).
  IpcDirect(int rank, int nranks, cudaStream_t stream, bool one_worker);
  ~IpcDirect();  // unmaps the peers' buffers; never throws
  IpcDirect(const IpcDirect&) = delete;
  IpcDirect& operator=(const IpcDirect&) = delete;

  // Attaches the control records (nranks of them, in host shared memory).
  void connect(DirectCtl* ctls) { ctls_ = ctls; }
  bool one_worker() const { return one_worker_; }

  // Runs steps 1-3; `kernels` enqueues this rank's kernels on the stream
  // given the view (called on workers only). in_bytes / out_bytes: the call's
  // input and output sizes on this rank (in == out for in-place operations).
  // issue: the event that marks the caller's earlier work, or null when its
  // stream was idle. Returns false, having launched nothing, when some rank
  // could not export; throws pyc::Error for a CUDA failure and whatever the
  // monitor throws (timeout, dead peer, abort).
  bool run(const void* in, size_t in_bytes, void* out, size_t out_bytes, cudaEvent_t issue,
           WaitMonitor& mon, const std::function<void(const IpcView&)>& kernels);

 private:
  // Fills the handle and offset of `p`'s allocation; false when it cannot be exported.
  bool export_buffer(const void* p, cudaIpcMemHandle_t* h, uint64_t* off);
  // Rank `peer`'s allocation behind `h`, mapped here (opened once, then cached).
  char* map(int peer, const cudaIpcMemHandle_t& h);

  // An allocation exported before: its base address, its process-wide unique
  // id (CU_POINTER_ATTRIBUTE_BUFFER_ID: a freed and reallocated allocation at
  // the same address gets a new one) and its handle.
  struct Exported {
    uintptr_t base;
    unsigned long long id;
    cudaIpcMemHandle_t handle;
  };

  int rank_, n_;
  cudaStream_t stream_;
  bool one_worker_;
  cudaEvent_t done_ = nullptr;  // marks this rank's kernels of the operation
  DirectCtl* ctls_ = nullptr;
  uint32_t seq_ = 0;
  // Per peer: the allocations mapped so far, by handle bytes.
  std::vector<std::unordered_map<std::string, char*>> mapped_;
  // Our allocations exported so far, the most recent last (cudaIpcGetMemHandle
  // costs a driver call per buffer per operation otherwise).
  std::vector<Exported> exported_;
};

}  // namespace pyc
