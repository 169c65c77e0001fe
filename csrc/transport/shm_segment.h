// A POSIX shared-memory segment: created by one rank, opened by the others,
// unlinked as soon as every rank has mapped it, so nothing stays in /dev/shm.
#pragma once

#include <cstddef>
#include <string>

namespace pyc {

class ShmSegment {
 public:
  // Creates a new segment of `bytes` bytes, backed by real pages (so a full
  // /dev/shm is an error here, not a SIGBUS later).
  static ShmSegment create(const std::string& name, size_t bytes);
  // Opens and maps an existing segment; waits up to timeout_s for it to appear
  // with the expected size.
  static ShmSegment open(const std::string& name, size_t min_bytes, double timeout_s);
  // A name no other segment on this host uses.
  static std::string unique_name();

  ShmSegment() = default;
  ShmSegment(ShmSegment&& o) noexcept;
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();

  // Removes the name (idempotent); the mapping stays valid.
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
