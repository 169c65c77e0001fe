// The CUDA path of a Communicator (see cuda_path.h): the per-communicator
// stream, staging memory and IPC links, set up at the first CUDA collective,
// and the operations, run by the progress engine over the algorithm layer.
#include "cuda/cuda_path.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>

#include "algo/algorithms.h"
#include "algo/prims.h"
#include "core/env.h"
#include "cuda/check.h"
#include "cuda/cuda_transport.h"
#include "cuda/ipc_algos.h"
#include "cuda/ipc_direct.h"
#include "cuda/kernels.h"
#include "transport/shm_segment.h"

namespace pyc {
namespace {

// PYCOLL_CUDA_SLOT_BYTES default: large slots amortize the host round trip
// of each ring step (event query, publish, the peer's poll and launch);
// smaller ones as the staging memory, (n-1) x nslots x slot, grows with n.
size_t default_slot_bytes(int n) { return n <= 4 ? 16 << 20 : n <= 8 ? 8 << 20 : 4 << 20; }
constexpr uint32_t kDefaultNSlots = 4;  // PYCOLL_CUDA_NSLOTS

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// What each rank tells the others at the first CUDA collective.
struct PeerInfo {
  cudaIpcMemHandle_t mem;  // this rank's staging buffer (its incoming FIFOs)
  char uuid[16];           // its device (ordinals differ between processes)
  char ctl_name[64];       // rank 0: the name of the control segment
  uint64_t slot_bytes;
  uint32_t nslots;
  int32_t pid;
  uint32_t direct;  // 1: this rank may take the direct path
};

// The host segment of the CUDA FIFOs' control words, created by rank 0.
struct CtlHeader {
  alignas(64) std::atomic<uint32_t> attached;  // ranks that mapped it
};

// Layout: the header, the n(n-1) FIFO control blocks, their slot headers, the
// n records of the direct path.
size_t ctl_bytes(int n, uint32_t nslots) {
  const size_t pairs = static_cast<size_t>(n) * static_cast<size_t>(n - 1);
  return round_up(sizeof(CtlHeader), kAlign) + pairs * sizeof(FifoCtl) +
         pairs * nslots * sizeof(SlotHeader) + static_cast<size_t>(n) * sizeof(DirectCtl);
}

// Index of the FIFO src -> dst among all n(n-1), as ShmLayout::pair.
size_t pair_index(int n, int src, int dst) {
  return static_cast<size_t>(src) * (n - 1) + (dst < src ? dst : dst - 1);
}

// Position of src's FIFO among dst's n-1 incoming FIFOs (in dst's staging buffer).
size_t in_index(int src, int dst) { return static_cast<size_t>(src < dst ? src : src - 1); }

std::string device_name(int d) { return "cuda:" + std::to_string(d); }

}  // namespace

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
    using Clock = std::chrono::steady_clock;
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
    std::unique_lock<std::mutex> lk(m_);
    // The operation may also fail before its body runs (an abort, a peer's
    // error, the lead check): then only the core Work completes, so look at
    // it too, every millisecond.
    while (!recorded_ && !failed_ && !work->is_completed()) {
      if (timeout_s >= 0 && Clock::now() >= deadline) return false;
      cv_.wait_for(lk, std::chrono::milliseconds(1));
    }
    recorded = recorded_;
    host_only = host_only_;
  }
  // Failed before its last kernel was enqueued: Work::wait rethrows (the
  // engine finishes the Work right after the body throws). An error found
  // later (while draining) is rethrown once the Work has completed.
  if (!recorded || work->is_completed()) work->wait(-1);
  if (!recorded || host_only) return true;  // host_only: complete, nothing to wait for
  DeviceGuard g(device);
  PYC_CUDA_CHECK(
      cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), final_event->get(), 0));
  return true;
}

bool CudaWork::wait_host(double timeout_s) { return work->wait(timeout_s); }

bool CudaWork::is_completed() { return work->is_completed(); }

