#include "transfer/ucx/ucx_peer.h"

#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>

#include "common/log.h"
#include "transfer/region_table.h"
#include "transfer/ucx/staged_messages.h"
#include "transfer/ucx/ucx_backend.h"

namespace siesta::transfer::ucx {

// The error handler's argument: outlives the peer until the endpoint is closed.
struct EndpointContext {
  std::weak_ptr<UcxPeer> peer;
  UcxWorker* worker = nullptr;
};

namespace {

constexpr auto kReleaseGrace = std::chrono::milliseconds(1000);


void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* ctx = static_cast<EndpointContext*>(arg);
  std::weak_ptr<UcxPeer> weak = ctx->peer;
  // Closing the endpoint inside its own error callback is not allowed: next loop.
  ctx->worker->post([weak, status] {
    if (auto peer = weak.lock())
      peer->break_connection(unavailable(fmt::format("the UCX endpoint to peer {} failed ({}); the peer process "
                                                     "probably exited",
                                                     peer->meta().engine_id, ucs_status_string(status))),
                             true);
  });
}

struct CloseState {
  EndpointContext* ctx;
  std::function<void()> closed;
};

void on_close_done(void* request, ucs_status_t, void* user_data) {
  auto* st = static_cast<CloseState*>(user_data);
  ucp_request_free(request);
  if (st->closed) st->closed();
  delete st->ctx;
  delete st;
}

// Closes `ep` (force: cancel everything); `closed` runs when UCX is done with it.
void close_ep(ucp_ep_h ep, EndpointContext* ctx, bool force, std::function<void()> closed) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  p.cb.send = on_close_done;
  auto* st = new CloseState{ctx, std::move(closed)};
  p.user_data = st;
  ucs_status_ptr_t sp = ucp_ep_close_nbx(ep, &p);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {
    if (st->closed) st->closed();
    delete st->ctx;
    delete st;
  }
}

// Closes `ep`, then destroys `rkeys` and runs `closed`. A request that still
// waits in the endpoint's queue reads its rkey until the close completes it
// (a forced close fails such requests, a flushing one sends them), so a key
// goes only after its endpoint; without an endpoint, at once.
void close_ep_then_destroy(ucp_ep_h ep, EndpointContext* ctx, bool force, std::vector<ucp_rkey_h> rkeys,
                           std::function<void()> closed) {
  auto destroy = [rkeys = std::move(rkeys), closed = std::move(closed)] {
    for (ucp_rkey_h r : rkeys)
      if (r != nullptr) ucp_rkey_destroy(r);
    if (closed) closed();
  };
  if (ep == nullptr) {
    destroy();
    return;
  }
  close_ep(ep, ctx, force, std::move(destroy));
}

// The peer's keys, moved out: the region keys' slots stay, null.
std::vector<ucp_rkey_h> take_rkeys(std::vector<ucp_rkey_h>& region_keys, ucp_rkey_h& table_key) {
  std::vector<ucp_rkey_h> keys;
  for (ucp_rkey_h& r : region_keys) {
    if (r != nullptr) keys.push_back(r);
    r = nullptr;
  }
  if (table_key != nullptr) keys.push_back(table_key);
  table_key = nullptr;
  return keys;
}

}  // namespace

UcxPeer::UcxPeer(UcxBackend& backend, EngineMeta meta, std::string worker_address, RemoteTable table,
                 uint64_t guarded_bytes, int process_watch)
    : backend_(backend),
      meta_(std::move(meta)),
      worker_address_(std::move(worker_address)),
      table_(std::move(table)),
      guarded_bytes_(guarded_bytes),
      process_watch_(process_watch) {}

bool UcxPeer::process_exited() const { return siesta::transfer::process_exited(process_watch_); }

UcxPeer::~UcxPeer() {
  if (process_watch_ >= 0) close(process_watch_);
  // release() normally closed everything; otherwise close it now without us.
  std::vector<ucp_rkey_h> rkeys = take_rkeys(rkeys_, table_rkey_);
  ucp_ep_h ep = ep_;
  EndpointContext* ctx = ep_context_;
  auto cleanup = [rkeys, ep, ctx] { close_ep_then_destroy(ep, ctx, true, rkeys, nullptr); };
  if (rkeys.empty() && ep == nullptr) return;
  if (backend_.worker().on_worker_thread()) {
    cleanup();
  } else {
    backend_.worker().post(cleanup);
  }
}

