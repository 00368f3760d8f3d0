#include "pd/load_state.h"

#include <string>

namespace siesta::pd {

Result<LoadState> next_load_state(LoadState from, LoadEvent event) {
  using S = LoadState;
  using E = LoadEvent;
  switch (from) {
    case S::kPending:
      if (event == E::kAllocated) return S::kStarting;
      if (event == E::kFailed || event == E::kProducerEnded) return S::kFailed;
      break;
    case S::kStarting:
      if (event == E::kAsked) return S::kAsked;
      if (event == E::kReadStarted) return S::kReading;
      if (event == E::kKvInPlace) return S::kLoaded;
      if (event == E::kFailed || event == E::kProducerEnded) return S::kFailed;
      break;
    case S::kAsked:
      if (event == E::kAccepted) return S::kAwaitingWrite;
      if (event == E::kKvInPlace) return S::kLoaded;
      if (event == E::kFailed) return S::kEnding;
      if (event == E::kProducerEnded) return S::kFailed;
      break;
    case S::kAwaitingWrite:
      if (event == E::kKvInPlace) return S::kLoaded;
      if (event == E::kFailed) return S::kEnding;
      if (event == E::kProducerEnded) return S::kFailed;
      break;
    case S::kReading:
      if (event == E::kReadDone) return S::kConfirming;
      if (event == E::kFailed) return S::kEnding;
      break;
    case S::kConfirming:
      if (event == E::kKvInPlace) return S::kLoaded;
      if (event == E::kFailed || event == E::kProducerEnded) return S::kFailed;
      break;
    case S::kEnding:
      if (event == E::kQuiet) return S::kFailed;
      break;
    case S::kLoaded:
    case S::kFailed: break;
  }
  return conflict(std::string("load state ") + load_state_name(from) + " does not allow event " +
                  load_event_name(event));
}

bool load_ended(LoadState state) {
  return state == LoadState::kLoaded || state == LoadState::kEnding || state == LoadState::kFailed;
}

bool load_final(LoadState state) { return state == LoadState::kLoaded || state == LoadState::kFailed; }

const char* load_state_name(LoadState state) {
  switch (state) {
    case LoadState::kPending: return "PENDING";
    case LoadState::kStarting: return "STARTING";
    case LoadState::kAsked: return "ASKED";
    case LoadState::kAwaitingWrite: return "AWAITING_WRITE";
    case LoadState::kReading: return "READING";
    case LoadState::kConfirming: return "CONFIRMING";
    case LoadState::kLoaded: return "LOADED";
    case LoadState::kEnding: return "ENDING";
    case LoadState::kFailed: return "FAILED";
  }
  return "?";
}

const char* load_event_name(LoadEvent event) {
  switch (event) {
    case LoadEvent::kAllocated: return "allocated";
    case LoadEvent::kAsked: return "asked";
    case LoadEvent::kAccepted: return "accepted";
    case LoadEvent::kReadStarted: return "read_started";
    case LoadEvent::kReadDone: return "read_done";
    case LoadEvent::kKvInPlace: return "kv_in_place";
    case LoadEvent::kFailed: return "failed";
    case LoadEvent::kProducerEnded: return "producer_ended";
    case LoadEvent::kQuiet: return "quiet";
  }
  return "?";
}

}  // namespace siesta::pd
