// The CUDA path of a Communicator (see cuda_path.h, cuda_path_impl.h): the
// per-communicator stream, its creation and checks, and how an operation is
// issued and run by the progress engine. Set-up of the staging memory and IPC
// links: cuda_setup.cc; the operations: cuda_ops.cc.
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "cuda/check.h"
#include "cuda/cuda_path_impl.h"

namespace pyc {

CudaPath::CudaPath(Communicator& comm, int device) : comm_(comm), device_(device) {
  DeviceGuard g(device_);
  PYC_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  pool_ = std::make_shared<EventPool>(device_);
  exec_ = std::make_unique<CudaExec>(stream_, pool_);
}

CudaPath::~CudaPath() {
  // Never throws; the runtime may already be shutting down at exit.
  int prev = -1;
  const bool have_prev = cudaGetDevice(&prev) == cudaSuccess;
  if (cudaSetDevice(device_) == cudaSuccess) {
    if (stream_) (void)cudaStreamSynchronize(stream_);  // no kernel of ours still runs
    direct_.reset();
    links_.reset();
    for (void* p : peer_base_)
      if (p) (void)cudaIpcCloseMemHandle(p);
    if (staging_) (void)cudaFree(staging_);
    exec_.reset();
    if (stream_) (void)cudaStreamDestroy(stream_);
    if (have_prev && prev != device_) (void)cudaSetDevice(prev);
  }
  (void)cudaGetLastError();
}

std::shared_ptr<CudaPath> CudaPath::get(Communicator& comm, const CudaCall& call, OpKind kind) {
  std::lock_guard<std::mutex> lk(comm.cuda_mu_);
  comm.check_issue(kind);
  if (!comm.cuda_) {
    cuda::require_device(op_kind_name(kind));
    const int ndev = cuda::device_count();
    if (call.device < 0 || call.device >= ndev)
      PYC_THROW(InvalidArgument, "pycollectives: rank " << comm.rank_ << ": " << op_kind_name(kind)
                                                        << ": device " << call.device
                                                        << " is out of range (this process sees "
                                                        << ndev << " CUDA devices)");
    comm.cuda_ = std::make_shared<CudaPath>(comm, call.device);
  } else if (comm.cuda_->device_ != call.device) {
    PYC_THROW(InvalidArgument,
              "pycollectives: rank "
                  << comm.rank_ << ": " << op_kind_name(kind) << ": the buffers are on "
                  << device_name(call.device) << ", but this communicator's CUDA operations run on "
                  << device_name(comm.cuda_->device_) << " (fixed by its first CUDA operation)");
  }
  return comm.cuda_;
}

void CudaPath::check_buffer(const void* p, size_t bytes, OpKind kind, const char* arg) const {
  if (bytes == 0) return;
  cudaPointerAttributes a{};
  const cudaError_t err = cudaPointerGetAttributes(&a, p);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    PYC_THROW(InvalidArgument, "pycollectives: rank "
                                   << comm_.rank_ << ": " << op_kind_name(kind) << ": " << arg
                                   << " is not CUDA memory (cudaPointerGetAttributes: "
                                   << cudaGetErrorString(err) << ")");
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    PYC_THROW(InvalidArgument, "pycollectives: rank " << comm_.rank_ << ": " << op_kind_name(kind)
                                                      << ": " << arg
                                                      << " is host memory, not device memory of "
                                                      << device_name(device_));
  if (a.device != device_)
    PYC_THROW(InvalidArgument, "pycollectives: rank " << comm_.rank_ << ": " << op_kind_name(kind)
                                                      << ": " << arg << " is on "
                                                      << device_name(a.device) << ", not "
                                                      << device_name(device_));
}

void CudaPath::check_peer(int peer, const char* what, OpKind kind) const {
  comm_.check_rank(peer, what, kind);
  if (peer == comm_.rank_)
    PYC_THROW(InvalidArgument, "pycollectives: rank " << comm_.rank_ << ": " << op_kind_name(kind)
                                                      << ": " << what << "=" << peer
                                                      << " is this rank");
  if (!collective_issued_.load())
    PYC_THROW(InvalidArgument,
              "pycollectives: rank "
                  << comm_.rank_ << ": " << op_kind_name(kind)
                  << ": CUDA point-to-point needs the CUDA transport, which the first CUDA "
                     "collective of the communicator sets up; run one first on every rank (e.g. "
                     "all_reduce of a one-element CUDA tensor)");
}

std::shared_ptr<CudaWork> CudaPath::issue(const OpSig& sig, const CudaCall& call, int p2p_peer,
                                          OpFn fn) {
  auto w = std::make_shared<CudaWork>();
  w->device = device_;
  {
    DeviceGuard g(device_);
    // Only a stream with work still queued gets an event: recording one on an
    // idle stream would give the GPU work in this process's context.
    auto* caller = reinterpret_cast<cudaStream_t>(call.stream);
    const cudaError_t busy = cudaStreamQuery(caller);
    if (busy == cudaErrorNotReady) {
      (void)cudaGetLastError();
      w->issue_event = pool_->get();
      PYC_CUDA_CHECK(cudaEventRecord(w->issue_event->get(), caller));
    } else {
      PYC_CUDA_CHECK(busy);
    }
  }
  auto self = shared_from_this();  // queued operations keep the path alive
  Communicator::Body body = [self, w, collective = p2p_peer < 0, fn = std::move(fn),
                             caller = std::this_thread::get_id()](OpCtx& c) {
    self->run(c, *w, collective, fn, std::this_thread::get_id() == caller);
  };
  // A synchronous collective runs on the caller's thread (when nothing is
  // pending) once the direct path is set up: what was measured and tested on a
  // GPU. The staging ring and point-to-point still go through the engine.
  const bool async = !(call.sync && p2p_peer < 0 && direct_ready_.load());
  if (p2p_peer >= 0) {
    w->work = comm_.point_to_point(sig, p2p_peer, call.timeout_s, async, std::move(body));
  } else {
    collective_issued_.store(true);
    w->work = comm_.collective(sig, call.timeout_s, async, std::move(body));
  }
  return w;
}

void CudaPath::run(OpCtx& c, CudaWork& w, bool collective, const OpFn& fn, bool on_caller) {
  // The caller's thread gets its current device back. The engine's own thread
  // keeps ours (restoring device 0 there would create a context on it in a
  // process that does not use it).
  std::optional<DeviceGuard> guard;
  try {
    if (on_caller)
      guard.emplace(device_);
    else
      PYC_CUDA_CHECK(cudaSetDevice(device_));
    if (!links_) {
      // Only a collective may set up (every rank runs it); a send/recv was
      // admitted after a CUDA collective was issued, so that one failed.
      if (!collective)
        PYC_THROW(Aborted, "pycollectives: rank "
                               << rank()
                               << ": CUDA point-to-point: the CUDA transport was not set up (the "
                                  "first CUDA collective failed)");
      setup(c);
    }
    issue_ = w.issue_event ? w.issue_event->get() : nullptr;
    host_only_ = false;
    exec_->begin();
    c.exec = exec_.get();
    c.links = links_.get();
    fn(c, *this);
    if (host_only_) {
      w.set_recorded(true);
    } else {
      after_issue();  // an operation that launched nothing still orders after the caller
      w.final_event = pool_->get();  // only the staging path needs one
      PYC_CUDA_CHECK(cudaEventRecord(w.final_event->get(), stream_));
      w.set_recorded(false);
    }
    links_->drain(*c.mon);
    if (ctl_linked_ && ctl_.data() &&
        static_cast<CtlHeader*>(ctl_.data())->attached.load() == static_cast<uint32_t>(nranks())) {
      // Every rank has mapped it: nothing stays in /dev/shm. Every rank
      // removes the name (the first succeeds), so that rank 0 dying now
      // leaves nothing behind either.
      ctl_linked_ = false;
      if (rank() == 0)
        ctl_.unlink();
      else
        ShmSegment::unlink_name(ctl_.name());
    }
  } catch (...) {
    w.set_failed();
    throw;
  }
}

void CudaPath::collective(OpCtx& c, const void* in, size_t in_bytes, void* out, size_t out_bytes,
                          const std::function<void(const IpcView&)>& direct,
                          const std::function<void()>& staging) {
  if (direct_ && (in_bytes > 0 || out_bytes > 0)) {
    const bool ok = direct_->run(in, in_bytes, out, out_bytes, issue_, *c.mon, direct);
    issue_ = nullptr;  // waited for, on the host or by the stream
    if (ok) {
      c.path = Path::kDirect;
      host_only_ = true;
      return;
    }
  }
  after_issue();
  staging();
}

void CudaPath::after_issue() {
  if (issue_ != nullptr) PYC_CUDA_CHECK(cudaStreamWaitEvent(stream_, issue_, 0));
  issue_ = nullptr;
}

}  // namespace pyc
