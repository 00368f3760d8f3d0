#include "pd/load_state.h"

#include <string>

namespace siesta::pd {

Result<LoadState> next_load_state(LoadState from, LoadEvent event) {
  if (event == LoadEvent::kFailed && !load_ended(from)) return LoadState::kFailed;
  switch (from) {
    case LoadState::kPending:
      if (event == LoadEvent::kAllocated) return LoadState::kStarting;
      break;
    case LoadState::kStarting:
      if (event == LoadEvent::kAccepted) return LoadState::kAwaitingWrite;
      if (event == LoadEvent::kReadStarted) return LoadState::kReading;
      if (event == LoadEvent::kKvInPlace) return LoadState::kLoaded;
      break;
    case LoadState::kAwaitingWrite:
      if (event == LoadEvent::kKvInPlace) return LoadState::kLoaded;
      break;
    case LoadState::kReading:
      if (event == LoadEvent::kReadDone) return LoadState::kConfirming;
      break;
    case LoadState::kConfirming:
      if (event == LoadEvent::kKvInPlace) return LoadState::kLoaded;
      break;
    case LoadState::kLoaded:
    case LoadState::kFailed:
      break;
  }
  return conflict(std::string("load state ") + load_state_name(from) + " does not allow event " +
                  load_event_name(event));
}

bool load_ended(LoadState state) { return state == LoadState::kLoaded || state == LoadState::kFailed; }

const char* load_state_name(LoadState state) {
  switch (state) {
    case LoadState::kPending: return "PENDING";
    case LoadState::kStarting: return "STARTING";
    case LoadState::kAwaitingWrite: return "AWAITING_WRITE";
    case LoadState::kReading: return "READING";
    case LoadState::kConfirming: return "CONFIRMING";
    case LoadState::kLoaded: return "LOADED";
    case LoadState::kFailed: return "FAILED";
  }
  return "?";
}

const char* load_event_name(LoadEvent event) {
  switch (event) {
    case LoadEvent::kAllocated: return "allocated";
    case LoadEvent::kAccepted: return "accepted";
    case LoadEvent::kReadStarted: return "read_started";
    case LoadEvent::kReadDone: return "read_done";
    case LoadEvent::kKvInPlace: return "kv_in_place";
    case LoadEvent::kFailed: return "failed";
  }
  return "?";
}

}  // namespace siesta::pd
