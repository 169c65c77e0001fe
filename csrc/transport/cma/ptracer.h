// Who may access this process with CMA under Yama (ptrace_scope 1, where a
// process may access only its descendants and the processes that named it
// with prctl(PR_SET_PTRACER)). A communicator that agreed on single copy
// holds a PtracerGrant naming its peers; the process's setting follows every
// live grant and is reset when the last one goes (close()):
//
// - one peer: that peer's pid (Yama allows it and its descendants);
// - several: their nearest common ancestor (the launcher: torchrun, mpirun,
//   the test's parent), which Yama admits with its descendants, the ranks;
// - several with no common ancestor but init, or grants naming different
//   tracers: PR_SET_PTRACER_ANY (any process of the user), as OpenMPI sets.
//
// Without Yama (or with another scope) nothing is called: the kernel's own
// rule (same user, or CAP_SYS_PTRACE) applies unchanged.
#pragma once

#include <sys/types.h>

#include <vector>

namespace pyc {

class PtracerGrant {
 public:
  explicit PtracerGrant(const std::vector<pid_t>& peers);
  ~PtracerGrant();
  PtracerGrant(const PtracerGrant&) = delete;
  PtracerGrant& operator=(const PtracerGrant&) = delete;
  // A forked child leaves the parent's grant alone (its registry is a copy).
  void forget() { id_ = 0; }

 private:
  unsigned long id_;
};

// The tracer this process's grants call for: 0 none (reset), -1 any, else a
// pid; and whether it was applied (Yama's ptrace_scope is 1). For tests.
long ptracer_wanted(bool* applied);

}  // namespace pyc
