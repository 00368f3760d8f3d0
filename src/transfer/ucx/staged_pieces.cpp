// UcxPeer, the staged pieces of a transfer (ucx_peer.h says what they are).
// Everything here runs on the progress thread. UCX callbacks only record what
// completed; pump(), every tick, starts what comes next.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "common/log.h"
#include "transfer/ucx/staged_messages.h"
#include "transfer/ucx/staging_pool.h"
#include "transfer/ucx/ucx_backend.h"
#include "transfer/ucx/ucx_peer.h"

namespace siesta::transfer::ucx {

namespace {

// Pieces of one transfer in flight at once (chunks bound it further).
constexpr size_t kPiecesInFlight = 8;

using State = StagedPiece::State;

void on_piece_request_done(void* request, ucs_status_t status, void* user_data) {
  auto* p = static_cast<StagedPiece*>(user_data);
  UcxXfer* x = p->xfer;
  ucp_request_free(request);
  p->in_flight = false;
  if (x->orphaned) {
    StagingPool* pool = x->backend->initiator_pool();  // null once the backend is going away
    if (p->chunk != nullptr && pool != nullptr) pool->release(p->chunk);
    p->chunk = nullptr;
    if (--x->outstanding == 0) x->backend->drop_orphan(x);
    return;
  }
  --x->outstanding;
  if (status != UCS_OK) {
    if (!x->failure)
      x->failure = ucx_error(fmt::format("UCX operation with peer {}", x->peer->meta().engine_id).c_str(), status);
    return;
  }
  switch (p->state) {
    case State::kSending:  // the wire is done with the chunk
      if (p->chunk != nullptr) x->backend->initiator_pool()->release(p->chunk);
      p->chunk = nullptr;
      p->state = p->remote_staged && !p->acked ? State::kAwaitAck : State::kDone;
      break;
    case State::kGetting:
      p->state = State::kLanded;
      break;
    case State::kReceiving:
      p->state = p->local_staged ? State::kLanded : State::kDone;
      break;
    default:
      break;
  }
}

void on_recv_done(void* request, ucs_status_t status, size_t, void* user_data) {
  on_piece_request_done(request, status, user_data);
}

// A request whose completion only counts (kStagedReadRequest).
void on_plain_request_done(void* request, ucs_status_t status, void* user_data) {
  auto* x = static_cast<UcxXfer*>(user_data);
  ucp_request_free(request);
  if (x->orphaned) {
    if (--x->outstanding == 0) x->backend->drop_orphan(x);
    return;
  }
  if (status != UCS_OK && !x->failure)
    x->failure = ucx_error(fmt::format("UCX operation with peer {}", x->peer->meta().engine_id).c_str(), status);
  --x->outstanding;
}

ucp_request_param_t piece_param(StagedPiece& p) {
  ucp_request_param_t r{};
  r.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  r.cb.send = on_piece_request_done;
  r.user_data = &p;
  return r;
}

}  // namespace

Ok UcxPeer::plan_pieces(UcxXfer* x) {
  const std::vector<XferSegment>& segs = x->plan.segments;
  size_t count = 0;
  std::vector<std::pair<std::optional<int>, uint64_t>> staging(segs.size());  // local device, piece size
  for (size_t i = 0; i < segs.size(); ++i) {
    const XferSegment& s = segs[i];
    std::optional<int> local = backend_.local_staging(s.local_region);
    bool remote = remote_staged_[s.remote_index];
    if (!remote) x->direct_remote = true;
    if (!local && !remote) {
      x->direct_segments.push_back(i);
      continue;
    }
    uint64_t piece = UINT64_MAX;
    if (local) {
      if (backend_.initiator_pool() == nullptr)
        return internal_error("a staged region has no staging pool on the progress thread");
      piece = backend_.initiator_pool()->chunk_bytes();
    }
    if (remote) piece = std::min(piece, remote_chunk_[s.remote_index]);
    if (piece == 0) return corrupt(fmt::format("peer {} announced staging chunks of 0 bytes", meta_.engine_id));
    staging[i] = {local, piece};
    count += (s.bytes + piece - 1) / piece;
  }
  x->pieces.reserve(count);  // pieces point into it: never reallocated after this
  for (size_t i = 0; i < segs.size(); ++i) {
    auto [local, piece] = staging[i];
    if (piece == 0) continue;
    bool remote = remote_staged_[segs[i].remote_index];
    for (uint64_t off = 0; off < segs[i].bytes; off += piece) {
      StagedPiece p;
      p.xfer = x;
      p.segment = i;
      p.offset = off;
      p.bytes = std::min(piece, segs[i].bytes - off);
      p.local_staged = local.has_value();
      p.remote_staged = remote;
      p.device = local.value_or(-1);
      x->pieces.push_back(p);
      if (!remote) ++x->direct_unposted;
    }
  }
  return {};
}

void UcxPeer::pump(UcxXfer* x) {
  if (x->orphaned || x->stage != UcxXfer::Stage::kData) return;
  size_t open = 0;
  bool chunks_left = true;
  for (size_t i = x->first_open; i < x->pieces.size(); ++i) {
    StagedPiece& p = x->pieces[i];
    if (p.state == State::kIdle) {
      if (x->failure || !chunks_left || open >= kPiecesInFlight || ep_ == nullptr) continue;
      if (p.local_staged && backend_.initiator_pool()->free_count() == 0) {
        chunks_left = false;  // pieces take chunks in order
        continue;
      }
      Ok started = start_piece(p);
      if (!started) fail_piece(p, started.error());
    }
    step_piece(p);
    if (p.state != State::kDone && p.state != State::kIdle) ++open;
  }
  while (x->first_open < x->pieces.size() && x->pieces[x->first_open].state == State::kDone) ++x->first_open;
  // The post-check follows the last put/get to a direct region.
  if (!x->failure && x->direct_remote && x->direct_unposted == 0 && !x->post_check_posted && ep_ != nullptr)
    post_check(x);
  bool finished = x->failure ? x->copies == 0 : x->pieces_done == x->pieces.size();
  if (x->outstanding == 0 && finished) backend_.ready(x);
}

Ok UcxPeer::start_piece(StagedPiece& p) {
  UcxXfer* x = p.xfer;
  const XferSegment& s = x->plan.segments[p.segment];
  char* local = static_cast<char*>(s.local) + p.offset;
  if (p.local_staged) {
    p.chunk = backend_.initiator_pool()->acquire();
    if (p.chunk == nullptr) return internal_error("no staging chunk although one was free");
  }
  if (x->plan.op == XferOp::kWrite) {
    if (!p.local_staged) return send_piece(p);
    SIESTA_TRY(backend_.initiator_pool()->copy_in(p.chunk, local, p.bytes, p.device));
    ++x->copies;
    p.state = State::kCopyIn;
    return {};
  }
  if (p.remote_staged) {
    const RegionDesc& d = meta_.regions[s.remote_index];
    StagedRequest req{initiator_key_, 0, d.id, d.slot, meta_.epoch, s.remote_offset + p.offset, p.bytes,
                      static_cast<uint32_t>(millis_left(x->plan.deadline))};
    p.token = backend_.await_reply(&p);
    req.token = p.token;
    p.header = encode_staged_request(req);
    ucp_request_param_t r{};
    r.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    r.cb.send = on_plain_request_done;
    r.user_data = x;
    r.flags = UCP_AM_SEND_FLAG_REPLY;
    p.state = State::kAwaitData;
    issue(x, [&] { return ucp_am_send_nbx(ep_, kStagedReadRequest, p.header.data(), p.header.size(), nullptr, 0, &r); });
    return {};
  }
  // READ from a direct region into the chunk.
  ucp_request_param_t r = piece_param(p);
  r.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
  r.memh = p.chunk->memh;
  uint64_t remote = meta_.regions[s.remote_index].base + s.remote_offset + p.offset;
  --x->direct_unposted;
  issue_piece(p, State::kGetting,
              [&] { return ucp_get_nbx(ep_, p.chunk->data, p.bytes, remote, rkeys_[s.remote_index], &r); });
  return {};
}

// WRITE: the piece's bytes (in its chunk, or in our unstaged region) go out:
// a put to a direct region, kStagedWrite to a staged one.
Ok UcxPeer::send_piece(StagedPiece& p) {
  UcxXfer* x = p.xfer;
  const XferSegment& s = x->plan.segments[p.segment];
  const void* from = p.chunk != nullptr ? static_cast<const void*>(p.chunk->data)
                                        : static_cast<const char*>(s.local) + p.offset;
  ucp_mem_h memh = p.chunk != nullptr ? p.chunk->memh : backend_.local_memh(s.local_region);
  ucp_request_param_t r = piece_param(p);
  if (memh != nullptr) {
    r.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    r.memh = memh;
  }
  const RegionDesc& d = meta_.regions[s.remote_index];
  if (!p.remote_staged) {
    --x->direct_unposted;
    issue_piece(p, State::kSending, [&] {
      return ucp_put_nbx(ep_, from, p.bytes, d.base + s.remote_offset + p.offset, rkeys_[s.remote_index], &r);
    });
    return {};
  }
  StagedRequest req{initiator_key_, 0, d.id, d.slot, meta_.epoch, s.remote_offset + p.offset, p.bytes,
                    static_cast<uint32_t>(millis_left(x->plan.deadline))};
  p.token = backend_.await_reply(&p);
  req.token = p.token;
  p.header = encode_staged_request(req);
  r.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
  r.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_RNDV;
  issue_piece(p, State::kSending,
              [&] { return ucp_am_send_nbx(ep_, kStagedWrite, p.header.data(), p.header.size(), from, p.bytes, &r); });
  return {};
}

// Starts a piece's next step with a UCX request. The piece is in `next` and
// counted before the call: UCX may complete the request, and run its
// callback, inside the call. One that completed at once moves the piece on
// here, as its callback would have.
void UcxPeer::issue_piece(StagedPiece& p, State next, const std::function<ucs_status_ptr_t()>& call) {
  UcxXfer* x = p.xfer;
  p.state = next;
  p.in_flight = true;
  ++x->outstanding;
  ucs_status_ptr_t sp = call();
  if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) return;  // its callback moves the piece on
  p.in_flight = false;
  --x->outstanding;
  if (UCS_PTR_IS_ERR(sp)) {
    fail_piece(p, ucx_error(fmt::format("UCX operation with peer {}", meta_.engine_id).c_str(), UCS_PTR_STATUS(sp)));
    return;
  }
  switch (next) {
    case State::kSending:
      if (p.chunk != nullptr) backend_.initiator_pool()->release(p.chunk);
      p.chunk = nullptr;
      p.state = p.remote_staged && !p.acked ? State::kAwaitAck : State::kDone;
      break;
    case State::kGetting:
      p.state = State::kLanded;
      break;
    case State::kReceiving:
      p.state = p.local_staged ? State::kLanded : State::kDone;
      break;
    default:
      break;
  }
}

