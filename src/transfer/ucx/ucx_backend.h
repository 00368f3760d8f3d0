// UcxBackend: moves bytes between engines through UCX's UCP API, on whatever
// transports the installed UCX offers (tcp and shared memory here; RDMA verbs
// on a cluster; `ucx_info -d` lists them). TransferConfig::ucx_transports and
// ucx_net_devices select them (UCX_TLS, UCX_NET_DEVICES).
//
// Exporter side: every region is registered with ucp_mem_map and its packed
// rkey goes into RegionDesc::backend_blob; the region table is registered too
// and described (address, size, rkey) in EngineMeta::backend_blob with the
// worker's address.
//
// Importer side: connect() makes a UcxPeer (ucx_peer.h): an endpoint to the
// peer's worker with peer error handling, and the unpacked rkeys. Transfers
// are ucp_put_nbx / ucp_get_nbx, checked against the peer's region table
// (one GET before and one after), WRITEs flushed before they count as done.
//
// GPU memory: registered directly when UCX reports CUDA support; this build
// has no pinned staging path, so without it CUDA regions are refused with a
// message that says what to use instead.
//
// supports_sleep(): yes: ucp_mem_unmap at deregistration, ucp_mem_map again
// at registration; peers unpack the new rkeys after their next handshake.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "transfer/process_identity.h"
#include "transfer/transfer_backend.h"
#include "transfer/ucx/ucx_worker.h"

namespace siesta::transfer {
class RegionTable;
struct TransferConfig;
}  // namespace siesta::transfer

namespace siesta::transfer::ucx {

class UcxPeer;
struct UcxXfer;

class UcxBackend final : public TransferBackend {
 public:
  static Result<std::unique_ptr<UcxBackend>> create(const TransferConfig& config, RegionTable& table);
  ~UcxBackend() override;

  std::string_view name() const override { return "ucx"; }
  bool supports_sleep() const override { return true; }
  std::string engine_blob() const override { return engine_blob_; }
  Result<std::string> register_region(const LocalRegion& region) override;
  void deregister_region(RegionId id) override;
  Result<std::shared_ptr<BackendPeer>> connect(const EngineMeta& meta, Deadline deadline) override;

  UcxWorker& worker() { return *worker_; }
  // The memory handle of a local region, or null (UCX then finds it itself).
  ucp_mem_h local_memh(RegionId id);

  // Progress-thread bookkeeping of transfers in flight: track/untrack on
  // start/completion; ready() when a transfer's requests all completed (it
  // advances on the next tick, outside UCX callbacks).
  void track(UcxXfer* xfer) { active_.insert(xfer); }
  void untrack(UcxXfer* xfer) { active_.erase(xfer); }
  void ready(UcxXfer* xfer);
  // Failed transfers whose UCX requests never completed (UcxPeer::orphan):
  // freed when their last request completes, or after the worker is gone.
  void adopt_orphan(UcxXfer* xfer) { orphans_.insert(xfer); }
  void drop_orphan(UcxXfer* xfer);

 private:
  explicit UcxBackend(RegionTable& table) : table_(table) {}
  bool tick();

  RegionTable& table_;
  std::unique_ptr<UcxWorker> worker_;
  ucp_mem_h table_memh_ = nullptr;
  std::string engine_blob_;

  std::mutex mu_;
  std::map<RegionId, ucp_mem_h> memh_;

  ProcessIdentity identity_;
  std::set<UcxXfer*> active_;  // progress thread only
  Clock::time_point last_watch_{};  // progress thread only
  std::vector<UcxXfer*> ready_;  // progress thread only
  std::set<UcxXfer*> orphans_;   // progress thread only (destructor after stop)
};

}  // namespace siesta::transfer::ucx
