#include "engine/stop_string_checker.h"

#include <algorithm>

namespace siesta {

StopStringChecker::StopStringChecker(std::vector<std::string> stop_strings, bool include_stop_in_output)
    : include_stop_(include_stop_in_output) {
  for (std::string& s : stop_strings)
    if (!s.empty()) stops_.push_back(std::move(s));
}

size_t StopStringChecker::hold_length() const {
  size_t longest = 0;
  for (const std::string& s : stops_) longest = std::max(longest, s.size());
  const size_t max_len = std::min(pending_.size(), longest == 0 ? 0 : longest - 1);
  for (size_t len = max_len; len > 0; --len) {
    const std::string_view tail(pending_.data() + pending_.size() - len, len);
    for (const std::string& s : stops_)
      if (s.size() > len && std::string_view(s).substr(0, len) == tail) return len;
  }
  return 0;
}

StopCheck StopStringChecker::push(std::string_view new_text, bool may_stop) {
  StopCheck out;
  if (stopped_) {
    out.stopped = true;
    out.stop_index = stop_index_;
    return out;
  }
  pending_.append(new_text);
  if (!may_stop || stops_.empty()) {
    out.text = std::move(pending_);
    pending_.clear();
    sent_ += out.text;
    return out;
  }
  // Sent text never holds the start of a future match, so searching the
  // unsent text is enough.
  size_t best_pos = std::string::npos;
  int best = -1;
  for (size_t i = 0; i < stops_.size(); ++i) {
    const size_t pos = pending_.find(stops_[i]);
    if (pos < best_pos) {
      best_pos = pos;
      best = static_cast<int>(i);
    }
  }
  if (best >= 0) {
    stopped_ = true;
    stop_index_ = best;
    out.stopped = true;
    out.stop_index = best;
    out.text = pending_.substr(0, best_pos + (include_stop_ ? stops_[best].size() : 0));
    pending_.clear();
    sent_ += out.text;
    return out;
  }
  const size_t hold = hold_length();
  out.text = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  sent_ += out.text;
  return out;
}

std::string StopStringChecker::finish() {
  std::string rest = std::move(pending_);
  pending_.clear();
  sent_ += rest;
  return rest;
}

}  // namespace siesta
