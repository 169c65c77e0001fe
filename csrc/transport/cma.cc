#include "transport/cma.h"

#include <sys/prctl.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/error.h"

namespace pyc {

void cma_allow_peers() {
  std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
  int scope = 0;
  if (!(f >> scope) || scope != 1) return;  // no Yama, or it allows or forbids regardless
#ifdef PR_SET_PTRACER
  // Failure leaves CMA to the probe, which then falls back to the slots.
  (void)prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
#endif
}

bool cma_probe(pid_t pid, uint64_t addr, uint64_t expect) {
  uint64_t got = 0;
  iovec local{&got, sizeof(got)}, remote{reinterpret_cast<void*>(addr), sizeof(got)};
  return process_vm_readv(pid, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(sizeof(got)) &&
         got == expect;
}

void cma_read(pid_t pid, int peer, void* dst, uint64_t src, size_t bytes) {
  char* d = static_cast<char*>(dst);
  while (bytes > 0) {  // the kernel may stop short (a signal, or past its iovec limits)
    iovec local{d, bytes}, remote{reinterpret_cast<void*>(src), bytes};
    const ssize_t got = process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      const int err = got < 0 ? errno : EFAULT;
      PYC_THROW(Error, "pycollectives: process_vm_readv(pid "
                           << pid << ", " << bytes << " bytes) from rank " << peer << " failed: "
                           << std::strerror(err) << " at " << __FILE__ << ":" << __LINE__);
    }
    d += got;
    src += static_cast<uint64_t>(got);
    bytes -= static_cast<size_t>(got);
  }
}

}  // namespace pyc
