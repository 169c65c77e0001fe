// The direct CUDA IPC path: every rank's kernels address the callers' own
// buffers on every rank, mapped with CUDA IPC, so that a collective is one or
// two kernels per rank with no staging copy. Synchronisation between the
// ranks is host flags plus inter-process events, never a kernel that waits:
//
//   1. export the call's buffers (cudaIpcGetMemHandle of their allocation),
//      record this rank's `ready` event on the communicator's stream (after
//      the caller's work), publish the handles and the `ready` flag;
//   2. wait (host) for every peer's `ready` flag; map their buffers (cached);
//      make the stream wait for every peer's `ready` event; launch the kernels;
//   3. record this rank's `done` event, publish the `done` flag, wait (host)
//      for every peer's, make the stream wait for their `done` events.
//
// After step 3 no rank's kernel touches this rank's buffers any more, so the
// caller's later work on its stream is safe. The host never waits for the
// GPU, and the GPU waits only on events (the hardware's own inter-process
// synchronisation), so ranks that time-slice one GPU cannot deadlock.
//
// Reuse of the two events is safe because of the flags: a rank records
// `ready` for operation k+1 only after every peer published `done` for k,
// which each does after its stream-wait on our `ready` of k (and likewise for
// `done`, through the `ready` flags of k+1).
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
  Counter ready;            // direct operations whose buffers are below and `ready` event recorded
  Counter done;             // direct operations whose `done` event is recorded
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
};

class IpcDirect {
 public:
  // Creates this rank's two inter-process events (on the current device).
  IpcDirect(int rank, int nranks, cudaStream_t stream);
  ~IpcDirect();  // unmaps the peers' buffers, closes the events; never throws
  IpcDirect(const IpcDirect&) = delete;
  IpcDirect& operator=(const IpcDirect&) = delete;

  cudaIpcEventHandle_t ready_handle() const { return ready_handle_; }
  cudaIpcEventHandle_t done_handle() const { return done_handle_; }
  // Attaches the control records (nranks of them) and opens the peers' events
  // (their handles from the setup exchange, indexed by rank).
  void connect(DirectCtl* ctls, const std::vector<cudaIpcEventHandle_t>& ready,
               const std::vector<cudaIpcEventHandle_t>& done);

  // Runs steps 1-3 around `kernels`, which enqueues the operation's kernels on
  // the stream given the view. in_bytes / out_bytes: the call's input and
  // output sizes on this rank (in == out for in-place operations). Returns
  // false, having launched nothing, when some rank could not export; throws
  // pyc::Error for a CUDA failure and whatever the monitor throws (timeout,
  // dead peer, abort).
  bool run(const void* in, size_t in_bytes, void* out, size_t out_bytes, WaitMonitor& mon,
           const std::function<void(const IpcView&)>& kernels);

 private:
  // Fills the handle and offset of `p`'s allocation; false when it cannot be exported.
  bool export_buffer(const void* p, cudaIpcMemHandle_t* h, uint64_t* off);
  // Rank `peer`'s allocation behind `h`, mapped here (opened once, then cached).
  char* map(int peer, const cudaIpcMemHandle_t& h);

  int rank_, n_;
  cudaStream_t stream_;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  cudaIpcEventHandle_t ready_handle_{}, done_handle_{};
  std::vector<cudaEvent_t> peer_ready_, peer_done_;
  DirectCtl* ctls_ = nullptr;
  uint32_t seq_ = 0;
  // Per peer: the allocations mapped so far, by handle bytes.
  std::vector<std::unordered_map<std::string, char*>> mapped_;
};

}  // namespace pyc
