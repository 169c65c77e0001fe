// What a communicator needs to know about processes: whether this one is a
// forked copy of the one that made it, whether a peer process belongs to the
// same user, and named points where tests kill a rank.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <string>

namespace pyc {

// Counts the fork()s this process descends from since the library loaded
// (pthread_atfork): an object that records it at construction can tell a
// forked child, in which its threads do not exist and its shared state
// belongs to the parent. One relaxed load.
inline uint64_t fork_generation();

namespace detail {
extern std::atomic<uint64_t> g_forks;  // process.cc: counted by a pthread_atfork handler
}
inline uint64_t fork_generation() { return detail::g_forks.load(std::memory_order_relaxed); }

// Whether process `pid` runs as this process's effective user: its real,
// effective and saved uids all equal ours, as the kernel requires of a
// ptrace peer without CAP_SYS_PTRACE. Otherwise false, with the reason in
// *why (its uids, or that it is gone). `pid` is pinned with a pidfd while it is
// read, so a pid reused meanwhile is not mistaken for the process.
bool same_user(pid_t pid, std::string* why);

// The parent of process `pid` (from /proc), or -1 if unknown.
pid_t parent_pid(pid_t pid);

// A user's name for messages: "uid 1000 (alice)".
std::string describe_uid(uid_t uid);

// Fault injection for the tests of set-up failures: when the environment
// variable PYCOLL_TEST_KILL_AT names `step`, the process SIGKILLs itself here
// (a crash at exactly that point); when PYCOLL_TEST_STOP_AT names it, the
// process SIGSTOPs itself (a peer's SIGCONT resumes it). Read once per process.
void fault_point(const char* step);

}  // namespace pyc
