#include "proxy/instance_set.h"

#include <cstdlib>
#include <sstream>

namespace siesta::proxy {

class InFlight {
 public:
  InFlight(InstanceSet* set, size_t index) : set_(set), index_(index) {}
  ~InFlight() { set_->release(index_); }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  InstanceSet* set_;
  size_t index_;
};

namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// The value of the first sample of `family` whose labels contain `label` (empty: any).
std::optional<double> sample(const std::string& text, const std::string& family, const std::string& label = {}) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line.compare(0, family.size(), family) != 0) continue;
    const char next = line.size() > family.size() ? line[family.size()] : '\0';
    if (next != ' ' && next != '{') continue;
    if (!label.empty() && line.find(label) == std::string::npos) continue;
    const size_t space = line.rfind(' ');
    if (space == std::string::npos) continue;
    char* end = nullptr;
    const double v = std::strtod(line.c_str() + space + 1, &end);
    if (end == line.c_str() + space + 1) continue;
    return v;
  }
  return std::nullopt;
}

}  // namespace

const char* role_name(Role role) { return role == Role::kPrefill ? "prefill" : "decode"; }

const char* condition_name(Condition c) {
  switch (c) {
    case Condition::kServing:
      return "serving";
    case Condition::kAsleep:
      return "asleep";
    case Condition::kPaused:
      return "paused";
    case Condition::kWaking:
      return "waking";
  }
  return "unknown";
}

Condition condition_of_engine_state(const std::string& state) {
  if (state.rfind("sleeping", 0) == 0 || state == "partially_awake") return Condition::kAsleep;
  if (state == "paused" || state == "paused_kv_released" || state == "draining") return Condition::kPaused;
  return Condition::kServing;
}

EngineReport parse_engine_report(const std::string& text) {
  EngineReport r;
  std::istringstream in(text);
  std::string line;
  const std::string state_family = "siesta:engine_state{";
  while (std::getline(in, line)) {
    if (line.compare(0, state_family.size(), state_family) != 0) continue;
    const size_t at = line.find("state=\"");
    const size_t close = at == std::string::npos ? at : line.find('"', at + 7);
    if (close == std::string::npos || line.substr(line.rfind(' ') + 1) == "0") continue;
    r.state = line.substr(at + 7, close - at - 7);
    break;
  }
  for (const char* prefix : {"siesta:", "vllm:"}) {
    const std::string p = prefix;
    if (auto awake = sample(text, p + "engine_sleep_state", "sleep_state=\"awake\""); awake && !r.asleep)
      r.asleep = *awake == 0;
    if (auto v = sample(text, p + "num_requests_running")) r.running = *v;
    if (auto v = sample(text, p + "num_requests_waiting")) r.waiting = *v;
    if (auto v = sample(text, p + "kv_cache_usage_perc")) r.kv_usage = *v;
    if (sample(text, p + "num_requests_running")) break;  // siesta's names found: vLLM's copies say the same
  }
  if (auto v = sample(text, "siesta:kv_blocks_in_use")) r.blocks_in_use = *v;
  return r;
}

InstanceSet::InstanceSet(Role role, std::vector<InstanceUrl> urls, uint64_t affinity_slack)
    : role_(role), urls_(std::move(urls)), affinity_slack_(affinity_slack), states_(urls_.size()) {}

std::optional<size_t> InstanceSet::find(const std::string& url_text) const {
  for (size_t i = 0; i < urls_.size(); ++i)
    if (urls_[i].text == url_text) return i;
  return std::nullopt;
}

double InstanceSet::load_of(const State& s) const {
  const double engine = s.report.running + s.report.waiting;
  const double ours = static_cast<double>(s.in_flight);
  return (engine > ours ? engine : ours) + s.report.kv_usage;
}

std::optional<Pick> InstanceSet::pick(std::optional<uint64_t> affinity) { return choose(affinity, false); }

std::optional<Pick> InstanceSet::pick_holding() {
  {
    std::lock_guard lock(mu_);
    for (const State& s : states_)
      if (s.up && s.condition == Condition::kServing) return std::nullopt;  // pick() serves
  }
  return choose(std::nullopt, true);
}

