#include "engine/engine_state.h"

#include <string>

namespace siesta {
namespace {

using S = EngineState;
using E = EngineEvent;

S sleeping_at(int level) {
  switch (level) {
    case 0: return S::kSleepingLevel0;
    case 1: return S::kSleepingLevel1;
    default: return S::kSleepingLevel2;
  }
}

int sleep_level(E event) {
  switch (event) {
    case E::kSleepLevel0: return 0;
    case E::kSleepLevel1: return 1;
    case E::kSleepLevel2: return 2;
    default: return -1;
  }
}

Status refuse(S from, E event, const char* what_first) {
  return conflict(std::string("the engine is ") + engine_state_name(from) + ": " + engine_event_name(event) +
                  " is not allowed now; " + what_first);
}

}  // namespace

Result<EngineState> next_engine_state(EngineState from, EngineEvent event) {
  const bool pause_event = event == E::kPauseNow || event == E::kPauseWhenDrained || event == E::kDrained;
  const int level = sleep_level(event);
  switch (from) {
    case S::kRunning:
      if (event == E::kPauseNow) return S::kPaused;
      if (event == E::kPauseWhenDrained) return S::kDraining;
      if (event == E::kResume || event == E::kWakeAll) return S::kRunning;
      if (event == E::kDrained) return refuse(from, event, "only a draining engine drains");
      if (event == E::kWakePartial) return refuse(from, event, "an awake engine has every tag resident");
      return refuse(from, event, "pause it first (POST /pause)");
    case S::kDraining:
      if (event == E::kPauseNow || event == E::kDrained) return S::kPaused;
      if (event == E::kPauseWhenDrained || event == E::kWakeAll) return S::kDraining;
      if (event == E::kResume) return S::kRunning;
      if (event == E::kWakePartial) return refuse(from, event, "an awake engine has every tag resident");
      return refuse(from, event, "wait until the running requests finish, or pause with mode abort or keep");
    case S::kPaused:
      if (pause_event || event == E::kWakeAll) return S::kPaused;
      if (event == E::kResume) return S::kRunning;
      if (level >= 0) return sleeping_at(level);
      if (event == E::kReleaseKvCache) return S::kPausedKvReleased;
      return refuse(from, event, "a paused engine has every tag resident");
    case S::kPausedKvReleased:
      if (pause_event || event == E::kReleaseKvCache || event == E::kWakePartial) return S::kPausedKvReleased;
      if (event == E::kWakeAll) return S::kPaused;
      if (level == 0) return S::kPartiallyAwake;
      if (level > 0) return sleeping_at(level);
      return refuse(from, event, "the KV cache memory is released; call POST /wake_up?tags=kv_cache first");
    case S::kSleepingLevel0:
    case S::kSleepingLevel1:
    case S::kSleepingLevel2: {
      const int current = from == S::kSleepingLevel0 ? 0 : from == S::kSleepingLevel1 ? 1 : 2;
      if (pause_event) return from;
      if (level >= 0) return sleeping_at(level > current ? level : current);
      if (event == E::kReleaseKvCache) return current == 0 ? S::kPartiallyAwake : from;
      if (event == E::kWakePartial) return S::kPartiallyAwake;
      if (event == E::kWakeAll) return S::kRunning;
      return refuse(from, event, "the engine is asleep; call POST /wake_up first");
    }
    case S::kPartiallyAwake:
      if (pause_event || level == 0 || event == E::kReleaseKvCache || event == E::kWakePartial) return from;
      if (level > 0) return sleeping_at(level);
      if (event == E::kWakeAll) return S::kRunning;
      return refuse(from, event, "some memory is still asleep; call POST /wake_up (without tags: everything) first");
  }
  return internal_error("engine state out of range");
}

bool engine_admits(EngineState state) { return state == S::kRunning; }

bool engine_schedules(EngineState state) { return state == S::kRunning || state == S::kDraining; }

bool engine_is_sleeping(EngineState state) {
  return state == S::kSleepingLevel0 || state == S::kSleepingLevel1 || state == S::kSleepingLevel2 ||
         state == S::kPartiallyAwake;
}

bool engine_is_paused(EngineState state) { return !engine_schedules(state); }

const char* engine_state_name(EngineState state) {
  switch (state) {
    case S::kRunning: return "running";
    case S::kDraining: return "draining";
    case S::kPaused: return "paused";
    case S::kPausedKvReleased: return "paused_kv_released";
    case S::kSleepingLevel0: return "sleeping_level_0";
    case S::kSleepingLevel1: return "sleeping_level_1";
    case S::kSleepingLevel2: return "sleeping_level_2";
    case S::kPartiallyAwake: return "partially_awake";
  }
  return "unknown";
}

const char* engine_event_name(EngineEvent event) {
  switch (event) {
    case E::kPauseNow: return "pause";
    case E::kPauseWhenDrained: return "pause (wait)";
    case E::kDrained: return "drained";
    case E::kResume: return "resume";
    case E::kSleepLevel0: return "sleep (level 0)";
    case E::kSleepLevel1: return "sleep (level 1)";
    case E::kSleepLevel2: return "sleep (level 2)";
    case E::kReleaseKvCache: return "release_kv_cache_memory";
    case E::kWakePartial: return "wake_up (partial)";
    case E::kWakeAll: return "wake_up";
  }
  return "unknown";
}

Result<PauseMode> parse_pause_mode(std::string_view name) {
  if (name == "abort") return PauseMode::kAbort;
  if (name == "wait") return PauseMode::kWait;
  if (name == "keep") return PauseMode::kKeep;
  return invalid_argument("pause mode must be abort, wait or keep, got '" + std::string(name) + "'");
}

const char* pause_mode_name(PauseMode mode) {
  switch (mode) {
    case PauseMode::kAbort: return "abort";
    case PauseMode::kWait: return "wait";
    case PauseMode::kKeep: return "keep";
  }
  return "unknown";
}

}  // namespace siesta
