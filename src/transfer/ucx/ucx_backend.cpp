#include "transfer/ucx/ucx_backend.h"

#include <fmt/format.h>

#include "common/log.h"
#include "transfer/region_table.h"
#include "transfer/transfer_config.h"
#include "transfer/ucx/ucx_peer.h"
#include "transfer/wire.h"

namespace siesta::transfer::ucx {

namespace {

constexpr size_t kMaxBlobBytes = 1u << 16;
constexpr auto kWatchInterval = std::chrono::milliseconds(10);

template <class T>
struct Waiter {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<T> value;
  void set(T v) {
    std::lock_guard<std::mutex> lock(mu);
    value.emplace(std::move(v));
    cv.notify_all();
  }
  std::optional<T> wait_until(Deadline d) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_until(lock, d, [&] { return value.has_value(); });
    return value;
  }
};

Result<std::pair<ucp_mem_h, std::string>> map_and_pack(ucp_context_h context, void* base, size_t bytes,
                                                       ucs_memory_type_t type) {
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                  UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  mp.address = base;
  mp.length = bytes;
  mp.memory_type = type;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context, &mp, &memh);
  if (st != UCS_OK) return ucx_error("ucp_mem_map", st);
  void* rkey = nullptr;
  size_t rkey_bytes = 0;
  st = ucp_rkey_pack(context, memh, &rkey, &rkey_bytes);
  if (st != UCS_OK) {
    ucp_mem_unmap(context, memh);
    return ucx_error("ucp_rkey_pack", st);
  }
  std::string packed(static_cast<const char*>(rkey), rkey_bytes);
  ucp_rkey_buffer_release(rkey);
  return std::make_pair(memh, std::move(packed));
}

}  // namespace

Result<std::unique_ptr<UcxBackend>> UcxBackend::create(const TransferConfig& config, RegionTable& table) {
  std::unique_ptr<UcxBackend> b(new UcxBackend(table));
  SIESTA_ASSIGN_OR_RETURN(b->worker_, UcxWorker::create(UcxOptions{config.ucx_transports, config.ucx_net_devices,
                                                                 config.ucx_peer_error_handling}));
  SIESTA_ASSIGN_OR_RETURN(auto mapped, map_and_pack(b->worker_->context(), table.base(), table.bytes(),
                                                    UCS_MEMORY_TYPE_HOST));
  b->table_memh_ = mapped.first;
  WireWriter w;
  w.bytes(b->worker_->address());
  w.u64(reinterpret_cast<uint64_t>(table.base()));
  w.u64(table.bytes());
  w.bytes(mapped.second);
  b->identity_ = ProcessIdentity::of_this_process();
  b->identity_.encode(w);
  b->engine_blob_ = w.take();
  UcxBackend* raw = b.get();
  b->worker_->start([raw] { return raw->tick(); });
  return b;
}

UcxBackend::~UcxBackend() {
  worker_->stop();
  // Transfers still in flight (a peer that never answered) fail now.
  std::vector<UcxXfer*> stuck(active_.begin(), active_.end());
  for (UcxXfer* x : stuck) {
    std::shared_ptr<UcxPeer> peer = x->peer;
    peer->abandon(x, unavailable("the transfer engine shut down"));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, memh] : memh_) ucp_mem_unmap(worker_->context(), memh);
    memh_.clear();
    if (table_memh_ != nullptr) ucp_mem_unmap(worker_->context(), table_memh_);
  }
  worker_.reset();  // no UCX callback runs after this
  for (UcxXfer* x : orphans_) delete x;
}

void UcxBackend::drop_orphan(UcxXfer* xfer) {
  orphans_.erase(xfer);
  delete xfer;
}

Result<std::string> UcxBackend::register_region(const LocalRegion& region) {
  const RegionSpec& s = region.spec;
  ucs_memory_type_t type = UCS_MEMORY_TYPE_HOST;
  if (s.kind == MemoryKind::kCuda) {
    if (!worker_->supports_cuda())
      return unavailable("this UCX has no CUDA memory support (`ucx_info -d` lists no cuda transport), and the ucx "
                         "backend has no host staging path; use the ipc backend for GPUs on one host, or a UCX "
                         "built with CUDA");
    type = UCS_MEMORY_TYPE_CUDA;
  }
  SIESTA_ASSIGN_OR_RETURN(auto mapped, map_and_pack(worker_->context(), s.base, s.bytes, type));
  std::lock_guard<std::mutex> lock(mu_);
  memh_[region.id] = mapped.first;
  return std::move(mapped.second);
}

