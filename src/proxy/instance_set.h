// InstanceSet: the instances of one role (prefill or decode), their health,
// their lifecycle state (serving, asleep, paused, waking), their load, and
// the choice of the instance that serves the next request.
//
// Lifecycle:
//   1. InstanceSet(role, urls): every instance starts down ("not checked
//      yet"); the health monitor's first round brings up those that answer.
//   2. pick(affinity) for each request: among the instances that are up and
//      serving (never one asleep, paused, draining or being woken), the least
//      loaded, load being the larger of the requests the proxy has in flight
//      there and the requests the engine reported running or waiting, then
//      its KV cache usage; ties go round robin. With an affinity key (a hash
//      of the prompt's leading text) the instance that key hashes to
//      (rendezvous hashing) is chosen while its load is within
//      affinity_slack of the least loaded, so that requests sharing a prefix
//      meet the same prefix cache. nullopt when none can serve. The Pick
//      counts as in flight until its last copy is gone. pick_holding() then
//      gives an instance that is asleep or paused, to hold the request (a
//      proxy that does not wake on demand).
//   3. record_health(i, ok, why, report) after each health check of instance
//      i (report: what its /metrics said, when it said it);
//      record_failure(i, why) when a request to it failed. A failure marks
//      the instance down until its next good health check.
//   4. Sleep and wake (sleep_controller.h): wake_candidate() claims an
//      instance that is up but asleep for waking (kWaking; one waker per
//      instance), wake_done() ends the claim; park_candidates() claims idle
//      serving instances for parking (kAsleep before the call goes out, so no
//      request is routed to them meanwhile); wait_for_change() blocks until
//      any of these changes or a deadline.
//   5. snapshot() / up_count() / serving_count() for /health and /metrics.
//
// Threads: every method may be called from any thread; one mutex guards the
// state, and no method blocks except wait_for_change() (bounded by its
// deadline).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "proxy/instance_url.h"

namespace siesta::proxy {

enum class Role { kPrefill, kDecode };
const char* role_name(Role role);  // "prefill" | "decode"

// What the instance can do for a request, as its last report said.
enum class Condition {
  kServing,  // running (or an engine whose /metrics names no lifecycle state)
  kAsleep,   // sleeping at some level, or partially awake; /wake_up brings it back
  kPaused,   // paused, paused with its KV cache released, or draining: the operator's, never woken by the proxy
  kWaking,   // the proxy asked it to wake up and waits for the answer
};
const char* condition_name(Condition c);  // "serving" | "asleep" | "paused" | "waking"
// The Condition of a siesta engine state name ("running", "sleeping_level_1", ...).
Condition condition_of_engine_state(const std::string& state);

// What an instance's /metrics said (siesta's names; vLLM's where siesta's are absent).
struct EngineReport {
  std::string state;           // siesta:engine_state's label; empty when not reported
  std::optional<bool> asleep;  // engine_sleep_state{sleep_state="awake"} == 0
  double running = 0;
  double waiting = 0;
  double kv_usage = 0;  // 0..1
  double blocks_in_use = 0;
};
// Reads the families above from Prometheus text; absent ones stay at their defaults.
EngineReport parse_engine_report(const std::string& prometheus_text);

struct InstanceStatus {
  InstanceUrl url;
  Role role = Role::kPrefill;
  bool up = false;
  std::string why_down;  // empty when up
  Condition condition = Condition::kServing;
  std::string engine_state;    // as reported; empty when never
  uint64_t picked = 0;         // requests routed to it
  uint64_t failures = 0;       // requests to it that failed (transport or bad answer)
  uint64_t health_checks = 0;  // health checks answered, good or bad
  uint64_t in_flight = 0;      // requests the proxy has there now
  double engine_running = 0;
  double engine_waiting = 0;
  double kv_usage = 0;
  uint64_t wakes = 0;  // wake_up calls the proxy made
  uint64_t wake_failures = 0;
  uint64_t parks = 0;  // sleep calls the proxy made for idleness
};

// Counts one request in flight at an instance while it lives.
class InFlight;

// What pick() hands out: which instance, by index and address.
struct Pick {
  size_t index = 0;
  InstanceUrl url;
  std::shared_ptr<InFlight> in_flight;  // null for picks that route nothing (first_up)
};

class InstanceSet {
 public:
  InstanceSet(Role role, std::vector<InstanceUrl> urls, uint64_t affinity_slack = 2);
  InstanceSet(const InstanceSet&) = delete;
  InstanceSet& operator=(const InstanceSet&) = delete;

