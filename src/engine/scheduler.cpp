#include "engine/scheduler.h"

#include <algorithm>

#include "common/log.h"

namespace siesta {
namespace {

std::string num(int64_t v) { return std::to_string(v); }

bool contains(const std::vector<int32_t>& ids, int32_t id) {
  return std::find(ids.begin(), ids.end(), id) != ids.end();
}

}  // namespace

Result<std::unique_ptr<Scheduler>> Scheduler::create(const SchedulerOptions& o, BlockPool& pool) {
  if (o.max_num_seqs < 1) return invalid_argument("max_num_seqs must be at least 1, got " + num(o.max_num_seqs));
  if (o.max_num_batched_tokens < 1)
    return invalid_argument("max_num_batched_tokens must be at least 1, got " + num(o.max_num_batched_tokens));
  if (o.max_model_len < 1) return invalid_argument("max_model_len must be at least 1, got " + num(o.max_model_len));
  if (o.block_size < 1) return invalid_argument("block_size must be at least 1, got " + num(o.block_size));
  const int64_t blocks_for_one = (static_cast<int64_t>(o.max_model_len) + o.block_size - 1) / o.block_size;
  if (blocks_for_one > pool.num_blocks())
    return invalid_argument("max_model_len " + num(o.max_model_len) + " needs " + num(blocks_for_one) +
                            " KV blocks for one request, but the KV cache has " + num(pool.num_blocks()) +
                            " (" + num(static_cast<int64_t>(pool.num_blocks()) * o.block_size) +
                            " tokens); lower --max-model-len or give the KV cache more memory");
  return std::unique_ptr<Scheduler>(new Scheduler(o, pool));
}

Scheduler::Scheduler(const SchedulerOptions& options, BlockPool& pool)
    : options_(options), pool_(pool), allocator_(pool, options.block_size) {}

Result<void> Scheduler::add_request(NewRequest nr) {
  if (nr.id.empty()) return invalid_argument("request id must not be empty");
  if (requests_.count(nr.id)) return invalid_argument("request id '" + nr.id + "' is already in use");
  if (nr.prompt_tokens.empty()) return invalid_argument("request '" + nr.id + "': the prompt has no tokens");
  if (auto ok = nr.params.validate(); !ok) return ok.error().with_context("request '" + nr.id + "'");
  const auto prompt_len = static_cast<int64_t>(nr.prompt_tokens.size());
  if (prompt_len > options_.max_model_len)
    return invalid_argument("request '" + nr.id + "': the prompt has " + num(prompt_len) +
                            " tokens, more than the maximum model length of " + num(options_.max_model_len));
  for (size_t i = 0; i < nr.prompt_tokens.size(); ++i) {
    const int32_t t = nr.prompt_tokens[i];
    if (t < 0 || (options_.vocab_size > 0 && t >= options_.vocab_size))
      return invalid_argument("request '" + nr.id + "': prompt token " + num(i) + " is " + num(t) +
                              ", outside the vocabulary [0, " + num(options_.vocab_size) + ")");
  }
  auto req = std::make_unique<Request>();
  req->id = nr.id;
  req->params = std::move(nr.params);
  req->cache_salt = std::move(nr.cache_salt);
  req->salt_hash = hash_salt(req->cache_salt);
  req->hold_blocks_for_remote_reader = nr.hold_blocks_for_remote_reader;
  req->tokens = std::move(nr.prompt_tokens);
  req->num_prompt_tokens = static_cast<int32_t>(prompt_len);
  waiting_.push_back(req.get());
  requests_.emplace(req->id, std::move(req));
  return {};
}

Request* Scheduler::lookup(const RequestId& id) {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : it->second.get();
}

const Request* Scheduler::find(const RequestId& id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : it->second.get();
}

int32_t Scheduler::chunk_tokens(const Request& req, int32_t budget) const {
  int32_t n = std::min(req.num_tokens() - req.num_computed_tokens, budget);
  if (req.needs_prompt_logprobs() && req.num_computed_tokens < req.num_prompt_tokens)
    n = std::min(n, std::max(options_.max_prompt_logprob_tokens, 1));
  return n;
}

CachedPrefix Scheduler::cached_prefix(Request& req) const {
  // Every prompt position of a scored prompt needs its logits: no cache reads.
  if (req.params.prompt_logprobs) return CachedPrefix{};
  return allocator_.find_cached_prefix(req);
}

void Scheduler::add_to_batch(SchedulerOutput& out, Request& req, int32_t n) {
  const int32_t start = req.num_computed_tokens;
  SequenceChunk chunk;
  chunk.tokens = std::span<const int32_t>(req.tokens).subspan(start, n);
  chunk.start_pos = start;
  chunk.block_table = req.block_table;
  chunk.all_logits = req.needs_prompt_logprobs() && start + 1 < req.num_prompt_tokens;
  out.chunks.push_back(chunk);
  ScheduledSequence seq;
  seq.request_id = req.id;
  seq.start_pos = start;
  seq.num_tokens = n;
  seq.sample = start + n == req.num_tokens();
  seq.params = &req.params;
  seq.sample_step = static_cast<uint64_t>(req.num_output_tokens());
  seq.keep_logits = seq.sample && seq.sample_step == 0 && req.hold_blocks_for_remote_reader;
  seq.prompt_tokens = std::span<const int32_t>(req.tokens).first(static_cast<size_t>(req.num_prompt_tokens));
  seq.output_tokens = req.output_tokens();
  seq.prompt_logprobs = chunk.all_logits;
  out.sequences.push_back(std::move(seq));
  out.num_batched_tokens += n;
}

void Scheduler::preempt(Request& req, SchedulerOutput* out) {
  allocator_.free(req);
  req.num_computed_tokens = 0;
  ++req.num_preemptions;
  ++num_preemptions_;
  if (auto ok = req.apply(RequestEvent::kPreempt); !ok) SIESTA_LOG_ERROR("scheduler: {}", ok.error().message);
  running_.erase(std::remove(running_.begin(), running_.end(), &req), running_.end());
  waiting_.push_front(&req);
  if (out) out->preempted.push_back(req.id);
  SIESTA_LOG_DEBUG("scheduler: preempted request {} ({} tokens to recompute)", req.id, req.num_tokens());
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int32_t budget = options_.max_num_batched_tokens;
  bool preempted = false;

  // Running requests, oldest first. Victims come from the back, so a request
  // already given work this step is never preempted.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Request& req = *running_[i];
    const int32_t n = chunk_tokens(req, budget);
    bool fits = true;
    while (!allocator_.allocate(req, n)) {
      Request& victim = *running_.back();
      preempt(victim, &out);
      preempted = true;
      if (&victim == &req) {
        fits = false;
        break;
      }
    }
    if (!fits) break;
    add_to_batch(out, req, n);
    budget -= n;
    ++i;
  }

