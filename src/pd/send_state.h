// SendState: where a producer's send of one request's KV is, and the one
// function that moves it (next_send_state). The table below is the whole
// state machine (also in src/pd/README.md).
//
//   from \ event   Prefilled  Sent  Failed  Aborted  Expired  Released
//   Waiting        Ready      -     Done    Done     -        Done
//   Ready          -          Done  Done    Done     Done     Done
//   Done           -          -     -       -        -        -
//
// Waiting: the request is prefilling; a WRITE target may already be attached.
// Ready:   prefill done; its blocks are held (send_hold_owner) for the reader,
//          until the hold deadline.
// Done:    nothing more will be sent. The hold is given back once no transfer
//          of ours reads the blocks any more (a write in flight finishes or
//          fails first); a consumer that read them learns from its read_done
//          answer whether the hold lasted (it did only if the send was still
//          Ready then).
// Events: Prefilled (the request finished with its blocks held), Sent (the
// WRITE and its notification landed, or the reader's read_done came while
// Ready), Failed (the write failed, or the blocks could not be held),
// Aborted (the request was aborted here, or the consumer cancelled), Expired
// (the hold deadline passed), Released (release_transfer_kv: sleep).
// Any other pair is kConflict, and the caller leaves the send as it was.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace siesta::pd {

enum class SendState : uint8_t { kWaiting, kReady, kDone };

enum class SendEvent : uint8_t { kPrefilled, kSent, kFailed, kAborted, kExpired, kReleased };

Result<SendState> next_send_state(SendState from, SendEvent event);

const char* send_state_name(SendState state);
const char* send_event_name(SendEvent event);
// Why a Done send ended, as a peer is told: "finished", "failed", "aborted",
// "expired", "released for sleep".
const char* send_end_reason(SendEvent event);

}  // namespace siesta::pd
