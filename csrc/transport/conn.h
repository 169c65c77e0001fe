// One direction of a point-to-point link, pipelined through fixed-size slots.
// The algorithms (algo/) are written against these two interfaces only, so the
// shared-memory, CUDA IPC and TCP transports serve the same ring code.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/wait.h"

namespace pyc {

// Which operation a slot belongs to: the sender's sequence number and the
// packed OpSig, checked by the receiver.
struct SlotTag {
  uint32_t seq = 0;
  uint64_t w0 = 0, w1 = 0;
  bool operator==(const SlotTag& o) const { return seq == o.seq && w0 == o.w0 && w1 == o.w1; }
};

struct RecvSlot {
  const void* data = nullptr;
  size_t bytes = 0;
  SlotTag tag;
};

class SendConn {
 public:
  virtual ~SendConn() = default;
  virtual size_t slot_bytes() const = 0;
  // Waits until a slot is free and returns its payload (slot_bytes() bytes).
  virtual void* acquire(WaitMonitor& mon) = 0;
  // Whether a slot is free (acquire() would return at once); never blocks.
  virtual bool ready() = 0;
  // Hands the slot returned by the last acquire() to the receiver.
  virtual void post(const SlotTag& tag, size_t bytes) = 0;
};

class RecvConn {
 public:
  virtual ~RecvConn() = default;
  virtual size_t slot_bytes() const = 0;
  // Waits for the next slot and returns it; it stays valid until release().
  virtual RecvSlot wait(WaitMonitor& mon) = 0;
  // Whether the next slot has arrived (wait() would return at once); never blocks.
  virtual bool ready() = 0;
  // Gives the slot returned by the last wait() back to the sender.
  virtual void release() = 0;
};

}  // namespace pyc
