// Shared-memory slot FIFO between two processes of one host: the sender
// writes a slot and advances `tail`; the receiver reads it and advances `head`
// (NCCL's Simple protocol: bulk data, then a flag).
#pragma once

#include "transport/conn.h"
#include "transport/shm/shm_layout.h"

namespace pyc {

class ShmSendConn final : public SendConn {
 public:
  // src, dst: indices in the segment (local ranks); peer: dst's rank in the
  // communicator (named by the monitor).
  ShmSendConn(const ShmLayout& layout, void* base, int src, int dst, int peer);
  size_t slot_bytes() const override { return slot_bytes_; }
  void* acquire(WaitMonitor& mon) override;
  bool ready() override;
  void post(const SlotTag& tag, size_t bytes) override;

 private:
  FifoCtl* ctl_;
  char* slots_;
  size_t stride_, slot_bytes_;
  uint32_t nslots_;
  int peer_;
  uint32_t tail_ = 0;         // slots posted (mirror of ctl_->tail)
  uint32_t head_cached_ = 0;  // last head seen
};

class ShmRecvConn final : public RecvConn {
 public:
  ShmRecvConn(const ShmLayout& layout, void* base, int src, int dst, int peer);
  size_t slot_bytes() const override { return slot_bytes_; }
  RecvSlot wait(WaitMonitor& mon) override;
  bool ready() override;
  void release() override;

 private:
  FifoCtl* ctl_;
  char* slots_;
  size_t stride_, slot_bytes_;
  uint32_t nslots_;
  int peer_;
  uint32_t head_ = 0;         // slots released (mirror of ctl_->head)
  uint32_t tail_cached_ = 0;  // last tail seen
};

}  // namespace pyc