void UcxPeer::open(std::function<void(Ok)> done) {
  auto* ctx = new EndpointContext{weak_from_this(), &backend_.worker()};
  ucp_ep_params_t ep_params{};
  ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep_params.address = reinterpret_cast<const ucp_address_t*>(worker_address_.data());
  bool handle_errors = backend_.worker().peer_error_handling();
  ep_params.err_mode = handle_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (handle_errors) {
    ep_params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.err_handler.cb = on_ep_error;
    ep_params.err_handler.arg = ctx;
  }
  ucs_status_t st = ucp_ep_create(backend_.worker().worker(), &ep_params, &ep_);
  if (st != UCS_OK) {
    delete ctx;
    ep_ = nullptr;
    done(ucx_error(fmt::format("creating a UCX endpoint to peer {} (do both engines share a transport? compare "
                               "their ucx_transports; with peer error handling on, UCX 1.13 cannot use its "
                               "shared-memory transports: add tcp, or turn ucx_peer_error_handling off)",
                               meta_.engine_id)
                       .c_str(),
                   st));
    return;
  }
  ep_context_ = ctx;
  guarded_ = backend_.sends_guarded() && guarded_bytes_ > 0 && rma_in_software(ep_);
  rkeys_.assign(meta_.regions.size(), nullptr);
  remote_staged_.assign(meta_.regions.size(), false);
  remote_chunk_.assign(meta_.regions.size(), 0);
  for (size_t i = 0; i < meta_.regions.size(); ++i) {
    Result<RegionBlob> blob = decode_region_blob(meta_.regions[i].backend_blob);
    if (!blob) {
      done(blob.error().with_context(fmt::format("region {} of peer {}", meta_.regions[i].id.value, meta_.engine_id)));
      return;
    }
    if (blob->staged) {
      remote_staged_[i] = true;
      remote_chunk_[i] = blob->chunk_bytes;
      continue;
    }
    st = ucp_ep_rkey_unpack(ep_, blob->rkey.data(), &rkeys_[i]);
    if (st != UCS_OK) {
      done(ucx_error(fmt::format("unpacking the rkey of region {} of peer {}", meta_.regions[i].id.value,
                                 meta_.engine_id)
                         .c_str(),
                     st));
      return;
    }
  }
  st = ucp_ep_rkey_unpack(ep_, table_.rkey.data(), &table_rkey_);
  if (st != UCS_OK) {
    done(ucx_error(fmt::format("unpacking the region-table rkey of peer {}", meta_.engine_id).c_str(), st));
    return;
  }
  // A peer with staged regions, or one that serves our guarded transfers,
  // answers our requests through an endpoint of its own: tell it where we are
  // (before any request, on the same endpoint).
  if (guarded_ || std::find(remote_staged_.begin(), remote_staged_.end(), true) != remote_staged_.end()) {
    initiator_key_ = backend_.new_initiator_key();
    send_key(kStagedHello, encode_staged_hello(StagedHello{initiator_key_, ProcessIdentity::of_this_process()}),
             backend_.worker().address());
  }
  // A flush completes the connection, so an unreachable peer fails the handshake.
  struct FlushState {
    std::function<void(Ok)> done;
    std::string peer;
  };
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  auto* fs = new FlushState{std::move(done), meta_.engine_id};
  p.user_data = fs;
  p.cb.send = [](void* request, ucs_status_t status, void* user_data) {
    auto* s = static_cast<FlushState*>(user_data);
    ucp_request_free(request);
    if (status == UCS_OK) {
      s->done(Ok{});
    } else {
      s->done(ucx_error(fmt::format("connecting to peer {} over UCX", s->peer).c_str(), status));
    }
    delete s;
  };
  ucs_status_ptr_t sp = ucp_ep_flush_nbx(ep_, &p);
  if (sp == nullptr) {
    fs->done(Ok{});
    delete fs;
  } else if (UCS_PTR_IS_ERR(sp)) {
    fs->done(ucx_error(fmt::format("connecting to peer {} over UCX", meta_.engine_id).c_str(), UCS_PTR_STATUS(sp)));
    delete fs;
  }
}

