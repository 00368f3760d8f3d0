// UcxPeer: what the ucx backend holds for one remote engine: an endpoint to
// its worker (peer error handling on), the rkeys of its regions and of its
// region table. Everything but post()/release() runs on the progress thread.
//
// A transfer (UcxXfer) goes through stages on the progress thread:
//   kPreCheck  GET the peer's region table; every remote region must be live
//              at our descriptor's epoch, else nothing is sent
//   kData      ucp_put_nbx / ucp_get_nbx for every segment
//   kFlush     (WRITE) ucp_ep_flush_nbx: the bytes are at the target
//   kPostCheck GET the table again: a deregistration during the transfer
//              fails it (a READ's bytes are then not trusted)
// An endpoint error (the peer died), the peer's process exiting or a missed
// deadline breaks the peer: every transfer in flight fails.
//
// The checks cannot close one window: a peer that deregisters (and frees) a
// region between our pre-check and our puts, without INVALIDATE first, may
// still receive the bytes on transports without hardware keys (tcp writes to
// the address). The post-check then fails the transfer. The protocol
// (invalidate_peers before deregister_region) is what makes this safe.
#pragma once

#include <ucp/api/ucp.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "transfer/engine_meta.h"
#include "transfer/transfer_backend.h"

namespace siesta::transfer::ucx {

class UcxBackend;
class UcxPeer;
struct EndpointContext;

// Where the peer's region table lives (from its EngineMeta::backend_blob).
struct RemoteTable {
  uint64_t address = 0;
  uint64_t bytes = 0;
  std::string rkey;  // packed
};

struct UcxXfer {
  enum class Stage { kPreCheck, kData, kFlush, kPostCheck };
  UcxBackend* backend = nullptr;
  std::shared_ptr<UcxPeer> peer;
  XferPlan plan;
  XferDone done;
  Stage stage = Stage::kPreCheck;
  size_t outstanding = 0;      // UCX requests not yet completed
  bool queued = false;         // in the backend's ready list
  bool orphaned = false;       // failed and handed back; only its requests keep it
  std::set<void*> requests;
  std::optional<Status> failure;
  std::vector<uint64_t> table;  // the fetched region table words
};

class UcxPeer final : public BackendPeer, public std::enable_shared_from_this<UcxPeer> {
 public:
  // process_watch: a pidfd of the peer's process (or -1), owned from here on.
  UcxPeer(UcxBackend& backend, EngineMeta meta, std::string worker_address, RemoteTable table, int process_watch);
  ~UcxPeer() override;

  void post(XferPlan plan, XferDone done) override;
  Ok release(Deadline deadline) override;

  // --- progress thread ---
  // Creates the endpoint, unpacks the rkeys and flushes (which completes the
  // connection); `done` gets the outcome.
  void open(std::function<void(Ok)> done);
  // Moves a transfer to its next stage once its requests completed.
  void advance(UcxXfer* x);
  // Schedules advance() for the next tick (from UCX callbacks).
  void advance_later(UcxXfer* x);
  // The endpoint failed, the peer exited or a deadline passed: fail every
  // transfer in flight. With peer error handling on, or when the peer is gone
  // (`peer_gone`), the endpoint is force-closed, which cancels their requests;
  // otherwise (a live peer without error handling, where a forced close is
  // undefined behaviour for it) the requests are left to finish.
  void break_connection(const Status& why, bool peer_gone);
  bool process_exited() const;
  // At shutdown (worker stopped): fails `x` now; its requests, if any, are
  // left to UCX as an orphan that the backend frees after the worker.
  void abandon(UcxXfer* x, const Status& why);
  const EngineMeta& meta() const { return meta_; }

 private:
  void start(UcxXfer* x);
  void issue(UcxXfer* x, ucs_status_ptr_t sp);
  void fetch_table(UcxXfer* x);
  void send_data(UcxXfer* x);
  void complete(UcxXfer* x, Ok result);
  void orphan(UcxXfer* x);
  void close_endpoint(bool force, std::function<void()> closed);

  UcxBackend& backend_;
  const EngineMeta meta_;
  const std::string worker_address_;
  const RemoteTable table_;
  const int process_watch_;

  // progress thread
  ucp_ep_h ep_ = nullptr;
  EndpointContext* ep_context_ = nullptr;
  std::vector<ucp_rkey_h> rkeys_;  // parallel to meta_.regions
  ucp_rkey_h table_rkey_ = nullptr;
  std::optional<Status> broken_;
  std::set<UcxXfer*> xfers_;

  // any thread
  std::mutex mu_;
  std::condition_variable idle_cv_;
  size_t in_flight_ = 0;
  bool released_ = false;
};

}  // namespace siesta::transfer::ucx
