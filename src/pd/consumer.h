// Consumer: the decode (D) half of SiestaConnector. It keeps one Load per
// request that came with kv_transfer_params.do_remote_prefill, moves it
// through load_state.h's table, and tells the engine when loads end and when
// blocks that a peer might still have written may be reused.
//
//   on_added(r)          engine loop: parse the params, a Load in PENDING
//                        (none when the KV cache is not registered: the
//                        request computes its prompt and the producer is
//                        told to let go)
//   start_load(id, t)    engine loop: the request's blocks; the first
//                        num_cached_tokens / block_size come from the prefix
//                        cache and are not transferred; a task starts the load
//   on_skipped(id)       engine loop: no blocks; the request computes here
//   on_aborted(id)       engine loop: the request ended; the producer is told
//                        to let go; its blocks (load_hold_owner) are given
//                        back once nothing can touch them
//   on_dropped(r)        engine loop: aborted before admission; the producer
//                        is told to let go
//   collect(updates)     engine loop: loads that ended (FinishedLoad), holds
//                        now safe to give back
//   on_load_failed(m)    side-channel thread: the producer will not write
//   on_written(w)        notification thread: the producer's write landed
//   tick(now)            ticker: deadlines, reads in flight
//   end_all()            release_transfer_kv: every load that has not ended
//                        fails (its request recomputes; the producer is
//                        told); the connector then ticks until
//                        reads_in_flight() is 0
//   peers_invalidated(a) release_transfer_kv, after INVALIDATE: the peers
//                        that acknowledged cannot write into our memory any more
//
// A load that fails or comes late never fails the request: it recomputes
// its prompt here (0 computed tokens). Its blocks are reused only when
// nothing can touch them (load_state.h: ENDING until Quiet).
//
// Whenever a load ends on our side (deadline, release, abort, an error) the
// producer is told at once (cancel), so that it frees the blocks it holds
// for us instead of keeping them until its hold deadline.
//
// Everything it does on the network goes through ctx.port (KvPort), its
// blocking work through ctx.tasks, and every deadline is on ctx.now(), so a
// test drives it with a fake (tests/unit/pd_core_test.cpp).
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
  // Fails every load that has not ended (the request recomputes); returns how many.
  int32_t end_all(const std::string& why);
  // Loads whose read of ours may still touch our blocks.
  size_t reads_in_flight() const;
  // The peers in `acked` (every peer when null) dropped our memory: no write
  // of theirs can land any more.
  void peers_invalidated(const std::vector<std::string>* acked);

  size_t num_loads() const;
  // The load of request `id`, while it is known (tests, logs).
  std::optional<LoadState> state_of(const RequestId& id) const;

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

  // The request's side of a load: what the scheduler knows and holds.
  enum class Waiter : uint8_t {
    kWaiting,  // it waits for the load (WaitingForRemoteKv) and was not told how it ended
    kTold,     // told (FinishedLoad) that the load ended; nothing held for the load
    kHolds,    // the scheduler holds load_hold_owner(id) until the load is final (Quiet)
    kGone,     // the request ended; nothing held
  };

  struct Load {
    RequestId id;
    Source source;
    LoadState state = LoadState::kPending;
    Waiter waiter = Waiter::kWaiting;
    std::string failure;
    PromptCheck prompt;
    std::vector<BlockId> blocks;
    int32_t first_block = 0;
    Clock::time_point started;
    Deadline deadline;               // the load fails then
    Deadline quiet_at;               // WRITE: no write of the producer's can start or run after it
    std::string producer_address;    // WRITE: resolved from the URL
    std::optional<transfer::XferId> read;  // READ: once submitted
    Clock::time_point read_started;
    uint64_t bytes = 0;
    LogitsRow logits;                // the producer's, of the prompt's last position
    int32_t logits_top = 0;          // how many of their best entries decide the first token (0: all)
  };

  static Result<Source> parse_source(const nlohmann::json& params, TransferMode preferred);
  // The one place a load changes state; logs, and wakes the engine when the
  // load ends or becomes final.
  void transition(Load& l, LoadEvent event, const std::string& detail = {});
  // Our side gives up (Failed): counts it and tells the producer (cancel).
  void fail(Load& l, const std::string& why);
  // An ENDING load whose blocks nothing can touch any more becomes FAILED.
  void settle(Load& l, Clock::time_point now);
  // Tells the producer, on a task, that the consumer needs nothing more from
  // it: read_done when the KV was in place without a read (READ mode, the
  // prefix cache held it all), cancel otherwise. A cancel answered
  // "writing: false" makes an ENDING load of `id` quiet.
  void post_release(const RequestId& id, const Source& source, std::string producer_address, bool consumed = false);
  void run_write_start(const RequestId& id);
  void run_read_start(const RequestId& id);
  void run_read_confirm(const RequestId& id);

  PdContext& ctx_;
  mutable std::mutex mu_;
  std::unordered_map<RequestId, Load> loads_;
};

}  // namespace siesta::pd
