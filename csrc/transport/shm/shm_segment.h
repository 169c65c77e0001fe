// A POSIX shared-memory segment: created by one rank, opened by the others,
// unlinked as soon as every rank has mapped it, so nothing stays in /dev/shm.
//
// /dev/shm is shared by every user of the host, and its names are all a
// rank learns from the (unauthenticated) bootstrap store, so a segment is
// opened only if this process's user owns it and no other user may read or
// write it: a segment another user planted is refused, naming its owner.
#pragma once

#include <cstddef>
#include <string>

#include "core/function_ref.h"

namespace pyc {

class ShmSegment {
 public:
  // Creates a new segment of `bytes` bytes (mode 0600, O_EXCL), backed by real
  // pages (so a full /dev/shm is an error here, not a SIGBUS later).
  static ShmSegment create(const std::string& name, size_t bytes);
  // Opens and maps an existing segment of this user with no group or other
  // permissions; waits up to timeout_s for it to appear with at least
  // `min_bytes` (exactly `exact_bytes`, when not 0), calling `poll` about
  // every 10 ms meanwhile (it throws to give up, e.g. when the creator died).
  static ShmSegment open(const std::string& name, size_t min_bytes, double timeout_s,
                         FunctionRef<void()> poll, size_t exact_bytes = 0);
  // A name no other segment on this host uses, with 64 random bits.
  static std::string unique_name();
  // 16 random hex digits (getrandom), for names another user cannot guess.
  static std::string random_hex();
  // Removes `name` from /dev/shm if it is there; throws for an error other
  // than ENOENT (the name is already gone).
  static void unlink_name(const std::string& name);

  ShmSegment() = default;
  ShmSegment(ShmSegment&& o) noexcept;
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  // Unmaps; a creator whose segment still has its name removes it (errors
  // are not reported from a destructor: unlink() reports them).
  ~ShmSegment();

  // Removes the name (idempotent); the mapping stays valid. Throws for an
  // error other than ENOENT.
  void unlink();
  void* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool owner_ = false;
  bool linked_ = false;
};

}  // namespace pyc
