// CUDA IPC transport: events, the kernel executor, the deferred FIFOs (see
// cuda_transport.h).
#include "cuda/cuda_transport.h"

#include <sched.h>
#include <time.h>

#include <chrono>

#include "comm/communicator.h"
#include "cuda/check.h"
#include "cuda/kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PYC_CUDA_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define PYC_CUDA_PAUSE() asm volatile("yield")
#else
#define PYC_CUDA_PAUSE() \
  do {                   \
  } while (0)
#endif

namespace pyc {
namespace {

using Clock = std::chrono::steady_clock;

// Wait tuning: poll (each poll also queries the pending events, ~1 us) for a
// while, then yield the core, then sleep in short slices: a kernel of a few
// MiB takes microseconds, and with several ranks per GPU the peer's kernel
// may need our core's process to get its turn.
constexpr int kSpinPolls = 512;
constexpr int kYieldPolls = 2048;
constexpr long kSleepNs = 20000;  // 20 us
constexpr auto kSlowPeriod = std::chrono::milliseconds(1);

}  // namespace

// ---- DeviceGuard, events ----

DeviceGuard::DeviceGuard(int device) {
  int cur = -1;
  PYC_CUDA_CHECK(cudaGetDevice(&cur));
  if (cur != device) {
    PYC_CUDA_CHECK(cudaSetDevice(device));
    prev_ = cur;
  }
}

DeviceGuard::~DeviceGuard() {
  if (prev_ >= 0 && cudaSetDevice(prev_) != cudaSuccess) (void)cudaGetLastError();
}

CudaEvent::~CudaEvent() {
  if (pool_) pool_->put(ev_);
}

bool event_done(cudaEvent_t ev) {
  const cudaError_t err = cudaEventQuery(ev);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: keep it out of the next launch check
    return false;
  }
  PYC_CUDA_CHECK(err);
  return true;
}

bool CudaEvent::done() {
  if (!done_) done_ = event_done(ev_);
  return done_;
}

EventPool::~EventPool() {
  // The process may be exiting with the runtime already torn down: ignore errors.
  for (cudaEvent_t ev : free_)
    if (cudaEventDestroy(ev) != cudaSuccess) (void)cudaGetLastError();
}

EventRef EventPool::get() {
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> lk(m_);
    if (!free_.empty()) {
      ev = free_.back();
      free_.pop_back();
    }
  }
  if (ev == nullptr) {
    DeviceGuard g(device_);
    PYC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  }
  return std::make_shared<CudaEvent>(ev, shared_from_this());
}

void EventPool::put(cudaEvent_t ev) noexcept {
  try {
    std::lock_guard<std::mutex> lk(m_);
    free_.push_back(ev);
  } catch (...) {
    if (cudaEventDestroy(ev) != cudaSuccess) (void)cudaGetLastError();
  }
}

// ---- CudaExec ----

void CudaExec::reduce(const ReduceArgs& args) {
  if (args.count == 0) return;
  cuda::reduce(args, stream_);
  dirty_ = true;
}

void CudaExec::scale_avg(void* x, DataType dtype, size_t count, int divisor) {
  if (count == 0) return;
  cuda::scale_avg(x, dtype, count, divisor, stream_);
  dirty_ = true;
}

void CudaExec::copy(void* dst0, void* dst1, const void* src, size_t bytes) {
  if (bytes == 0) return;
  cuda::copy(dst0, dst1, src, bytes, stream_);
  dirty_ = true;
}

EventRef CudaExec::mark() {
  if (dirty_) {
    EventRef ev = pool_->get();
    PYC_CUDA_CHECK(cudaEventRecord(ev->get(), stream_));
    last_ = std::move(ev);
    dirty_ = false;
  }
  return last_;
}

// ---- FIFOs ----

CudaSendConn::CudaSendConn(CudaLinks& links, const CudaFifo& f, int peer)
    : l_(links), f_(f), peer_(peer) {}

size_t CudaSendConn::slot_bytes() const { return l_.slot_bytes(); }

void* CudaSendConn::acquire(WaitMonitor& mon) {
  const uint32_t ns = l_.nslots();
  if (posted_ - head_cached_ >= ns)
    head_cached_ = l_.wait_counter(f_.ctl->head, posted_ - ns + 1, mon, peer_);
  return f_.slots + static_cast<size_t>(posted_ % ns) * l_.slot_bytes();
}

bool CudaSendConn::ready() {
  const uint32_t ns = l_.nslots();
  if (posted_ - head_cached_ >= ns)
    head_cached_ = f_.ctl->head.value.load(std::memory_order_acquire);
  return posted_ - head_cached_ < ns;
}

void CudaSendConn::post(const SlotTag& tag, size_t bytes) {
  pending_.push_back(Pending{l_.exec().mark(), tag, bytes});
  ++posted_;
  progress();
}

