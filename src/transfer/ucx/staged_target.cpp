#include "transfer/ucx/staged_target.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>

#include "common/log.h"
#include "transfer/region_table.h"
#include "transfer/ucx/staging_pool.h"
#include "transfer/ucx/ucx_worker.h"

namespace siesta::transfer::ucx {

// A UCX request's argument: outlives the StagedTarget when the worker is
// destroyed after it (owner is then null and the callback only cleans up).
struct TargetRequestContext {
  StagedTarget* owner = nullptr;
  std::function<void(ucs_status_t)> done;
  std::string header;  // of a reply: UCX 1.13 reads it until the send completes
};

// Our endpoint's error handler argument; freed when the endpoint is closed.
struct InitiatorContext {
  StagedTarget* target = nullptr;
  UcxWorker* worker = nullptr;
  uint64_t key = 0;
};

namespace {

constexpr auto kMaxRequestWait = std::chrono::seconds(600);
constexpr auto kCloseWait = std::chrono::seconds(1);
constexpr auto kWatchInterval = std::chrono::milliseconds(10);
constexpr auto kAbandonAfter = std::chrono::seconds(5);

void on_send_done(void* request, ucs_status_t status, void* user_data) {
  auto* ctx = static_cast<TargetRequestContext*>(user_data);
  ucp_request_free(request);
  if (ctx->owner != nullptr && ctx->done) ctx->done(status);
  delete ctx;
}

void on_recv_done(void* request, ucs_status_t status, size_t, void* user_data) {
  on_send_done(request, status, user_data);
}

}  // namespace

StagedTarget::StagedTarget(UcxWorker& worker, const RegionTable& table, bool peer_error_handling)
    : worker_(worker), table_(table), peer_error_handling_(peer_error_handling) {}

StagedTarget::~StagedTarget() {
  // The worker's thread has stopped: nothing runs concurrently.
  for (auto& q : requests_) {
    if (q->in_flight != nullptr) q->in_flight->owner = nullptr;  // UCX frees it when (if) it completes
    if (q->rendezvous != nullptr) ucp_am_data_release(worker_.worker(), q->rendezvous);
    if (q->chunk != nullptr && pool_) pool_->release(q->chunk);
  }
  requests_.clear();
  for (auto& q : abandoned_)
    if (q->in_flight != nullptr) q->in_flight->owner = nullptr;
  abandoned_.clear();
  // Our endpoints, force-closed here while the worker still exists (those to
  // failed initiators without peer error handling were left open: UCX closes
  // them with the worker).
  Deadline deadline = deadline_after(std::chrono::duration_cast<std::chrono::milliseconds>(kCloseWait));
  for (auto& [key, in] : initiators_) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = peer_error_handling_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t sp = ucp_ep_close_nbx(in.ep, &p);
    bool closed = true;
    if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) {
      while (ucp_request_check_status(sp) == UCS_INPROGRESS && !expired(deadline)) ucp_worker_progress(worker_.worker());
      closed = ucp_request_check_status(sp) != UCS_INPROGRESS;
      ucp_request_free(sp);
    }
    if (closed) delete in.context;  // else its error handler may still run: left to the process
    if (in.watch >= 0) close(in.watch);
  }
  initiators_.clear();
}

Ok StagedTarget::install() {
  struct Handler {
    unsigned id;
    ucp_am_recv_callback_t cb;
    void* arg;
  };
  // The request handler tells writes from reads by the argument's low bit.
  auto self = reinterpret_cast<uintptr_t>(this);
  const Handler handlers[] = {
      {kStagedWrite, on_request, reinterpret_cast<void*>(self | 1)},
      {kStagedReadRequest, on_request, this},
      {kStagedHello, on_hello, this},
      {kStagedBye, on_bye, this},
  };
  for (const Handler& h : handlers) {
    ucp_am_handler_param_t p{};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                   UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    p.id = h.id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    p.cb = h.cb;
    p.arg = h.arg;
    ucs_status_t st = ucp_worker_set_am_recv_handler(worker_.worker(), &p);
    if (st != UCS_OK) return ucx_error("registering the staged-transfer handlers", st);
  }
  return {};
}

