// POSIX shared memory (shm_open + mmap) with checked calls and a clear error
// when /dev/shm is too small.
#include "transport/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <random>
#include <sstream>
#include <thread>

#include "core/error.h"

namespace pyc {
namespace {

std::string mib(size_t bytes) {
  std::ostringstream os;
  os << (bytes + (1u << 20) - 1) / (1u << 20) << " MiB";
  return os.str();
}

[[noreturn]] void throw_no_space(size_t need) {
  struct statvfs st{};
  std::ostringstream os;
  os << "pycollectives: /dev/shm is too small: a shared-memory segment of " << mib(need)
     << " is needed";
  if (statvfs("/dev/shm", &st) == 0)
    os << " but only " << mib(static_cast<size_t>(st.f_bavail) * st.f_frsize) << " of "
       << mib(static_cast<size_t>(st.f_blocks) * st.f_frsize) << " are free";
  os << ". Enlarge it (docker run --shm-size=1g ..., or mount -o remount,size=2G /dev/shm), "
        "or use smaller pipelining buffers (PYCOLL_SLOT_BYTES, PYCOLL_NSLOTS; the "
        "communicator's segment) or smaller alloc_shared windows.";
  throw Error(os.str());
}

}  // namespace

std::string ShmSegment::unique_name() {
  static std::atomic<unsigned> counter{0};
  std::random_device rd;
  std::ostringstream os;
  os << "/pycoll-" << getpid() << "-" << counter++ << "-" << std::hex << rd();
  return os.str();
}

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  struct statvfs st{};
  if (statvfs("/dev/shm", &st) == 0 && static_cast<size_t>(st.f_bavail) * st.f_frsize < bytes)
    throw_no_space(bytes);
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  PYC_SYSCHECK(fd);
  ShmSegment seg;
  seg.name_ = name;
  seg.owner_ = true;
  seg.linked_ = true;
  int err = ftruncate(fd, static_cast<off_t>(bytes));
  if (err == 0)
    err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  else
    err = errno;
  if (err != 0) {
    close(fd);
    seg.unlink();
    if (err == ENOSPC || err == EFBIG || err == ENOMEM) throw_no_space(bytes);
    detail::throw_sys(__FILE__, __LINE__, "posix_fallocate(shm)", err);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int map_err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    seg.unlink();
    detail::throw_sys(__FILE__, __LINE__, "mmap(shm)", map_err);
  }
  seg.data_ = p;
  seg.size_ = bytes;
  return seg;
}

ShmSegment ShmSegment::open(const std::string& name, size_t min_bytes, double timeout_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int fd = -1;
  struct stat st{};
  for (;;) {
    fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd >= 0) {
      PYC_SYSCHECK(fstat(fd, &st));
      if (static_cast<size_t>(st.st_size) >= min_bytes) break;
      close(fd);
    } else if (errno != ENOENT) {
      detail::throw_sys(__FILE__, __LINE__, "shm_open", errno);
    }
    if (std::chrono::steady_clock::now() > deadline)
      PYC_THROW(Error, "pycollectives: shared-memory segment " << name << " did not appear within "
                                                               << timeout_s << " s");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  void* p = mmap(nullptr, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int map_err = errno;
  close(fd);
  if (p == MAP_FAILED) detail::throw_sys(__FILE__, __LINE__, "mmap(shm)", map_err);
  ShmSegment seg;
  seg.name_ = name;
  seg.data_ = p;
  seg.size_ = static_cast<size_t>(st.st_size);
  return seg;
}

ShmSegment::ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    this->~ShmSegment();
    name_ = std::move(o.name_);
    data_ = o.data_;
    size_ = o.size_;
    owner_ = o.owner_;
    linked_ = o.linked_;
    o.data_ = nullptr;
    o.size_ = 0;
    o.owner_ = o.linked_ = false;
  }
  return *this;
}

ShmSegment::~ShmSegment() {
  unlink();
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
}

void ShmSegment::unlink() {
  if (owner_ && linked_) {
    shm_unlink(name_.c_str());  // ENOENT is fine: already gone
    linked_ = false;
  }
}

}  // namespace pyc
