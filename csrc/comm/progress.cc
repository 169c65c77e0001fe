// Progress engine and Work (see progress.h).
#include "comm/progress.h"

#include <algorithm>
#include <chrono>
#include <future>

#include "core/clock.h"
#include "core/error.h"
#include "core/wait.h"

namespace pyc {

std::string InterruptHook::fire(const char* what) {
  std::lock_guard<std::mutex> lk(m_);
  return fn_ ? fn_(what) : std::string();
}

void InterruptHook::clear() {
  std::lock_guard<std::mutex> lk(m_);
  fn_ = nullptr;
}

bool Work::wait(double timeout_s, bool settle) {
  // How often a waiting thread looks for Ctrl-C: as often as a sleeping wait
  // for a peer does (core/wait.cc), cheap next to an operation's wait.
  constexpr auto kPoll = std::chrono::milliseconds(5);
  const auto deadline =
      timeout_s < 0 ? Clock::time_point::max() : deadline_after(Clock::now(), timeout_s);
  std::unique_lock<std::mutex> lk(m_);
  while (!done_) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    cv_.wait_until(lk, std::min(deadline, now + kPoll));
    if (done_) break;
    lk.unlock();
    check_interrupt(settle);
    lk.lock();
  }
  if (err_) std::rethrow_exception(err_);
  return true;
}

void Work::check_interrupt(bool settle) {
  const InterruptCheck interrupted = interrupt_check();
  if (interrupted == nullptr || !interrupted()) return;
  std::string msg = hook_ ? hook_->fire(what_) : std::string();
  if (msg.empty())
    msg = std::string("pycollectives: interrupted (signal) while waiting for ") + what_;
  if (settle) {  // the abort ends it at its next check, within milliseconds
    std::unique_lock<std::mutex> lk(m_);
    cv_.wait(lk, [&] { return done_; });
  }
  throw Interrupted(msg);
}

bool Work::is_completed() {
  std::lock_guard<std::mutex> lk(m_);
  return done_;
}

std::exception_ptr Work::error() {
  std::lock_guard<std::mutex> lk(m_);
  return err_;
}

void Work::finish(std::exception_ptr err) {
  {
    std::lock_guard<std::mutex> lk(m_);
    done_ = true;
    err_ = std::move(err);
  }
  cv_.notify_all();
}

ProgressEngine::ProgressEngine(std::function<void()> on_start, std::function<void()> on_stop,
                               std::shared_ptr<InterruptHook> hook)
    : on_start_(std::move(on_start)), on_stop_(std::move(on_stop)), hook_(std::move(hook)) {
  std::promise<void> started;
  auto fut = started.get_future();
  thread_ = std::thread([this, &started] {
    try {
      if (on_start_) on_start_();
      started.set_value();
    } catch (...) {
      started.set_exception(std::current_exception());
      return;
    }
    loop();
  });
  try {
    fut.get();
  } catch (...) {
    thread_.join();
    throw;
  }
}

ProgressEngine::~ProgressEngine() { shutdown(); }

std::shared_ptr<Work> ProgressEngine::submit(const std::function<uint32_t()>& order, Task fn,
                                             bool async, const char* what) {
  if (!async && run_if_idle(order, fn)) return nullptr;  // nothing pending: no hand-off
  std::unique_lock<std::mutex> lk(m_);
  auto work = std::make_shared<Work>(hook_, what);
  queue_.push_back(Item{std::move(fn), order(), work});
  lk.unlock();
  cv_.notify_all();
  if (async) return work;
  before_block();  // the caller waits for the progress thread
  work->wait(-1, true);
  return nullptr;
}

void ProgressEngine::end_inline() {
  std::unique_lock<std::mutex> lk(m_);
  busy_ = false;
  // Wake the engine only if work arrived meanwhile, or someone drains: an
  // idle engine thread stays asleep (waking it costs a futex call and a
  // cross-core hand-off per synchronous operation).
  const bool wake = !queue_.empty() || drainers_ > 0 || stop_;
  lk.unlock();
  if (wake) cv_.notify_all();
}

void ProgressEngine::loop() {
  std::unique_lock<std::mutex> lk(m_);
  for (;;) {
    cv_.wait(lk,
             [&] { return (!queue_.empty() && !busy_) || (stop_ && queue_.empty() && !busy_); });
    if (queue_.empty()) break;  // stop_ and nothing left
    auto item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lk.unlock();
    std::exception_ptr err;
    try {
      item.fn(item.ticket);
    } catch (...) {
      err = std::current_exception();
    }
    item.work->finish(err);
    lk.lock();
    if (err && stop_) {
      try {
        std::rethrow_exception(err);
      } catch (const std::exception& e) {
        closing_errors_.push_back(std::string(item.work->what()) + ": " + e.what());
      } catch (...) {
        closing_errors_.push_back(std::string(item.work->what()) + ": unknown error");
      }
    }
    busy_ = false;
    cv_.notify_all();
  }
  lk.unlock();
  if (on_stop_) on_stop_();
}

void ProgressEngine::drain() {
  std::unique_lock<std::mutex> lk(m_);
  ++drainers_;
  cv_.wait(lk, [&] { return queue_.empty() && !busy_; });
  --drainers_;
}

std::vector<std::string> ProgressEngine::shutdown() {
  if (!thread_.joinable()) return {};
  {
    std::lock_guard<std::mutex> lk(m_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  std::lock_guard<std::mutex> lk(m_);
  return std::move(closing_errors_);
}

}  // namespace pyc
