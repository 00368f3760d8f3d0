// Transfers: what submit() takes and what poll()/wait() report.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "common/clock.h"
#include "common/status.h"
#include "transfer/region.h"

namespace siesta::transfer {

// One-sided: the initiator moves the bytes; the target's CPU only serves
// metadata and receives the optional notification.
enum class XferOp : uint8_t {
  kRead,   // remote region → local region
  kWrite,  // local region → remote region
};

const char* xfer_op_name(XferOp op);

// One contiguous piece of a batched transfer.
struct XferEntry {
  RegionId local_region;
  uint64_t local_offset = 0;
  RegionId remote_region;
  uint64_t remote_offset = 0;
  uint64_t bytes = 0;
};

struct XferId {
  uint64_t value = 0;
  friend auto operator<=>(XferId, XferId) = default;
};

enum class XferState { kPending, kDone, kFailed };

struct XferStatus {
  XferState state = XferState::kPending;
  Status why;  // set when kFailed
  // When the status became final (done: the data in place and the
  // notification, if any, acknowledged), however late poll() looked.
  Clock::time_point finished_at{};
  // done: when the bytes were in place, before the notification went out.
  Clock::time_point data_at{};

  bool pending() const { return state == XferState::kPending; }
  bool done() const { return state == XferState::kDone; }
  bool failed() const { return state == XferState::kFailed; }

  static XferStatus make_pending() { return {}; }
  static XferStatus make_done() { return {XferState::kDone, {}}; }
  static XferStatus make_failed(Status why) { return {XferState::kFailed, std::move(why)}; }
};

// A notification delivered to the target of a transfer after its data.
struct Notification {
  std::string from_engine;
  std::string payload;
};

}  // namespace siesta::transfer

template <>
struct std::hash<siesta::transfer::XferId> {
  size_t operator()(siesta::transfer::XferId id) const noexcept { return std::hash<uint64_t>{}(id.value); }
};