namespace {

void on_initiator_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* ctx = static_cast<InitiatorContext*>(arg);
  // The endpoint cannot be closed inside its own error callback: next loop.
  StagedTarget* target = ctx->target;
  uint64_t key = ctx->key;
  ctx->worker->post([target, key, status] { target->initiator_failed(key, status); });
}

}  // namespace

ucs_status_t StagedTarget::on_hello(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                    const ucp_am_recv_param_t*) {
  auto* self = static_cast<StagedTarget*>(arg);
  Result<StagedHello> hello = decode_staged_hello(header, header_length);
  if (hello && data != nullptr && length > 0) self->hello(*hello, data, length);
  return UCS_OK;
}

ucs_status_t StagedTarget::on_bye(void* arg, const void* header, size_t header_length, void*, size_t,
                                  const ucp_am_recv_param_t*) {
  auto* self = static_cast<StagedTarget*>(arg);
  Result<uint64_t> key = decode_initiator_key(header, header_length);
  if (!key) return UCS_OK;
  auto it = self->initiators_.find(*key);
  if (it != self->initiators_.end()) it->second.leaving = true;
  return UCS_OK;
}

void StagedTarget::hello(const StagedHello& h, const void* address, size_t bytes) {
  uint64_t key = h.key;
  if (initiators_.count(key) != 0) return;
  std::string addr(static_cast<const char*>(address), bytes);  // ucp_ep_create reads it during the call
  auto* ctx = new InitiatorContext{this, &worker_, key};
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
  ep.err_mode = peer_error_handling_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (peer_error_handling_) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_handler.cb = on_initiator_error;
    ep.err_handler.arg = ctx;
  }
  Initiator in;
  in.context = ctx;
  ucs_status_t st = ucp_ep_create(worker_.worker(), &ep, &in.ep);
  if (st != UCS_OK) {
    SIESTA_LOG_WARN("ucx staging: no endpoint back to an initiator ({}); its staged requests go unanswered",
                    ucs_status_string(st));
    delete ctx;
    return;
  }
  // Without UCX's peer error handling, an initiator on this host is watched through its pid.
  if (!peer_error_handling_ && identity_.same_pid_namespace(h.identity)) in.watch = open_process_watch(h.identity.pid);
  initiators_.emplace(key, in);
}

void StagedTarget::initiator_failed(uint64_t key, ucs_status_t status) {
  auto it = initiators_.find(key);
  if (it == initiators_.end()) return;
  SIESTA_LOG_DEBUG("ucx staging: an initiator's endpoint failed ({}); its requests are dropped",
                   ucs_status_string(status));
  it->second.failed = true;
}

ucp_ep_h StagedTarget::reply_endpoint(uint64_t key) const {
  auto it = initiators_.find(key);
  if (it == initiators_.end() || it->second.failed) return nullptr;
  return it->second.ep;
}

// Closes the endpoints of initiators that failed (or, without UCX peer
// error handling, whose process exited) and of those that left once their
// requests are done. A failed initiator's requests that UCX still holds may
// never end (UCX does not always fail a receive from a dead peer, and without
// peer error handling fails nothing, nor allows a forced close): they are set
// aside and their chunks retired (the pool replaces them).
void StagedTarget::close_initiators() {
  Clock::time_point now = Clock::now();
  bool watch = now - last_watch_ >= kWatchInterval;
  if (watch) last_watch_ = now;
  for (auto it = initiators_.begin(); it != initiators_.end();) {
    Initiator& in = it->second;
    uint64_t key = it->first;
    if (watch && in.watch >= 0 && !in.failed && process_exited(in.watch)) in.failed = true;
    bool busy = std::any_of(requests_.begin(), requests_.end(),
                            [&](const std::unique_ptr<Request>& q) { return q->req.initiator == key; });
    if (!in.failed && !(in.leaving && !busy)) {
      ++it;
      continue;
    }
    if (in.failed)
      for (auto& q : requests_)
        if (q->req.initiator == key && q->in_flight != nullptr) abandon(q);
    if (in.failed && !peer_error_handling_) {
      delete in.context;  // no error handler uses it without peer error handling
    } else {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
      p.flags = in.failed ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      p.cb.send = [](void* request, ucs_status_t, void* user_data) {
        ucp_request_free(request);
        delete static_cast<InitiatorContext*>(user_data);
      };
      p.user_data = in.context;
      ucs_status_ptr_t sp = ucp_ep_close_nbx(in.ep, &p);
      if (sp == nullptr || UCS_PTR_IS_ERR(sp)) delete in.context;
    }
    if (in.watch >= 0) close(in.watch);
    it = initiators_.erase(it);
  }
  std::erase_if(requests_, [](const std::unique_ptr<Request>& q) { return q == nullptr; });
}

