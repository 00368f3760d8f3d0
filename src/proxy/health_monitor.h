// HealthMonitor: asks every instance GET /health and GET /metrics and records
// the answers in its InstanceSet (/health 200: up; anything else, or no
// answer in time: down, with the reason; /metrics: the engine's lifecycle
// state and load, parse_engine_report()).
//
// Lifecycle:
//   1. HealthMonitor(sets, options): nothing runs yet.
//   2. check_all(): one round, every instance at once; returns when each
//      check has answered or hit options.timeout.
//   3. start(): a background thread runs a round every options.interval.
//   4. stop() or the destructor: wakes the thread and joins it (at most one
//      round's timeout).
//
// Threads: check_all() from any thread; start()/stop() from the owner.
// The InstanceSets must outlive the monitor.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "proxy/instance_set.h"

namespace siesta::proxy {

struct HealthOptions {
  std::chrono::milliseconds interval{5'000};
  std::chrono::milliseconds timeout{2'000};
  std::vector<std::pair<std::string, std::string>> headers;  // e.g. Authorization
};

class HealthMonitor {
 public:
  HealthMonitor(std::vector<InstanceSet*> sets, HealthOptions options);
  ~HealthMonitor();
  HealthMonitor(const HealthMonitor&) = delete;
  HealthMonitor& operator=(const HealthMonitor&) = delete;

  void check_all();
  void start();
  void stop();

 private:
  void loop();

  const std::vector<InstanceSet*> sets_;
  const HealthOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace siesta::proxy