// ---- CudaPath ----

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
  // (a collective, or point-to-point with p2p_peer >= 0).
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
  void run(OpCtx& c, CudaWork& w, bool collective, const OpFn& fn);
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
  // Of the operation being run (engine thread): the caller's issue event not
  // yet waited for (null: none, or done), and whether the operation completed
  // on the host (the direct path), so that no stream has to wait for it.
  cudaEvent_t issue_ = nullptr;
  bool host_only_ = false;
  std::atomic<bool> collective_issued_{false};
  void* staging_ = nullptr;
  std::vector<void*> peer_base_;
  ShmSegment ctl_;
  bool ctl_linked_ = false;  // rank 0: the control segment still has its name
};

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
  comm.check_open(kind);
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
  Communicator::Body body = [self, w, collective = p2p_peer < 0, fn = std::move(fn)](OpCtx& c) {
    self->run(c, *w, collective, fn);
  };
  if (p2p_peer >= 0) {
    w->work = comm_.point_to_point(sig, p2p_peer, call.timeout_s, true, std::move(body));
  } else {
    collective_issued_.store(true);
    w->work = comm_.collective(sig, call.timeout_s, true, std::move(body));
  }
  return w;
}

void CudaPath::run(OpCtx& c, CudaWork& w, bool collective, const OpFn& fn) {
  try {
    // The engine's own thread: set, never restored (restoring device 0 would
    // create a context there in a process that does not use it).
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
      ctl_.unlink();  // every rank has mapped it: nothing stays in /dev/shm
      ctl_linked_ = false;
    }
  } catch (...) {
    w.set_failed();
    throw;
  }
}

