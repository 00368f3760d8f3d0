#include "transfer/peer_state.h"

namespace siesta::transfer {

PeerState next_peer_state(PeerState from, PeerEvent event) {
  switch (event) {
    case PeerEvent::kHandshake:
      return PeerState::kReady;
    case PeerEvent::kInvalidated:
      return from == PeerState::kError ? PeerState::kError : PeerState::kInvalid;
    case PeerEvent::kTransferFailed:
      return from == PeerState::kInvalid ? PeerState::kInvalid : PeerState::kError;
  }
  return from;
}

const char* peer_state_name(PeerState state) {
  switch (state) {
    case PeerState::kReady: return "ready";
    case PeerState::kInvalid: return "invalid";
    case PeerState::kError: return "error";
  }
  return "unknown";
}

const char* peer_event_name(PeerEvent event) {
  switch (event) {
    case PeerEvent::kHandshake: return "handshake";
    case PeerEvent::kInvalidated: return "invalidated";
    case PeerEvent::kTransferFailed: return "transfer_failed";
  }
  return "unknown";
}

}  // namespace siesta::transfer
