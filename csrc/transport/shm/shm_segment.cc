// POSIX shared memory (shm_open + mmap) with checked calls and a clear error
// when /dev/shm is too small.
#include "transport/shm/shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <sstream>
#include <thread>

#include "core/clock.h"
#include "core/error.h"
#include "core/process.h"

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

// Refuses a segment this process's user does not own, or that other users
// may read or write: anyone can create names in /dev/shm, and the name came
// from the bootstrap store, which anyone who reaches it can write.
void check_owner(int fd, const std::string& name) {
  struct stat st{};
  PYC_SYSCHECK(fstat(fd, &st));
  std::ostringstream os;
  if (!S_ISREG(st.st_mode)) {
    os << "pycollectives: shared-memory segment " << name << " is not a regular file: refusing it";
  } else if (st.st_uid != geteuid()) {
    os << "pycollectives: shared-memory segment " << name << " belongs to "
       << describe_uid(st.st_uid) << ", not to this process's " << describe_uid(geteuid())
       << ": refusing it (another user may have planted it; see docs/api.md, Security)";
  } else if ((st.st_mode & 077) != 0) {
    os << "pycollectives: shared-memory segment " << name << " has mode " << std::oct
       << (st.st_mode & 0777) << std::dec
       << ", which lets other users read or write it: refusing it (pycollectives creates 0600)";
  } else {
    return;
  }
  throw Error(os.str());
}

}  // namespace

std::string ShmSegment::random_hex() {
  uint64_t r = 0;
  for (size_t got = 0; got < sizeof(r);) {
    const ssize_t k = getrandom(reinterpret_cast<char*>(&r) + got, sizeof(r) - got, 0);
    if (k < 0 && errno == EINTR) continue;
    PYC_SYSCHECK(k);
    got += static_cast<size_t>(k);
  }
  std::ostringstream os;
  os << std::hex;
  os.width(16);
  os.fill('0');
  os << r;
  return os.str();
}

std::string ShmSegment::unique_name() {
  static std::atomic<unsigned> counter{0};
  std::ostringstream os;
  os << "/pycoll-" << getpid() << "-" << counter++ << "-" << random_hex();
  return os.str();
}

void ShmSegment::unlink_name(const std::string& name) {
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT)
    detail::throw_sys(__FILE__, __LINE__, ("shm_unlink(" + name + ")").c_str(), errno);
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
    // seg's destructor removes the name as the error unwinds
    if (err == ENOSPC || err == EFBIG || err == ENOMEM) throw_no_space(bytes);
    detail::throw_sys(__FILE__, __LINE__, "posix_fallocate(shm)", err);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int map_err = errno;
  close(fd);
  if (p == MAP_FAILED) {
    // seg's destructor removes the name as the error unwinds
    detail::throw_sys(__FILE__, __LINE__, "mmap(shm)", map_err);
  }
  seg.data_ = p;
  seg.size_ = bytes;
  return seg;
}

ShmSegment ShmSegment::open(const std::string& name, size_t min_bytes, double timeout_s,
                            FunctionRef<void()> poll, size_t exact_bytes) {
  const auto deadline = deadline_after(Clock::now(), timeout_s);
  auto next_poll = Clock::now();
  int fd = -1;
  struct stat st{};
  for (;;) {
    fd = shm_open(name.c_str(), O_RDWR | O_NOFOLLOW, 0600);
    if (fd >= 0) {
      try {
        check_owner(fd, name);
      } catch (...) {
        close(fd);
        throw;
      }
      PYC_SYSCHECK(fstat(fd, &st));
      const auto size = static_cast<size_t>(st.st_size);
      // A creator sizes its segment right after creating it: a smaller one may
      // still grow, a larger one than asked for will not shrink.
      if (exact_bytes != 0 && size > exact_bytes) {
        close(fd);
        PYC_THROW(Error, "pycollectives: shared-memory segment "
                             << name << " has " << size << " bytes, expected " << exact_bytes);
      }
      if (size >= min_bytes && (exact_bytes == 0 || size == exact_bytes)) break;
      close(fd);
    } else if (errno == EACCES) {  // another user's, most likely: say whose
      const int err = errno;
      struct stat other{};
      if (stat(("/dev/shm" + name).c_str(), &other) == 0 && other.st_uid != geteuid())
        PYC_THROW(Error, "pycollectives: shared-memory segment "
                             << name << " belongs to " << describe_uid(other.st_uid)
                             << ", not to this process's " << describe_uid(geteuid())
                             << ": refusing it (ranks of one communicator run as one user; see "
                                "docs/api.md, Security)");
      detail::throw_sys(__FILE__, __LINE__, ("shm_open(" + name + ")").c_str(), err);
    } else if (errno != ENOENT) {
      detail::throw_sys(__FILE__, __LINE__, ("shm_open(" + name + ")").c_str(), errno);
    }
    const auto now = Clock::now();
    if (now > deadline)
      PYC_THROW(TimeoutError, "pycollectives: shared-memory segment "
                                  << name << " did not appear within " << timeout_s << " s");
    if (now >= next_poll) {
      poll();
      next_poll = now + std::chrono::milliseconds(10);
    }
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
  if (owner_ && linked_) (void)shm_unlink(name_.c_str());  // best effort: nobody to tell
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
}

void ShmSegment::unlink() {
  if (owner_ && linked_) {
    linked_ = false;
    unlink_name(name_);
  }
}

}  // namespace pyc
