#include "pd/task_queue.h"

#include <chrono>

#include "common/log.h"

namespace siesta::pd {

TaskQueue::TaskQueue(int threads, std::string name) : name_(std::move(name)) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { run(); });
}

TaskQueue::~TaskQueue() { stop(); }

void TaskQueue::post(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    tasks_.push_back(std::move(task));
  }
  cv_.notify_one();
}

void TaskQueue::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
    if (!tasks_.empty()) SIESTA_LOG_DEBUG("{}: {} queued tasks dropped at shutdown", name_, tasks_.size());
    tasks_.clear();
  }
  cv_.notify_all();
  for (std::thread& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

void TaskQueue::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Idle threads look again every half second (no wait is unbounded).
      if (!cv_.wait_for(lock, std::chrono::milliseconds(500), [&] { return stopping_ || !tasks_.empty(); })) continue;
      if (stopping_) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    try {
      task();
    } catch (const std::exception& e) {
      SIESTA_LOG_ERROR("{}: a task threw: {}", name_, e.what());
    }
  }
}

}  // namespace siesta::pd
