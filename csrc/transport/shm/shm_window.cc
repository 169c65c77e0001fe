#include "transport/shm/shm_window.h"

#include <cstdint>

namespace pyc {

ShmWindow::ShmWindow(int id, int rank, size_t bytes, std::vector<ShmSegment> segs)
    : id_(id), rank_(rank), bytes_(bytes), segs_(std::move(segs)) {}

bool ShmWindow::contains(const void* p, size_t n, size_t* off) const {
  const auto a = reinterpret_cast<uintptr_t>(p), b = reinterpret_cast<uintptr_t>(local());
  if (a < b || a - b > bytes_ || n > bytes_ - (a - b)) return false;
  *off = a - b;
  return true;
}

}  // namespace pyc