  // Waiting requests, in order, unless this step had to preempt.
  if (!preempted) {
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (budget <= 0 || static_cast<int32_t>(running_.size()) >= options_.max_num_seqs) break;
      Request& req = **it;
      if (req.state == RequestState::kWaitingForRemoteKv) {
        ++it;
        continue;
      }
      const CachedPrefix prefix = cached_prefix(req);
      const int32_t n = chunk_tokens(req, budget + prefix.num_tokens) - prefix.num_tokens;
      const bool first_lookup = req.block_table.empty();
      if (!allocator_.allocate(req, n, prefix)) break;
      if (first_lookup) pool_.record_prefix_query(req.num_tokens(), prefix.num_tokens);
      if (req.num_cached_tokens < 0) req.num_cached_tokens = prefix.num_tokens;
      if (auto ok = req.apply(RequestEvent::kSchedule); !ok) SIESTA_LOG_ERROR("scheduler: {}", ok.error().message);
      it = waiting_.erase(it);
      running_.push_back(&req);
      add_to_batch(out, req, n);
      budget -= n;
    }
  }
  return out;
}

bool Scheduler::check_stop(Request& req, RequestEvent& event) const {
  const SamplingParams& p = req.params;
  const int32_t out_tokens = req.num_output_tokens();
  if (req.num_tokens() >= options_.max_model_len || (p.max_tokens && out_tokens >= *p.max_tokens)) {
    event = RequestEvent::kReachLength;
    return true;
  }
  if (out_tokens < p.min_tokens) return false;
  const int32_t last = req.tokens.back();
  if (!p.ignore_eos && contains(options_.eos_token_ids, last)) {
    event = RequestEvent::kStop;
    return true;
  }
  if (contains(p.stop_token_ids, last)) {
    req.stop_token = last;
    event = RequestEvent::kStop;
    return true;
  }
  return false;
}

RequestOutput Scheduler::finish(Request& req, RequestEvent event) {
  RequestOutput o;
  o.request_id = req.id;
  if (auto ok = req.apply(event); !ok) SIESTA_LOG_ERROR("scheduler: request {}: {}", req.id, ok.error().message);
  remove_from_queues(req);
  o.state = req.state;
  o.stop_token = req.stop_token;
  o.num_prompt_tokens = req.num_prompt_tokens;
  o.num_output_tokens = req.num_output_tokens();
  o.num_cached_tokens = std::max(req.num_cached_tokens, 0);
  if (req.hold_blocks_for_remote_reader && req.state != RequestState::kFinishedAborted && !req.block_table.empty()) {
    if (auto held = pool_.hold(send_hold_owner(req.id), req.block_table); held)
      o.held_blocks = req.block_table;
    else
      SIESTA_LOG_WARN("scheduler: request {}: blocks not held for the remote reader: {}", req.id,
                      held.error().message);
  }
  allocator_.free(req);
  const RequestId id = req.id;
  requests_.erase(id);  // req is gone from here on
  return o;
}

