#include "proxy/sleep_controller.h"

#include <algorithm>
#include <memory>

#include "common/log.h"

namespace siesta::proxy {
namespace {

// An answer's status and the start of its body, for logs.
std::string outcome(const Result<LegHead>& head, const Result<std::string>& body) {
  if (!head) return head.error().message;
  std::string text = "HTTP " + std::to_string(head->status);
  if (body && !body->empty()) text += ": " + body->substr(0, std::min<size_t>(body->size(), 200));
  return text;
}

}  // namespace

SleepController::SleepController(std::vector<InstanceSet*> sets, SleepOptions options)
    : sets_(std::move(sets)), options_(std::move(options)) {}

SleepController::~SleepController() { stop(); }

Interrupt SleepController::interrupt() const {
  return [this]() -> std::optional<Status> {
    if (stopping_.load()) return unavailable("the proxy is stopping");
    return std::nullopt;
  };
}

void SleepController::start() {
  if (!options_.park_idle_after || park_thread_.joinable()) return;
  park_thread_ = std::thread([this] { park_loop(); });
}

void SleepController::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_.store(true);
  }
  cv_.notify_all();
  if (park_thread_.joinable()) park_thread_.join();
  std::list<Call> calls;
  {
    std::lock_guard lock(mu_);
    calls.swap(calls_);
  }
  for (Call& c : calls)
    if (c.thread.joinable()) c.thread.join();
}

void SleepController::spawn(std::function<void()> work) {
  std::lock_guard lock(mu_);
  if (stopping_.load()) return;
  for (auto it = calls_.begin(); it != calls_.end();) {
    if (it->done.load()) {
      it->thread.join();
      it = calls_.erase(it);
    } else {
      ++it;
    }
  }
  Call& call = calls_.emplace_back();
  call.thread = std::thread([&call, work = std::move(work)] {
    work();
    call.done.store(true);
  });
}

void SleepController::wake_one(InstanceSet& set) {
  if (!options_.wake_on_demand) return;
  const std::optional<size_t> index = set.wake_candidate();
  if (!index) return;
  InstanceSet* raw = &set;
  const size_t i = *index;
  spawn([this, raw, i] { run_wake(raw, i); });
}

void SleepController::run_wake(InstanceSet* set, size_t index) {
  const InstanceUrl& url = set->url(index);
  SIESTA_LOG_INFO("proxy: every {} instance is asleep; waking {}", role_name(set->role()), url.text);
  const auto started = Clock::now();
  const LegLimits limits{options_.connect_timeout, options_.wake_timeout, options_.wake_timeout};
  std::unique_ptr<Leg> leg = Leg::start(url, {"POST", "/wake_up", "", "application/json", options_.headers}, limits);
  Result<LegHead> head = leg->wait_head(interrupt());
  Result<std::string> body = head ? leg->wait_body(interrupt()) : Result<std::string>(head.error());
  const bool ok = head && body && head->status == 200;
  const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
  if (ok) {
    SIESTA_LOG_INFO("proxy: {} is awake ({:.2f} s)", url.text, seconds);
  } else {
    SIESTA_LOG_WARN("proxy: waking {} failed after {:.2f} s: {}", url.text, seconds, outcome(head, body));
  }
  set->wake_done(index, ok, ok ? std::string() : outcome(head, body));
}

void SleepController::run_park(InstanceSet* set, size_t index) {
  const InstanceUrl& url = set->url(index);
  SIESTA_LOG_INFO("proxy: {} instance {} idle for {} s; putting it to sleep (level 1)", role_name(set->role()),
                  url.text, std::chrono::duration<double>(*options_.park_idle_after).count());
  const LegLimits limits{options_.connect_timeout, options_.call_timeout, options_.call_timeout};
  std::unique_ptr<Leg> leg =
      Leg::start(url, {"POST", "/sleep?level=1&mode=wait", "", "application/json", options_.headers}, limits);
  Result<LegHead> head = leg->wait_head(interrupt());
  Result<std::string> body = head ? leg->wait_body(interrupt()) : Result<std::string>(head.error());
  const bool ok = head && body && head->status == 200;
  if (!ok) SIESTA_LOG_WARN("proxy: putting {} to sleep failed: {}", url.text, outcome(head, body));
  set->park_done(index, ok, ok ? std::string() : outcome(head, body));
}

void SleepController::park_loop() {
  const auto idle = *options_.park_idle_after;
  const auto period = std::clamp(idle / 4, std::chrono::milliseconds(50), std::chrono::milliseconds(1000));
  std::unique_lock lock(mu_);
  while (!stopping_.load()) {
    if (cv_.wait_for(lock, period, [this] { return stopping_.load(); })) break;
    lock.unlock();
    for (InstanceSet* set : sets_)
      for (size_t i : set->park_candidates(std::chrono::steady_clock::now(), idle))
        spawn([this, set, i] { run_park(set, i); });
    lock.lock();
  }
}

}  // namespace siesta::proxy