// What a piece does without a UCX callback: poll its copy, receive data that
// arrived, copy landed bytes to the region, and count itself done.
void UcxPeer::step_piece(StagedPiece& p) {
  UcxXfer* x = p.xfer;
  StagingPool* pool = backend_.initiator_pool();
  const XferSegment& s = x->plan.segments[p.segment];
  switch (p.state) {
    case State::kCopyIn:
    case State::kCopyOut: {
      Result<bool> f = p.chunk->copy.finished();
      if (f && !*f) return;
      --x->copies;
      if (!f) {
        fail_piece(p, f.error());
        p.state = State::kDone;
      } else if (p.state == State::kCopyOut) {
        p.state = State::kDone;
      } else if (x->failure || ep_ == nullptr) {
        fail_piece(p, x->failure.value_or(unavailable("the endpoint is closed")));
        p.state = State::kDone;
      } else if (Ok sent = send_piece(p); !sent) {
        fail_piece(p, sent.error());
      }
      break;
    }
    case State::kAwaitData: {
      if (p.arrived == nullptr) return;
      void* desc = p.arrived;
      p.arrived = nullptr;
      if (x->failure) {
        ucp_am_data_release(backend_.worker().worker(), desc);
        return;
      }
      void* into = p.chunk != nullptr ? static_cast<void*>(p.chunk->data) : static_cast<char*>(s.local) + p.offset;
      ucp_request_param_t r{};
      r.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      r.cb.recv_am = on_recv_done;
      r.user_data = &p;
      ucp_mem_h memh = p.chunk != nullptr ? p.chunk->memh : backend_.local_memh(s.local_region);
      if (memh != nullptr) {
        r.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        r.memh = memh;
      }
      issue_piece(p, State::kReceiving,
                  [&] { return ucp_am_recv_data_nbx(backend_.worker().worker(), desc, into, p.bytes, &r); });
      break;
    }
    default:
      break;
  }
  if (p.state == State::kLanded && !x->failure) {
    Ok started = pool->copy_out(p.chunk, static_cast<char*>(s.local) + p.offset, p.bytes, p.device);
    if (!started) return fail_piece(p, started.error());
    ++x->copies;
    p.state = State::kCopyOut;
    Result<bool> f = p.chunk->copy.finished();  // a host copy is finished already
    if (f && *f) {
      --x->copies;
      p.state = State::kDone;
    } else if (!f) {
      --x->copies;
      return fail_piece(p, f.error());
    }
  }
  if (p.state == State::kDone) piece_done(p);
}