void UcxBackend::deregister_region(RegionId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = memh_.find(id);
  if (it == memh_.end()) return;
  ucs_status_t st = ucp_mem_unmap(worker_->context(), it->second);
  if (st != UCS_OK) SIESTA_LOG_WARN("ucx: ucp_mem_unmap of region {}: {}", id.value, ucs_status_string(st));
  memh_.erase(it);
}

ucp_mem_h UcxBackend::local_memh(RegionId id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = memh_.find(id);
  return it == memh_.end() ? nullptr : it->second;
}

Result<std::shared_ptr<BackendPeer>> UcxBackend::connect(const EngineMeta& meta, Deadline deadline) {
  WireReader r(meta.backend_blob);
  std::string address = r.bytes(kMaxBlobBytes);
  RemoteTable table;
  table.address = r.u64();
  table.bytes = r.u64();
  table.rkey = r.bytes(kMaxBlobBytes);
  ProcessIdentity identity = ProcessIdentity::decode(r);
  if (!r.done() || address.empty() || table.bytes < region_table_bytes(1))
    return corrupt(fmt::format("the ucx backend blob of peer {} is malformed", meta.engine_id));
  for (const RegionDesc& d : meta.regions)
    if (d.backend_blob.empty())
      return corrupt(fmt::format("region {} of peer {} carries no rkey", d.id.value, meta.engine_id));
  // A peer process in our pid namespace is watched, so its exit fails its
  // transfers even where UCX's own peer error handling is off.
  int watch = identity_.same_pid_namespace(identity) ? open_process_watch(identity.pid) : -1;
  auto peer = std::make_shared<UcxPeer>(*this, meta, std::move(address), std::move(table), watch);
  auto opened = std::make_shared<Waiter<Ok>>();
  worker_->post([peer, opened] { peer->open([opened](Ok r) { opened->set(std::move(r)); }); });
  std::optional<Ok> result = opened->wait_until(deadline);
  if (!result || !*result) {
    Status why = result ? result->error()
                        : timeout(fmt::format("UCX did not connect to peer {} before the deadline", meta.engine_id));
    (void)peer->release(deadline_after(std::chrono::milliseconds(500)));
    return why;
  }
  return std::shared_ptr<BackendPeer>(peer);
}

void UcxBackend::ready(UcxXfer* xfer) {
  if (xfer->queued) return;
  xfer->queued = true;
  ready_.push_back(xfer);
}

bool UcxBackend::tick() {
  Clock::time_point now = Clock::now();
  if (now - last_watch_ >= kWatchInterval) {
    last_watch_ = now;
    std::set<UcxPeer*> busy;
    for (UcxXfer* x : active_) busy.insert(x->peer.get());
    for (UcxPeer* peer : busy)
      if (peer->process_exited()) peer->break_connection(
          unavailable(fmt::format("peer {} exited during the transfer", peer->meta().engine_id)), true);
  }
  while (!ready_.empty()) {
    std::vector<UcxXfer*> batch;
    batch.swap(ready_);
    for (UcxXfer* x : batch) {
      UcxPeer* peer = x->peer.get();
      peer->advance(x);
    }
  }
  // Deadlines: a transfer still in flight at its deadline breaks its peer's
  // connection, which cancels its requests (and fails the others to that peer).
  std::vector<std::shared_ptr<UcxPeer>> late;
  for (UcxXfer* x : active_)
    if (!x->failure && now >= x->plan.deadline) late.push_back(x->peer);
  for (auto& peer : late)
    peer->break_connection(timeout(fmt::format("a transfer with peer {} passed its deadline", peer->meta().engine_id)),
                           false);
  return !active_.empty();
}

}  // namespace siesta::transfer::ucx
