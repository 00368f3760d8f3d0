#include "engine/engine.h"

#include <algorithm>
#include <deque>
#include <unordered_set>

#include "common/log.h"
#include "common/thread_pool.h"
#include "engine/engine_step.h"
#include "model/cpu/qwen3_cpu.h"

namespace siesta {

using Clock = std::chrono::steady_clock;

// How long the idle loop sleeps at most before looking at its inbox again.
constexpr auto kIdleWait = std::chrono::milliseconds(100);
// How long it waits when requests exist but none could be scheduled (waiting
// for remote KV): long enough not to spin, short enough not to add latency.
constexpr auto kNothingScheduledWait = std::chrono::milliseconds(1);

struct EngineSubmission {
  EngineRequest request;
  std::shared_ptr<StreamState> stream;
  size_t index = 0;
  Clock::time_point arrival;
};

namespace {

struct CommandResult {
  std::mutex mu;
  std::condition_variable cv;
  bool started = false;
  bool cancelled = false;
  bool done = false;
  Result<void> result;
};

struct Command {
  std::function<Result<void>()> fn;
  std::shared_ptr<CommandResult> result;
};

std::string num(int64_t v) { return std::to_string(v); }

}  // namespace

// What other threads hand to the loop: submissions, aborts, commands. Also
// the set of live request ids (submitted, not yet finished) for the
// duplicate check. Streams reach it through a weak_ptr to abort.
class EngineInbox final : public StreamAborter {
 public:
  void abort(const std::vector<RequestId>& ids) override {
    {
      std::lock_guard<std::mutex> lock(mu);
      aborts.insert(aborts.end(), ids.begin(), ids.end());
    }
    cv.notify_all();
  }

  std::mutex mu;
  std::condition_variable cv;
  std::vector<EngineSubmission> submissions;
  std::vector<RequestId> aborts;
  std::deque<Command> commands;
  std::unordered_set<RequestId> live_ids;
  bool stopping = false;
};

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options, std::unique_ptr<KvConnector> connector) {
  auto tok = Tokenizer::load(options.model_dir);
  if (!tok) return tok.error().with_context("loading the tokenizer from " + options.model_dir.string());
  auto threads = std::make_unique<ThreadPool>(options.threads);
  auto model = CpuQwen3::load(options.model_dir, *threads);
  if (!model) return model.error().with_context("loading the model from " + options.model_dir.string());
  const KvCacheLayout layout = (*model)->kv_layout();
  SIESTA_ASSIGN_OR_RETURN(EngineLimits limits, resolve_engine_limits(options, (*model)->config(), layout));
  SIESTA_ASSIGN_OR_RETURN(KvCacheMemory kv, KvCacheMemory::allocate(layout, limits.num_kv_blocks));
  auto pool = std::make_unique<BlockPool>(limits.num_kv_blocks, limits.enable_prefix_caching);
  SchedulerOptions so;
  so.max_num_seqs = limits.max_num_seqs;
  so.max_num_batched_tokens = limits.max_num_batched_tokens;
  so.max_model_len = limits.max_model_len;
  so.vocab_size = limits.vocab_size;
  so.block_size = limits.block_size;
  so.eos_token_ids = (*model)->config().eos_token_ids;
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> scheduler, Scheduler::create(so, *pool));
  SIESTA_LOG_INFO("engine: {} KV blocks of {} tokens ({} bytes), max_model_len {}, max_num_seqs {}, "
                  "max_num_batched_tokens {}, prefix caching {}",
                  limits.num_kv_blocks, limits.block_size, limits.kv_cache_bytes, limits.max_model_len,
                  limits.max_num_seqs, limits.max_num_batched_tokens, limits.enable_prefix_caching ? "on" : "off");
  return std::unique_ptr<Engine>(new Engine(options, limits, std::move(*tok), std::move(threads), std::move(*model),
                                            std::move(kv), std::move(pool), std::move(scheduler),
                                            std::move(connector)));
}