bool CudaSendConn::progress() {
  while (!pending_.empty()) {
    Pending& p = pending_.front();
    if (p.ev && !p.ev->done()) return false;
    SlotHeader* h = f_.hdrs + published_ % l_.nslots();
    h->seq = p.tag.seq;
    h->w0 = p.tag.w0;
    h->w1 = p.tag.w1;
    h->bytes = p.bytes;
    publish(f_.ctl->tail, ++published_);  // release store: the header is visible first
    pending_.pop_front();
  }
  return true;
}

CudaRecvConn::CudaRecvConn(CudaLinks& links, const CudaFifo& f, int peer)
    : l_(links), f_(f), peer_(peer) {}

size_t CudaRecvConn::slot_bytes() const { return l_.slot_bytes(); }

RecvSlot CudaRecvConn::wait(WaitMonitor& mon) {
  if (!reached(tail_cached_, consumed_ + 1))
    tail_cached_ = l_.wait_counter(f_.ctl->tail, consumed_ + 1, mon, peer_);
  const uint32_t i = consumed_ % l_.nslots();
  const SlotHeader* h = f_.hdrs + i;
  RecvSlot s;
  s.data = f_.slots + static_cast<size_t>(i) * l_.slot_bytes();
  s.bytes = h->bytes;
  s.tag.seq = h->seq;
  s.tag.w0 = h->w0;
  s.tag.w1 = h->w1;
  return s;
}

bool CudaRecvConn::ready() {
  if (!reached(tail_cached_, consumed_ + 1))
    tail_cached_ = f_.ctl->tail.value.load(std::memory_order_acquire);
  return reached(tail_cached_, consumed_ + 1);
}

void CudaRecvConn::release() {
  pending_.push_back(l_.exec().mark());
  ++consumed_;
  progress();
}

bool CudaRecvConn::progress() {
  while (!pending_.empty()) {
    const EventRef& ev = pending_.front();
    if (ev && !ev->done()) return false;
    publish(f_.ctl->head, ++released_);
    pending_.pop_front();
  }
  return true;
}

// ---- CudaLinks ----

CudaLinks::CudaLinks(Communicator& comm, int rank, int nranks, uint32_t nslots, size_t slot_bytes,
                     CudaExec& exec, const std::vector<CudaFifo>& out,
                     const std::vector<CudaFifo>& in)
    : comm_(comm), nslots_(nslots), slot_bytes_(slot_bytes), exec_(exec) {
  send_.resize(nranks);
  recv_.resize(nranks);
  for (int p = 0; p < nranks; ++p) {
    if (p == rank) continue;
    send_[p] = std::make_unique<CudaSendConn>(*this, out[p], p);
    recv_[p] = std::make_unique<CudaRecvConn>(*this, in[p], p);
  }
}

void CudaLinks::tag_mismatch(int peer, const SlotTag& got, const SlotTag& want) {
  comm_.tag_mismatch(peer, got, want);
}

bool CudaLinks::progress() {
  bool idle = true;
  for (auto& s : send_)
    if (s && !s->progress()) idle = false;
  for (auto& r : recv_)
    if (r && !r->progress()) idle = false;
  return idle;
}

void cuda_poll(const std::function<bool()>& done, WaitMonitor& mon) {
  Clock::time_point next_slow{};
  for (long i = 0;; ++i) {
    if (done()) return;
    if ((i & 15) == 15) mon.check_fast();
    if (i < kSpinPolls) {
      PYC_CUDA_PAUSE();
      continue;
    }
    const auto now = Clock::now();
    if (next_slow == Clock::time_point{}) {
      next_slow = now + kSlowPeriod;
    } else if (now >= next_slow) {
      mon.check_slow();  // timeout, dead peers, mismatch, Ctrl-C
      next_slow = now + kSlowPeriod;
    }
    if (i < kSpinPolls + kYieldPolls) {
      sched_yield();
    } else {
      const timespec ts{0, kSleepNs};
      nanosleep(&ts, nullptr);
    }
  }
}

uint32_t CudaLinks::wait_counter(Counter& ctr, uint32_t target, WaitMonitor& mon, int peer) {
  uint32_t v = ctr.value.load(std::memory_order_acquire);
  if (reached(v, target)) return v;
  mon.peer = peer;
  cuda_poll(
      [&] {
        progress();  // our own deferred posts/releases may be what the peer waits for
        v = ctr.value.load(std::memory_order_acquire);
        return reached(v, target);
      },
      mon);
  return v;
}

void CudaLinks::drain(WaitMonitor& mon) {
  if (progress()) return;
  mon.peer = -1;
  cuda_poll([this] { return progress(); }, mon);
}

void wait_event(cudaEvent_t ev, WaitMonitor& mon) {
  cuda_poll([ev] { return event_done(ev); }, mon);
}

}  // namespace pyc