void UcxPeer::on_write_ack(StagedPiece* piece, Ok result) {
  backend_.forget(piece->token);
  piece->token = 0;
  if (!result) return fail_piece(*piece, result.error().with_context(fmt::format("peer {}", meta_.engine_id)));
  piece->acked = true;
  if (piece->state == State::kAwaitAck) piece->state = State::kDone;  // piece_done() on the next pump
}

ucs_status_t UcxPeer::on_read_data(StagedPiece* piece, Ok result, void* data, size_t length, bool rendezvous) {
  backend_.forget(piece->token);
  piece->token = 0;
  UcxXfer* x = piece->xfer;
  if (!result) {
    fail_piece(*piece, result.error().with_context(fmt::format("peer {}", meta_.engine_id)));
    return UCS_OK;
  }
  if (length != piece->bytes || piece->state != State::kAwaitData || x->failure) {
    if (!x->failure)
      fail_piece(*piece, corrupt(fmt::format("peer {} sent {} bytes for a staged piece of {}", meta_.engine_id, length,
                                             piece->bytes)));
    return UCS_OK;  // a rendezvous descriptor is dropped with it
  }
  if (rendezvous) {
    piece->arrived = data;  // received on the next pump
    return UCS_INPROGRESS;
  }
  const XferSegment& s = x->plan.segments[piece->segment];
  void* into = piece->chunk != nullptr ? static_cast<void*>(piece->chunk->data)
                                       : static_cast<char*>(s.local) + piece->offset;
  std::memcpy(into, data, length);
  piece->state = piece->local_staged ? State::kLanded : State::kDone;
  return UCS_OK;
}

