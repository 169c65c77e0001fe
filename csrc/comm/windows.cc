// Communicator: symmetric shared-memory windows (alloc_shared): their
// collective allocation, and finding the window a buffer lies in.
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

#include "algo/algorithms.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "core/process.h"

namespace pyc {

std::shared_ptr<ShmWindow> Communicator::find_window(const void* p, size_t n, uint64_t* where) {
  *where = 0;
  // Across hosts a window is mapped by its host's ranks only: its buffers
  // are plain ones to the collectives.
  if (n == 0 || algo_ == Algo::kRing || multi_host() ||
      !any_window_.load(std::memory_order_acquire))
    return nullptr;
  std::lock_guard<std::mutex> lk(windows_mu_);
  for (const auto& w : windows_) {
    std::shared_ptr<ShmWindow> win = w.lock();
    size_t off = 0;
    if (win && win->contains(p, n, &off) && off < (uint64_t{1} << 40)) {
      *where = static_cast<uint64_t>(win->id() + 1) << 40 | off;
      return win;
    }
  }
  return nullptr;
}

DirectView Communicator::direct_view(const ShmWindow& win, uint64_t where) {
  DirectView v;
  const size_t off = where & ((uint64_t{1} << 40) - 1);
  for (int p = 0; p < n_; ++p) {
    RankCtl* rc = ctl(p);
    v.data[p] = win.base(p) + off;
    v.reduced[p] = &rc->reduced;
    v.gathered[p] = &rc->gathered;
  }
  return v;
}

std::shared_ptr<ShmWindow> Communicator::alloc_window(size_t bytes, double timeout_s) {
  const OpKind kind = OpKind::kAllocShared;
  check_issue(kind);
  timeout_s = op_timeout(timeout_s, kind);
  const size_t page = 4096;
  if (bytes > (size_t{1} << 48))
    PYC_THROW(InvalidArgument, "pycollectives: rank " << rank_ << ": alloc_shared: " << bytes
                                                      << " bytes is more than any host has");
  const size_t size = std::max<size_t>(page, (bytes + page - 1) / page * page);
  const int id = next_window_++;
  // Every collective step is of kind kAllocShared with the size asked for: a
  // rank that asks for another size, or calls another collective, gets a
  // CollectiveMismatch naming both on every rank.
  const OpSig sig{kind, DataType::kUInt8, ReduceOp::kSum, -1, bytes};
  // A name with 64 random bits, which no other user can take first (with a
  // predictable one, anyone could create it and make this fail); the ranks
  // exchange them through the segment.
  constexpr size_t kName = 128;
  std::vector<char> mine(kName, 0), all(kName * n_, 0);
  std::ostringstream os;
  os << seg_.name() << ".w" << id << "." << rank_ << "." << ShmSegment::random_hex();
  PYC_ASSERT(os.str().size() < kName);
  std::memcpy(mine.data(), os.str().data(), os.str().size());
  collective(sig, timeout_s, false,
             [&](OpCtx& c) { ring_all_gather(c, mine.data(), all.data(), kName); });
  std::vector<std::string> names(n_);
  for (int p = 0; p < n_; ++p) names[p].assign(&all[kName * p], strnlen(&all[kName * p], kName));
  // From here on a name may exist in /dev/shm: whatever fails (this rank or
  // a peer, which then raises PeerFailure here), every name goes, a dead
  // rank's too, and so does every name once every rank has mapped every
  // buffer. Only between one rank's create and the last rank's mapping can
  // a crash of every rank leave one behind.
  auto unlink_all = [&names, this] {  // this host's (another host's ranks remove theirs)
    for (int p = 0; p < n_; ++p)
      if (topo_.same_host(p)) (void)shm_unlink(names[p].c_str());
  };
  std::vector<ShmSegment> segs(n_);
  try {
    segs[rank_] = ShmSegment::create(names[rank_], size);
    fault_point("window.created");
    sync(sig, timeout_s);         // every rank created its buffer
    for (int p = 0; p < n_; ++p)  // this host's (another host's cannot be mapped)
      if (p != rank_ && topo_.same_host(p))
        segs[p] = ShmSegment::open(names[p], size, timeout_s, kNoCheck, size);
    fault_point("window.mapped");
    sync(sig, timeout_s);  // every rank mapped every buffer: no name is needed any more
  } catch (const std::exception& e) {
    set_abort(AbortKind::kError, e.what());  // the peers must not wait for this window
    unlink_all();
    throw;
  }
  segs[rank_].unlink();
  for (int p = 0; p < n_; ++p)
    if (p != rank_ && topo_.same_host(p))
      ShmSegment::unlink_name(names[p]);  // ENOENT: its rank was first
  auto win = std::make_shared<ShmWindow>(id, rank_, bytes, std::move(segs));
  std::lock_guard<std::mutex> lk(windows_mu_);
  windows_.erase(std::remove_if(windows_.begin(), windows_.end(),
                                [](const std::weak_ptr<ShmWindow>& w) { return w.expired(); }),
                 windows_.end());
  windows_.push_back(win);
  any_window_.store(true, std::memory_order_release);
  return win;
}

}  // namespace pyc
