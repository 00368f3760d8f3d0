// TaskQueue: a few threads that run the connector's blocking work
// (handshakes, side-channel messages, HTTP lookups, transfer starts), each
// bounded by its own deadline, so the engine loop never waits on the network.
//
//   TaskQueue q(4, "pd");
//   q.post([] { ... });      // any thread; runs later on one of the threads
//   q.stop();                // drops tasks not yet started, joins (tasks running finish)
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pd/kv_port.h"

namespace siesta::pd {

class TaskQueue final : public TaskRunner {
 public:
  TaskQueue(int threads, std::string name);
  ~TaskQueue() override;
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  // Ignored after stop().
  void post(std::function<void()> task) override;
  void stop();

 private:
  void run();

  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace siesta::pd
