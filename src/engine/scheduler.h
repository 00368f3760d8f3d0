// Scheduler: continuous batching over a paged KV cache.
//
// Lifecycle (all calls from the engine loop thread; not thread-safe)
//   BlockPool pool(num_blocks);
//   auto sched = Scheduler::create(options, pool);      // pool outlives it
//   sched->add_request(NewRequest{...});                // validated; queued as Waiting
//   loop:
//     SchedulerOutput out = sched->schedule();          // who computes what this step
//     model.forward(out.chunks, kv, logits);            // see run_step (engine_step.h)
//     sample one token per sequence with `sample` set
//     auto outputs = sched->update(out, sampled);       // tokens appended, finished requests freed
//   sched->abort(id) / stop(id)                         // between steps, in any state
//
// Policy (vLLM v1's): running requests first, in arrival order, each taking
// the tokens it still needs (a decode token, or the next chunk of a prompt)
// from the step's token budget (max_num_batched_tokens). When a running
// request needs a block and none is free, the newest running request is
// preempted: its blocks are freed, its computed tokens drop to 0, and it goes
// to the front of the waiting queue keeping its generated tokens, so that
// recomputing reproduces them and generation continues from the same state.
// Then, if nothing was preempted, waiting requests are admitted in order
// (first come, first served: one that does not fit stops admission) while
// budget, max_num_seqs and blocks allow; admission looks up the prefix cache
// and computes only the tokens it does not cover, in chunks if the budget is
// short.
//
// Finishing (checked after each sampled token, in vLLM's order): length
// (max_tokens, or max_model_len tokens in all) first; then, once min_tokens
// are out, eos (unless ignore_eos) or a stop token id. Stop strings need text:
// the caller detects them (StopStringChecker) and calls stop().
//
// P/D and sleep hooks:
//   - hold_blocks_for_remote_reader: a finished request's blocks stay held
//     (send_hold_owner) until release_hold().
//   - await_remote_kv / finish_remote_kv(_sampled): a consumer request gets
//     blocks for its prompt and waits in WaitingForRemoteKv while a peer fills
//     them; then it continues from its first token, sampled from the
//     producer's logits of the prompt's last position (finish_remote_kv_sampled:
//     no prompt token is computed here), or computes only the last prompt
//     token (KV without logits), or the whole prompt (the load failed).
//   - preempt_all: every running request goes back to recompute, e.g. before
//     the KV cache is released for sleep.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "engine/block_pool.h"
#include "engine/block_table_allocator.h"
#include "engine/remote_kv.h"
#include "engine/request.h"
#include "engine/request_output.h"
#include "engine/sampled_token.h"
#include "engine/scheduler_output.h"

namespace siesta {

struct SchedulerOptions {
  int32_t max_num_seqs = 256;             // running requests at most
  int32_t max_num_batched_tokens = 8192;  // tokens per step (all sequences)
  int32_t max_model_len = 0;              // prompt + generated tokens of one request, required
  int32_t vocab_size = 0;                 // prompt token ids must be below it (0: unchecked)
  int32_t block_size = kBlockSize;
  std::vector<int32_t> eos_token_ids;
  // Prompt tokens per step of a request whose prompt is scored
  // (SamplingParams::prompt_logprobs): each brings a row of logits to the host.
  int32_t max_prompt_logprob_tokens = 256;
};

struct SchedulerStats {
  int32_t num_running = 0;
  int32_t num_waiting = 0;                // includes preempted and waiting-for-remote-KV
  int32_t num_waiting_for_remote_kv = 0;
  uint64_t num_preemptions = 0;
  uint64_t num_remote_kv_failures = 0;
};

class Scheduler {
 public:
  // kInvalidArgument for options out of range, or when one request of
  // max_model_len tokens would not fit in the pool (it could never run).
  static Result<std::unique_ptr<Scheduler>> create(const SchedulerOptions& options, BlockPool& pool);

  // kInvalidArgument: empty or duplicate id, empty prompt, a token id outside
  // the vocabulary, a prompt longer than max_model_len, bad SamplingParams.
  Result<void> add_request(NewRequest request);

