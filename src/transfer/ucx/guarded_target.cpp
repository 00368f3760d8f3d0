#include "transfer/ucx/guarded_target.h"

#include <fmt/format.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "common/log.h"
#include "transfer/region_table.h"
#include "transfer/ucx/staged_messages.h"
#include "transfer/ucx/staged_target.h"
#include "transfer/ucx/ucx_worker.h"

namespace siesta::transfer::ucx {

namespace {

// A reply in flight: UCX reads its header and data until the send completes.
struct GuardedReply {
  std::string header;
  std::string data;
};

void on_reply_done(void* request, ucs_status_t, void* user_data) {
  ucp_request_free(request);
  delete static_cast<GuardedReply*>(user_data);
}

}  // namespace

GuardedTarget::GuardedTarget(UcxWorker& worker, const RegionTable& table, StagedTarget& endpoints)
    : worker_(worker), table_(table), endpoints_(endpoints) {}

Ok GuardedTarget::install() {
  for (unsigned id : {unsigned{kGuardedWrite}, unsigned{kGuardedReadRequest}}) {
    ucp_am_handler_param_t p{};
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                   UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    p.id = id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    p.cb = id == kGuardedWrite ? on_write : on_read;
    p.arg = this;
    ucs_status_t st = ucp_worker_set_am_recv_handler(worker_.worker(), &p);
    if (st != UCS_OK) return ucx_error("registering the guarded-transfer handlers", st);
  }
  return {};
}

void GuardedTarget::add_region(RegionId id, uint32_t slot, char* base, size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  served_[id] = Served{slot, base, bytes};
}

void GuardedTarget::remove_region(RegionId id) {
  std::lock_guard<std::mutex> lock(mu_);  // waits for a copy that runs now
  served_.erase(id);
}

void GuardedTarget::stop() { stopped_ = true; }

ucs_status_t GuardedTarget::on_write(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
  auto* self = static_cast<GuardedTarget*>(arg);
  if (self->stopped_) return UCS_OK;
  Result<GuardedRequest> req = decode_guarded_request(header, header_length);
  if (!req) {
    SIESTA_LOG_WARN("ucx: dropped a malformed guarded write");
    return UCS_OK;
  }
  ucp_ep_h ep = self->reply_endpoint(req->initiator);
  if (ep == nullptr) return UCS_OK;
  Ok result;
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) {
    result = invalid_argument("a guarded write arrived as rendezvous data (guarded writes are sent eagerly)");
  } else if (length != req->bytes()) {
    result = invalid_argument(fmt::format("a guarded write of {} bytes came with {}", req->bytes(), length));
  } else {
    result = self->serve(*req, static_cast<const char*>(data), nullptr);
  }
  self->reply(ep, kGuardedWriteAck, req->token, result, {});
  return UCS_OK;  // a rendezvous descriptor is dropped with it
}

ucs_status_t GuardedTarget::on_read(void* arg, const void* header, size_t header_length, void*, size_t,
                                    const ucp_am_recv_param_t*) {
  auto* self = static_cast<GuardedTarget*>(arg);
  if (self->stopped_) return UCS_OK;
  Result<GuardedRequest> req = decode_guarded_request(header, header_length);
  if (!req) {
    SIESTA_LOG_WARN("ucx: dropped a malformed guarded read");
    return UCS_OK;
  }
  ucp_ep_h ep = self->reply_endpoint(req->initiator);
  if (ep == nullptr) return UCS_OK;
  std::string out;
  Ok result = req->bytes() > kGuardedMessageBytes
                  ? invalid_argument(fmt::format("a guarded read of {} bytes is more than the {} bytes a guarded "
                                                 "message carries",
                                                 req->bytes(), kGuardedMessageBytes))
                  : self->serve(*req, nullptr, &out);
  self->reply(ep, kGuardedReadData, req->token, result, result ? std::move(out) : std::string());
  return UCS_OK;
}

Ok GuardedTarget::serve(const GuardedRequest& r, const char* in, std::string* out) {
  if (r.expires_unix_ms != 0) {
    const auto now = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                               std::chrono::system_clock::now().time_since_epoch())
                                               .count());
    if (now > r.expires_unix_ms)
      return timeout(fmt::format("a guarded {} arrived {} ms after its transfer's deadline; nothing copied",
                                 in != nullptr ? "write" : "read", now - r.expires_unix_ms));
  }
  std::lock_guard<std::mutex> lock(mu_);
  const auto* words = static_cast<const uint64_t*>(table_.base());
  size_t nwords = table_.bytes() / sizeof(uint64_t);
  std::vector<char*> at(r.ranges.size());
  for (size_t i = 0; i < r.ranges.size(); ++i) {
    const GuardedRange& g = r.ranges[i];
    SIESTA_TRY(check_region_live(words, nwords, g.slot, g.region, r.epoch));
    auto it = served_.find(g.region);
    if (it == served_.end() || it->second.slot != g.slot)
      return conflict(fmt::format("region {} was deregistered by its owner without invalidating us, or is not host "
                                  "memory it serves with guarded copies",
                                  g.region.value));
    const Served& s = it->second;
    if (g.offset > s.bytes || g.bytes > s.bytes - g.offset)
      return invalid_argument(fmt::format("guarded range [{}, +{}) is outside region {} ({} bytes)", g.offset, g.bytes,
                                          g.region.value, s.bytes));
    at[i] = s.base + g.offset;
  }
  if (out != nullptr) out->resize(r.bytes());
  char* to = out != nullptr ? out->data() : nullptr;
  for (size_t i = 0; i < r.ranges.size(); ++i) {
    size_t n = r.ranges[i].bytes;
    if (in != nullptr) {
      std::memcpy(at[i], in, n);
      in += n;
    } else {
      std::memcpy(to, at[i], n);
      to += n;
    }
  }
  return {};
}

ucp_ep_h GuardedTarget::reply_endpoint(uint64_t initiator) {
  ucp_ep_h ep = endpoints_.reply_endpoint(initiator);
  if (ep == nullptr)
    SIESTA_LOG_WARN("ucx: dropped a guarded request from an initiator we have no endpoint to (it said no hello, or "
                    "failed); nothing was copied");
  return ep;
}

void GuardedTarget::reply(ucp_ep_h ep, unsigned id, uint64_t token, const Ok& result, std::string data) {
  auto* r = new GuardedReply{encode_staged_reply(StagedReply{token, result}), std::move(data)};
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.cb.send = on_reply_done;
  p.user_data = r;
  p.flags = UCP_AM_SEND_FLAG_EAGER;
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, id, r->header.data(), r->header.size(),
                                        r->data.empty() ? nullptr : r->data.data(), r->data.size(), &p);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {
    if (UCS_PTR_IS_ERR(sp))
      SIESTA_LOG_DEBUG("ucx: a guarded reply to a peer failed: {}", ucs_status_string(UCS_PTR_STATUS(sp)));
    delete r;  // sent at once, or refused: no callback
  }
}

}  // namespace siesta::transfer::ucx
