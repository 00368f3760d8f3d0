// SendState: where a producer's send of one request's KV is, and the one
// function that moves it (next_send_state). The table below is the whole
// state machine (also in src/pd/README.md).
//
//   from \ event  Prefilled  WriteStarted  Sent  Failed    Aborted  Cancelled  Expired  Released  Drained
//   Waiting       Ready      -             -     Done      Done     Done       -        Done      -
//   Ready         -          Writing       Done  Done      Done     Done       Done     Done      -
//   Writing       -          -             Done  Draining  -        -          -        -         -
//   Draining      -          -             -     -         -        -          -        -         Done
//   Done          -          -             -     -         -        -          -        -         -
//
// Waiting:  the request is prefilling; a WRITE target may already be attached.
//           Its blocks are not held yet.
// Ready:    prefill done; its blocks are held (send_hold_owner) for the
//           reader until the hold deadline. READ mode: the reader reads them
//           and its read_done (while Ready) is Sent.
// Writing:  WRITE mode: our write of the blocks to the consumer is starting
//           (handshake, submit) or in flight. Nothing ends it but its own end:
//           a cancel is answered "writing: true", an expiry or a release
//           waits for it.
// Draining: the write failed (at its deadline, say) while the backend may
//           still read our blocks; Drained when it lets go.
// Done:     nothing more will be sent. The hold goes back to the pool at the
//           engine's next poll and the send is forgotten; a late message
//           about it gets the reason it ended.
// Events: Prefilled (the request finished with its blocks held), WriteStarted
// (a WRITE target and a Ready send: the write task is posted), Sent (the
// WRITE and its notification landed, or READ's read_done came while Ready),
// Failed (the blocks could not be held, or the write failed), Aborted (the
// request was aborted here), Cancelled (the consumer gave up), Expired (the
// hold deadline passed), Released (release_transfer_kv: the KV cache is
// reset or released), Drained (a failed write no longer touches the blocks).
// Any other pair is kConflict, and the caller leaves the send as it was.
// A send that ends by Failed, Aborted, Expired or Released while the consumer
// asked for a write tells it (load_failed), so that it recomputes at once.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace siesta::pd {

enum class SendState : uint8_t { kWaiting, kReady, kWriting, kDraining, kDone };

enum class SendEvent : uint8_t {
  kPrefilled,
  kWriteStarted,
  kSent,
  kFailed,
  kAborted,
  kCancelled,
  kExpired,
  kReleased,
  kDrained,
};

Result<SendState> next_send_state(SendState from, SendEvent event);

// Holds blocks for a reader (the scheduler's send hold exists).
bool send_holds_blocks(SendState state);
const char* send_state_name(SendState state);
const char* send_event_name(SendEvent event);
// Why a send ended, as a peer is told: "finished (...)", "failed", "aborted",
// "cancelled by the consumer", "expired (...)", "released (...)".
const char* send_end_reason(SendEvent event);

}  // namespace siesta::pd
