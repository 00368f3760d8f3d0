// The active messages of the ucx backend's guarded path: reads and writes of
// a peer's directly registered host regions, checked and copied by the peer's
// progress thread, for transports on which UCX emulates puts and gets in
// software on the target anyway (tcp, shared memory). One round trip per
// message, with the region check done at the target as it copies:
//
//   kGuardedWrite      initiator -> owner   GuardedRequest; data: the ranges' bytes, in order (eager)
//   kGuardedWriteAck   owner -> initiator   StagedReply, once every byte is in the region (or why none is)
//   kGuardedReadRequest initiator -> owner  GuardedRequest
//   kGuardedReadData   owner -> initiator   StagedReply; data when ok: the ranges' bytes, in order (eager)
//
// The owner checks every range of a request (region live in its table at the
// initiator's epoch, served here, range in bounds) before it copies any, and
// copies while deregistration waits (guarded_target.h): a refused request
// touches no byte. Answers go through the owner's endpoint to the initiator
// (made on kStagedHello, staged_messages.h), as staged replies do.
//
// Headers are little-endian (wire.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "transfer/epoch.h"
#include "transfer/region.h"

namespace siesta::transfer::ucx {

enum GuardedAm : unsigned {
  kGuardedWrite = 0x5201,
  kGuardedWriteAck = 0x5202,
  kGuardedReadRequest = 0x5203,
  kGuardedReadData = 0x5204,
};

// The most bytes one guarded message carries (an owner announces its own
// limit in its engine blob; this is ours). Sent eagerly, never rendezvous:
// the owner's UCX assembles each whole message before the handler copies it.
inline constexpr uint64_t kGuardedMessageBytes = 64u << 10;
// The most ranges in one message's header.
inline constexpr uint32_t kGuardedMaxRanges = 64;
// Messages of one transfer in flight at once (what bounds the memory the
// owner's UCX holds for it).
inline constexpr size_t kGuardedMessagesInFlight = 8;

struct GuardedRange {
  RegionId region;
  uint32_t slot = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct GuardedRequest {
  uint64_t initiator = 0;  // the key of its kStagedHello
  uint64_t token = 0;      // the initiator's name for this message
  Epoch epoch;             // of the initiator's descriptor of the owner
  // The transfer's deadline on the wall clock (ms since 1970; 0: none). The
  // owner copies nothing of a request that arrives after it: the initiator
  // has failed the transfer by then, and its peer may have reused the
  // memory (a write held in a cut link's retransmissions lands seconds late).
  uint64_t expires_unix_ms = 0;
  std::vector<GuardedRange> ranges;

  uint64_t bytes() const;
};

std::string encode_guarded_request(const GuardedRequest& r);
// Refuses malformed headers, more than kGuardedMaxRanges ranges, empty
// ranges and totals that overflow.
Result<GuardedRequest> decode_guarded_request(const void* header, size_t bytes);

}  // namespace siesta::transfer::ucx