// kStagedHello / kStagedBye; nothing waits for it.
void UcxPeer::send_key(unsigned id, std::string header_bytes, const std::string& data) {
  auto* header = new std::string(std::move(header_bytes));  // UCX reads it until the send completes
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = [](void* request, ucs_status_t, void* user_data) {
    ucp_request_free(request);
    delete static_cast<std::string*>(user_data);
  };
  p.user_data = header;
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep_, id, header->data(), header->size(), data.data(), data.size(), &p);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) delete header;
}

void UcxPeer::post(XferPlan plan, XferDone done) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_) {
      done(unavailable(fmt::format("the descriptor of peer {} was released (INVALIDATE or a new handshake); "
                                   "handshake again",
                                   meta_.engine_id)));
      return;
    }
    ++in_flight_;
  }
  auto* x = new UcxXfer;
  x->backend = &backend_;
  x->peer = shared_from_this();
  x->plan = std::move(plan);
  x->done = std::move(done);
  backend_.worker().post([x] { x->peer->start(x); });
}

void UcxPeer::advance_later(UcxXfer* x) { backend_.ready(x); }

void UcxPeer::start(UcxXfer* x) {
  backend_.track(x);
  xfers_.insert(x);
  if (broken_) {
    x->failure = *broken_;
  } else if (expired(x->plan.deadline)) {
    x->failure = timeout("the deadline passed before the transfer started");
  } else if (Ok planned = plan_pieces(x); !planned) {
    x->failure = planned.error();
  } else if (guarded_eligible(x)) {
    x->stage = UcxXfer::Stage::kGuarded;  // the peer checks each range as it copies
    start_guarded(x);
    return;
  } else if (x->direct_remote) {
    fetch_table(x);
    return;
  } else {
    x->stage = UcxXfer::Stage::kData;  // the peer checks staged pieces itself
    send_data(x);
    return;
  }
  backend_.ready(x);
}

// Counts the request before the call: UCX may complete it, and run its
// callback, inside the call.
void UcxPeer::issue(UcxXfer* x, const std::function<ucs_status_ptr_t()>& call) {
  ++x->outstanding;
  ucs_status_ptr_t sp = call();
  if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) return;  // its callback counts it done
  --x->outstanding;                                   // done at once, or refused: no callback
  if (UCS_PTR_IS_ERR(sp) && !x->failure)
    x->failure = ucx_error(fmt::format("UCX operation with peer {}", meta_.engine_id).c_str(), UCS_PTR_STATUS(sp));
}

namespace {
ucp_request_param_t request_param(UcxXfer* x) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = on_xfer_request_done;
  p.user_data = x;
  return p;
}
}  // namespace

bool UcxPeer::endpoint_usable(UcxXfer* x) {
  if (ep_ != nullptr) return true;
  if (!x->failure) x->failure = broken_.value_or(unavailable("the endpoint is closed"));
  backend_.ready(x);
  return false;
}

void UcxPeer::fetch_table(UcxXfer* x) {
  if (!endpoint_usable(x)) return;
  uint32_t max_slot = 0;
  for (const XferSegment& s : x->plan.segments) max_slot = std::max(max_slot, meta_.regions[s.remote_index].slot);
  size_t words = std::min<size_t>(kRegionTableHeaderWords + max_slot + 1, table_.bytes / sizeof(uint64_t));
  x->table.assign(words, 0);
  ucp_request_param_t p = request_param(x);
  issue(x, [&] { return ucp_get_nbx(ep_, x->table.data(), words * sizeof(uint64_t), table_.address, table_rkey_, &p); });
  if (x->outstanding == 0) backend_.ready(x);
}