// Sets a request aside whose UCX request may never end; its chunk is retired.
void StagedTarget::abandon(std::unique_ptr<Request>& q) {
  if (q->chunk != nullptr) pool_->retire(q->chunk);
  q->chunk = nullptr;
  release_hold(*q);
  abandoned_.push_back(std::move(q));  // leaves null in requests_
}

void StagedTarget::add_region(RegionId id, uint32_t slot, char* base, size_t bytes, int device) {
  std::lock_guard<std::mutex> lock(mu_);
  served_[id] = Served{slot, base, bytes, device, 0};
}

void StagedTarget::remove_region(RegionId id, Deadline deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = served_.find(id);
  if (it == served_.end()) return;
  if (!idle_cv_.wait_until(lock, deadline, [&] { return served_.at(id).copying == 0; }))
    SIESTA_LOG_WARN("ucx staging: region {} deregistered while a copy of a peer's request still ran", id.value);
  served_.erase(id);
}

void StagedTarget::set_pool(std::unique_ptr<StagingPool> pool) { pool_ = std::move(pool); }

ucs_status_t StagedTarget::on_request(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                      const ucp_am_recv_param_t* param) {
  auto bits = reinterpret_cast<uintptr_t>(arg);
  auto* self = reinterpret_cast<StagedTarget*>(bits & ~uintptr_t{1});
  return self->accept((bits & 1) != 0, header, header_length, data, length, param);
}

ucs_status_t StagedTarget::accept(bool write, const void* header, size_t header_length, void* data, size_t length,
                                  const ucp_am_recv_param_t* param) {
  bool rendezvous = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  Result<StagedRequest> req = decode_staged_request(header, header_length);
  if (!req || initiators_.count(req->initiator) == 0) {
    SIESTA_LOG_WARN("ucx staging: dropped a {} (no endpoint back to its initiator)",
                    req ? "staged request from an initiator that did not say hello" : "malformed staged request");
    return UCS_OK;  // a rendezvous descriptor is dropped with it
  }
  auto q = std::make_unique<Request>();
  q->write = write;
  q->req = *req;
  q->deadline = Clock::now() + std::min<std::chrono::milliseconds>(std::chrono::milliseconds(req->deadline_ms),
                                                                   kMaxRequestWait);
  ucs_status_t keep = UCS_OK;
  if (write && length != req->bytes) {
    q->failure = invalid_argument(fmt::format("a staged write of {} bytes came with {}", req->bytes, length));
  } else if (Ok live = check(*req, false, nullptr, nullptr); !live) {
    q->failure = live.error();
  } else if (write && rendezvous) {
    q->rendezvous = data;
    keep = UCS_INPROGRESS;
  } else if (write) {
    q->eager.assign(static_cast<const char*>(data), static_cast<const char*>(data) + length);
  }
  // A refused request is answered on the next tick, like the others.
  if (q->failure) q->state = Request::State::kReply;
  requests_.push_back(std::move(q));
  return keep;
}

Ok StagedTarget::check(const StagedRequest& r, bool hold, char** address, int* device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = served_.find(r.region);
  if (it == served_.end())
    return conflict(fmt::format("region {} was deregistered by its owner without invalidating us (its staged copy "
                                "was refused before touching it)",
                                r.region.value));
  Served& s = it->second;
  const auto* words = static_cast<const uint64_t*>(table_.base());
  SIESTA_TRY(check_region_live(words, table_.bytes() / sizeof(uint64_t), r.slot, r.region, r.epoch));
  if (r.bytes == 0 || r.offset > s.bytes || r.bytes > s.bytes - r.offset)
    return invalid_argument(fmt::format("staged range [{}, +{}) is outside region {} ({} bytes)", r.offset, r.bytes,
                                        r.region.value, s.bytes));
  if (pool_ && r.bytes > pool_->chunk_bytes())
    return invalid_argument(fmt::format("a staged piece of {} bytes is larger than a staging chunk ({} bytes)", r.bytes,
                                        pool_->chunk_bytes()));
  if (hold) {
    ++s.copying;
    *address = s.base + r.offset;
    *device = s.device;
  }
  return {};
}

