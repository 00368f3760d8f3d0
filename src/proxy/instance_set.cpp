#include "proxy/instance_set.h"

namespace siesta::proxy {

const char* role_name(Role role) { return role == Role::kPrefill ? "prefill" : "decode"; }

InstanceSet::InstanceSet(Role role, std::vector<InstanceUrl> urls)
    : role_(role), urls_(std::move(urls)), states_(urls_.size()) {}

std::optional<size_t> InstanceSet::find(const std::string& url_text) const {
  for (size_t i = 0; i < urls_.size(); ++i)
    if (urls_[i].text == url_text) return i;
  return std::nullopt;
}

std::optional<Pick> InstanceSet::pick() {
  std::lock_guard lock(mu_);
  const size_t n = urls_.size();
  for (size_t step = 0; step < n; ++step) {
    const size_t i = (cursor_ + step) % n;
    if (!states_[i].up) continue;
    cursor_ = (i + 1) % n;
    ++states_[i].picked;
    return Pick{i, urls_[i]};
  }
  return std::nullopt;
}

void InstanceSet::record_health(size_t index, bool ok, const std::string& why) {
  std::lock_guard lock(mu_);
  State& s = states_.at(index);
  ++s.health_checks;
  s.up = ok;
  s.why_down = ok ? std::string() : why;
}

void InstanceSet::record_failure(size_t index, const std::string& why) {
  std::lock_guard lock(mu_);
  State& s = states_.at(index);
  ++s.failures;
  s.up = false;
  s.why_down = "request failed: " + why;
}

size_t InstanceSet::up_count() const {
  std::lock_guard lock(mu_);
  size_t up = 0;
  for (const State& s : states_) up += s.up ? 1 : 0;
  return up;
}

std::optional<Pick> InstanceSet::first_up() const {
  std::lock_guard lock(mu_);
  for (size_t i = 0; i < urls_.size(); ++i)
    if (states_[i].up) return Pick{i, urls_[i]};
  return std::nullopt;
}

std::vector<InstanceStatus> InstanceSet::snapshot() const {
  std::lock_guard lock(mu_);
  std::vector<InstanceStatus> out;
  out.reserve(urls_.size());
  for (size_t i = 0; i < urls_.size(); ++i) {
    const State& s = states_[i];
    out.push_back({urls_[i], role_, s.up, s.why_down, s.picked, s.failures, s.health_checks});
  }
  return out;
}

std::string InstanceSet::describe_none_up() const {
  std::string text = std::string("no ") + role_name(role_) + " instance is up: ";
  const std::vector<InstanceStatus> all = snapshot();
  for (size_t i = 0; i < all.size(); ++i) {
    if (i) text += ", ";
    text += all[i].url.text + (all[i].up ? " (up)" : " (" + all[i].why_down + ")");
  }
  return text;
}

}  // namespace siesta::proxy