void Scheduler::remove_from_queues(const Request& req) {
  running_.erase(std::remove(running_.begin(), running_.end(), &req), running_.end());
  waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), &req), waiting_.end());
}

Result<std::vector<RequestOutput>> Scheduler::update(const SchedulerOutput& out, std::span<const SampledToken> sampled,
                                                     std::span<const std::vector<TokenLogprobs>> prompt_logprobs) {
  if (sampled.size() != out.num_samples())
    return invalid_argument("scheduler update: " + num(sampled.size()) + " sampled tokens for " +
                            num(out.num_samples()) + " sequences that sample");
  if (!prompt_logprobs.empty() && prompt_logprobs.size() != out.sequences.size())
    return invalid_argument("scheduler update: prompt log-probabilities for " + num(prompt_logprobs.size()) +
                            " of " + num(out.sequences.size()) + " sequences");
  std::vector<RequestOutput> outputs;
  size_t next = 0;
  for (size_t i = 0; i < out.sequences.size(); ++i) {
    const ScheduledSequence& seq = out.sequences[i];
    const SampledToken* token = seq.sample ? &sampled[next++] : nullptr;
    Request* req = lookup(seq.request_id);
    // Gone or moved since schedule(): its step result no longer applies.
    if (!req || req->state != RequestState::kRunning || req->num_computed_tokens != seq.start_pos) continue;
    if (!prompt_logprobs.empty()) {
      // Entry k scores position start + 1 + k; positions scored before a
      // preemption are kept, not appended twice.
      const std::vector<TokenLogprobs>& scored = prompt_logprobs[i];
      for (size_t k = 0; k < scored.size(); ++k)
        if (static_cast<size_t>(seq.start_pos) + k == req->prompt_logprobs.size() &&
            req->needs_prompt_logprobs())
          req->prompt_logprobs.push_back(scored[k]);
    }
    req->num_computed_tokens += seq.num_tokens;
    allocator_.publish_computed_blocks(*req);
    if (token) outputs.push_back(append_token(*req, *token));
  }
  return outputs;
}

RequestOutput Scheduler::append_token(Request& req, const SampledToken& token) {
  req.tokens.push_back(token.token);
  std::vector<TokenLogprobs> prompt_logprobs;
  if (req.params.prompt_logprobs && req.num_output_tokens() == 1) prompt_logprobs = req.prompt_logprobs;
  RequestEvent event{};
  if (check_stop(req, event)) {
    RequestOutput o = finish(req, event);  // req is gone from here on
    o.new_tokens.push_back(token);
    o.prompt_logprobs = std::move(prompt_logprobs);
    return o;
  }
  RequestOutput o;
  o.prompt_logprobs = std::move(prompt_logprobs);
  o.request_id = req.id;
  o.new_tokens.push_back(token);
  o.state = req.state;
  o.num_prompt_tokens = req.num_prompt_tokens;
  o.num_output_tokens = req.num_output_tokens();
  o.num_cached_tokens = std::max(req.num_cached_tokens, 0);
  return o;
}

Result<RequestOutput> Scheduler::abort(const RequestId& id) {
  Request* req = lookup(id);
  if (!req) return not_found("request '" + id + "' is not running or waiting (unknown or already finished)");
  if (req->state == RequestState::kWaitingForRemoteKv && !req->block_table.empty()) {
    // A peer may still be writing into these blocks: keep them until the
    // P/D layer says the write has ended.
    if (auto held = pool_.hold(load_hold_owner(id), req->block_table); !held)
      SIESTA_LOG_WARN("scheduler: request {}: {}", id, held.error().message);
  }
  return finish(*req, RequestEvent::kAbort);
}

Result<RequestOutput> Scheduler::stop(const RequestId& id) {
  Request* req = lookup(id);
  if (!req) return not_found("request '" + id + "' is not running or waiting (unknown or already finished)");
  if (auto allowed = next_state(req->state, RequestEvent::kStop); !allowed)
    return allowed.error().with_context("request '" + id + "'");
  if (req->num_output_tokens() == 0)
    return conflict("request '" + id + "' has generated nothing yet, so no stop string can have ended it");
  return finish(*req, RequestEvent::kStop);
}

int32_t Scheduler::preempt_all() {
  int32_t n = 0;
  while (!running_.empty()) {
    preempt(*running_.back(), nullptr);
    ++n;
  }
  return n;
}

