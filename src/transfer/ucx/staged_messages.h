// The active messages of the ucx backend's staged path: how an initiator
// reads and writes a peer's staged region (memory the peer's UCX cannot
// register, so it has no rkey), with the peer's progress thread moving the
// bytes between the region and its staging chunks.
//
//   kStagedHello        initiator -> owner   u64 initiator key, its ProcessIdentity; data: its worker address
//   kStagedWrite        initiator -> owner   StagedRequest, data (rendezvous)
//   kStagedWriteAck     owner -> initiator   StagedReply, once the bytes are in the region
//   kStagedReadRequest  initiator -> owner   StagedRequest
//   kStagedReadData     owner -> initiator   StagedReply, then data (rendezvous) when ok
//   kStagedBye          initiator -> owner   u64 initiator key: it closes its endpoint
//
// The owner answers through an endpoint of its own to the initiator's worker
// (made on kStagedHello, with peer error handling where configured), never
// through UCX's reply endpoint, which UCX may destroy when the initiator fails
// while a request is still being served.
//
// Headers are little-endian (wire.h); the owner checks every request against
// its region table (live region, the initiator's epoch, range in bounds)
// before it touches the region.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "transfer/epoch.h"
#include "transfer/process_identity.h"
#include "transfer/region.h"

namespace siesta::transfer::ucx {

enum StagedAm : unsigned {
  kStagedWrite = 0x5101,
  kStagedWriteAck = 0x5102,
  kStagedReadRequest = 0x5103,
  kStagedReadData = 0x5104,
  kStagedHello = 0x5105,
  kStagedBye = 0x5106,
};

struct StagedRequest {
  uint64_t initiator = 0;  // the key of its kStagedHello
  uint64_t token = 0;      // the initiator's name for this piece
  RegionId region;
  uint32_t slot = 0;
  Epoch epoch;  // of the initiator's descriptor of the owner
  uint64_t offset = 0;
  uint64_t bytes = 0;
  uint32_t deadline_ms = 0;  // how long the initiator waits for it
};

struct StagedReply {
  uint64_t token = 0;
  Ok result;
};

std::string encode_staged_request(const StagedRequest& r);
Result<StagedRequest> decode_staged_request(const void* header, size_t bytes);
std::string encode_staged_reply(const StagedReply& r);
Result<StagedReply> decode_staged_reply(const void* header, size_t bytes);
// kStagedHello: the initiator key and the initiator's process (watched where
// UCX's peer error handling is off); kStagedBye: the key alone.
struct StagedHello {
  uint64_t key = 0;
  ProcessIdentity identity;
};
std::string encode_staged_hello(const StagedHello& h);
Result<StagedHello> decode_staged_hello(const void* header, size_t bytes);
std::string encode_initiator_key(uint64_t key);
Result<uint64_t> decode_initiator_key(const void* header, size_t bytes);

}  // namespace siesta::transfer::ucx
