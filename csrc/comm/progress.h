// The progress engine: one C++ thread per communicator that runs operations
// in the order they were issued, so Python computes while they run. A
// synchronous call with nothing pending runs on the caller's thread instead
// (no hand-off).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pyc {

// What a thread waiting for an operation does when it is interrupted
// (Ctrl-C): fire(what) aborts the operation's communicator (so its peers
// raise too) and returns the message to raise. Cleared when the communicator
// closes; a cleared hook returns "".
class InterruptHook {
 public:
  explicit InterruptHook(std::function<std::string(const char*)> fn) : fn_(std::move(fn)) {}
  std::string fire(const char* what);
  void clear();

 private:
  std::mutex m_;
  std::function<std::string(const char*)> fn_;
};

// Completion handle of one operation.
class Work {
 public:
  // `what` (a static string, e.g. "all_reduce") names the operation in messages.
  Work(std::shared_ptr<InterruptHook> hook, const char* what)
      : hook_(std::move(hook)), what_(what) {}
  // Blocks until done or until timeout_s (< 0: forever; inf too) passes;
  // returns false on timeout. Rethrows the operation's error. A pending
  // interrupt (Ctrl-C) of the waiting thread aborts the communicator and
  // throws Interrupted; with `settle`, only once the operation has ended (it
  // uses the caller's buffers, which a synchronous caller frees as it raises).
  bool wait(double timeout_s = -1, bool settle = false);
  // The waiting thread's part of wait(): on a pending interrupt, aborts and
  // throws Interrupted (for waits built on this Work, e.g. CudaWork's).
  void check_interrupt(bool settle = false);
  bool is_completed();
  std::exception_ptr error();
  void finish(std::exception_ptr err);
  const char* what() const { return what_; }
  // A receive from any peer: the sender's rank once the operation completed
  // (-1 before, and for every other operation), as torch's Work::sourceRank.
  int source() const { return source_ ? source_->load() : -1; }
  void set_source(std::shared_ptr<const std::atomic<int>> s) { source_ = std::move(s); }

 private:
  std::shared_ptr<InterruptHook> hook_;
  const char* what_;
  std::shared_ptr<const std::atomic<int>> source_;
  std::mutex m_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr err_;
};

class ProgressEngine {
 public:
  // on_start / on_stop run on the engine's thread when it starts and exits;
  // `hook` goes to every Work (see InterruptHook).
  ProgressEngine(std::function<void()> on_start, std::function<void()> on_stop,
                 std::shared_ptr<InterruptHook> hook);
  ~ProgressEngine();

  // Runs fn(ticket) after everything submitted before it. `order` is called
  // under the engine's lock at submission and returns the ticket, so numbering
  // follows issue order. async: returns a Work at once. Otherwise runs it
  // (inline when idle) and returns nullptr, rethrowing its error. `what`
  // names the operation (a static string).
  using Task = std::function<void(uint32_t)>;
  std::shared_ptr<Work> submit(const std::function<uint32_t()>& order, Task fn, bool async,
                               const char* what);
  // If nothing is queued or running: draws the ticket from `order`, runs
  // fn(ticket) on the calling thread, rethrows its error and returns true.
  // Otherwise returns false and does nothing (submit then queues it). Takes
  // `fn` by reference: a synchronous operation allocates nothing to run.
  template <class Order, class Fn>
  bool run_if_idle(Order&& order, Fn&& fn) {
    std::unique_lock<std::mutex> lk(m_);
    if (busy_ || !queue_.empty()) return false;
    const uint32_t ticket = order();
    busy_ = true;
    lk.unlock();
    std::exception_ptr err;
    try {
      fn(ticket);
    } catch (...) {
      err = std::current_exception();
    }
    end_inline();
    if (err) std::rethrow_exception(err);
    return true;
  }
  // Waits for every submitted operation.
  void drain();
  // Runs what is queued, then stops the thread (runs on_stop there). Returns
  // "<what>: <error>" for each operation that failed meanwhile (they were
  // pending when the communicator closed). Idempotent.
  std::vector<std::string> shutdown();

 private:
  void loop();
  // Clears busy_ after an operation ran on the caller's thread.
  void end_inline();

  std::function<void()> on_start_, on_stop_;
  std::shared_ptr<InterruptHook> hook_;
  std::mutex m_;
  std::condition_variable cv_;
  struct Item {
    Task fn;
    uint32_t ticket;
    std::shared_ptr<Work> work;
  };
  std::deque<Item> queue_;
  bool busy_ = false;
  int drainers_ = 0;  // threads in drain(): the inline path wakes them
  bool stop_ = false;
  std::vector<std::string> closing_errors_;  // failures once stop_ was set
  std::thread thread_;
};

}  // namespace pyc
