// Offsets of the shared-memory segment (see shm_layout.h).
#include "transport/shm/shm_layout.h"

#include "core/error.h"

namespace pyc {
namespace {

// Overflow-checked size arithmetic: the sizes come from the environment or
// from a peer's header, and a wrapped total once made a tiny segment that
// every rank then wrote past.
struct Sizes {
  int n;
  uint32_t nslots;
  size_t slot_bytes, oneshot_bytes;

  size_t add(size_t a, size_t b) const {
    size_t r;
    if (__builtin_add_overflow(a, b, &r)) fail();
    return r;
  }
  size_t mul(size_t a, size_t b) const {
    size_t r;
    if (__builtin_mul_overflow(a, b, &r)) fail();
    return r;
  }
  size_t round_up(size_t x, size_t a) const { return add(x, a - 1) / a * a; }
  [[noreturn]] void fail() const {
    PYC_THROW(InvalidArgument, "pycollectives: the shared-memory segment of "
                                   << n << " ranks with " << nslots << " slots of " << slot_bytes
                                   << " bytes (PYCOLL_NSLOTS, PYCOLL_SLOT_BYTES) and one-shot "
                                      "areas of "
                                   << oneshot_bytes
                                   << " bytes (PYCOLL_ONESHOT_BYTES) would not fit the address "
                                      "space");
  }
};

}  // namespace

ShmLayout::ShmLayout(int n, uint32_t ns, size_t sb, size_t ob) : world_size(n), nslots(ns) {
  const Sizes z{n, ns, sb, ob};
  if (n < 1) z.fail();
  slot_bytes = z.round_up(sb, kAlign);
  oneshot_bytes = z.round_up(ob, kAlign);
  const size_t ranks = static_cast<size_t>(n);
  const size_t pairs = z.mul(ranks, ranks - 1);
  rank_ctl_off = z.round_up(sizeof(SegmentHeader), 4096);
  fifo_ctl_off = z.round_up(z.add(rank_ctl_off, z.mul(ranks, sizeof(RankCtl))), 4096);
  fifo_data_off = z.round_up(z.add(fifo_ctl_off, z.mul(pairs, sizeof(FifoCtl))), 4096);
  const size_t stride = z.add(sizeof(SlotHeader), slot_bytes);
  oneshot_off = z.round_up(z.add(fifo_data_off, z.mul(z.mul(pairs, nslots), stride)), 4096);
  const size_t oneshot_stride = z.add(sizeof(OneShotHeader), oneshot_bytes);
  agree_off = z.round_up(z.add(oneshot_off, z.mul(z.mul(ranks, 2), oneshot_stride)), 4096);
  agree_stride = z.round_up(z.add(sizeof(AgreeCtl), z.mul(ranks, 2)), kAlign);
  total = z.round_up(z.add(agree_off, z.mul(ranks, agree_stride)), 4096);
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

AgreeCtl* ShmLayout::agree(void* base, int r) const {
  return reinterpret_cast<AgreeCtl*>(static_cast<char*>(base) + agree_off +
                                     static_cast<size_t>(r) * agree_stride);
}

uint8_t* ShmLayout::verdicts(void* base, int r, int which) const {
  return reinterpret_cast<uint8_t*>(agree(base, r)) + sizeof(AgreeCtl) +
         static_cast<size_t>(which) * static_cast<size_t>(world_size);
}

}  // namespace pyc