// Posts every direct put/get at once, then the staged pieces that chunks
// allow; the post-check follows the last put/get (post_check()).
void UcxPeer::send_data(UcxXfer* x) {
  if (!endpoint_usable(x)) return;
  for (size_t i : x->direct_segments) {
    const XferSegment& s = x->plan.segments[i];
    uint64_t remote = meta_.regions[s.remote_index].base + s.remote_offset;
    ucp_request_param_t p = request_param(x);
    if (ucp_mem_h memh = backend_.local_memh(s.local_region)) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = memh;
    }
    if (x->plan.op == XferOp::kWrite) {
      issue(x, [&] { return ucp_put_nbx(ep_, s.local, s.bytes, remote, rkeys_[s.remote_index], &p); });
    } else {
      issue(x, [&] { return ucp_get_nbx(ep_, s.local, s.bytes, remote, rkeys_[s.remote_index], &p); });
    }
    if (x->failure) break;
  }
  if (x->staged()) {
    pump(x);
    return;
  }
  if (!x->failure && x->direct_remote) post_check(x);
  if (x->outstanding == 0) backend_.ready(x);
}

// The post-check GET, fenced behind the transfer's puts and gets: UCX performs
// it at the target after them, so its completion also means every put landed
// (no flush of its own) and its answer covers the whole transfer.
void UcxPeer::post_check(UcxXfer* x) {
  if (x->post_check_posted) return;
  x->post_check_posted = true;
  ucs_status_t st = ucp_worker_fence(backend_.worker().worker());
  if (st != UCS_OK) {
    if (!x->failure) x->failure = ucx_error("ucp_worker_fence", st);
    return;
  }
  fetch_table(x);
}

void UcxPeer::advance(UcxXfer* x) {
  x->queued = false;
  if (x->stage == UcxXfer::Stage::kGuarded) return advance_guarded(x);
  if (x->outstanding > 0) return;
  if (x->failure) {
    if (x->copies == 0) complete(x, *x->failure);  // a running copy still touches our region: pump() waits for it
    return;
  }
  auto check = [&]() -> Ok {
    for (const XferSegment& s : x->plan.segments) {
      if (remote_staged_[s.remote_index]) continue;
      const RegionDesc& d = meta_.regions[s.remote_index];
      SIESTA_TRY(check_region_live(x->table.data(), x->table.size(), d.slot, d.id, meta_.epoch));
    }
    return {};
  };
  switch (x->stage) {
    case UcxXfer::Stage::kPreCheck: {
      Ok live = check();
      if (!live) {
        complete(x, live.error().with_context("nothing was sent"));
        return;
      }
      x->stage = UcxXfer::Stage::kData;
      send_data(x);
      return;
    }
    case UcxXfer::Stage::kData: {
      if (x->pieces_done < x->pieces.size()) return;  // pump() moves the pieces
      if (x->direct_remote && !x->post_check_posted) {
        post_check(x);
        if (x->outstanding == 0) backend_.ready(x);
        return;
      }
      Ok live = x->direct_remote ? check() : Ok{};
      if (!live) {
        complete(x, live.error().with_context(x->plan.op == XferOp::kRead
                                                  ? "the bytes read are not trusted"
                                                  : "the bytes written may not have reached the peer"));
        return;
      }
      complete(x, Ok{});
      return;
    }
    case UcxXfer::Stage::kGuarded:
      return;  // advance_guarded()
  }
}

void UcxPeer::complete(UcxXfer* x, Ok result) {
  release_staging(x, false);
  forget_guarded(x);
  backend_.untrack(x);
  xfers_.erase(x);
  std::shared_ptr<UcxPeer> self = std::move(x->peer);
  XferDone done = std::move(x->done);
  delete x;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--in_flight_ == 0) idle_cv_.notify_all();
  }
  done(std::move(result));
}

