// Offsets of the shared-memory segment (see shm_layout.h).
#include "transport/shm_layout.h"

namespace pyc {
namespace {
size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
}  // namespace

ShmLayout::ShmLayout(int n, uint32_t ns, size_t sb, size_t ob)
    : world_size(n),
      nslots(ns),
      slot_bytes(round_up(sb, kAlign)),
      oneshot_bytes(round_up(ob, kAlign)) {
  const size_t pairs = static_cast<size_t>(n) * static_cast<size_t>(n - 1);
  rank_ctl_off = round_up(sizeof(SegmentHeader), 4096);
  fifo_ctl_off = round_up(rank_ctl_off + n * sizeof(RankCtl), 4096);
  fifo_data_off = round_up(fifo_ctl_off + pairs * sizeof(FifoCtl), 4096);
  oneshot_off = round_up(fifo_data_off + pairs * nslots * slot_stride(), 4096);
  total = round_up(oneshot_off + static_cast<size_t>(n) * 2 * oneshot_stride(), 4096);
}

RankCtl* ShmLayout::rank_ctl(void* base, int r) const {
  return reinterpret_cast<RankCtl*>(static_cast<char*>(base) + rank_ctl_off) + r;
}

FifoCtl* ShmLayout::fifo_ctl(void* base, int src, int dst) const {
  return reinterpret_cast<FifoCtl*>(static_cast<char*>(base) + fifo_ctl_off) + pair(src, dst);
}

char* ShmLayout::fifo_slots(void* base, int src, int dst) const {
  return static_cast<char*>(base) + fifo_data_off + pair(src, dst) * nslots * slot_stride();
}

OneShotHeader* ShmLayout::oneshot(void* base, int r, int parity) const {
  return reinterpret_cast<OneShotHeader*>(static_cast<char*>(base) + oneshot_off +
                                          (2 * static_cast<size_t>(r) + parity) * oneshot_stride());
}

}  // namespace pyc
