// Progress engine and Work (see progress.h).
#include "comm/progress.h"

#include <chrono>
#include <future>

namespace pyc {

bool Work::wait(double timeout_s) {
  std::unique_lock<std::mutex> lk(m_);
  if (timeout_s < 0) {
    cv_.wait(lk, [&] { return done_; });
  } else if (!cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return done_; })) {
    return false;
  }
  if (err_) std::rethrow_exception(err_);
  return true;
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

ProgressEngine::ProgressEngine(std::function<void()> on_start, std::function<void()> on_stop)
    : on_start_(std::move(on_start)), on_stop_(std::move(on_stop)) {
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
                                             bool async) {
  if (!async && run_if_idle(order, fn)) return nullptr;  // nothing pending: no hand-off
  std::unique_lock<std::mutex> lk(m_);
  auto work = std::make_shared<Work>();
  queue_.push_back(Item{std::move(fn), order(), work});
  lk.unlock();
  cv_.notify_all();
  if (async) return work;
  work->wait();
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

void ProgressEngine::shutdown() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lk(m_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

}  // namespace pyc
