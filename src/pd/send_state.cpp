#include "pd/send_state.h"

#include <string>

namespace siesta::pd {

Result<SendState> next_send_state(SendState from, SendEvent event) {
  using S = SendState;
  using E = SendEvent;
  switch (from) {
    case S::kWaiting:
      switch (event) {
        case E::kPrefilled: return S::kReady;
        case E::kFailed:
        case E::kAborted:
        case E::kCancelled:
        case E::kReleased: return S::kDone;
        default: break;
      }
      break;
    case S::kReady:
      switch (event) {
        case E::kWriteStarted: return S::kWriting;
        case E::kSent:
        case E::kFailed:
        case E::kAborted:
        case E::kCancelled:
        case E::kExpired:
        case E::kReleased: return S::kDone;
        default: break;
      }
      break;
    case S::kWriting:
      if (event == E::kSent) return S::kDone;
      if (event == E::kFailed) return S::kDraining;
      break;
    case S::kDraining:
      if (event == E::kDrained) return S::kDone;
      break;
    case S::kDone: break;
  }
  return conflict(std::string("send state ") + send_state_name(from) + " does not allow event " +
                  send_event_name(event));
}

bool send_holds_blocks(SendState state) {
  return state == SendState::kReady || state == SendState::kWriting || state == SendState::kDraining;
}

const char* send_state_name(SendState state) {
  switch (state) {
    case SendState::kWaiting: return "WAITING";
    case SendState::kReady: return "READY";
    case SendState::kWriting: return "WRITING";
    case SendState::kDraining: return "DRAINING";
    case SendState::kDone: return "DONE";
  }
  return "?";
}

const char* send_event_name(SendEvent event) {
  switch (event) {
    case SendEvent::kPrefilled: return "prefilled";
    case SendEvent::kWriteStarted: return "write_started";
    case SendEvent::kSent: return "sent";
    case SendEvent::kFailed: return "failed";
    case SendEvent::kAborted: return "aborted";
    case SendEvent::kCancelled: return "cancelled";
    case SendEvent::kExpired: return "expired";
    case SendEvent::kReleased: return "released";
    case SendEvent::kDrained: return "drained";
  }
  return "?";
}

const char* send_end_reason(SendEvent event) {
  switch (event) {
    case SendEvent::kSent: return "finished (its KV was already sent)";
    case SendEvent::kFailed: return "failed";
    case SendEvent::kAborted: return "aborted";
    case SendEvent::kCancelled: return "cancelled by the consumer";
    case SendEvent::kExpired: return "expired (its hold deadline passed)";
    case SendEvent::kReleased: return "released (the producer's KV cache was reset or went to sleep)";
    case SendEvent::kDrained: return "failed";
    case SendEvent::kPrefilled:
    case SendEvent::kWriteStarted: return "in progress";
  }
  return "?";
}

}  // namespace siesta::pd