  Role role() const { return role_; }
  size_t size() const { return urls_.size(); }
  const InstanceUrl& url(size_t index) const { return urls_[index]; }
  const std::vector<InstanceUrl>& urls() const { return urls_; }
  // Index of the instance with this URL (normalised text), if configured.
  std::optional<size_t> find(const std::string& url_text) const;

  std::optional<Pick> pick(std::optional<uint64_t> affinity = std::nullopt);
  // When no instance serves: the least loaded that is up but asleep or
  // paused (not one being woken or parked by us), which holds the request
  // until it is woken or resumed (siesta serve's --max-held-seconds); for a
  // proxy that does not wake on demand. nullopt when one serves or none is up.
  std::optional<Pick> pick_holding();
  // asked_at: when the check was sent; a report asked before our last wake
  // or park of the instance ended says nothing of its state now.
  void record_health(size_t index, bool ok, const std::string& why, const std::optional<EngineReport>& report = {},
                     std::chrono::steady_clock::time_point asked_at = std::chrono::steady_clock::time_point::max());
  void record_failure(size_t index, const std::string& why);

  // An instance that is up and asleep, now claimed for waking (kWaking), or
  // nullopt when one of the set is being woken already, or none is asleep.
  std::optional<size_t> wake_candidate();
  // Whether some instance is up and being woken or asleep (a wake may help).
  bool can_wake() const;
  void wake_done(size_t index, bool ok, const std::string& why);
  // Serving instances with nothing in flight, no request reported running
  // or waiting, and no request routed to them for `idle`; each is marked
  // asleep (parked) before it is returned.
  std::vector<size_t> park_candidates(std::chrono::steady_clock::time_point now, std::chrono::milliseconds idle);
  void park_done(size_t index, bool ok, const std::string& why);
  // Blocks until a state changes (health, wake, park) or `until`.
  void wait_for_change(std::chrono::steady_clock::time_point until);

  size_t up_count() const;
  size_t serving_count() const;  // up and kServing
  std::optional<Pick> first_up() const;
  std::vector<InstanceStatus> snapshot() const;
  // "no prefill instance can serve: http://a:1 (connection refused), http://b:2 (asleep), ..." for errors.
  std::string describe_none_up() const;

 private:
  friend class InFlight;
  struct State {
    bool up = false;
    std::string why_down = "not checked yet";
    Condition condition = Condition::kServing;
    std::string engine_state;
    uint64_t picked = 0;
    uint64_t failures = 0;
    uint64_t health_checks = 0;
    uint64_t in_flight = 0;
    EngineReport report;
    std::chrono::steady_clock::time_point last_routed{};
    uint64_t wakes = 0;
    uint64_t wake_failures = 0;
    uint64_t parks = 0;
    bool parking = false;  // a sleep call of ours is out: health reports do not override kAsleep
    std::chrono::steady_clock::time_point lifecycle_at{};  // when our last wake or park ended
  };
  double load_of(const State& s) const;
  std::optional<Pick> choose(std::optional<uint64_t> affinity, bool holding);
  void release(size_t index);

  const Role role_;
  const std::vector<InstanceUrl> urls_;
  const uint64_t affinity_slack_;
  mutable std::mutex mu_;
  std::condition_variable changed_;
  std::vector<State> states_;  // one per url, same order
  size_t cursor_ = 0;          // where ties start looking
};

}  // namespace siesta::proxy
