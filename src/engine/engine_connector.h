// KvConnector: what the engine asks of a P/D connector (src/pd implements it;
// the engine never includes pd). Every call comes from the engine loop thread,
// between steps, except the first on_kv_cache_mapped (Engine::create's
// thread, before the loop starts) and metrics() (any thread); an
// implementation does its transfers elsewhere and reports their ends through
// poll().
//
// The KV cache:
//   on_kv_cache_mapped(region)    at Engine::create and after every wake that
//                                 maps the KV cache again: register it with
//                                 the transfer engine (a new epoch)
//   release_transfer_kv(scope, deadline)
//                                 before the KV cache's blocks are reset
//                                 (kReset: a pause that clears the cache,
//                                 reset_prefix_cache) or its memory released
//                                 (kMemory: sleep level >= 1,
//                                 release_kv_cache_memory): loads end (their
//                                 requests recompute), sends end (readers are
//                                 told), our transfers in flight finish; for
//                                 kMemory every peer that imported our memory
//                                 drops it (INVALIDATE, ACK) and the KV cache
//                                 is deregistered. The blocks those transfers
//                                 held come back through poll(). A failure
//                                 leaves the registration as it was.
//
// Per request, in order:
//   on_request_added(r)           before the request enters the scheduler:
//                                 hold its blocks for a remote reader when it
//                                 finishes (producer), and/or load its
//                                 prompt's KV from a peer (consumer)
//   start_load(id, target)        consumer: blocks allocated (Scheduler::await_remote_kv)
//   on_load_skipped(id)           consumer: no blocks for the load; the
//                                 request computes its prompt here
//   poll()                        each loop iteration: loads that ended
//                                 (Scheduler::finish_remote_kv) and holds
//                                 whose readers are done (Scheduler::release_hold)
//   on_request_finished(r, out)   out.held_blocks: the blocks kept for a
//                                 reader; returns the response's
//                                 kv_transfer_params (null for none)
//   on_request_aborted(id)        aborted in any state; a load in flight
//                                 leaves its blocks under load_hold_owner(id)
//                                 until poll() releases them
//   on_request_dropped(r)         aborted before it was admitted (held while
//                                 paused or asleep): on_request_added never ran
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/engine_kv_cache.h"
#include "engine/engine_metrics.h"
#include "engine/engine_request.h"
#include "engine/engine_status.h"
#include "engine/engine_stream.h"
#include "engine/hold_key.h"
#include "engine/remote_kv.h"
#include "engine/request_output.h"

namespace siesta {

struct ConnectorPlan {
  bool hold_blocks_for_remote_reader = false;  // producer
  bool load_remote_kv = false;                 // consumer
};

// A load that ended (Scheduler::finish_remote_kv).
struct FinishedLoad {
  RequestId id;
  bool loaded = false;  // the prompt's KV is in the request's blocks
  // Not loaded, and a peer may still write into the blocks (it did not
  // answer whether it stopped): the scheduler keeps them under
  // load_hold_owner(id) until a later poll() lists that hold as releasable,
  // and the request recomputes in new blocks.
  bool blocks_may_change = false;
  // Loaded, with the producer's logits of the prompt's last position: the
  // engine samples the first token from them and computes nothing of the
  // prompt (null: it computes the last prompt token for its logits).
  LogitsRow first_logits;
};

struct ConnectorUpdates {
  std::vector<FinishedLoad> finished_loads;
  std::vector<HoldKey> releasable_holds;  // send_hold_owner / load_hold_owner
};

// What release_transfer_kv prepares for.
enum class KvReleaseScope : uint8_t {
  kReset,   // the blocks are reset, the memory stays: the KV cache stays registered
  kMemory,  // the memory goes: peers drop it, the KV cache is deregistered
};

class KvConnector {
 public:
  virtual ~KvConnector() = default;
  virtual Result<void> on_kv_cache_mapped(const KvCacheRegion& /*region*/) { return {}; }
  virtual ConnectorPlan on_request_added(const EngineRequest& request) = 0;
  virtual void start_load(const RequestId& id, const RemoteKvTarget& target) = 0;
  virtual void on_load_skipped(const RequestId& /*id*/) {}
  virtual ConnectorUpdates poll() = 0;
  virtual nlohmann::json on_request_finished(const EngineRequest& request, const RequestOutput& output) = 0;
  virtual void on_request_aborted(const RequestId& id) = 0;
  virtual void on_request_dropped(const EngineRequest& /*request*/) {}
  virtual Result<KvReleaseReport> release_transfer_kv(KvReleaseScope scope, Deadline deadline) = 0;
  // The engine gives, before its loop starts, what the connector calls (from
  // any thread, without holding its own locks) when poll() has news: a load
  // ended. The engine loop then wakes at once instead of at its next tick.
  virtual void set_progress_callback(std::function<void()> /*progress*/) {}
  // Thread-safe: the HTTP thread renders them.
  virtual KvTransferMetrics metrics() const { return KvTransferMetrics(); }
};

}  // namespace siesta
