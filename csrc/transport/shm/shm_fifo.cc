// Shared-memory slot FIFO (see shm_fifo.h).
#include "transport/shm/shm_fifo.h"

namespace pyc {

ShmSendConn::ShmSendConn(const ShmLayout& l, void* base, int src, int dst, int peer)
    : ctl_(l.fifo_ctl(base, src, dst)),
      slots_(l.fifo_slots(base, src, dst)),
      stride_(l.slot_stride()),
      slot_bytes_(l.slot_bytes),
      nslots_(l.nslots),
      peer_(peer) {}

void* ShmSendConn::acquire(WaitMonitor& mon) {
  if (tail_ - head_cached_ >= nslots_) {
    mon.peer = peer_;
    head_cached_ = wait_reached(ctl_->head, tail_ - nslots_ + 1, mon);
  }
  return slots_ + (tail_ % nslots_) * stride_ + sizeof(SlotHeader);
}

bool ShmSendConn::ready() {
  if (tail_ - head_cached_ >= nslots_)
    head_cached_ = ctl_->head.value.load(std::memory_order_acquire);
  return tail_ - head_cached_ < nslots_;
}

void ShmSendConn::post(const SlotTag& tag, size_t bytes) {
  auto* h = reinterpret_cast<SlotHeader*>(slots_ + (tail_ % nslots_) * stride_);
  h->seq = tag.seq;
  h->w0 = tag.w0;
  h->w1 = tag.w1;
  h->bytes = bytes;
  publish(ctl_->tail, ++tail_);
}

ShmRecvConn::ShmRecvConn(const ShmLayout& l, void* base, int src, int dst, int peer)
    : ctl_(l.fifo_ctl(base, src, dst)),
      slots_(l.fifo_slots(base, src, dst)),
      stride_(l.slot_stride()),
      slot_bytes_(l.slot_bytes),
      nslots_(l.nslots),
      peer_(peer) {}

RecvSlot ShmRecvConn::wait(WaitMonitor& mon) {
  if (!reached(tail_cached_, head_ + 1)) {
    mon.peer = peer_;
    tail_cached_ = wait_reached(ctl_->tail, head_ + 1, mon);
  }
  const char* slot = slots_ + (head_ % nslots_) * stride_;
  const auto* h = reinterpret_cast<const SlotHeader*>(slot);
  RecvSlot s;
  s.data = slot + sizeof(SlotHeader);
  s.bytes = h->bytes;
  s.tag.seq = h->seq;
  s.tag.w0 = h->w0;
  s.tag.w1 = h->w1;
  return s;
}

bool ShmRecvConn::ready() {
  if (!reached(tail_cached_, head_ + 1))
    tail_cached_ = ctl_->tail.value.load(std::memory_order_acquire);
  return reached(tail_cached_, head_ + 1);
}

void ShmRecvConn::release() { publish(ctl_->head, ++head_); }

}  // namespace pyc
