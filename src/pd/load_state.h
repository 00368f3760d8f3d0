// LoadState: where a consumer's load of one request's prompt KV is, and the
// one function that moves it (next_load_state). The table is the whole
// state machine (also in src/pd/README.md).
//
//   from \ event   Allocated  Accepted       ReadStarted  ReadDone    KvInPlace  Failed
//   Pending        Starting   -              -            -           -          Failed
//   Starting       -          AwaitingWrite  Reading      -           Loaded     Failed
//   AwaitingWrite  -          -              -            -           Loaded     Failed
//   Reading        -          -              -            Confirming  -          Failed
//   Confirming     -          -              -            -           Loaded     Failed
//   Loaded/Failed  -          -              -            -           -          -
//
// Pending: admitted, waiting for blocks (start_load). Starting: blocks
// allocated; finding the producer, asking it (WRITE request, or READ start).
// AwaitingWrite (WRITE mode): the producer accepted and writes after its
// prefill; its notification is KvInPlace. Reading (READ mode): our read of
// its blocks is in flight. Confirming: read done, asking the producer whether
// its hold lasted the whole read (KvInPlace if it did). Starting goes to
// Loaded directly when the prefix cache covers every block (nothing to move)
// or a notification overtakes the producer's answer. Failed: the request
// recomputes its prompt here; its blocks are reused only once no peer can
// still write them (the consumer tracks that apart from this state).
#pragma once

#include <cstdint>

#include "common/status.h"

namespace siesta::pd {

enum class LoadState : uint8_t { kPending, kStarting, kAwaitingWrite, kReading, kConfirming, kLoaded, kFailed };

enum class LoadEvent : uint8_t { kAllocated, kAccepted, kReadStarted, kReadDone, kKvInPlace, kFailed };

Result<LoadState> next_load_state(LoadState from, LoadEvent event);

bool load_ended(LoadState state);
const char* load_state_name(LoadState state);
const char* load_event_name(LoadEvent event);

}  // namespace siesta::pd