void StagedTarget::release_hold(Request& q) {
  if (q.holding.value == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = served_.find(q.holding);
  if (it != served_.end() && it->second.copying > 0 && --it->second.copying == 0) idle_cv_.notify_all();
  q.holding = RegionId{};
}

bool StagedTarget::tick() {
  bool waiting_for_chunk = false;
  for (auto& q : requests_) {
    if (q->state == Request::State::kQueued && waiting_for_chunk) continue;  // arrival order for chunks
    step(*q);
    if (q->state == Request::State::kQueued) waiting_for_chunk = true;
  }
  std::erase_if(requests_, [](const std::unique_ptr<Request>& q) { return q->state == Request::State::kDone; });
  // Long after its initiator gave up, a request UCX still holds is set aside too.
  for (auto& q : requests_)
    if (q->in_flight != nullptr && Clock::now() > q->deadline + kAbandonAfter) abandon(q);
  std::erase_if(requests_, [](const std::unique_ptr<Request>& q) { return q == nullptr; });
  close_initiators();
  // Set-aside requests count for nothing; they go if UCX ever completes them.
  std::erase_if(abandoned_, [](const std::unique_ptr<Request>& q) { return q->in_flight == nullptr; });
  bool draining = pool_ && pool_->poll();
  return !requests_.empty() || draining;
}

void StagedTarget::step(Request& q) {
  using State = Request::State;
  if (q.in_flight != nullptr || q.state == State::kReplying || q.state == State::kDone) return;
  if (q.state == State::kQueued) {
    auto in = initiators_.find(q.req.initiator);
    if (in == initiators_.end() || in->second.failed) {  // it is gone: nobody to serve
      if (q.rendezvous != nullptr) ucp_am_data_release(worker_.worker(), q.rendezvous);
      q.rendezvous = nullptr;
      q.state = State::kDone;
      return;
    }
  }
  if (q.failure && q.state != State::kReply) {
    // Let a running copy end before the region and the chunk are let go.
    if (q.chunk != nullptr && q.chunk->copy.running()) {
      Result<bool> f = q.chunk->copy.finished();
      if (f && !*f) return;
    }
    q.state = State::kReply;
  }
  switch (q.state) {
    case State::kQueued: {
      if (expired(q.deadline)) {
        q.failure = timeout("the staged request waited past its deadline for a staging chunk");
        return step(q);
      }
      if (!pool_) return;  // the pool is on its way from the registering thread
      if (q.req.bytes > pool_->chunk_bytes()) {
        q.failure = invalid_argument(fmt::format("a staged piece of {} bytes is larger than a staging chunk ({} bytes)",
                                                 q.req.bytes, pool_->chunk_bytes()));
        return step(q);
      }
      q.chunk = pool_->acquire();
      if (q.chunk == nullptr) return;
      if (!q.write) return start_copy(q);
      if (q.rendezvous == nullptr) {
        std::memcpy(q.chunk->data, q.eager.data(), q.eager.size());
        q.eager = {};
        return start_copy(q);
      }
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_MEMH;
      p.cb.recv_am = on_recv_done;
      p.memh = q.chunk->memh;
      auto* ctx = new TargetRequestContext{this, {}, {}};
      ctx->done = [this, &q](ucs_status_t st) {
        q.in_flight = nullptr;
        if (st != UCS_OK) q.failure = ucx_error("receiving a staged write", st);
        q.state = State::kReceived;  // the next tick goes on
      };
      p.user_data = ctx;
      void* desc = q.rendezvous;
      q.rendezvous = nullptr;  // UCX owns it from here on, even if the receive fails
      // Set before the call: UCX may complete the receive, and run its callback, inside it.
      q.in_flight = ctx;
      q.state = State::kReceiving;
      ucs_status_ptr_t sp = ucp_am_recv_data_nbx(worker_.worker(), desc, q.chunk->data, q.req.bytes, &p);
      if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) return;  // its callback moves it on
      delete ctx;  // done at once, or refused: no callback
      q.in_flight = nullptr;
      if (UCS_PTR_IS_ERR(sp)) q.failure = ucx_error("receiving a staged write", UCS_PTR_STATUS(sp));
      q.state = State::kReceived;
      return step(q);
    }
    case State::kReceiving:
      return;  // its callback moves it on
    case State::kReceived:
      return start_copy(q);
    case State::kCopying: {
      Result<bool> f = q.chunk->copy.finished();
      if (f && !*f) return;
      release_hold(q);
      if (!f) q.failure = f.error();
      q.state = State::kReply;
      return step(q);
    }
    case State::kReply:
      return reply(q);
    case State::kReplying:
    case State::kDone:
      return;
  }
}

