#include "proxy/health_monitor.h"

#include <memory>

#include "proxy/leg.h"

namespace siesta::proxy {

HealthMonitor::HealthMonitor(std::vector<InstanceSet*> sets, HealthOptions options)
    : sets_(std::move(sets)), options_(std::move(options)) {}

HealthMonitor::~HealthMonitor() { stop(); }

void HealthMonitor::check_all() {
  struct Check {
    InstanceSet* set;
    size_t index;
    std::unique_ptr<Leg> health;
    std::unique_ptr<Leg> metrics;
  };
  std::vector<Check> checks;
  const LegLimits limits{options_.timeout, options_.timeout, options_.timeout};
  const auto asked_at = std::chrono::steady_clock::now();
  for (InstanceSet* set : sets_) {
    for (size_t i = 0; i < set->size(); ++i) {
      LegRequest health{"GET", "/health", "", "application/json", options_.headers};
      LegRequest metrics{"GET", "/metrics", "", "text/plain", options_.headers};
      checks.push_back({set, i, Leg::start(set->url(i), std::move(health), limits),
                        Leg::start(set->url(i), std::move(metrics), limits)});
    }
  }
  for (Check& check : checks) {
    Result<LegHead> head = check.health->wait_head(nullptr);
    // The engine's state and load, when its /metrics answers (an instance
    // without it is routed by the proxy's own count of its requests).
    std::optional<EngineReport> report;
    Result<LegHead> m_head = check.metrics->wait_head(nullptr);
    if (m_head && m_head->status == 200) {
      Result<std::string> text = check.metrics->wait_body(nullptr);
      if (text) report = parse_engine_report(*text);
    }
    if (!head) {
      check.set->record_health(check.index, false, head.error().message);
    } else if (head->status != 200) {
      check.set->record_health(check.index, false, "GET /health answered HTTP " + std::to_string(head->status));
    } else {
      check.set->record_health(check.index, true, "", report, asked_at);
    }
  }
}

void HealthMonitor::start() {
  std::lock_guard lock(mu_);
  if (thread_.joinable() || stopping_) return;
  thread_ = std::thread([this] { loop(); });
}

void HealthMonitor::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void HealthMonitor::loop() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    if (cv_.wait_for(lock, options_.interval, [this] { return stopping_; })) break;
    lock.unlock();
    check_all();
    lock.lock();
  }
}

}  // namespace siesta::proxy
