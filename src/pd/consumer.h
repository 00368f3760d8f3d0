// Consumer: the decode (D) half of SiestaConnector. It keeps one Load per
// request that came with kv_transfer_params.do_remote_prefill, moves it
// through load_state.h's table, and tells the engine when loads end and when
// blocks that a peer might still have written may be reused.
//
//   on_added(r)          engine loop: parse the params, a Load in PENDING
//   start_load(id, t)    engine loop: the request's blocks; the first
//                        num_cached_tokens / block_size come from the prefix
//                        cache and are not transferred; a task starts the load
//   on_skipped(id)       engine loop: no blocks; the request computes here
//   on_aborted(id)       engine loop: the request ended; the producer is told
//                        to let go; its blocks (load_hold_owner) are given back
//                        once no transfer can touch them
//   on_dropped(r)        engine loop: aborted before admission; the producer
//                        is told to let go
//   collect(updates)     engine loop: loads that ended, holds now safe to give back
//   on_load_failed(m)    side-channel thread: the producer will not write
//   on_written(w)        notification thread: the producer's write landed
//   tick(now)            ticker: deadlines, reads in flight
//   end_all(deadline)    release_transfer_kv: every load fails (its request
//                        recomputes after wake); waits for our reads
//   peers_invalidated()  release_transfer_kv, after INVALIDATE: no peer can
//                        write into our memory any more
//
// A failed or late load never fails the request: it recomputes its prompt
// here (0 computed tokens). "Quiet" blocks: a load's blocks are reused only
// when no read of ours is in flight and no producer can still write them
// (it refused, answered a cancel with writing: false, notified, said
// load_failed, or the write request's deadline plus write_grace passed).
//
// Thread safety: every method may be called from any thread (one mutex).
#pragma once

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/engine_connector.h"
#include "pd/load_state.h"
#include "pd/pd_context.h"
#include "pd/prefill_locator.h"

namespace siesta::pd {

class Consumer {
 public:
  explicit Consumer(PdContext& ctx) : ctx_(ctx) {}

  ConnectorPlan on_added(const EngineRequest& request);
  void start_load(const RequestId& id, const RemoteKvTarget& target);
  void on_skipped(const RequestId& id);
  void on_aborted(const RequestId& id);
  void on_dropped(const EngineRequest& request);
  void collect(ConnectorUpdates& updates);

  std::string on_load_failed(const LoadFailed& m);
  void on_written(const Written& w, const std::string& from_engine);

  // Returns whether something is in flight (poll again soon).
  // wait_on: set to a transfer still in flight, if any (the ticker waits
  // for it to end rather than sleeping).
  bool tick(Clock::time_point now, std::optional<transfer::XferId>* wait_on = nullptr);
  Result<void> end_all(Deadline deadline);
  void peers_invalidated();

  size_t num_loads() const;

 private:
  // Where the KV comes from, from kv_transfer_params.
  struct Source {
    TransferMode mode = TransferMode::kWrite;
    // WRITE: the producer's HTTP URL and how it names the request.
    std::string prefill_url;
    std::string x_request_id;
    int32_t choice = 0;
    // READ: the producer's side channel, its request and blocks.
    std::string producer_engine;
    std::string producer_address;
    std::string producer_request;
    std::vector<BlockId> producer_blocks;
  };

  struct Load {
    RequestId id;
    Source source;
    LoadState state = LoadState::kPending;
    std::string failure;
    PromptCheck prompt;
    std::vector<BlockId> blocks;
    int32_t first_block = 0;
    Clock::time_point started;
    Deadline deadline;
    std::string producer_address;   // WRITE: resolved from the URL
    // Whether the producer may still write into our blocks (WRITE mode).
    bool producer_may_write = false;
    Deadline quiet_at;               // ... and when we stop assuming it may
    bool read_starting = false;      // a task is between its snapshot and submit
    std::optional<transfer::XferId> read;
    bool read_final = false;
    Clock::time_point read_started;
    uint64_t bytes = 0;
    LogitsRow logits;                // the producer's, of the prompt's last position
    int32_t logits_top = 0;          // how many of their best entries decide the first token (0: all)
    bool aborted = false;            // the request ended while its blocks were held for the load
    bool reported = false;           // the engine has its FinishedLoad
    bool hold_pending = false;       // a load hold the scheduler made, not yet given back
    bool producer_told = false;      // cancel / read_done sent (or being sent)
  };

  static Result<Source> parse_source(const nlohmann::json& params, TransferMode preferred);
  // The one place a load changes state; logs and counts.
  void transition(Load& l, LoadEvent event, const std::string& detail = {});
  void fail(Load& l, const std::string& why);
  bool quiet(const Load& l, Clock::time_point now) const;
  // Tells the producer, on a task, that the consumer needs nothing more from
  // it: read_done when the KV was in place without a read (READ mode, the
  // prefix cache held it all), cancel otherwise. A cancel's answer updates
  // producer_may_write if the load is still known.
  void post_release(const RequestId& id, const Source& source, bool consumed = false);
  void run_write_start(const RequestId& id);
  void run_read_start(const RequestId& id);
  void run_read_confirm(const RequestId& id);

  PdContext& ctx_;
  PrefillLocator locator_{ctx_.config.http_api_key};
  mutable std::mutex mu_;
  std::unordered_map<RequestId, Load> loads_;
};

}  // namespace siesta::pd
