#include "bench/transfer/ucx_put_probe.h"

#include <fmt/format.h>

#include <vector>

#include "transfer/wire.h"

namespace siesta::transfer::ucx {

namespace {

void request_done(void*, ucs_status_t, void*) {}

}  // namespace

Result<std::unique_ptr<UcxPutTarget>> UcxPutTarget::create(const UcxOptions& options, void* base, size_t bytes) {
  std::unique_ptr<UcxPutTarget> t(new UcxPutTarget());
  SIESTA_ASSIGN_OR_RETURN(t->worker_, UcxWorker::create(options));
  SIESTA_ASSIGN_OR_RETURN(MappedMemory mapped,
                          map_memory(t->worker_->context(), base, bytes, UCS_MEMORY_TYPE_HOST, true));
  t->memh_ = mapped.memh;
  WireWriter w;
  w.bytes(t->worker_->address());
  w.u64(reinterpret_cast<uint64_t>(base));
  w.u64(bytes);
  w.bytes(mapped.rkey);
  t->descriptor_ = w.take();
  t->worker_->start([] { return false; });
  return t;
}

UcxPutTarget::~UcxPutTarget() {
  if (!worker_) return;
  worker_->stop();
  if (memh_ != nullptr) ucp_mem_unmap(worker_->context(), memh_);
}

Result<std::unique_ptr<UcxPutProbe>> UcxPutProbe::connect(const UcxOptions& options, const std::string& descriptor,
                                                          void* local, size_t local_bytes, Deadline deadline) {
  std::unique_ptr<UcxPutProbe> p(new UcxPutProbe());
  WireReader r(descriptor);
  std::string address = r.bytes(1u << 16);
  p->remote_base_ = r.u64();
  p->remote_bytes_ = r.u64();
  std::string rkey = r.bytes(1u << 16);
  if (!r.done() || address.empty()) return corrupt("malformed UCX put-target descriptor");
  SIESTA_ASSIGN_OR_RETURN(p->worker_, UcxWorker::create(options));
  SIESTA_ASSIGN_OR_RETURN(MappedMemory mapped,
                          map_memory(p->worker_->context(), local, local_bytes, UCS_MEMORY_TYPE_HOST, false));
  p->local_memh_ = mapped.memh;
  p->local_ = static_cast<char*>(local);
  p->local_bytes_ = local_bytes;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
  ep.err_mode = options.peer_error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  ucs_status_t st = ucp_ep_create(p->worker_->worker(), &ep, &p->ep_);
  if (st != UCS_OK) return ucx_error("creating the put probe's endpoint", st);
  st = ucp_ep_rkey_unpack(p->ep_, rkey.data(), &p->rkey_);
  if (st != UCS_OK) return ucx_error("unpacking the put target's rkey", st);
  // Connect now, so the first timed batch does not pay for it.
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
  rp.cb.send = request_done;
  SIESTA_TRY(p->wait(ucp_ep_flush_nbx(p->ep_, &rp), deadline));
  return p;
}

UcxPutProbe::~UcxPutProbe() {
  if (!worker_) return;
  if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
  if (ep_ != nullptr) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
    rp.cb.send = request_done;
    (void)wait(ucp_ep_close_nbx(ep_, &rp), deadline_after(std::chrono::milliseconds(2000)));
  }
  if (local_memh_ != nullptr) ucp_mem_unmap(worker_->context(), local_memh_);
}

Ok UcxPutProbe::wait(void* request, Deadline deadline) {
  if (request == nullptr) return {};
  if (UCS_PTR_IS_ERR(request)) return ucx_error("UCX request", UCS_PTR_STATUS(request));
  ucs_status_t st;
  while ((st = ucp_request_check_status(request)) == UCS_INPROGRESS) {
    ucp_worker_progress(worker_->worker());
    if (expired(deadline)) return timeout("the UCX put probe did not complete before its deadline");
  }
  ucp_request_free(request);
  if (st != UCS_OK) return ucx_error("UCX put probe", st);
  return {};
}

Ok UcxPutProbe::put_batch(size_t bytes, size_t count, Deadline deadline) {
  if (bytes * count > local_bytes_ || bytes * count > remote_bytes_) return invalid_argument("put batch too large");
  std::vector<void*> requests;
  requests.reserve(count + 1);
  for (size_t i = 0; i < count; ++i) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_MEMH;
    rp.cb.send = request_done;
    rp.memh = local_memh_;
    void* req = ucp_put_nbx(ep_, local_ + i * bytes, bytes, remote_base_ + i * bytes, rkey_, &rp);
    if (req != nullptr) requests.push_back(req);
  }
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK;
  rp.cb.send = request_done;
  void* flush = ucp_ep_flush_nbx(ep_, &rp);
  Ok result;
  for (void* req : requests) {
    Ok r = wait(req, deadline);
    if (!r && result) result = r;
  }
  Ok f = wait(flush, deadline);
  if (!f && result) result = f;
  return result;
}

}  // namespace siesta::transfer::ucx
