#include "engine/engine_state.h"

#include <cstring>
#include <string>

namespace siesta {

Result<EngineState> next_engine_state(EngineState from, EngineEvent event) {
  using S = EngineState;
  using E = EngineEvent;
  if (event == E::kResume) return S::kRunning;
  switch (from) {
    case S::kRunning:
      if (event == E::kPauseNow) return S::kPaused;
      if (event == E::kPauseWhenDrained) return S::kDraining;
      break;
    case S::kDraining:
      if (event == E::kPauseNow || event == E::kDrained) return S::kPaused;
      if (event == E::kPauseWhenDrained) return S::kDraining;
      break;
    case S::kPaused:
      return S::kPaused;
  }
  return conflict(std::string("engine state ") + engine_state_name(from) + " does not allow this event");
}

const char* engine_state_name(EngineState state) {
  switch (state) {
    case EngineState::kRunning: return "running";
    case EngineState::kDraining: return "draining";
    case EngineState::kPaused: return "paused";
  }
  return "unknown";
}

Result<PauseMode> parse_pause_mode(const char* name) {
  if (std::strcmp(name, "abort") == 0) return PauseMode::kAbort;
  if (std::strcmp(name, "wait") == 0) return PauseMode::kWait;
  if (std::strcmp(name, "keep") == 0) return PauseMode::kKeep;
  return invalid_argument(std::string("pause mode must be abort, wait or keep, got '") + name + "'");
}

}  // namespace siesta