Engine::Engine(EngineOptions options, EngineLimits limits, Tokenizer tokenizer, std::unique_ptr<ThreadPool> threads,
               std::unique_ptr<Model> model, KvCacheMemory kv, std::unique_ptr<BlockPool> pool,
               std::unique_ptr<Scheduler> scheduler, std::unique_ptr<KvConnector> connector)
    : options_(std::move(options)),
      limits_(limits),
      tokenizer_(std::move(tokenizer)),
      threads_(std::move(threads)),
      model_(std::move(model)),
      kv_(std::move(kv)),
      pool_(std::move(pool)),
      scheduler_(std::move(scheduler)),
      sampler_(model_->config().eos_token_ids,
               options_.seed ? RandomGenerator(*options_.seed) : RandomGenerator::from_entropy()),
      outputs_(tokenizer_, metrics_,
               [this](const RequestId& id) {
                 std::lock_guard<std::mutex> lock(inbox_->mu);
                 inbox_->live_ids.erase(id);
               }),
      connector_(std::move(connector)),
      inbox_(std::make_shared<EngineInbox>()) {
  publish_metrics();
  loop_ = std::thread([this] { run_loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(inbox_->mu);
    inbox_->stopping = true;
  }
  inbox_->cv.notify_all();
  if (loop_.joinable()) loop_.join();
}

// ---- any thread --------------------------------------------------------------

Result<void> Engine::validate(const EngineRequest& r) const {
  const std::string who = "request '" + r.id + "': ";
  if (r.id.empty()) return invalid_argument("request id must not be empty");
  if (r.prompt_tokens.empty()) return invalid_argument(who + "the prompt has no tokens");
  const int64_t len = static_cast<int64_t>(r.prompt_tokens.size());
  const int64_t max_len = limits_.max_model_len;
  if (len >= max_len)
    return invalid_argument("This model's maximum context length is " + num(max_len) +
                            " tokens. However, your request has " + num(len) +
                            " input tokens. Please reduce the length of the input (at least one token must be "
                            "left to generate).");
  if (r.params.max_tokens && len + *r.params.max_tokens > max_len)
    return invalid_argument("This model's maximum context length is " + num(max_len) +
                            " tokens. However, you requested " + num(len + *r.params.max_tokens) + " tokens (" +
                            num(len) + " in the prompt, " + num(*r.params.max_tokens) +
                            " in the completion). Please reduce the length of the prompt or max_tokens.");
  for (size_t i = 0; i < r.prompt_tokens.size(); ++i) {
    const int32_t t = r.prompt_tokens[i];
    if (t < 0 || t >= limits_.vocab_size)
      return invalid_argument(who + "prompt token " + num(static_cast<int64_t>(i)) + " is " + num(t) +
                              ", outside the vocabulary [0, " + num(limits_.vocab_size) + ")");
  }
  if (auto ok = r.params.validate(); !ok) return ok.error();
  for (int32_t t : r.params.stop_token_ids)
    if (t >= limits_.vocab_size)
      return invalid_argument("stop_token_ids: " + num(t) + " is outside the vocabulary [0, " +
                              num(limits_.vocab_size) + ")");
  return {};
}

Result<OutputStream> Engine::submit(std::vector<EngineRequest> requests) {
  if (requests.empty()) return invalid_argument("no requests to submit");
  std::vector<RequestId> ids;
  for (const EngineRequest& r : requests) {
    SIESTA_TRY(validate(r));
    if (std::find(ids.begin(), ids.end(), r.id) != ids.end())
      return invalid_argument("request id '" + r.id + "' appears twice in one submission");
    ids.push_back(r.id);
  }
  auto stream = std::make_shared<StreamState>(ids);
  const Clock::time_point now = Clock::now();
  {
    std::lock_guard<std::mutex> lock(inbox_->mu);
    if (inbox_->stopping) return unavailable("the engine is shutting down");
    for (const RequestId& id : ids)
      if (inbox_->live_ids.count(id)) return conflict("request id '" + id + "' is already in use");
    for (size_t i = 0; i < requests.size(); ++i) {
      inbox_->live_ids.insert(ids[i]);
      inbox_->submissions.push_back(EngineSubmission{std::move(requests[i]), stream, i, now});
    }
  }
  inbox_->cv.notify_all();
  metrics_.record_submitted(ids.size());
  return OutputStream(stream, std::weak_ptr<StreamAborter>(inbox_));
}

void Engine::abort(const RequestId& id) { inbox_->abort({id}); }

Result<void> Engine::run_on_loop(std::function<Result<void>()> fn, Deadline deadline) {
  auto result = std::make_shared<CommandResult>();
  {
    std::lock_guard<std::mutex> lock(inbox_->mu);
    if (inbox_->stopping) return unavailable("the engine is shutting down");
    inbox_->commands.push_back(Command{std::move(fn), result});
  }
  inbox_->cv.notify_all();
  std::unique_lock<std::mutex> lock(result->mu);
  if (!result->cv.wait_until(lock, deadline, [&] { return result->done; })) {
    if (!result->started) {
      result->cancelled = true;
      return timeout("the engine loop did not take the command before the deadline (a long step is running)");
    }
    return timeout("the engine loop did not finish the command before the deadline");
  }
  return result->result;
}

void Engine::set_state(EngineEvent event) {
  std::lock_guard<std::mutex> lock(state_mu_);
  auto next = next_engine_state(state_.load(), event);
  if (!next) {
    SIESTA_LOG_ERROR("engine: {}", next.error().message);
    return;
  }
  if (*next != state_.load())
    SIESTA_LOG_INFO("engine: {} -> {}", engine_state_name(state_.load()), engine_state_name(*next));
  state_.store(*next);
  state_cv_.notify_all();
}

Result<void> Engine::pause(PauseMode mode, Deadline deadline) {
  SIESTA_TRY(run_on_loop(
      [this, mode]() -> Result<void> {
        switch (mode) {
          case PauseMode::kAbort:
            abort_all(std::nullopt);
            set_state(EngineEvent::kPauseNow);
            break;
          case PauseMode::kKeep: {
            const int32_t n = scheduler_->preempt_all();
            if (n > 0) SIESTA_LOG_INFO("engine: pause keeps {} running requests; they recompute after resume", n);
            set_state(EngineEvent::kPauseNow);
            break;
          }
          case PauseMode::kWait:
            set_state(scheduler_->has_unfinished() ? EngineEvent::kPauseWhenDrained : EngineEvent::kPauseNow);
            break;
        }
        return {};
      },
      deadline));
  std::unique_lock<std::mutex> lock(state_mu_);
  if (!state_cv_.wait_until(lock, deadline, [&] { return state_.load() == EngineState::kPaused; }))
    return timeout("pause(wait): requests are still running at the deadline; the engine stays draining "
                   "(call pause again to keep waiting, or resume)");
  return {};
}

Result<void> Engine::resume(Deadline deadline) {
  return run_on_loop(
      [this]() -> Result<void> {
        set_state(EngineEvent::kResume);
        return {};
      },
      deadline);
}

Result<void> Engine::reset_prefix_cache(bool reset_running_requests, Deadline deadline) {
  return run_on_loop([this, reset_running_requests] { return scheduler_->reset_prefix_cache(reset_running_requests); },
                     deadline);
}

// ---- the loop thread -----------------------------------------------------------

void Engine::run_loop() {
  std::vector<EngineSubmission> submissions;
  std::vector<RequestId> aborts;
  std::deque<Command> commands;
  bool idle_step = false;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(inbox_->mu);
      const bool admitting = state_.load() == EngineState::kRunning;
      auto has_input = [&] {
        return inbox_->stopping || !inbox_->aborts.empty() || !inbox_->commands.empty() ||
               (admitting && !inbox_->submissions.empty());
      };
      const bool busy = scheduler_->has_unfinished() && state_.load() != EngineState::kPaused;
      if (!busy)
        inbox_->cv.wait_until(lock, Clock::now() + kIdleWait, has_input);
      else if (idle_step)
        inbox_->cv.wait_until(lock, Clock::now() + kNothingScheduledWait, has_input);
      if (inbox_->stopping) break;
      aborts.swap(inbox_->aborts);
      commands.swap(inbox_->commands);
      if (state_.load() == EngineState::kRunning) submissions.swap(inbox_->submissions);
    }
    admit(submissions);
    submissions.clear();
    apply_aborts(aborts);
    aborts.clear();
    for (Command& c : commands) {
      {
        std::lock_guard<std::mutex> lock(c.result->mu);
        if (c.result->cancelled) continue;
        c.result->started = true;
      }
      Result<void> r = c.fn();
      {
        std::lock_guard<std::mutex> lock(c.result->mu);
        c.result->result = std::move(r);
        c.result->done = true;
      }
      c.result->cv.notify_all();
    }
    commands.clear();
    poll_connector();
    idle_step = false;
    if (state_.load() != EngineState::kPaused && scheduler_->has_unfinished()) idle_step = !step();
    if (state_.load() == EngineState::kDraining && !scheduler_->has_unfinished()) set_state(EngineEvent::kDrained);
    publish_metrics();
  }
  // Shutting down: every request still known ends as aborted.
  abort_all(unavailable("the engine shut down before the request finished"));
  std::vector<EngineSubmission> held;
  {
    std::lock_guard<std::mutex> lock(inbox_->mu);
    held.swap(inbox_->submissions);
    for (Command& c : inbox_->commands) {
      std::lock_guard<std::mutex> clock(c.result->mu);
      c.result->result = unavailable("the engine shut down");
      c.result->done = true;
      c.result->cv.notify_all();
    }
    inbox_->commands.clear();
    inbox_->live_ids.clear();
  }
  for (EngineSubmission& s : held) {
    RequestDelta d;
    d.finish = RequestFinish{FinishReason::kAbort, {}, static_cast<int32_t>(s.request.prompt_tokens.size()), 0, 0,
                             unavailable("the engine shut down before the request started"), nullptr};
    s.stream->push(s.index, std::move(d));
  }
  publish_metrics();
}

