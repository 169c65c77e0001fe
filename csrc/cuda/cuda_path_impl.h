// The CUDA path of a Communicator, inside: the class behind cuda_path.h's
// functions, shared by cuda_path.cc (the path itself: creation, checks, issue
// and run), cuda_setup.cc (the staging memory and IPC links, set up at the
// first CUDA collective) and cuda_ops.cc (the operations).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "algo/context.h"
#include "cuda/cuda_path.h"
#include "cuda/cuda_transport.h"
#include "cuda/ipc_direct.h"
#include "transport/shm/shm_segment.h"

namespace pyc {

// The host segment of the CUDA FIFOs' control words, created by rank 0.
struct CtlHeader {
  alignas(64) std::atomic<uint32_t> attached;  // ranks that mapped it
};

inline std::string device_name(int d) { return "cuda:" + std::to_string(d); }

class CudaPath : public std::enable_shared_from_this<CudaPath> {
 public:
  // An operation's body, run by the progress engine.
  using OpFn = std::function<void(OpCtx&, CudaPath&)>;

  CudaPath(Communicator& comm, int device);
  ~CudaPath();
  CudaPath(const CudaPath&) = delete;
  CudaPath& operator=(const CudaPath&) = delete;

  // The communicator's CUDA path, created by its first CUDA operation;
  // checks that `call` is on its device.
  static std::shared_ptr<CudaPath> get(Communicator& comm, const CudaCall& call, OpKind kind);
  // Validates one buffer of `bytes` bytes of a call.
  void check_buffer(const void* p, size_t bytes, OpKind kind, const char* arg) const;
  void check_rank(int r, const char* what, OpKind kind) const { comm_.check_rank(r, what, kind); }
  void check_peer(int peer, const char* what, OpKind kind) const;
  // Records the issue event on the caller's stream and queues the operation
  // (a collective, or point-to-point with p2p_peer >= 0); a synchronous one
  // (call.sync) has run when this returns, on the caller's thread if nothing
  // was pending, and rethrows its error.
  std::shared_ptr<CudaWork> issue(const OpSig& sig, const CudaCall& call, int p2p_peer, OpFn fn);
  int rank() const { return comm_.rank_; }
  int nranks() const { return comm_.n_; }
  // Runs a collective: on the direct path (cuda/ipc_direct.h) with `direct`,
  // or, when this communicator has none or some rank could not export its
  // buffers (every rank finds the same), on the staging path with `staging`,
  // ordered after the caller's earlier work.
  void collective(OpCtx& c, const void* in, size_t in_bytes, void* out, size_t out_bytes,
                  const std::function<void(const IpcView&)>& direct,
                  const std::function<void()>& staging);
  // Makes the stream wait for the caller's earlier work (the staging path's
  // first step; a no-op once done for this operation).
  void after_issue();

 private:
  // Runs one issued operation; `on_caller` when it runs on the thread that
  // issued it (the caller's current device is then restored afterwards).
  void run(OpCtx& c, CudaWork& w, bool collective, const OpFn& fn, bool on_caller);
  // Allocates the staging memory, exchanges the IPC handles with a CPU
  // all-gather inside the first CUDA collective (every rank reaches it at the
  // same sequence number) and maps the peers' buffers.
  void setup(OpCtx& c);

  Communicator& comm_;
  int device_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<EventPool> pool_;
  std::unique_ptr<CudaExec> exec_;
  std::unique_ptr<CudaLinks> links_;   // set by setup(), on the engine's thread
  std::unique_ptr<IpcDirect> direct_;  // set by setup() when every rank may take it
  // direct_ is set (read by the issuing thread: synchronous collectives then
  // run on it, see issue()).
  std::atomic<bool> direct_ready_{false};
  // Of the operation being run (on the engine's thread, or on the caller's
  // for a synchronous one): the caller's issue event not yet waited for (null:
  // none, or done), and whether the operation completed on the host (the
  // direct path), so that no stream has to wait for it.
  cudaEvent_t issue_ = nullptr;
  bool host_only_ = false;
  std::atomic<bool> collective_issued_{false};
  void* staging_ = nullptr;
  std::vector<void*> peer_base_;
  ShmSegment ctl_;
  bool ctl_linked_ = false;  // the control segment may still have its name
};

}  // namespace pyc