void CudaPath::setup(OpCtx& c) {
  const int n = comm_.n_, r = comm_.rank_;
  std::vector<CudaFifo> out(n), in(n);
  if (n == 1) {
    links_ = std::make_unique<CudaLinks>(comm_, r, n, 1, kAlign, *exec_, out, in);
    return;
  }
  PeerInfo mine;
  std::memset(&mine, 0, sizeof(mine));
  mine.slot_bytes = round_up(env_size("PYCOLL_CUDA_SLOT_BYTES", default_slot_bytes(n), 1), 4096);
  mine.nslots = static_cast<uint32_t>(env_size("PYCOLL_CUDA_NSLOTS", kDefaultNSlots, kMinSlots));
  mine.pid = static_cast<int32_t>(getpid());
  cudaDeviceProp prop{};
  PYC_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  static_assert(sizeof(prop.uuid) == sizeof(mine.uuid), "cudaUUID_t is 16 bytes");
  std::memcpy(mine.uuid, &prop.uuid, sizeof(mine.uuid));
  const size_t fifo_bytes = static_cast<size_t>(mine.nslots) * mine.slot_bytes;
  const size_t staging_bytes = static_cast<size_t>(n - 1) * fifo_bytes;
  if (const cudaError_t e = cudaMalloc(&staging_, staging_bytes); e != cudaSuccess) {
    (void)cudaGetLastError();
    staging_ = nullptr;
    PYC_THROW(Error, "pycollectives: rank "
                         << r << ": cannot allocate " << staging_bytes
                         << " bytes of staging memory on " << device_name(device_) << " (" << n - 1
                         << " peers x " << mine.nslots << " slots x " << mine.slot_bytes
                         << " bytes): " << cudaGetErrorString(e) << " at " << __FILE__ << ":"
                         << __LINE__ << "; lower PYCOLL_CUDA_SLOT_BYTES / PYCOLL_CUDA_NSLOTS");
  }
  PYC_CUDA_CHECK(cudaIpcGetMemHandle(&mine.mem, staging_));
  // The direct path: on unless the staging ring is forced, for as many ranks
  // as one reduction kernel takes sources.
  mine.direct = comm_.algo_ != Algo::kRing && n <= cuda::kMaxSrcs ? 1 : 0;
  const size_t cbytes = ctl_bytes(n, mine.nslots);
  if (r == 0) {
    const std::string name = ShmSegment::unique_name();
    PYC_ASSERT(name.size() < sizeof(mine.ctl_name));
    ctl_ = ShmSegment::create(name, cbytes);
    ctl_linked_ = true;
    std::memcpy(mine.ctl_name, name.c_str(), name.size());
  }

  // The exchange: a CPU all-gather over the shared-memory links, tagged as
  // this operation (every rank runs it at the same sequence number).
  std::vector<PeerInfo> all(n);
  {
    OpCtx g = c;
    g.dtype = DataType::kUInt8;
    g.op = ReduceOp::kSum;
    g.links = &comm_;
    g.exec = nullptr;
    ring_all_gather(g, &mine, all.data(), sizeof(PeerInfo));
  }
  for (int p = 1; p < n; ++p)
    if (all[p].slot_bytes != all[0].slot_bytes || all[p].nslots != all[0].nslots)
      PYC_THROW(InvalidArgument,
                "pycollectives: rank "
                    << r << ": PYCOLL_CUDA_SLOT_BYTES / PYCOLL_CUDA_NSLOTS differ: "
                    << "rank " << p << " uses " << all[p].nslots << " x " << all[p].slot_bytes
                    << " bytes, rank 0 " << all[0].nslots << " x " << all[0].slot_bytes
                    << "; set them alike on every rank");
  if (r != 0) {
    all[0].ctl_name[sizeof(all[0].ctl_name) - 1] = '\0';
    ctl_ = ShmSegment::open(all[0].ctl_name, cbytes, comm_.timeout_s_);
  }
  auto* hdr = static_cast<CtlHeader*>(ctl_.data());
  hdr->attached.fetch_add(1);

  // Map the peers' staging buffers; enable peer access where the device differs.
  int ndev = 0;
  PYC_CUDA_CHECK(cudaGetDeviceCount(&ndev));
  peer_base_.assign(n, nullptr);
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    if (std::memcmp(all[p].uuid, mine.uuid, sizeof(mine.uuid)) != 0) {
      for (int d = 0; d < ndev; ++d) {
        cudaDeviceProp pp{};
        PYC_CUDA_CHECK(cudaGetDeviceProperties(&pp, d));
        if (std::memcmp(&pp.uuid, all[p].uuid, sizeof(mine.uuid)) != 0) continue;
        int can = 0;
        PYC_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, device_, d));
        if (!can)
          PYC_THROW(Error, "pycollectives: rank " << r << ": " << device_name(device_)
                                                  << " cannot access the device of rank " << p
                                                  << " (" << device_name(d)
                                                  << " here) peer to peer");
        const cudaError_t e = cudaDeviceEnablePeerAccess(d, 0);
        if (e == cudaErrorPeerAccessAlreadyEnabled)
          (void)cudaGetLastError();
        else
          PYC_CUDA_CHECK(e);
      }
      // A device this process cannot see (CUDA_VISIBLE_DEVICES): the IPC open
      // below enables access lazily.
    }
    PYC_CUDA_CHECK(
        cudaIpcOpenMemHandle(&peer_base_[p], all[p].mem, cudaIpcMemLazyEnablePeerAccess));
  }

  auto* fifo_ctl = reinterpret_cast<FifoCtl*>(static_cast<char*>(ctl_.data()) +
                                              round_up(sizeof(CtlHeader), kAlign));
  auto* hdrs = reinterpret_cast<SlotHeader*>(fifo_ctl + static_cast<size_t>(n) * (n - 1));
  const uint32_t ns = mine.nslots;
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    const size_t o = pair_index(n, r, p), i = pair_index(n, p, r);
    out[p] = CudaFifo{fifo_ctl + o, hdrs + o * ns,
                      static_cast<char*>(peer_base_[p]) + in_index(r, p) * fifo_bytes};
    in[p] = CudaFifo{fifo_ctl + i, hdrs + i * ns,
                     static_cast<char*>(staging_) + in_index(p, r) * fifo_bytes};
  }
  links_ = std::make_unique<CudaLinks>(comm_, r, n, ns, mine.slot_bytes, *exec_, out, in);

  bool every_rank_direct = true, one_device = true;
  for (const PeerInfo& p : all) {
    every_rank_direct = every_rank_direct && p.direct == 1;
    one_device = one_device && std::memcmp(p.uuid, mine.uuid, sizeof(mine.uuid)) == 0;
  }
  if (every_rank_direct) {
    direct_ = std::make_unique<IpcDirect>(r, n, stream_, one_device);
    direct_->connect(reinterpret_cast<DirectCtl*>(hdrs + static_cast<size_t>(n) * (n - 1) * ns));
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