// Checks the region again, holds it, and starts the copy between it and the chunk.
void StagedTarget::start_copy(Request& q) {
  char* address = nullptr;
  int device = -1;
  Ok live = check(q.req, true, &address, &device);
  if (!live) {
    q.failure = q.write ? live.error().with_context("nothing was written") : live.error();
    q.state = Request::State::kReply;
    return step(q);
  }
  q.holding = q.req.region;
  Ok started = q.write ? pool_->copy_out(q.chunk, address, q.req.bytes, device)
                       : pool_->copy_in(q.chunk, address, q.req.bytes, device);
  if (!started) {
    release_hold(q);
    q.failure = started.error();
    q.state = Request::State::kReply;
    return step(q);
  }
  q.state = Request::State::kCopying;
  step(q);
}

// Sends the ack (write) or the data (read), or the failure of either; the
// chunk stays with the request until the send completes.
void StagedTarget::reply(Request& q) {
  release_hold(q);
  if (q.rendezvous != nullptr) {
    ucp_am_data_release(worker_.worker(), q.rendezvous);
    q.rendezvous = nullptr;
  }
  auto in = initiators_.find(q.req.initiator);
  if (in == initiators_.end() || in->second.failed) {  // nobody to answer
    done(q);
    return;
  }
  StagedReply r;
  r.token = q.req.token;
  if (q.failure) r.result = *q.failure;
  bool with_data = !q.write && !q.failure && q.chunk != nullptr;
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = on_send_done;
  p.flags = with_data ? UCP_AM_SEND_FLAG_RNDV : 0;
  if (with_data) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = q.chunk->memh;
  }
  auto* ctx = new TargetRequestContext{this, {}, {}};
  ctx->header = encode_staged_reply(r);
  ctx->done = [this, &q](ucs_status_t st) {
    q.in_flight = nullptr;
    if (st != UCS_OK && st != UCS_ERR_CANCELED)
      SIESTA_LOG_DEBUG("ucx staging: a reply to a peer failed: {}", ucs_status_string(st));
    done(q);
  };
  p.user_data = ctx;
  // Set before the call: UCX may complete the send, and run its callback, inside it.
  q.state = Request::State::kReplying;
  q.in_flight = ctx;
  // The header (in ctx) and the data (in the chunk) stay until the send completes.
  ucs_status_ptr_t sp = ucp_am_send_nbx(in->second.ep, q.write ? kStagedWriteAck : kStagedReadData, ctx->header.data(),
                                        ctx->header.size(), with_data ? q.chunk->data : nullptr,
                                        with_data ? q.req.bytes : 0, &p);
  if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) return;  // its callback ends the request
  delete ctx;  // sent at once, or refused: no callback
  q.in_flight = nullptr;
  if (UCS_PTR_IS_ERR(sp))
    SIESTA_LOG_DEBUG("ucx staging: a reply to a peer failed: {}", ucs_status_string(UCS_PTR_STATUS(sp)));
  done(q);
}

void StagedTarget::done(Request& q) {
  if (q.chunk != nullptr) pool_->release(q.chunk);
  q.chunk = nullptr;
  q.state = Request::State::kDone;
}

}  // namespace siesta::transfer::ucx
