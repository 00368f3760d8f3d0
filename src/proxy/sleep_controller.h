// SleepController: the proxy's part in sleep mode. It wakes an instance on
// demand (`--wake-on-demand`: a request that finds every instance of a role
// asleep makes it POST /wake_up to one of them, and waits until it is up) and
// parks idle ones (`--park-idle-after S`: an instance with nothing routed to
// it and nothing running for S seconds gets POST /sleep?level=1).
//
// Lifecycle:
//   1. SleepController(sets, options): nothing runs yet.
//   2. start(): with park_idle_after, a thread looks for idle instances
//      every quarter of it (at most every second).
//   3. wake_one(set) from request threads: claims an asleep instance of the
//      set (InstanceSet::wake_candidate) and calls /wake_up on a thread of
//      its own; the requests wait on the set (InstanceSet::wait_for_change),
//      never on the call. At most one wake per instance is out at a time.
//   4. stop() or the destructor: ends the park thread and every call in
//      flight (their connections are closed), joins.
//
// Every call has a deadline: a wake wake_timeout, a park the proxy's
// --timeout-s. A wake that fails leaves the instance asleep (a later request
// tries again); a park that fails leaves it serving.
//
// Threads: wake_one() from any thread; start()/stop() from the owner. The
// InstanceSets must outlive the controller.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <list>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "proxy/instance_set.h"
#include "proxy/leg.h"

namespace siesta::proxy {

struct SleepOptions {
  bool wake_on_demand = false;
  std::chrono::milliseconds wake_timeout{60'000};
  std::optional<std::chrono::milliseconds> park_idle_after;
  std::chrono::milliseconds connect_timeout{5'000};
  std::chrono::milliseconds call_timeout{300'000};           // a park's /sleep call
  std::vector<std::pair<std::string, std::string>> headers;  // e.g. Authorization
};

class SleepController {
 public:
  SleepController(std::vector<InstanceSet*> sets, SleepOptions options);
  ~SleepController();
  SleepController(const SleepController&) = delete;
  SleepController& operator=(const SleepController&) = delete;

  const SleepOptions& options() const { return options_; }
  void start();
  void stop();
  // Starts waking one asleep instance of `set` unless one is being woken.
  void wake_one(InstanceSet& set);

 private:
  struct Call {
    std::thread thread;
    std::atomic<bool> done{false};
  };
  void spawn(std::function<void()> work);  // under no lock; joins finished calls
  void run_wake(InstanceSet* set, size_t index);
  void run_park(InstanceSet* set, size_t index);
  void park_loop();
  Interrupt interrupt() const;

  const std::vector<InstanceSet*> sets_;
  const SleepOptions options_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  std::list<Call> calls_;
  std::thread park_thread_;
};

}  // namespace siesta::proxy