std::optional<Pick> InstanceSet::choose(std::optional<uint64_t> affinity, bool holding) {
  std::lock_guard lock(mu_);
  const size_t n = urls_.size();
  auto eligible = [holding](const State& s) {
    if (!s.up) return false;
    return holding ? (s.condition == Condition::kAsleep && !s.parking) || s.condition == Condition::kPaused
                   : s.condition == Condition::kServing;
  };
  std::optional<size_t> best;
  double best_load = 0;
  for (size_t step = 0; step < n; ++step) {
    const size_t i = (cursor_ + step) % n;
    const State& s = states_[i];
    if (!eligible(s)) continue;
    const double load = load_of(s);
    if (!best || load < best_load) {
      best = i;
      best_load = load;
    }
  }
  if (!best) return std::nullopt;
  if (affinity) {
    std::optional<size_t> home;
    uint64_t home_weight = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!eligible(states_[i])) continue;
      const uint64_t w = mix(*affinity ^ fnv1a(urls_[i].text));
      if (!home || w > home_weight) {
        home = i;
        home_weight = w;
      }
    }
    if (home && load_of(states_[*home]) <= best_load + static_cast<double>(affinity_slack_)) best = home;
  }
  const size_t i = *best;
  cursor_ = (i + 1) % n;
  State& s = states_[i];
  ++s.picked;
  ++s.in_flight;
  s.last_routed = std::chrono::steady_clock::now();
  return Pick{i, urls_[i], std::make_shared<InFlight>(this, i)};
}

void InstanceSet::release(size_t index) {
  std::lock_guard lock(mu_);
  State& s = states_[index];
  if (s.in_flight > 0) --s.in_flight;
  s.last_routed = std::chrono::steady_clock::now();
}

void InstanceSet::record_health(size_t index, bool ok, const std::string& why,
                                const std::optional<EngineReport>& report,
                                std::chrono::steady_clock::time_point asked_at) {
  {
    std::lock_guard lock(mu_);
    State& s = states_.at(index);
    ++s.health_checks;
    s.up = ok;
    s.why_down = ok ? std::string() : why;
    if (ok && report) {
      s.report = *report;
      s.engine_state = report->state;
      Condition c = report->state.empty() ? (report->asleep.value_or(false) ? Condition::kAsleep : Condition::kServing)
                                          : condition_of_engine_state(report->state);
      // Our own wake or park call is out, or ended after this report was
      // asked for: its answer, not the report, says what the engine is.
      if (s.condition != Condition::kWaking && !s.parking && asked_at >= s.lifecycle_at) s.condition = c;
    } else if (ok && s.condition != Condition::kWaking && !s.parking) {
      s.condition = Condition::kServing;
    }
  }
  changed_.notify_all();
}

void InstanceSet::record_failure(size_t index, const std::string& why) {
  {
    std::lock_guard lock(mu_);
    State& s = states_.at(index);
    ++s.failures;
    s.up = false;
    s.why_down = "request failed: " + why;
  }
  changed_.notify_all();
}

std::optional<size_t> InstanceSet::wake_candidate() {
  std::lock_guard lock(mu_);
  // One wake at a time: the requests wait for it; another starts only if it fails.
  for (const State& s : states_)
    if (s.condition == Condition::kWaking) return std::nullopt;
  for (size_t i = 0; i < states_.size(); ++i) {
    State& s = states_[i];
    if (s.up && s.condition == Condition::kAsleep && !s.parking) {
      s.condition = Condition::kWaking;
      ++s.wakes;
      return i;
    }
  }
  return std::nullopt;
}

bool InstanceSet::can_wake() const {
  std::lock_guard lock(mu_);
  for (const State& s : states_)
    if (s.up && (s.condition == Condition::kAsleep || s.condition == Condition::kWaking)) return true;
  return false;
}

void InstanceSet::wake_done(size_t index, bool ok, const std::string& why) {
  {
    std::lock_guard lock(mu_);
    State& s = states_.at(index);
    s.lifecycle_at = std::chrono::steady_clock::now();
    if (ok) {
      s.condition = Condition::kServing;
      s.engine_state = "running";
      s.last_routed = std::chrono::steady_clock::now();  // a fresh wake is not idle
    } else {
      ++s.wake_failures;
      s.condition = Condition::kAsleep;
      s.why_down.clear();
      (void)why;
    }
  }
  changed_.notify_all();
}

