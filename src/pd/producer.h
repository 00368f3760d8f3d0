// Producer: the prefill (P) half of SiestaConnector. It keeps one Send per
// request that came with kv_transfer_params.do_remote_decode, moves it
// through send_state.h's table, and tells the engine when a send's blocks
// may go back to the pool.
//
//   on_added(r)          engine loop: a send in WAITING (the blocks will be held)
//   on_finished(r, out)  engine loop: READY with out.held_blocks, until
//                        hold_timeout; answers vLLM's kv_transfer_params
//                        (with no blocks when none are held: the prefill
//                        itself succeeded, and the reader computes the prompt)
//   on_aborted(id)       engine loop: a WAITING send ends (aborted)
//   collect(updates)     engine loop: the holds of DONE sends (their blocks
//                        go back to the pool); the sends are forgotten
//   on_write / on_cancel / on_read_start / on_read_done
//                        side-channel threads: the consumer's messages,
//                        answered at once (a refusal names why)
//   tick(now)            ticker thread: hold deadlines, writes in flight
//   end_all()            release_transfer_kv: every READY send ends
//                        (released; a consumer that asked for a write is
//                        told); the connector then ticks until
//                        writes_in_flight() is 0 (no write of ours reads our
//                        blocks). WAITING sends stay: their requests
//                        recompute and hold new blocks.
//
// WRITE mode: the consumer's `write` names (x_request_id, choice), may come
// before the request does (it is parked until then), and the write starts
// once the send is READY (a task: handshake, then submit with a
// notification). READ mode: `read_start` and `read_done` name the request id
// that kv_transfer_params gave; read_done answers whether the send was still
// READY, i.e. whether the hold lasted the whole read.
//
// Everything it does on the network goes through ctx.port (KvPort), its
// blocking work through ctx.tasks, and every deadline is on ctx.now(), so a
// test drives it with a fake (tests/unit/pd_core_test.cpp).
//
// Thread safety: every method may be called from any thread (one mutex).
#pragma once

#include <nlohmann/json.hpp>

#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/engine_connector.h"
#include "pd/pd_context.h"
#include "pd/send_state.h"

namespace siesta::pd {

class Producer {
 public:
  explicit Producer(PdContext& ctx) : ctx_(ctx) {}

  ConnectorPlan on_added(const EngineRequest& request);
  nlohmann::json on_finished(const EngineRequest& request, const RequestOutput& output);
  void on_aborted(const RequestId& id);
  void collect(ConnectorUpdates& updates);

  std::string on_write(const WriteRequest& m);
  std::string on_cancel(const CancelRequest& m);
  std::string on_read_start(const ReadStart& m);
  std::string on_read_done(const ReadDone& m);

  // Returns whether a write is in flight (poll again soon).
  // wait_on: set to a transfer still in flight, if any (the ticker waits
  // for it to end rather than sleeping).
  bool tick(Clock::time_point now, std::optional<transfer::XferId>* wait_on = nullptr);
  // Ends every READY send (released); returns how many.
  int32_t end_all();
  // Sends WRITING or DRAINING: a write of ours may still read our blocks.
  size_t writes_in_flight() const;

  // The send of request `id`, while it is known (tests, logs).
  std::optional<SendState> state_of(const RequestId& id) const;

 private:
  struct Target {
    WriteRequest request;
    Deadline deadline;  // no write starts after it
  };

  struct Send {
    RequestId id;
    std::string key;  // x_request_id + choice (empty without an X-Request-Id)
    SendState state = SendState::kWaiting;
    SendEvent end = SendEvent::kPrefilled;  // why it ended (DRAINING, DONE)
    std::string end_detail;
    int32_t num_tokens = 0;
    uint64_t prompt_hash = 0;
    // The scheduler holds send_hold_owner(id) (the request finished with its
    // blocks held): given back when the send is DONE.
    bool hold = false;
    std::vector<BlockId> blocks;   // the prompt's blocks, while the hold lasts
    LogitsRow logits;              // of the prompt's last position, for the consumer's first token
    Deadline hold_deadline;
    std::optional<Target> target;
    std::optional<transfer::XferId> write;  // WRITING / DRAINING, once submitted
    Clock::time_point write_started;
    uint64_t write_bytes = 0;
  };

  static std::string key_of(const std::string& x_request_id, int32_t choice);
  // vLLM's answer to do_remote_decode, naming `blocks` (none: compute the prompt).
  nlohmann::json params(const RequestId& id, const std::vector<BlockId>& blocks) const;
  // The one place a send changes state; logs, counts, records why it ended,
  // and tells a waiting consumer when the send ends without its write.
  void transition(Send& s, SendEvent event, const std::string& detail = {});
  // A DRAINING send whose write no longer touches our blocks becomes DONE.
  void settle(Send& s);
  void start_write(Send& s);
  void run_write(const RequestId& id);
  void fail_write(const RequestId& id, const std::string& why);
  // Tells the consumer of `target` that no write will come (best effort).
  void post_load_failed(const Target& target, const std::string& why);
  std::string check_prompt(const Send& s, const PromptCheck& p, const LocalKv& kv) const;
  Target target_of(const WriteRequest& m) const;

  PdContext& ctx_;
  mutable std::mutex mu_;
  std::unordered_map<RequestId, Send> sends_;
  std::unordered_map<std::string, RequestId> by_key_;
  std::unordered_map<std::string, Target> parked_;  // write requests that came before their request
  EndedRequests ended_ids_;
  EndedRequests ended_keys_;
  // Keys the consumer cancelled before their request came: it holds nothing.
  EndedRequests cancelled_early_;
  std::vector<HoldKey> orphan_holds_;  // holds the scheduler made for requests we do not track
};

}  // namespace siesta::pd
