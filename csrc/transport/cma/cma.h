// Cross-memory attach (CMA): one process copies straight out of another's
// memory with process_vm_readv, or into it with process_vm_writev, so a plain
// (private) buffer crosses between ranks in one copy instead of two through
// the shared slots. OpenMPI's vader and MPICH's nemesis take the same
// single-copy path.
//
// It needs ptrace access to the peer (same user; Yama's ptrace_scope <= 1 with
// the peer's consent, which a PtracerGrant gives, transport/cma/ptracer.h) and a
// seccomp profile that allows the calls; cma_probe tells whether a given peer
// is accessible. The pids and addresses come from the peers' announcements in
// the shared segment (of this user only, transport/shm/shm_segment.h); the pids
// are checked at connect (same user) and kept privately from then on.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#include "core/wait.h"

namespace pyc {

// Whether the word at `addr` in process `pid` reads as `expect` and can be
// written back.
bool cma_probe(pid_t pid, uint64_t addr, uint64_t expect);
// Copies `bytes` at `src` in process `pid` (rank `peer`) into `dst`. If the
// kernel refuses, `mon` is told first (mon.peer_failed: a peer that died
// meanwhile raises PeerFailure naming it); otherwise throws naming the peer
// and the errno.
void cma_read(pid_t pid, int peer, void* dst, uint64_t src, size_t bytes, WaitMonitor& mon);
// Copies `bytes` at `src` here into `dst` in process `pid` (rank `peer`);
// fails likewise.
void cma_write(pid_t pid, int peer, uint64_t dst, const void* src, size_t bytes, WaitMonitor& mon);

}  // namespace pyc
