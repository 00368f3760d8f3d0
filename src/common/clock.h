// The steady clock every wait and duration in siesta reads, and deadlines on
// it: every wait ends at a point on that clock, never "forever". Callers pass
// a Deadline; helpers build one from a duration.
#pragma once

#include <algorithm>
#include <chrono>

namespace siesta {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

inline Deadline deadline_after(std::chrono::milliseconds d) { return Clock::now() + d; }
inline bool expired(Deadline d) { return Clock::now() >= d; }
inline Deadline earlier(Deadline a, Deadline b) { return std::min(a, b); }

// Milliseconds left until d (0 when passed), for APIs that take a timeout.
inline int millis_left(Deadline d) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(d - Clock::now()).count();
  if (left <= 0) return 0;
  return left > 1'000'000'000 ? 1'000'000'000 : static_cast<int>(left);
}

// Seconds from `start` to now.
inline double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace siesta