void Engine::admit(std::vector<EngineSubmission>& submissions) {
  for (EngineSubmission& s : submissions) {
    ConnectorPlan plan;
    if (connector_) plan = connector_->on_request_added(s.request);
    NewRequest nr;
    nr.id = s.request.id;
    nr.prompt_tokens = s.request.prompt_tokens;
    nr.params = s.request.params;
    nr.cache_salt = s.request.cache_salt;
    nr.hold_blocks_for_remote_reader = plan.hold_blocks_for_remote_reader;
    const RequestId id = s.request.id;
    if (auto ok = scheduler_->add_request(std::move(nr)); !ok) {
      // validate() let it through, so this is the scheduler's own check.
      {
        std::lock_guard<std::mutex> lock(inbox_->mu);
        inbox_->live_ids.erase(id);
      }
      RequestDelta d;
      d.finish = RequestFinish{FinishReason::kAbort, {}, static_cast<int32_t>(s.request.prompt_tokens.size()), 0, 0,
                               ok.error(), nullptr};
      s.stream->push(s.index, std::move(d));
      metrics_.record_finish(FinishReason::kAbort, 0.0);
      continue;
    }
    outputs_.add(std::move(s.request), std::move(s.stream), s.index, s.arrival);
    if (plan.load_remote_kv) {
      auto target = scheduler_->await_remote_kv(id);
      if (target)
        connector_->start_load(id, *target);
      else
        SIESTA_LOG_WARN("engine: request {}: no remote KV load ({}); it computes its prompt here", id,
                        target.error().message);
    }
  }
}

