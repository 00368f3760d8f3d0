// EngineState: whether the engine loop admits and schedules requests, and
// which of its memory is resident; next_engine_state is the one function that
// moves it. The table below is the whole state machine (docs/engine-states.md
// has it with the memory of each state); the engine calls next_engine_state
// only after the memory work of a call succeeded, so the state always says
// what the memory is.
//
//   from \ event        PauseNow  PauseWhen  Drained  Resume   Sleep0  Sleep1  Sleep2  ReleaseKv  WakePartial  WakeAll
//                                 Drained
//   running             paused    draining   -        running  -       -       -       -          -            running
//   draining            paused    draining   paused   running  -       -       -       -          -            draining
//   paused              paused    paused     paused   running  sleep0  sleep1  sleep2  kv_rel     -            paused
//   paused_kv_released  kv_rel    kv_rel     kv_rel   -        partial sleep1  sleep2  kv_rel     kv_rel       paused
//   sleeping_level_0    sleep0    sleep0     sleep0   -        sleep0  sleep1  sleep2  partial    partial      running
//   sleeping_level_1    sleep1    sleep1     sleep1   -        sleep1  sleep1  sleep2  sleep1     partial      running
//   sleeping_level_2    sleep2    sleep2     sleep2   -        sleep2  sleep2  sleep2  sleep2     partial      running
//   partially_awake     partial   partial    partial  -        partial sleep1  sleep2  partial    partial      running
//   ("-": kConflict with a message that says what to call first)
//
// running: submissions enter the scheduler; the loop steps. Everything resident.
// draining (pause mode "wait"): requests already in the scheduler run to the
//   end; new submissions wait in the engine's inbox.
// paused: nothing is scheduled; submissions wait; aborts still apply. With
//   pause mode "keep" the running requests were preempted first and recompute
//   after resume; with "abort" they were aborted. Everything resident.
// paused_kv_released: paused, and release_kv_cache_memory gave the KV cache
//   back (weights and scratch kept). wake_up maps it again (-> paused).
// sleeping_level_0: paused by sleep; nothing released. wake_up resumes.
// sleeping_level_1: weights copied to host memory, then the weights, the KV
//   cache and scratch released.
// sleeping_level_2: everything released; the weights' contents are gone.
// partially_awake: asleep, some tags woken (wake_up?tags=weights), not all.
//   Scheduling resumes (-> running) only when a wake leaves every tag resident.
//
// Sleep, wake and release run the pause first where the table needs one, so
// callers see "sleep from running" work; the table lists only single steps.
// Every repeated call (pause when paused, wake when awake, sleep at the same
// level) leaves the state as it was.
#pragma once

#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace siesta {

enum class EngineState : uint8_t {
  kRunning,
  kDraining,
  kPaused,
  kPausedKvReleased,
  kSleepingLevel0,
  kSleepingLevel1,
  kSleepingLevel2,
  kPartiallyAwake,
};

enum class EngineEvent : uint8_t {
  kPauseNow,          // pause modes abort and keep, or wait with nothing running
  kPauseWhenDrained,  // pause mode wait with requests running
  kDrained,           // the loop saw the scheduler empty while draining
  kResume,
  kSleepLevel0,
  kSleepLevel1,       // after the memory work: weights offloaded, the rest released
  kSleepLevel2,       // after the memory work: everything released
  kReleaseKvCache,    // after the KV cache was released
  kWakePartial,       // after a wake that left some tag not resident
  kWakeAll,           // after a wake that left every tag resident
};

// vLLM's pause modes.
enum class PauseMode : uint8_t {
  kAbort,  // abort every unfinished request, then pause
  kWait,   // let requests in the scheduler finish, then pause
  kKeep,   // preempt running requests (they recompute after resume), then pause
};

// The only transition function. kConflict for a pair the table does not
// allow, with a message naming the state and the call to make first.
Result<EngineState> next_engine_state(EngineState from, EngineEvent event);

// New submissions enter the scheduler.
bool engine_admits(EngineState state);
// The loop runs steps for requests in the scheduler.
bool engine_schedules(EngineState state);
// GET /is_sleeping: put to sleep and not yet fully awake.
bool engine_is_sleeping(EngineState state);
// GET /is_paused: the scheduler is stopped (paused or asleep).
bool engine_is_paused(EngineState state);

// "running", "draining", "paused", "paused_kv_released", "sleeping_level_0",
// "sleeping_level_1", "sleeping_level_2", "partially_awake".
const char* engine_state_name(EngineState state);
const char* engine_event_name(EngineEvent event);
Result<PauseMode> parse_pause_mode(std::string_view name);
const char* pause_mode_name(PauseMode mode);

}  // namespace siesta
