// RequestState: where a request is in its life, and the one function that
// moves it (next_state). The table below is the whole state machine.
//
//   from \ event        Schedule  Preempt    AwaitRemoteKv       RemoteKvLoaded/Failed  Stop     ReachLength  Abort
//   Waiting             Running   -          WaitingForRemoteKv  -                      Stopped  Length       Aborted
//   WaitingForRemoteKv  -         -          -                   Waiting                -        -            Aborted
//   Running             -         Preempted  -                   -                      Stopped  Length       Aborted
//   Preempted           Running   -          -                   -                      Stopped  -            Aborted
//   Finished*           -         -          -                   -                      -        -            -
//
// Waiting: queued, not yet scheduled (or queued again after a remote KV load:
//   with the KV and the producer's logits it has its first token already and
//   computes from there, with the KV alone it computes the prompt's last
//   token, after a failed load it computes the whole prompt). Stop and
//   ReachLength happen here only to a request whose first token came with
//   its remote load (it may end on that token, or on a stop string in its text).
// WaitingForRemoteKv: has blocks; a peer is writing the prompt's KV into them
//   (P/D consumer). The scheduler skips it until the load ends.
// Running: scheduled every step (a prefill chunk or one decode token).
// Preempted: queued again with no blocks and 0 computed tokens; when scheduled
//   it recomputes prompt + generated tokens and continues. This is also the
//   state of requests kept across a pause or sleep ("recompute after resume").
// Stop while Preempted: a stop string found in text already streamed.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace siesta {

enum class RequestState : uint8_t {
  kWaiting,
  kWaitingForRemoteKv,
  kRunning,
  kPreempted,
  kFinishedStopped,  // eos, a stop token id or a stop string
  kFinishedLength,   // max_tokens or the model's length limit
  kFinishedAborted,  // aborted (client gone, pause with mode=abort, P/D failure)
};

enum class RequestEvent : uint8_t {
  kSchedule,
  kPreempt,
  kAwaitRemoteKv,
  kRemoteKvLoaded,
  kRemoteKvFailed,
  kStop,
  kReachLength,
  kAbort,
};

// The only transition function. kConflict for a pair the table does not allow.
Result<RequestState> next_state(RequestState from, RequestEvent event);

bool is_finished(RequestState state);
const char* state_name(RequestState state);
const char* event_name(RequestEvent event);
// OpenAI's finish_reason: "stop", "length", "abort"; nullptr while unfinished.
const char* finish_reason(RequestState state);

}  // namespace siesta
