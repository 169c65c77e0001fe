// A symmetric shared-memory window: every rank of a communicator holds a
// buffer of the same size in its own segment and maps every peer's, so an
// algorithm reads and writes the peers' buffers in place instead of copying
// through slots (as NCCL's registered buffers and symmetric memory). Created
// collectively by Communicator::alloc_window.
#pragma once

#include <cstddef>
#include <vector>

#include "transport/shm/shm_segment.h"

namespace pyc {

class ShmWindow {
 public:
  // segs[r]: rank r's segment as mapped by this process (this rank's own included).
  ShmWindow(int id, int rank, size_t bytes, std::vector<ShmSegment> segs);

  int id() const { return id_; }
  size_t bytes() const { return bytes_; }
  // Rank r's buffer, mapped here.
  char* base(int r) const { return static_cast<char*>(segs_[r].data()); }
  char* local() const { return base(rank_); }
  // Whether [p, p + n) lies in this rank's buffer; sets *off to its offset.
  bool contains(const void* p, size_t n, size_t* off) const;

 private:
  int id_, rank_;
  size_t bytes_;
  std::vector<ShmSegment> segs_;
};

}  // namespace pyc
