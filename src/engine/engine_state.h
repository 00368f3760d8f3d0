// EngineState: whether the engine loop schedules, and the one function that
// moves it (next_engine_state). The table below is the whole state machine;
// sleep and wake (sleep levels, partial wake) add their states here.
//
//   from \ event   PauseNow   PauseWhenDrained   Drained   Resume
//   Running        Paused     Draining           -         Running
//   Draining       Paused     Draining           Paused    Running
//   Paused         Paused     Paused             Paused    Running
//
// Running: submissions enter the scheduler; the loop steps.
// Draining (pause mode "wait"): requests already in the scheduler run to the
//   end; new submissions are held in the engine's inbox.
// Paused: nothing is scheduled; submissions are held; aborts still apply.
//   With pause mode "keep" the running requests were preempted first and
//   recompute after resume; with "abort" they were aborted.
// Pausing a paused engine and resuming a running one change nothing.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace siesta {

enum class EngineState : uint8_t { kRunning, kDraining, kPaused };

enum class EngineEvent : uint8_t { kPauseNow, kPauseWhenDrained, kDrained, kResume };

// vLLM's pause modes.
enum class PauseMode : uint8_t {
  kAbort,  // abort every unfinished request, then pause
  kWait,   // let requests in the scheduler finish, then pause
  kKeep,   // preempt running requests (they recompute after resume), then pause
};

// The only transition function. kConflict for a pair the table does not allow.
Result<EngineState> next_engine_state(EngineState from, EngineEvent event);

const char* engine_state_name(EngineState state);
Result<PauseMode> parse_pause_mode(const char* name);

}  // namespace siesta
