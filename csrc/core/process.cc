// Processes: fork generations, same-user checks, fault points (process.h).
#include "core/process.h"

#include <pthread.h>
#include <pwd.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

namespace pyc {

std::atomic<uint64_t> detail::g_forks{0};

namespace {

void on_fork_child() { detail::g_forks.fetch_add(1, std::memory_order_relaxed); }

// Registered when the library loads, so no fork escapes the count.
[[maybe_unused]] const bool g_atfork_registered =
    pthread_atfork(nullptr, nullptr, on_fork_child) == 0;

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

// The Uid: line of /proc/<pid>/status: real, effective, saved, filesystem.
bool read_uids(pid_t pid, std::vector<long>* uids) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.compare(0, 4, "Uid:") != 0) continue;
    std::istringstream is(line.substr(4));
    long u;
    while (is >> u) uids->push_back(u);
    return uids->size() >= 3;
  }
  return false;
}

}  // namespace

std::string describe_uid(uid_t uid) {
  std::ostringstream os;
  os << "uid " << uid;
  passwd pw{}, *found = nullptr;
  char buf[1024];
  if (getpwuid_r(uid, &pw, buf, sizeof(buf), &found) == 0 && found != nullptr)
    os << " (" << found->pw_name << ")";
  return os.str();
}

bool same_user(pid_t pid, std::string* why) {
  // Pin the process: a pidfd refers to this process and no other, so once the
  // uids are read, a signal 0 through it says they were this process's.
  const long fd = syscall(SYS_pidfd_open, pid, 0);
  if (fd < 0 && errno == ESRCH) {
    *why = "process " + std::to_string(pid) + " is gone";
    return false;
  }
  std::vector<long> uids;
  const bool read = read_uids(pid, &uids);
  bool alive = true;
  if (fd >= 0) {  // ENOSYS (a kernel before 5.3): the caller checks liveness otherwise
    alive = syscall(SYS_pidfd_send_signal, static_cast<int>(fd), 0, nullptr, 0) == 0;
    close(static_cast<int>(fd));
  }
  if (!read || !alive) {
    *why = "process " + std::to_string(pid) + " is gone or not visible here";
    return false;
  }
  const long me = static_cast<long>(geteuid());
  if (uids[0] == me && uids[1] == me && uids[2] == me) return true;
  std::ostringstream os;
  os << "process " << pid << " runs as uid " << uids[0] << "/" << uids[1] << "/" << uids[2]
     << " (real/effective/saved), this one as " << describe_uid(geteuid());
  *why = os.str();
  return false;
}

pid_t parent_pid(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close_paren = s.rfind(')');  // the command name may hold spaces and parentheses
  if (close_paren == std::string::npos) return -1;
  std::istringstream is(s.substr(close_paren + 1));
  std::string state;
  long ppid = -1;
  if (!(is >> state >> ppid)) return -1;
  return static_cast<pid_t>(ppid);
}

void fault_point(const char* step) {
  static const std::string kill_at = [] {
    const char* v = std::getenv("PYCOLL_TEST_KILL_AT");
    return std::string(v != nullptr ? v : "");
  }();
  static const std::string stop_at = [] {
    const char* v = std::getenv("PYCOLL_TEST_STOP_AT");
    return std::string(v != nullptr ? v : "");
  }();
  if (!kill_at.empty() && kill_at == step) raise(SIGKILL);
  if (!stop_at.empty() && stop_at == step) raise(SIGSTOP);
}

}  // namespace pyc