void Engine::apply_aborts(const std::vector<RequestId>& ids) {
  if (ids.empty()) return;
  const Clock::time_point now = Clock::now();
  std::vector<EngineSubmission> held;
  for (const RequestId& id : ids) {
    if (outputs_.contains(id)) {
      auto out = scheduler_->abort(id);
      outputs_.finish_aborted(id, out ? &*out : nullptr, std::nullopt, now);
      if (connector_) connector_->on_request_aborted(id);
      continue;
    }
    // Not admitted yet (held while paused): take it out of the inbox.
    std::lock_guard<std::mutex> lock(inbox_->mu);
    auto& subs = inbox_->submissions;
    for (auto it = subs.begin(); it != subs.end(); ++it) {
      if (it->request.id != id) continue;
      held.push_back(std::move(*it));
      subs.erase(it);
      inbox_->live_ids.erase(id);
      break;
    }
  }
  for (EngineSubmission& s : held) {
    RequestDelta d;
    d.finish = RequestFinish{FinishReason::kAbort, {}, static_cast<int32_t>(s.request.prompt_tokens.size()), 0, 0,
                             std::nullopt, nullptr};
    s.stream->push(s.index, std::move(d));
    metrics_.record_finish(FinishReason::kAbort, std::chrono::duration<double>(now - s.arrival).count());
  }
}

void Engine::abort_all(const std::optional<Status>& error) {
  const Clock::time_point now = Clock::now();
  for (const RequestId& id : outputs_.ids()) {
    auto out = scheduler_->abort(id);
    outputs_.finish_aborted(id, out ? &*out : nullptr, error, now);
    if (connector_) connector_->on_request_aborted(id);
  }
}

void Engine::poll_connector() {
  if (!connector_) return;
  ConnectorUpdates u = connector_->poll();
  for (const auto& [id, loaded] : u.finished_loads)
    if (auto ok = scheduler_->finish_remote_kv(id, loaded); !ok)
      SIESTA_LOG_WARN("engine: remote KV for {}: {}", id, ok.error().message);
  for (const std::string& owner : u.releasable_holds)
    if (auto ok = scheduler_->release_hold(owner); !ok)
      SIESTA_LOG_WARN("engine: releasing hold {}: {}", owner, ok.error().message);
}

bool Engine::step() {
  auto outs = run_step(*scheduler_, *model_, kv_.view(), sampler_, logits_);
  if (!outs) {
    // No request advanced; the requests cannot be trusted to go on either.
    SIESTA_LOG_ERROR("engine: step failed, aborting every request: {}", outs.error().message);
    abort_all(outs.error().with_context("the engine step failed"));
    return true;
  }
  if (outs->empty()) return false;
  outputs_.process(*outs, *scheduler_, connector_.get(), Clock::now());
  return true;
}

void Engine::publish_metrics() {
  const SchedulerStats ss = scheduler_->stats();
  const BlockPoolStats ps = pool_->stats();
  size_t held = 0;
  {
    std::lock_guard<std::mutex> lock(inbox_->mu);
    held = inbox_->submissions.size();
  }
  metrics_.set_state(ss.num_running, ss.num_waiting + static_cast<int32_t>(held), ps.usage(), ps.num_blocks,
                     ps.prefix_cache_queries, ps.prefix_cache_hits, ss.num_preemptions);
}

}  // namespace siesta
