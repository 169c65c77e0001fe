// The direct CUDA IPC path (see ipc_direct.h).
#include "cuda/ipc_direct.h"

#include <cuda.h>  // CUdeviceptr, CUresult: types only, the driver is reached through the runtime

#include <cstring>

#include "core/error.h"
#include "cuda/check.h"
#include "cuda/cuda_transport.h"

namespace pyc {
namespace {

// Peer allocations kept mapped per peer before the cache is emptied (after
// the stream is synchronised, so that no queued kernel still uses them).
constexpr size_t kMaxMapped = 256;
// Own allocations whose handles are kept (a training step reuses a few).
constexpr size_t kMaxExported = 64;

using GetAttributes = CUresult (*)(unsigned, CUpointer_attribute*, void**, CUdeviceptr);

// cuPointerGetAttributes, looked up once through the runtime (the extension
// links no libcuda); null if the driver does not provide it.
GetAttributes attributes_fn() {
  static const GetAttributes fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<GetAttributes>(p);
  }();
  return fn;
}

std::string key(const cudaIpcMemHandle_t& h) {
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

}  // namespace

IpcDirect::IpcDirect(int rank, int nranks, cudaStream_t stream, bool one_worker)
    : rank_(rank), n_(nranks), stream_(stream), one_worker_(one_worker), mapped_(nranks) {
  PYC_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
}

IpcDirect::~IpcDirect() {
  for (auto& peer : mapped_)
    for (auto& [k, base] : peer) (void)cudaIpcCloseMemHandle(base);
  if (done_) (void)cudaEventDestroy(done_);
  (void)cudaGetLastError();
}

bool IpcDirect::export_buffer(const void* p, cudaIpcMemHandle_t* h, uint64_t* off) {
  const GetAttributes get = attributes_fn();
  CUdeviceptr base = 0;
  unsigned long long id = 0;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                 CU_POINTER_ATTRIBUTE_BUFFER_ID};
  void* data[] = {&base, &id};
  if (get == nullptr || get(2, attrs, data, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS ||
      base == 0)
    return false;
  const auto b = static_cast<uintptr_t>(base);
  *off = reinterpret_cast<uintptr_t>(p) - b;
  // Cached by (base, id): a freed and reallocated allocation at the same
  // address has a new id, so a stale handle (the old memory) is never sent.
  for (auto it = exported_.rbegin(); it != exported_.rend(); ++it) {
    if (it->base == b && it->id == id) {
      *h = it->handle;
      return true;
    }
  }
  if (cudaIpcGetMemHandle(h, reinterpret_cast<void*>(base)) != cudaSuccess) {
    (void)cudaGetLastError();  // e.g. memory of a stream-ordered pool
    return false;
  }
  if (exported_.size() >= kMaxExported) exported_.erase(exported_.begin());
  exported_.push_back({b, id, *h});
  return true;
}

char* IpcDirect::map(int peer, const cudaIpcMemHandle_t& h) {
  auto& cache = mapped_[peer];
  const std::string k = key(h);
  if (auto it = cache.find(k); it != cache.end()) return it->second;
  if (cache.size() >= kMaxMapped) {
    PYC_CUDA_CHECK(cudaStreamSynchronize(stream_));
    for (auto& [old, base] : cache) PYC_CUDA_CHECK(cudaIpcCloseMemHandle(base));
    cache.clear();
  }
  void* base = nullptr;
  PYC_CUDA_CHECK(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess));
  cache.emplace(k, static_cast<char*>(base));
  return static_cast<char*>(base);
}

bool IpcDirect::run(const void* in, size_t in_bytes, void* out, size_t out_bytes, cudaEvent_t issue,
                    WaitMonitor& mon, const std::function<void(const IpcView&)>& kernels) {
  PYC_ASSERT(ctls_ != nullptr);
  const uint32_t seq = ++seq_;
  DirectCtl& me = ctls_[rank_];
  const bool worker = !one_worker_ || rank_ == 0;

  // 1. Export; ready once the caller's earlier work has completed.
  bool ok = true;
  if (in_bytes > 0) ok = export_buffer(in, &me.in_mem, &me.in_off);
  if (ok && out_bytes > 0) {
    if (out == in) {
      me.out_mem = me.in_mem;
      me.out_off = me.in_off;
    } else {
      ok = export_buffer(out, &me.out_mem, &me.out_off);
    }
  }
  me.ok = ok ? 1 : 0;
  if (issue != nullptr) {
    mon.peer = -1;
    if (one_worker_ && worker)
      PYC_CUDA_CHECK(cudaStreamWaitEvent(stream_, issue, 0));  // only our kernels touch our buffer
    else
      wait_event(issue, mon);
  }
  publish(me.ready, seq);  // release: the record is visible first

  // 2. Every peer ready: a worker maps, launches and waits for its kernels.
  bool all_ok = ok;
  for (int p = 0; p < n_; ++p) {
    if (p == rank_) continue;
    mon.peer = p;
    wait_reached(ctls_[p].ready, seq, mon);
    all_ok = all_ok && ctls_[p].ok != 0;
  }
  if (all_ok && worker) {
    IpcView v;
    v.in.assign(n_, nullptr);
    v.out.assign(n_, nullptr);
    v.in[rank_] = static_cast<const char*>(in);
    v.out[rank_] = static_cast<char*>(out);
    v.one_worker = one_worker_;
    for (int p = 0; p < n_; ++p) {
      if (p == rank_) continue;
      const DirectCtl& c = ctls_[p];
      if (in_bytes > 0) v.in[p] = map(p, c.in_mem) + c.in_off;
      if (out_bytes > 0) v.out[p] = map(p, c.out_mem) + c.out_off;
    }
    kernels(v);
    PYC_CUDA_CHECK(cudaEventRecord(done_, stream_));
    mon.peer = -1;
    wait_event(done_, mon);
  }

  // 3. Done everywhere: every kernel of the operation has completed.
  publish(me.done, seq);
  for (int p = 0; p < n_; ++p) {
    if (p == rank_) continue;
    mon.peer = p;
    wait_reached(ctls_[p].done, seq, mon);
  }
  mon.peer = -1;
  return all_ok;
}

}  // namespace pyc
