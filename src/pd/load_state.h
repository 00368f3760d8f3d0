// LoadState: where a consumer's load of one request's prompt KV is, and the
// one function that moves it (next_load_state). The table is the whole state
// machine (also in src/pd/README.md).
//
//   from \ event   Allocated Asked  Accepted      ReadStarted ReadDone    KvInPlace Failed  ProducerEnded Quiet
//   Pending        Starting  -      -             -           -           -         Failed  Failed        -
//   Starting       -         Asked  -             Reading     -           Loaded    Failed  Failed        -
//   Asked          -         -      AwaitingWrite -           -           Loaded    Ending  Failed        -
//   AwaitingWrite  -         -      -             -           -           Loaded    Ending  Failed        -
//   Reading        -         -      -             -           Confirming  -         Ending  -             -
//   Confirming     -         -      -             -           -           Loaded    Failed  Failed        -
//   Ending         -         -      -             -           -           -         -       -             Failed
//   Loaded/Failed  -         -      -             -           -           -         -       -             -
//
// Pending: admitted, no blocks yet. Starting: blocks allocated; finding the
// producer (WRITE: its side channel from its URL) or asking it to start a
// read (READ: read_start). Asked (WRITE): our `write` request is out, so the
// producer may write into our blocks from now on. AwaitingWrite: it accepted,
// and writes after its prefill; its notification is KvInPlace. Reading
// (READ): our read of its blocks is being submitted or in flight.
// Confirming: the read is done; read_done asks whether its hold lasted the
// whole read (KvInPlace if it did). Loaded: the KV is in our blocks.
// Ending: the load failed but the blocks may still change (WRITE: the
// producer may still be writing them; READ: our read is still in flight);
// Quiet when nothing can touch them any more (the producer answered a cancel
// with "writing: false", notified, said load_failed, acknowledged our
// INVALIDATE, or the write request's deadline plus write_grace passed; our
// read ended). Failed: no KV; the request computes its prompt here, in
// blocks nothing else touches.
// Events: Failed is our side giving up (deadline, a transport error, the KV
// cache released or reset, the request aborted); the producer is told to let
// go (cancel). ProducerEnded is the producer saying it will not send
// (a refusal, load_failed): nothing to tell it.
#pragma once

#include <cstdint>

#include "common/status.h"

namespace siesta::pd {

enum class LoadState : uint8_t {
  kPending,
  kStarting,
  kAsked,
  kAwaitingWrite,
  kReading,
  kConfirming,
  kLoaded,
  kEnding,
  kFailed,
};

enum class LoadEvent : uint8_t {
  kAllocated,
  kAsked,
  kAccepted,
  kReadStarted,
  kReadDone,
  kKvInPlace,
  kFailed,
  kProducerEnded,
  kQuiet,
};

Result<LoadState> next_load_state(LoadState from, LoadEvent event);

// The load gave its result (Loaded, Ending, Failed): the request no longer
// waits for it.
bool load_ended(LoadState state);
// Final: nothing more happens to the load or its blocks (Loaded, Failed).
bool load_final(LoadState state);
const char* load_state_name(LoadState state);
const char* load_event_name(LoadEvent event);

}  // namespace siesta::pd
