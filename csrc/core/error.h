// Errors. Every system and allocation call is checked; the exception carries
// the file, the line and the call that failed.
#pragma once

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace pyc {

// Base class of every error this library raises from C++.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// Bad argument from the caller (maps to Python ValueError).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};
// A peer is late past the timeout (maps to pycollectives.CollectiveTimeout).
class TimeoutError : public Error {
 public:
  using Error::Error;
};
// A peer process died or closed its communicator (pycollectives.PeerFailure).
class PeerFailure : public Error {
 public:
  using Error::Error;
};
// Ranks called different operations at the same sequence number
// (pycollectives.CollectiveMismatch).
class Mismatch : public Error {
 public:
  using Error::Error;
};
// The communicator was aborted by another rank's error (the message is that
// rank's), or used after close.
class Aborted : public Error {
 public:
  using Error::Error;
};
// The communicator was revoked (Communicator::revoke, or by the survivors
// once an agreement found a rank failed): pycollectives.CommunicatorRevoked.
class Revoked : public Aborted {
 public:
  using Aborted::Aborted;
};
// The waiting thread received a signal (Ctrl-C); maps to KeyboardInterrupt.
class Interrupted : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] inline void throw_sys(const char* file, int line, const char* call, int err) {
  std::ostringstream os;
  os << "pycollectives: " << call << " failed: " << std::strerror(err) << " (errno " << err
     << ") at " << file << ":" << line;
  throw Error(os.str());
}
}  // namespace detail

}  // namespace pyc

// Checks a POSIX call that returns -1 and sets errno.
#define PYC_SYSCHECK(call)                                                        \
  do {                                                                            \
    if ((call) == -1) ::pyc::detail::throw_sys(__FILE__, __LINE__, #call, errno); \
  } while (0)

// Checks a pthread-style call that returns an error number.
#define PYC_ERRCHECK(call)                                                            \
  do {                                                                                \
    int pyc_err_ = (call);                                                            \
    if (pyc_err_ != 0) ::pyc::detail::throw_sys(__FILE__, __LINE__, #call, pyc_err_); \
  } while (0)

// Throws `type` with a streamed message.
#define PYC_THROW(type, msg)    \
  do {                          \
    std::ostringstream pyc_os_; \
    pyc_os_ << msg;             \
    throw type(pyc_os_.str());  \
  } while (0)

// Internal invariant; a failure is a bug in this library.
#define PYC_ASSERT(cond)                                                                       \
  do {                                                                                         \
    if (!(cond))                                                                               \
      PYC_THROW(::pyc::Error,                                                                  \
                "pycollectives internal error: " #cond " at " << __FILE__ << ":" << __LINE__); \
  } while (0)