int32_t Scheduler::free_request_blocks() {
  int32_t n = preempt_all();
  for (Request* req : waiting_) {
    if (req->state == RequestState::kWaitingForRemoteKv || req->block_table.empty()) continue;
    allocator_.free(*req);
    req->num_computed_tokens = 0;
    ++n;
    SIESTA_LOG_DEBUG("scheduler: waiting request {} gave its KV blocks back ({} tokens to recompute)", req->id,
                     req->num_tokens());
  }
  return n;
}

Result<void> Scheduler::reset_prefix_cache(bool reset_running_requests) {
  if (reset_running_requests) {
    const int32_t n = free_request_blocks();
    if (n > 0) SIESTA_LOG_INFO("scheduler: preempted {} running requests to reset the prefix cache", n);
  }
  auto ok = pool_.reset_prefix_cache();
  if (!ok && !running_.empty())
    return conflict(ok.error().message + " by " + num(static_cast<int64_t>(running_.size())) +
                    " running requests; retry when they finish, or reset with reset_running_requests to "
                    "preempt them (they recompute)");
  return ok;
}

Result<void> Scheduler::release_hold(const HoldKey& owner) { return pool_.release_hold(owner); }

Result<RemoteKvTarget> Scheduler::await_remote_kv(const RequestId& id) {
  Request* req = lookup(id);
  if (!req) return not_found("request '" + id + "' is not waiting (unknown or already finished)");
  if (req->state != RequestState::kWaiting || !req->block_table.empty() || req->num_output_tokens() != 0)
    return conflict("request '" + id + "' cannot wait for remote KV in state " + state_name(req->state));
  const CachedPrefix prefix = cached_prefix(*req);
  const int32_t n = req->num_prompt_tokens - prefix.num_tokens;
  if (!allocator_.allocate(*req, n, prefix))
    return unavailable("request '" + id + "': " + num(allocator_.blocks_needed(*req, n, prefix)) +
                       " KV blocks needed for the remote prefill, " + num(pool_.num_free_blocks()) +
                       " free; retry later or compute the prompt locally");
  pool_.record_prefix_query(req->num_tokens(), prefix.num_tokens);
  req->num_cached_tokens = prefix.num_tokens;
  SIESTA_TRY(req->apply(RequestEvent::kAwaitRemoteKv));
  return RemoteKvTarget{req->block_table, prefix.num_tokens};
}

Result<Request*> Scheduler::waiting_for_remote_kv(const RequestId& id) {
  Request* req = lookup(id);
  if (!req) return not_found("request '" + id + "' is not waiting (unknown or already finished)");
  if (req->state != RequestState::kWaitingForRemoteKv)
    return conflict("request '" + id + "' is not waiting for remote KV (state " + state_name(req->state) + ")");
  return req;
}

Result<void> Scheduler::finish_remote_kv(const RequestId& id, bool loaded, bool hold_blocks) {
  SIESTA_ASSIGN_OR_RETURN(Request* req, waiting_for_remote_kv(id));
  if (loaded) {
    // The last prompt token is computed again for its logits.
    req->num_computed_tokens = req->num_prompt_tokens - 1;
    allocator_.publish_computed_blocks(*req);
    return req->apply(RequestEvent::kRemoteKvLoaded);
  }
  if (hold_blocks && !req->block_table.empty()) {
    if (auto held = pool_.hold(load_hold_owner(id), req->block_table); !held)
      SIESTA_LOG_WARN("scheduler: request {}: {}", id, held.error().message);
  }
  allocator_.free(*req);
  req->num_computed_tokens = 0;
  ++num_remote_kv_failures_;
  return req->apply(RequestEvent::kRemoteKvFailed);
}

Result<RequestOutput> Scheduler::finish_remote_kv_sampled(const RequestId& id, const SampledToken& first) {
  SIESTA_ASSIGN_OR_RETURN(Request* req, waiting_for_remote_kv(id));
  if (req->num_output_tokens() != 0)
    return conflict("request '" + id + "' already has generated tokens; its first cannot come from a remote load");
  if (options_.vocab_size > 0 && (first.token < 0 || first.token >= options_.vocab_size))
    return invalid_argument("request '" + id + "': first token " + num(first.token) + " is outside the vocabulary");
  req->num_computed_tokens = req->num_prompt_tokens;
  allocator_.publish_computed_blocks(*req);
  SIESTA_TRY(req->apply(RequestEvent::kRemoteKvLoaded));
  return append_token(*req, first);
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s;
  s.num_running = static_cast<int32_t>(running_.size());
  s.num_waiting = static_cast<int32_t>(waiting_.size());
  for (const Request* r : waiting_) s.num_waiting_for_remote_kv += r->state == RequestState::kWaitingForRemoteKv;
  s.num_preemptions = num_preemptions_;
  s.num_remote_kv_failures = num_remote_kv_failures_;
  return s;
}

}  // namespace siesta
