// KvConnector: what the engine asks of a P/D connector (src/pd implements it;
// the engine never includes pd). Every call comes from the engine loop thread,
// between steps; an implementation does its transfers elsewhere and reports
// their ends through poll().
//
// Per request, in order:
//   on_request_added(r)           before the request enters the scheduler:
//                                 hold its blocks for a remote reader when it
//                                 finishes (producer), and/or load its
//                                 prompt's KV from a peer (consumer)
//   start_load(id, target)        consumer: blocks allocated (Scheduler::await_remote_kv)
//   poll()                        each loop iteration: loads that ended
//                                 (Scheduler::finish_remote_kv) and holds
//                                 whose readers are done (Scheduler::release_hold)
//   on_request_finished(r, out)   out.held_blocks: the blocks kept for a
//                                 reader; returns the response's
//                                 kv_transfer_params (null for none)
//   on_request_aborted(id)        aborted in any state; a load in flight
//                                 leaves its blocks under load_hold_owner(id)
//                                 until poll() releases them
// Before the KV cache memory is released (sleep, release_kv_cache_memory):
//   release_transfer_kv(deadline) ends loads and sends (loads recompute)
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "engine/engine_request.h"
#include "engine/engine_stream.h"
#include "engine/request_output.h"
#include "engine/scheduler.h"

namespace siesta {

struct ConnectorPlan {
  bool hold_blocks_for_remote_reader = false;  // producer
  bool load_remote_kv = false;                 // consumer
};

struct ConnectorUpdates {
  std::vector<std::pair<RequestId, bool>> finished_loads;  // (request, KV loaded)
  std::vector<std::string> releasable_holds;               // send_hold_owner / load_hold_owner names
};

class KvConnector {
 public:
  virtual ~KvConnector() = default;
  virtual ConnectorPlan on_request_added(const EngineRequest& request) = 0;
  virtual void start_load(const RequestId& id, const RemoteKvTarget& target) = 0;
  virtual ConnectorUpdates poll() = 0;
  virtual nlohmann::json on_request_finished(const EngineRequest& request, const RequestOutput& output) = 0;
  virtual void on_request_aborted(const RequestId& id) = 0;
  virtual Result<void> release_transfer_kv(Deadline deadline) = 0;
};

}  // namespace siesta
