#include "transport/cma/cma.h"

#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace pyc {

namespace {

// Moves `bytes` between `local` (this process) and `remote` (process `pid`,
// rank `peer`) in one kernel copy: out of the peer with process_vm_readv, or
// into it with process_vm_writev. A refusal goes to mon.peer_failed (a dead
// peer: PeerFailure), else throws naming the peer and the errno.
void cma_copy(bool into_peer, pid_t pid, int peer, char* local, uint64_t remote, size_t bytes,
              WaitMonitor& mon) {
  while (bytes > 0) {  // the kernel may stop short (a signal, or past its iovec limits)
    iovec l{local, bytes}, r{reinterpret_cast<void*>(remote), bytes};
    const ssize_t got = into_peer ? process_vm_writev(pid, &l, 1, &r, 1, 0)
                                  : process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = got < 0 ? errno : EFAULT;
      mon.peer_failed(peer);
      PYC_THROW(Error, "pycollectives: " << (into_peer ? "process_vm_writev" : "process_vm_readv")
                                         << "(pid " << pid << ", " << bytes << " bytes) "
                                         << (into_peer ? "to" : "from") << " rank " << peer
                                         << " failed: " << std::strerror(err) << " at " << __FILE__
                                         << ":" << __LINE__);
    }
    local += got;
    remote += static_cast<uint64_t>(got);
    bytes -= static_cast<size_t>(got);
  }
}

}  // namespace

bool cma_probe(pid_t pid, uint64_t addr, uint64_t expect) {
  // Reads the peer's token, then writes the same value back: both directions
  // must be allowed (a seccomp profile could allow one and not the other).
  uint64_t got = 0;
  iovec local{&got, sizeof(got)}, remote{reinterpret_cast<void*>(addr), sizeof(got)};
  return process_vm_readv(pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof(got)) &&
         got == expect &&
         process_vm_writev(pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof(got));
}

void cma_read(pid_t pid, int peer, void* dst, uint64_t src, size_t bytes, WaitMonitor& mon) {
  cma_copy(false, pid, peer, static_cast<char*>(dst), src, bytes, mon);
}

void cma_write(pid_t pid, int peer, uint64_t dst, const void* src, size_t bytes, WaitMonitor& mon) {
  cma_copy(true, pid, peer, const_cast<char*>(static_cast<const char*>(src)), dst, bytes, mon);
}

}  // namespace pyc
