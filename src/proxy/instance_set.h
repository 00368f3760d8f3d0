// InstanceSet: the instances of one role (prefill or decode), their health,
// and the round-robin cursor that picks the next one for a request.
//
// Lifecycle:
//   1. InstanceSet(role, urls): every instance starts down ("not checked
//      yet"); the health monitor's first round brings up those that answer.
//   2. pick() for each request: the next instance that is up, in round-robin
//      order, skipping those that are down; nullopt when none is up.
//   3. record_health(i, ok, why) after each health check of instance i;
//      record_failure(i, why) when a request to it failed. A failure marks
//      the instance down until its next good health check.
//   4. snapshot() / up_count() for /health and /metrics.
//
// Threads: every method may be called from any thread; one mutex guards the
// state, and no method blocks on anything else.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "proxy/instance_url.h"

namespace siesta::proxy {

enum class Role { kPrefill, kDecode };
const char* role_name(Role role);  // "prefill" | "decode"

struct InstanceStatus {
  InstanceUrl url;
  Role role = Role::kPrefill;
  bool up = false;
  std::string why_down;        // empty when up
  uint64_t picked = 0;         // requests routed to it
  uint64_t failures = 0;       // requests to it that failed (transport or bad answer)
  uint64_t health_checks = 0;  // health checks answered, good or bad
};

// What pick() hands out: which instance, by index and address.
struct Pick {
  size_t index = 0;
  InstanceUrl url;
};

class InstanceSet {
 public:
  InstanceSet(Role role, std::vector<InstanceUrl> urls);
  InstanceSet(const InstanceSet&) = delete;
  InstanceSet& operator=(const InstanceSet&) = delete;

  Role role() const { return role_; }
  size_t size() const { return urls_.size(); }
  const InstanceUrl& url(size_t index) const { return urls_[index]; }
  const std::vector<InstanceUrl>& urls() const { return urls_; }
  // Index of the instance with this URL (normalised text), if configured.
  std::optional<size_t> find(const std::string& url_text) const;

  std::optional<Pick> pick();
  void record_health(size_t index, bool ok, const std::string& why);
  void record_failure(size_t index, const std::string& why);

  size_t up_count() const;
  std::optional<Pick> first_up() const;
  std::vector<InstanceStatus> snapshot() const;
  // "no prefill instance is up: http://a:1 (connection refused), ..." for errors.
  std::string describe_none_up() const;

 private:
  struct State {
    bool up = false;
    std::string why_down = "not checked yet";
    uint64_t picked = 0;
    uint64_t failures = 0;
    uint64_t health_checks = 0;
  };

  const Role role_;
  const std::vector<InstanceUrl> urls_;
  mutable std::mutex mu_;
  std::vector<State> states_;  // one per url, same order
  size_t cursor_ = 0;          // where the next pick starts looking
};

}  // namespace siesta::proxy
