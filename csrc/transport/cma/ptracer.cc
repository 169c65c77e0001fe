// The process's Yama ptracer, following its communicators' grants (ptracer.h).
#include "transport/cma/ptracer.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <mutex>

#include "core/process.h"

namespace pyc {
namespace {

constexpr long kNone = 0, kAny = -1;

bool yama_restricts() {
  static const bool on = [] {
    std::ifstream f("/proc/sys/kernel/yama/ptrace_scope");
    int scope = 0;
    return static_cast<bool>(f >> scope) && scope == 1;  // 0: no limit; 2, 3: prctl cannot help
  }();
  return on;
}

// The ancestors of `pid`, itself first, up to (not including) init.
std::vector<pid_t> ancestors(pid_t pid) {
  std::vector<pid_t> chain;
  for (pid_t p = pid; p > 1 && chain.size() < 4096; p = parent_pid(p)) chain.push_back(p);
  return chain;
}

// The tracer that admits every peer: the peer itself, or their nearest
// common ancestor below init; any process of the user when there is none.
long tracer_for(const std::vector<pid_t>& peers) {
  if (peers.empty()) return kNone;
  if (peers.size() == 1) return peers[0];
  std::vector<pid_t> common = ancestors(peers[0]);
  for (size_t i = 1; i < peers.size() && !common.empty(); ++i) {
    const std::vector<pid_t> mine = ancestors(peers[i]);
    common.erase(std::remove_if(
                     common.begin(), common.end(),
                     [&](pid_t p) { return std::find(mine.begin(), mine.end(), p) == mine.end(); }),
                 common.end());
  }
  return common.empty() ? kAny : common.front();  // front: the nearest
}

std::mutex g_mu;
std::map<unsigned long, long> g_grants;  // grant id -> the tracer it calls for
unsigned long g_next_id = 1;
long g_applied = kNone;

long wanted_locked() {
  if (g_grants.empty()) return kNone;
  const long first = g_grants.begin()->second;
  for (const auto& [id, t] : g_grants)
    if (t != first) return kAny;
  return first;
}

void apply_locked() {
  const long want = wanted_locked();
  if (want == g_applied || !yama_restricts()) {
    g_applied = want;
    return;
  }
#ifdef PR_SET_PTRACER
  // Failure leaves single copy to the probe, which then falls back to the slots.
  const unsigned long arg = want == kAny ? PR_SET_PTRACER_ANY : static_cast<unsigned long>(want);
  if (prctl(PR_SET_PTRACER, arg, 0, 0, 0) == 0) g_applied = want;
#endif
}

}  // namespace

PtracerGrant::PtracerGrant(const std::vector<pid_t>& peers) {
  const long tracer = tracer_for(peers);
  std::lock_guard<std::mutex> lk(g_mu);
  id_ = g_next_id++;
  g_grants[id_] = tracer;
  apply_locked();
}

PtracerGrant::~PtracerGrant() {
  if (id_ == 0) return;
  std::lock_guard<std::mutex> lk(g_mu);
  g_grants.erase(id_);
  apply_locked();
}

long ptracer_wanted(bool* applied) {
  std::lock_guard<std::mutex> lk(g_mu);
  *applied = yama_restricts() && g_applied == wanted_locked();
  return wanted_locked();
}

}  // namespace pyc
