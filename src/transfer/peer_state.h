// PeerState: how this engine regards its cached descriptor of a remote engine.
// One transition function, next_peer_state(), is the only place a state
// changes; src/transfer/README.md has the same table.
//
//   from \ event   kHandshake   kInvalidated   kTransferFailed
//   kReady         kReady       kInvalid       kError
//   kInvalid       kReady       kInvalid       kInvalid
//   kError         kReady       kError         kError
//
// - kReady: the descriptor is current; transfers go through.
// - kInvalid: the peer told us (INVALIDATE) to drop its descriptor, e.g.
//   before it sleeps. Everything imported from it is unmapped; the next submit
//   to it handshakes again on its own.
// - kError: a transfer to it failed (peer gone, region deregistered without
//   INVALIDATE, stale epoch). Like an RDMA queue pair in the error state, every
//   later submit fails fast until the user calls connect() again. A failure of
//   a peer already kInvalid is explained by the invalidation and keeps it so.
#pragma once

namespace siesta::transfer {

enum class PeerState { kReady, kInvalid, kError };

enum class PeerEvent {
  kHandshake,       // GET_META answered and the backend imported the peer's regions
  kInvalidated,     // the peer sent INVALIDATE for the epoch we hold
  kTransferFailed,  // a transfer to or from the peer failed
};

PeerState next_peer_state(PeerState from, PeerEvent event);

const char* peer_state_name(PeerState state);
const char* peer_event_name(PeerEvent event);

}  // namespace siesta::transfer
