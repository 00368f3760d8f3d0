#include "engine/request_state.h"

#include <string>

namespace siesta {

Result<RequestState> next_state(RequestState from, RequestEvent event) {
  using S = RequestState;
  using E = RequestEvent;
  if (!is_finished(from) && event == E::kAbort) return S::kFinishedAborted;
  switch (from) {
    case S::kWaiting:
      if (event == E::kSchedule) return S::kRunning;
      if (event == E::kAwaitRemoteKv) return S::kWaitingForRemoteKv;
      // Only with a generated token: the first one, from a remote load.
      if (event == E::kStop) return S::kFinishedStopped;
      if (event == E::kReachLength) return S::kFinishedLength;
      break;
    case S::kWaitingForRemoteKv:
      if (event == E::kRemoteKvLoaded || event == E::kRemoteKvFailed) return S::kWaiting;
      break;
    case S::kRunning:
      if (event == E::kPreempt) return S::kPreempted;
      if (event == E::kStop) return S::kFinishedStopped;
      if (event == E::kReachLength) return S::kFinishedLength;
      break;
    case S::kPreempted:
      if (event == E::kSchedule) return S::kRunning;
      if (event == E::kStop) return S::kFinishedStopped;
      break;
    case S::kFinishedStopped:
    case S::kFinishedLength:
    case S::kFinishedAborted:
      break;
  }
  return conflict(std::string("request state ") + state_name(from) + " does not allow " + event_name(event));
}

bool is_finished(RequestState state) {
  return state == RequestState::kFinishedStopped || state == RequestState::kFinishedLength ||
         state == RequestState::kFinishedAborted;
}

const char* state_name(RequestState state) {
  switch (state) {
    case RequestState::kWaiting: return "waiting";
    case RequestState::kWaitingForRemoteKv: return "waiting_for_remote_kv";
    case RequestState::kRunning: return "running";
    case RequestState::kPreempted: return "preempted";
    case RequestState::kFinishedStopped: return "finished_stopped";
    case RequestState::kFinishedLength: return "finished_length";
    case RequestState::kFinishedAborted: return "finished_aborted";
  }
  return "unknown";
}

const char* event_name(RequestEvent event) {
  switch (event) {
    case RequestEvent::kSchedule: return "schedule";
    case RequestEvent::kPreempt: return "preempt";
    case RequestEvent::kAwaitRemoteKv: return "await_remote_kv";
    case RequestEvent::kRemoteKvLoaded: return "remote_kv_loaded";
    case RequestEvent::kRemoteKvFailed: return "remote_kv_failed";
    case RequestEvent::kStop: return "stop";
    case RequestEvent::kReachLength: return "reach_length";
    case RequestEvent::kAbort: return "abort";
  }
  return "unknown";
}

const char* finish_reason(RequestState state) {
  switch (state) {
    case RequestState::kFinishedStopped: return "stop";
    case RequestState::kFinishedLength: return "length";
    case RequestState::kFinishedAborted: return "abort";
    default: return nullptr;
  }
}

}  // namespace siesta