void UcxPeer::break_connection(const Status& why, bool peer_gone) {
  if (broken_ && (ep_ == nullptr || !peer_gone)) return;
  if (!broken_) broken_ = why;
  for (UcxXfer* x : xfers_)
    if (!x->failure) x->failure = why;
  if (!peer_gone && !backend_.worker().peer_error_handling()) {
    for (UcxXfer* x : xfers_)
      if (x->outstanding == 0) backend_.ready(x);
    return;
  }
  {
    ucp_ep_h ep = ep_;
    ep_ = nullptr;
    EndpointContext* ctx = ep_context_;
    ep_context_ = nullptr;
    // Forced: cancels what is in flight, whose callbacks fail them.
    close_ep_then_destroy(ep, ctx, true, take_rkeys(rkeys_, table_rkey_), nullptr);
  }
  // Transfers between stages (no request outstanding) fail on the next tick.
  // Without peer error handling a forced close does not complete the
  // requests to a dead peer: such transfers are failed now and their
  // requests left to UCX (orphans, freed if UCX ever completes them).
  std::vector<UcxXfer*> stuck;
  for (UcxXfer* x : xfers_) {
    if (x->outstanding == 0) {
      backend_.ready(x);
    } else if (peer_gone && !backend_.worker().peer_error_handling()) {
      stuck.push_back(x);
    }
  }
  for (UcxXfer* x : stuck) orphan(x);
}

void UcxPeer::abandon(UcxXfer* x, const Status& why) {
  if (!x->failure) x->failure = why;
  if (x->outstanding == 0) {
    complete(x, *x->failure);
  } else {
    orphan(x);
  }
}

void UcxPeer::orphan(UcxXfer* x) {
  release_staging(x, true);
  forget_guarded(x);
  backend_.untrack(x);
  xfers_.erase(x);
  backend_.adopt_orphan(x);
  x->orphaned = true;
  std::shared_ptr<UcxPeer> self = std::move(x->peer);
  XferDone done = std::move(x->done);
  Status why = x->failure.value_or(unavailable("the peer is gone"));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--in_flight_ == 0) idle_cv_.notify_all();
  }
  done(std::move(why));
}

Ok UcxPeer::release(Deadline deadline) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    released_ = true;
    if (!idle_cv_.wait_until(lock, deadline, [&] { return in_flight_ == 0; })) {
      lock.unlock();
      std::weak_ptr<UcxPeer> weak = weak_from_this();
      std::string peer = meta_.engine_id;
      backend_.worker().post([weak, peer] {
        if (auto p = weak.lock())
          p->break_connection(unavailable(fmt::format("the descriptor of peer {} was released while the transfer "
                                                      "was in flight",
                                                      peer)),
                              false);
      });
      lock.lock();
      idle_cv_.wait_until(lock, deadline + kReleaseGrace, [&] { return in_flight_ == 0; });
      if (in_flight_ > 0)
        return timeout(fmt::format("{} transfers with peer {} did not end after being cancelled", in_flight_,
                                   meta_.engine_id));
    }
  }
  auto closed = std::make_shared<Waiter<bool>>();
  auto self = shared_from_this();
  backend_.worker().post([self, closed] {
    if (self->initiator_key_ != 0 && self->ep_ != nullptr)  // before the close flushes
      self->send_key(kStagedBye, encode_initiator_key(self->initiator_key_), {});
    ucp_ep_h ep = self->ep_;
    self->ep_ = nullptr;
    EndpointContext* ctx = self->ep_context_;
    self->ep_context_ = nullptr;
    close_ep_then_destroy(ep, ctx, false, take_rkeys(self->rkeys_, self->table_rkey_),
                          [closed] { closed->set(true); });
  });
  if (!closed->wait_until(deadline + kReleaseGrace))
    return timeout(fmt::format("closing the UCX endpoint to peer {} did not finish before the deadline",
                               meta_.engine_id));
  return {};
}

void on_xfer_request_done(void* request, ucs_status_t status, void* user_data) {
  auto* x = static_cast<UcxXfer*>(user_data);
  ucp_request_free(request);
  if (x->orphaned) {
    if (--x->outstanding == 0) x->backend->drop_orphan(x);
    return;
  }
  if (status != UCS_OK && !x->failure)
    x->failure = ucx_error(fmt::format("UCX operation with peer {}", x->peer->meta().engine_id).c_str(), status);
  if (--x->outstanding == 0) x->peer->advance_later(x);
}

}  // namespace siesta::transfer::ucx
