// Communicator: symmetric shared-memory windows (alloc_shared): their
// collective allocation, and finding the window a buffer lies in.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <sstream>
#include <vector>

#include "algo/algorithms.h"
#include "comm/communicator.h"
#include "core/error.h"

namespace pyc {

std::shared_ptr<ShmWindow> Communicator::find_window(const void* p, size_t n, uint64_t* where) {
  *where = 0;
  if (n == 0 || algo_ == Algo::kRing || !any_window_.load(std::memory_order_acquire))
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
    RankCtl* ctl = layout_.rank_ctl(seg_.data(), p);
    v.data[p] = win.base(p) + off;
    v.reduced[p] = &ctl->reduced;
    v.gathered[p] = &ctl->gathered;
  }
  return v;
}

std::shared_ptr<ShmWindow> Communicator::alloc_window(size_t bytes, double timeout_s) {
  check_open(OpKind::kBarrier);
  if (timeout_s < 0) timeout_s = timeout_s_;
  const size_t page = 4096, size = std::max<size_t>(page, (bytes + page - 1) / page * page);
  const int id = next_window_++;
  auto name = [&](int r) {
    std::ostringstream os;
    os << seg_.name() << ".w" << id << "." << r;
    return os.str();
  };
  std::vector<ShmSegment> segs(n_);
  try {
    segs[rank_] = ShmSegment::create(name(rank_), size);
  } catch (const std::exception& e) {
    set_abort(AbortKind::kError, e.what());  // the peers must not wait for this window
    throw;
  }
  barrier(false, timeout_s);  // every rank created its buffer
  try {
    for (int p = 0; p < n_; ++p)
      if (p != rank_) segs[p] = ShmSegment::open(name(p), size, timeout_s);
  } catch (const std::exception& e) {
    set_abort(AbortKind::kError, e.what());
    throw;
  }
  barrier(false, timeout_s);  // every rank mapped every buffer: no name is needed any more
  segs[rank_].unlink();
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