  SchedulerOutput schedule();
  // sampled: one token per sequence of `out` with `sample` set, in order.
  // prompt_logprobs (empty, or one entry per sequence of `out`): for a
  // sequence with `prompt_logprobs` set, the log-probabilities of the prompt
  // tokens after the chunk's positions, in order. Returns one output per
  // request that sampled a token, finished included; a request's first
  // token carries its prompt's log-probabilities.
  Result<std::vector<RequestOutput>> update(const SchedulerOutput& out, std::span<const SampledToken> sampled,
                                            std::span<const std::vector<TokenLogprobs>> prompt_logprobs = {});

  // Ends a request in any unfinished state and frees its blocks (a request
  // waiting for remote KV keeps them under load_hold_owner(id) until
  // release_hold, since a peer may still be writing). kNotFound if unknown or
  // already finished.
  Result<RequestOutput> abort(const RequestId& id);
  // Ends a request as stopped (a stop string in its text). kNotFound as abort;
  // kConflict if its state does not allow a stop, or it generated nothing yet.
  Result<RequestOutput> stop(const RequestId& id);

  // Every running request back to the waiting queue to recompute. Returns how many.
  int32_t preempt_all();
  // preempt_all, and waiting requests that hold KV (a remote load put their
  // prompt's KV in place) give their blocks back too and recompute: no
  // request holds a block afterwards, but those waiting for remote KV, whose
  // load has not ended. Returns how many requests gave blocks back.
  int32_t free_request_blocks();
  // kConflict while blocks are in use, unless reset_running_requests, which
  // preempts the running requests first (they recompute). Blocks held for
  // remote readers or loads always block the reset.
  Result<void> reset_prefix_cache(bool reset_running_requests = false);
  // Gives back a hold the scheduler created (send_hold_owner / load_hold_owner).
  Result<void> release_hold(const HoldKey& owner);

  // P/D consumer: allocates blocks for a Waiting request's whole prompt
  // (prefix-cache hits included) and parks it in WaitingForRemoteKv.
  // kUnavailable when the pool lacks blocks now; kConflict in another state.
  Result<RemoteKvTarget> await_remote_kv(const RequestId& id);
  // The load ended. loaded: the prompt's KV is in the blocks; the request
  // computes only its last prompt token. Otherwise it recomputes the prompt;
  // with hold_blocks its blocks stay held under load_hold_owner(id) (a peer
  // may still write into them) until release_hold, and it recomputes in others.
  Result<void> finish_remote_kv(const RequestId& id, bool loaded, bool hold_blocks = false);
  // The load ended with the prompt's whole KV in the blocks and `first`, the
  // first generated token, sampled from the producer's logits of the prompt's
  // last position: nothing of the prompt is computed here. Returns the step
  // output for `first` (the request may finish on it, like any token).
  Result<RequestOutput> finish_remote_kv_sampled(const RequestId& id, const SampledToken& first);

  const Request* find(const RequestId& id) const;
  bool has_unfinished() const { return !requests_.empty(); }
  SchedulerStats stats() const;
  const SchedulerOptions& options() const { return options_; }
  BlockPool& pool() { return pool_; }

 private:
  Scheduler(const SchedulerOptions& options, BlockPool& pool);

  Request* lookup(const RequestId& id);
  // The request, if it is waiting for remote KV (kNotFound / kConflict otherwise).
  Result<Request*> waiting_for_remote_kv(const RequestId& id);
  // Tokens the request computes this step within `budget` (a scored prompt
  // takes at most max_prompt_logprob_tokens).
  int32_t chunk_tokens(const Request& req, int32_t budget) const;
  // The prefix-cache hit of a request without blocks (none for a scored prompt).
  CachedPrefix cached_prefix(Request& req) const;
  void add_to_batch(SchedulerOutput& out, Request& req, int32_t num_new_tokens);
  void preempt(Request& req, SchedulerOutput* out);
  // Applies a finishing event, releases the request and forgets it.
  RequestOutput finish(Request& req, RequestEvent event);
  void remove_from_queues(const Request& req);
  bool check_stop(Request& req, RequestEvent& event) const;
  // Appends a sampled token and finishes the request if it stops there.
  RequestOutput append_token(Request& req, const SampledToken& token);

  SchedulerOptions options_;
  BlockPool& pool_;
  BlockTableAllocator allocator_;
  std::unordered_map<RequestId, std::unique_ptr<Request>> requests_;
  std::vector<Request*> running_;   // arrival order of admission; the back is preempted first
  std::deque<Request*> waiting_;
  uint64_t num_preemptions_ = 0;
  uint64_t num_remote_kv_failures_ = 0;
};

}  // namespace siesta
