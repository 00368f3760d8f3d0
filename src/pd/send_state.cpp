#include "pd/send_state.h"

#include <string>

namespace siesta::pd {

Result<SendState> next_send_state(SendState from, SendEvent event) {
  switch (from) {
    case SendState::kWaiting:
      switch (event) {
        case SendEvent::kPrefilled: return SendState::kReady;
        case SendEvent::kFailed:
        case SendEvent::kAborted:
        case SendEvent::kReleased: return SendState::kDone;
        case SendEvent::kSent:
        case SendEvent::kExpired: break;
      }
      break;
    case SendState::kReady:
      switch (event) {
        case SendEvent::kSent:
        case SendEvent::kFailed:
        case SendEvent::kAborted:
        case SendEvent::kExpired:
        case SendEvent::kReleased: return SendState::kDone;
        case SendEvent::kPrefilled: break;
      }
      break;
    case SendState::kDone: break;
  }
  return conflict(std::string("send state ") + send_state_name(from) + " does not allow event " +
                  send_event_name(event));
}

const char* send_state_name(SendState state) {
  switch (state) {
    case SendState::kWaiting: return "WAITING";
    case SendState::kReady: return "READY";
    case SendState::kDone: return "DONE";
  }
  return "?";
}

const char* send_event_name(SendEvent event) {
  switch (event) {
    case SendEvent::kPrefilled: return "prefilled";
    case SendEvent::kSent: return "sent";
    case SendEvent::kFailed: return "failed";
    case SendEvent::kAborted: return "aborted";
    case SendEvent::kExpired: return "expired";
    case SendEvent::kReleased: return "released";
  }
  return "?";
}

const char* send_end_reason(SendEvent event) {
  switch (event) {
    case SendEvent::kSent: return "finished (its KV was already sent)";
    case SendEvent::kFailed: return "failed";
    case SendEvent::kAborted: return "aborted";
    case SendEvent::kExpired: return "expired (its hold deadline passed)";
    case SendEvent::kReleased: return "released (the producer's KV cache went to sleep)";
    case SendEvent::kPrefilled: return "prefilled";
  }
  return "?";
}

}  // namespace siesta::pd