std::vector<size_t> InstanceSet::park_candidates(std::chrono::steady_clock::time_point now,
                                                 std::chrono::milliseconds idle) {
  std::vector<size_t> out;
  {
    std::lock_guard lock(mu_);
    for (size_t i = 0; i < states_.size(); ++i) {
      State& s = states_[i];
      if (!s.up || s.condition != Condition::kServing || s.parking || s.in_flight > 0) continue;
      if (s.report.running + s.report.waiting > 0) continue;
      if (now - s.last_routed < idle) continue;
      s.condition = Condition::kAsleep;
      s.parking = true;
      ++s.parks;
      out.push_back(i);
    }
  }
  if (!out.empty()) changed_.notify_all();
  return out;
}

void InstanceSet::park_done(size_t index, bool ok, const std::string& why) {
  {
    std::lock_guard lock(mu_);
    State& s = states_.at(index);
    s.parking = false;
    s.lifecycle_at = std::chrono::steady_clock::now();
    if (ok) {
      s.engine_state = "sleeping_level_1";
    } else {
      // The engine refused to sleep (no sleep mode, paused...): its next
      // report says what it is; until then it serves as before.
      s.condition = Condition::kServing;
      s.last_routed = std::chrono::steady_clock::now();
      (void)why;
    }
  }
  changed_.notify_all();
}

void InstanceSet::wait_for_change(std::chrono::steady_clock::time_point until) {
  std::unique_lock lock(mu_);
  changed_.wait_until(lock, until);
}

size_t InstanceSet::up_count() const {
  std::lock_guard lock(mu_);
  size_t up = 0;
  for (const State& s : states_) up += s.up ? 1 : 0;
  return up;
}

size_t InstanceSet::serving_count() const {
  std::lock_guard lock(mu_);
  size_t n = 0;
  for (const State& s : states_) n += s.up && s.condition == Condition::kServing ? 1 : 0;
  return n;
}

std::optional<Pick> InstanceSet::first_up() const {
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < urls_.size(); ++i)
    if (states_[i].up && states_[i].condition == Condition::kServing) return Pick{i, urls_[i], nullptr};
  for (size_t i = 0; i < urls_.size(); ++i)
    if (states_[i].up) return Pick{i, urls_[i], nullptr};
  return std::nullopt;
}

std::vector<InstanceStatus> InstanceSet::snapshot() const {
  std::lock_guard lock(mu_);
  std::vector<InstanceStatus> out;
  out.reserve(urls_.size());
  for (size_t i = 0; i < urls_.size(); ++i) {
    const State& s = states_[i];
    InstanceStatus st;
    st.url = urls_[i];
    st.role = role_;
    st.up = s.up;
    st.why_down = s.why_down;
    st.condition = s.condition;
    st.engine_state = s.engine_state;
    st.picked = s.picked;
    st.failures = s.failures;
    st.health_checks = s.health_checks;
    st.in_flight = s.in_flight;
    st.engine_running = s.report.running;
    st.engine_waiting = s.report.waiting;
    st.kv_usage = s.report.kv_usage;
    st.wakes = s.wakes;
    st.wake_failures = s.wake_failures;
    st.parks = s.parks;
    out.push_back(std::move(st));
  }
  return out;
}

std::string InstanceSet::describe_none_up() const {
  const std::vector<InstanceStatus> all = snapshot();
  bool any_up = false;
  for (const InstanceStatus& s : all) any_up = any_up || s.up;
  std::string text = std::string("no ") + role_name(role_) + (any_up ? " instance can serve: " : " instance is up: ");
  for (size_t i = 0; i < all.size(); ++i) {
    if (i) text += ", ";
    const InstanceStatus& s = all[i];
    std::string why =
        !s.up
            ? s.why_down
            : (s.condition == Condition::kServing
                   ? std::string("up")
                   : std::string(condition_name(s.condition)) + (s.engine_state.empty() ? "" : ": " + s.engine_state));
    text += s.url.text + " (" + why + ")";
  }
  return text;
}

}  // namespace siesta::proxy
