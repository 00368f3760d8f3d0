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
// (one GET before and one after), WRITEs flushed before they count as done;
// small transfers to host regions over transports whose puts and gets UCX
// serves in software on the target (tcp) take the guarded path instead:
// active messages that the peer's progress thread checks and copies
// (guarded_messages.h, guarded_target.h), one round trip.
//
// GPU memory: registered directly when UCX reports CUDA support. Otherwise
// a CUDA region is staged: it gets no rkey (its blob says so), and bytes move
// through bounded pools of pinned host chunks, copied with cudaMemcpyAsync and
// pipelined with the wire: pieces of our staged regions go through our
// initiator pool (ucx_peer.h), pieces of a peer's staged region are served by
// the peer's progress thread over active messages through its target pool
// (staged_target.h). TransferConfig::ucx_staging "always" stages host
// regions too (how CI tests the path); "never" refuses CUDA regions that UCX
// cannot register.
//
// supports_sleep(): yes: ucp_mem_unmap at deregistration, ucp_mem_map again
// at registration; peers unpack the new rkeys after their next handshake.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "transfer/process_identity.h"
#include "transfer/transfer_backend.h"
#include "transfer/transfer_config.h"
#include "transfer/ucx/ucx_worker.h"

namespace siesta::transfer {
class RegionTable;
struct TransferConfig;
}  // namespace siesta::transfer

namespace siesta::transfer::ucx {

class GuardedTarget;
class StagedTarget;
class StagingPool;
class UcxPeer;
struct GuardedMessage;
struct StagedPiece;
struct UcxXfer;

// What a region's RegionDesc::backend_blob says: its packed rkey, or that it
// is staged (peers reach it through its owner's progress thread) and the
// owner's staging chunk size (the largest piece the owner takes at once).
struct RegionBlob {
  bool staged = false;
  std::string rkey;
  uint64_t chunk_bytes = 0;
};
std::string encode_region_blob(const RegionBlob& blob);
Result<RegionBlob> decode_region_blob(std::string_view blob);

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
  // Whether our transfers may take the guarded path (TransferConfig::ucx_guarded).
  bool sends_guarded() const { return sends_guarded_; }
  // The memory handle of a local region, or null (UCX then finds it itself).
  ucp_mem_h local_memh(RegionId id);
  // A local region that is staged: its CUDA device (-1 for host memory); nothing when it is not staged.
  std::optional<int> local_staging(RegionId id);
  // Whether a region of `kind` is staged here.
  bool stages(MemoryKind kind) const;

  // --- progress thread: staging ---
  // The pool of chunks for our own staged regions; null until one was registered.
  StagingPool* initiator_pool() { return initiator_pool_.get(); }
  // A fresh name for us as an initiator of staged requests to one peer (kStagedHello).
  uint64_t new_initiator_key();
  // Names a piece that awaits the peer's reply; forget() when it no longer does.
  uint64_t await_reply(StagedPiece* piece);
  void forget(uint64_t token);
  // The same for a guarded message (guarded_messages.h).
  uint64_t await_reply(GuardedMessage* message);
  void forget_guarded(uint64_t token);

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
  explicit UcxBackend(RegionTable& table);
  bool tick();
  Ok install_handlers();
  StagedPiece* awaiting(uint64_t token);
  static ucs_status_t on_write_ack(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                   const ucp_am_recv_param_t* param);
  static ucs_status_t on_read_data(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                   const ucp_am_recv_param_t* param);
  static ucs_status_t on_guarded_reply(void* arg, const void* header, size_t header_length, void* data,
                                       size_t length, const ucp_am_recv_param_t* param);

  RegionTable& table_;
  std::unique_ptr<UcxWorker> worker_;
  ucp_mem_h table_memh_ = nullptr;
  std::string engine_blob_;

  UcxStaging staging_ = UcxStaging::kAuto;
  bool sends_guarded_ = true;
  size_t chunk_bytes_ = 0;
  size_t chunk_count_ = 0;

  std::mutex mu_;
  std::map<RegionId, ucp_mem_h> memh_;
  std::map<RegionId, int> staged_;  // staged local regions: their CUDA device, -1 for host memory
  bool pools_made_ = false;         // the pools were made (and handed to the progress thread)

  std::unique_ptr<StagedTarget> target_;
  std::unique_ptr<GuardedTarget> guarded_;
  std::unique_ptr<StagingPool> initiator_pool_;  // progress thread (once handed over)
  std::unordered_map<uint64_t, StagedPiece*> awaiting_;  // progress thread
  std::unordered_map<uint64_t, GuardedMessage*> awaiting_guarded_;  // progress thread
  uint64_t next_token_ = 1;                               // progress thread
  std::mt19937_64 keys_;                                  // progress thread

  ProcessIdentity identity_;
  std::set<UcxXfer*> active_;  // progress thread only
  Clock::time_point last_watch_{};  // progress thread only
  std::vector<UcxXfer*> ready_;  // progress thread only
  std::set<UcxXfer*> orphans_;   // progress thread only (destructor after stop)
};

}  // namespace siesta::transfer::ucx
