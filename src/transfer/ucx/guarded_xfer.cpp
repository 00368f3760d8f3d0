// UcxPeer, guarded transfers (ucx_peer.h says what they are; the wire is
// guarded_messages.h, the peer's side guarded_target.h). Everything here runs
// on the progress thread.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "transfer/ucx/guarded_messages.h"
#include "transfer/ucx/ucx_backend.h"
#include "transfer/ucx/ucx_peer.h"

namespace siesta::transfer::ucx {

namespace {

constexpr size_t kRequestFixedBytes = 8 + 8 + 8 + 8 + 4;  // initiator, token, epoch, expiry, count
constexpr size_t kRangeBytes = 8 + 4 + 8 + 8;         // region, slot, offset, bytes


// Ranges per message: what our worker's largest header holds, at most kGuardedMaxRanges.
size_t ranges_per_message(size_t max_am_header) {
  if (max_am_header < kRequestFixedBytes + kRangeBytes) return 0;
  return std::min<size_t>(kGuardedMaxRanges, (max_am_header - kRequestFixedBytes) / kRangeBytes);
}

// A deadline of the steady clock on the wall clock, in ms since 1970.
uint64_t unix_ms_at(Deadline deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  const auto now = std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  return static_cast<uint64_t>(std::max<int64_t>(1, now + left));
}

}  // namespace

bool UcxPeer::guarded_eligible(const UcxXfer* x) const {
  if (!guarded_ || initiator_key_ == 0 || x->staged()) return false;
  if (ranges_per_message(backend_.worker().max_am_header()) == 0) return false;
  // The peer copies with memcpy, and so do we for a READ: host memory on both sides.
  for (const XferSegment& s : x->plan.segments)
    if (s.local_kind != MemoryKind::kHost || meta_.regions[s.remote_index].kind != MemoryKind::kHost) return false;
  return true;
}

// Cuts the transfer into messages of at most the peer's guarded size (and as
// many ranges as a header holds), then sends the first of them.
void UcxPeer::start_guarded(UcxXfer* x) {
  const uint64_t limit = std::min(guarded_bytes_, kGuardedMessageBytes);
  const size_t max_ranges = ranges_per_message(backend_.worker().max_am_header());
  for (const XferSegment& s : x->plan.segments) {
    const RegionDesc& d = meta_.regions[s.remote_index];
    for (uint64_t off = 0; off < s.bytes;) {
      if (x->guarded.empty() || x->guarded.back().bytes == limit || x->guarded.back().ranges.size() == max_ranges) {
        x->guarded.emplace_back();
        x->guarded.back().xfer = x;
      }
      GuardedMessage& m = x->guarded.back();
      uint64_t n = std::min(s.bytes - off, limit - m.bytes);
      m.ranges.push_back(GuardedRange{d.id, d.slot, s.remote_offset + off, n});
      m.local.push_back(ucp_dt_iov_t{static_cast<char*>(s.local) + off, n});
      m.bytes += n;
      off += n;
    }
  }
  send_guarded(x);
}

// Sends messages while fewer than kGuardedMessagesInFlight await their answers.
void UcxPeer::send_guarded(UcxXfer* x) {
  if (x->guarded_sent == x->guarded.size() || x->guarded_sent - x->guarded_answered >= kGuardedMessagesInFlight)
    return;
  if (!endpoint_usable(x)) return;
  const bool write = x->plan.op == XferOp::kWrite;
  while (!x->failure && x->guarded_sent < x->guarded.size() &&
         x->guarded_sent - x->guarded_answered < kGuardedMessagesInFlight) {
    GuardedMessage& m = x->guarded[x->guarded_sent++];
    m.token = backend_.await_reply(&m);
    m.header = encode_guarded_request(
        GuardedRequest{initiator_key_, m.token, meta_.epoch, unix_ms_at(x->plan.deadline), std::move(m.ranges)});
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = on_xfer_request_done;  // a message left; its answer may come before or after
    p.user_data = x;
    p.flags = UCP_AM_SEND_FLAG_EAGER;  // the peer copies in its handler: never a rendezvous
    if (write) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
      p.datatype = ucp_dt_make_iov();
      issue(x, [&] {
        return ucp_am_send_nbx(ep_, kGuardedWrite, m.header.data(), m.header.size(), m.local.data(), m.local.size(),
                               &p);
      });
    } else {
      issue(x, [&] {
        return ucp_am_send_nbx(ep_, kGuardedReadRequest, m.header.data(), m.header.size(), nullptr, 0, &p);
      });
    }
  }
  if (x->failure && x->outstanding == 0) backend_.ready(x);
}

// On the tick after an answer or the last send completion: more messages,
// or the end.
void UcxPeer::advance_guarded(UcxXfer* x) {
  if (!x->failure) send_guarded(x);
  if (x->outstanding > 0) return;  // a send's completion brings us back
  if (x->failure) {
    complete(x, *x->failure);
  } else if (x->guarded_answered == x->guarded.size()) {
    complete(x, Ok{});
  }
}

void UcxPeer::on_guarded_reply(GuardedMessage* m, Ok result, const void* data, size_t length, bool rendezvous) {
  UcxXfer* x = m->xfer;
  m->token = 0;
  if (m->answered) return;
  m->answered = true;
  ++x->guarded_answered;
  if (!result) {
    if (!x->failure)
      x->failure = result.error().with_context(
          fmt::format("peer {} refused a guarded {} and copied none of its {} bytes", meta_.engine_id,
                      x->plan.op == XferOp::kRead ? "read" : "write", m->bytes));
  } else if (x->plan.op == XferOp::kRead && !x->failure) {
    if (rendezvous || length != m->bytes) {
      x->failure = corrupt(fmt::format("peer {} answered a guarded read of {} bytes with {}{}", meta_.engine_id,
                                       m->bytes, length, rendezvous ? " (rendezvous)" : ""));
    } else {
      const char* from = static_cast<const char*>(data);
      for (const ucp_dt_iov_t& to : m->local) {
        std::memcpy(to.buffer, from, to.length);
        from += to.length;
      }
    }
  }
  backend_.ready(x);  // more messages, or the end
}

void UcxPeer::forget_guarded(UcxXfer* x) {
  for (GuardedMessage& m : x->guarded) {
    if (m.token != 0) backend_.forget_guarded(m.token);
    m.token = 0;
  }
}

}  // namespace siesta::transfer::ucx