void UcxPeer::fail_piece(StagedPiece& p, const Status& why) {
  UcxXfer* x = p.xfer;
  if (!x->failure) x->failure = why;
  if (p.token != 0) backend_.forget(p.token);
  p.token = 0;
}

void UcxPeer::piece_done(StagedPiece& p) {
  UcxXfer* x = p.xfer;
  if (p.chunk != nullptr) backend_.initiator_pool()->release(p.chunk);
  p.chunk = nullptr;
  p.state = State::kDone;
  if (p.counted) return;
  p.counted = true;
  ++x->pieces_done;
}

// The transfer ends (done, failed or orphaned): its chunks go back (those
// with a copy still running once it ended), its tokens are forgotten, and
// data that arrived but was not received is dropped. A piece whose UCX
// request still runs keeps its chunk until the request's callback; when the
// transfer is orphaned (a dead peer without UCX peer error handling, whose
// requests may never end) such a chunk is retired instead.
void UcxPeer::release_staging(UcxXfer* x, bool orphaning) {
  for (StagedPiece& p : x->pieces) {
    if (p.token != 0) backend_.forget(p.token);
    p.token = 0;
    if (p.arrived != nullptr) ucp_am_data_release(backend_.worker().worker(), p.arrived);
    p.arrived = nullptr;
    if (p.chunk == nullptr) continue;
    if (!p.in_flight) {
      backend_.initiator_pool()->release(p.chunk);
    } else if (orphaning) {
      backend_.initiator_pool()->retire(p.chunk);
    } else {
      continue;
    }
    p.chunk = nullptr;
  }
}

}  // namespace siesta::transfer::ucx
