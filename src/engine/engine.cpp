#include "engine/engine.h"

#include <algorithm>
#include <deque>
#include <unordered_set>
#include <utility>

#include "common/clock.h"
#include "common/log.h"
#include "common/thread_pool.h"
#include "engine/engine_model.h"
#include "engine/engine_step.h"
#include "memory/process_memory.h"

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
  bool connector_progress = false;  // the connector has news for poll() (a load ended)
};

Result<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options, std::unique_ptr<KvConnector> connector) {
  auto tok = Tokenizer::load(options.model_dir);
  if (!tok) return tok.error().with_context("loading the tokenizer from " + options.model_dir.string());
  // The CPU model computes on these threads; the CUDA model needs none.
  auto threads = std::make_unique<ThreadPool>(options.device == Device::kCpu ? options.threads : 1);
  // Every byte the engine owns comes from the model's pool (src/memory): the
  // host backend on the CPU, cuMem on CUDA (engine_model.h).
  SIESTA_ASSIGN_OR_RETURN(EngineModel loaded, load_engine_model(options, *threads));
  std::unique_ptr<memory::MemoryPool> memory = std::move(loaded.memory);
  std::unique_ptr<Model> model = std::move(loaded.model);
  const KvCacheLayout layout = model->kv_layout();
  // The KV cache's size: explicit, or (CUDA) what --gpu-memory-utilization leaves.
  EngineOptions sized = options;
  if (!options.num_kv_blocks) {
    auto budget = kv_cache_budget(options, loaded);
    if (!budget) return budget.error().with_context("sizing the KV cache");
    sized.kv_cache_memory_bytes = *budget;
  }
  // The model's own context bound (CUDA: its RoPE table and buffers) caps max_model_len.
  ModelConfig bounded = model->config();
  if (loaded.max_model_len > 0 &&
      (bounded.max_position_embeddings <= 0 || loaded.max_model_len < bounded.max_position_embeddings))
    bounded.max_position_embeddings = loaded.max_model_len;
  SIESTA_ASSIGN_OR_RETURN(EngineLimits limits, resolve_engine_limits(sized, bounded, layout));
  SIESTA_ASSIGN_OR_RETURN(KvCacheMemory kv, KvCacheMemory::allocate(*memory, layout, limits.num_kv_blocks));
  auto pool = std::make_unique<BlockPool>(limits.num_kv_blocks, limits.enable_prefix_caching);
  SchedulerOptions so;
  so.max_num_seqs = limits.max_num_seqs;
  so.max_num_batched_tokens = limits.max_num_batched_tokens;
  so.max_model_len = limits.max_model_len;
  so.vocab_size = limits.vocab_size;
  so.block_size = limits.block_size;
  so.eos_token_ids = model->config().eos_token_ids;
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<Scheduler> scheduler, Scheduler::create(so, *pool));
  SIESTA_LOG_INFO("engine: {} KV blocks of {} tokens ({} bytes), max_model_len {}, max_num_seqs {}, "
                  "max_num_batched_tokens {}, prefix caching {}, sleep mode {}",
                  limits.num_kv_blocks, limits.block_size, limits.kv_cache_bytes, limits.max_model_len,
                  limits.max_num_seqs, limits.max_num_batched_tokens, limits.enable_prefix_caching ? "on" : "off",
                  options.enable_sleep_mode ? "on" : "off");
  SIESTA_LOG_INFO("engine: memory pool on {}: weights {}, KV cache {}, scratch {}", memory->backend().description(),
                  memory::format_bytes(loaded.weights_bytes), memory::format_bytes(kv.allocation().bytes),
                  memory::format_bytes(loaded.scratch_bytes));
  if (connector) {
    // P/D: the connector registers the KV cache with its transfer engine.
    if (auto ok = connector->on_kv_cache_mapped(kv.export_for_transfer(options.cuda_device)); !ok)
      return ok.error().with_context("registering the KV cache for P/D transfers");
  }
  return std::unique_ptr<Engine>(new Engine(sized, limits, std::move(*tok), std::move(threads), std::move(memory),
                                            std::move(model), std::move(loaded.prepare_update), std::move(kv),
                                            std::move(pool), std::move(scheduler), std::move(connector)));
}

Engine::Engine(EngineOptions options, EngineLimits limits, Tokenizer tokenizer, std::unique_ptr<ThreadPool> threads,
               std::unique_ptr<memory::MemoryPool> memory, std::unique_ptr<Model> model, WeightsPreparer prepare_weights,
               KvCacheMemory kv, std::unique_ptr<BlockPool> pool, std::unique_ptr<Scheduler> scheduler,
               std::unique_ptr<KvConnector> connector)
    : options_(std::move(options)),
      limits_(limits),
      tokenizer_(std::move(tokenizer)),
      threads_(std::move(threads)),
      memory_(std::move(memory)),
      model_(std::move(model)),
      prepare_weights_(std::move(prepare_weights)),
      num_weight_tensors_(updatable_tensors(model_->config()).size()),
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
      inbox_(std::make_shared<EngineInbox>()),
      kv_registered_(connector_ != nullptr),
      weights_dir_(options_.model_dir),
      weights_written_(num_weight_tensors_, false) {
  publish_metrics();
  if (connector_)
    connector_->set_progress_callback([inbox = std::weak_ptr<EngineInbox>(inbox_)] {
      auto in = inbox.lock();
      if (!in) return;
      {
        std::lock_guard<std::mutex> lock(in->mu);
        in->connector_progress = true;
      }
      in->cv.notify_all();
    });
  loop_ = std::thread([this] { run_loop(); });
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lock(inbox_->mu);
    inbox_->stopping = true;
  }
  inbox_->cv.notify_all();
  if (loop_.joinable()) loop_.join();
  // The connector's transfer engine holds a copy of the KV cache's export.
  connector_.reset();
  kv_.close_transfer_export();
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
  const std::string vocab = " is outside the vocabulary [0, " + num(limits_.vocab_size) + ")";
  for (int32_t t : r.params.stop_token_ids)
    if (t >= limits_.vocab_size) return invalid_argument("stop_token_ids: " + num(t) + vocab);
  for (const auto& [t, bias] : r.params.logit_bias)
    if (t >= limits_.vocab_size) return invalid_argument("logit_bias: token id " + num(t) + vocab);
  for (int32_t t : r.params.allowed_token_ids)
    if (t >= limits_.vocab_size) return invalid_argument("allowed_token_ids: " + num(t) + vocab);
  for (const std::vector<int32_t>& word : r.params.bad_words_token_ids)
    for (int32_t t : word)
      if (t >= limits_.vocab_size) return invalid_argument("bad_words: token id " + num(t) + vocab);
  for (int32_t t : r.params.forced_tokens)
    if (t >= limits_.vocab_size) return invalid_argument("forced token " + num(t) + vocab);
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
    const EngineState state = state_.load();
    const size_t limit = static_cast<size_t>(options_.max_held_requests);
    if (!engine_admits(state) && inbox_->submissions.size() + ids.size() > limit)
      return unavailable("the engine is " + std::string(engine_state_name(state)) + " and " +
                         std::to_string(inbox_->submissions.size()) + " requests already wait for it (limit " +
                         std::to_string(limit) + ", --max-held-requests); retry after " +
                         (engine_is_sleeping(state) || state == EngineState::kPausedKvReleased ? "wake_up" : "resume"));
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

EngineMetricsSnapshot Engine::metrics() const {
  EngineMetricsSnapshot s = metrics_.snapshot();
  if (connector_) s.kv_transfer = connector_->metrics();
  return s;
}

Result<void> Engine::run_on_loop(std::function<Result<void>()> fn, Deadline deadline) const {
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
    // Started: the command may use the caller's locals (its captures), so it is
    // waited for to its end; its own waits on the loop are bounded by the same
    // deadline (loop_deadline), so this one is too.
    result->cv.wait(lock, [&] { return result->done; });
  }
  return result->result;
}

Result<EngineState> Engine::transition(EngineEvent event) {
  std::lock_guard<std::mutex> lock(state_mu_);
  const EngineState from = state_.load();
  auto next = next_engine_state(from, event);
  if (!next) return next.error();
  if (*next != from) SIESTA_LOG_INFO("engine: {} -> {} ({})", engine_state_name(from), engine_state_name(*next),
                                     engine_event_name(event));
  state_.store(*next);
  state_cv_.notify_all();
  return *next;
}

Result<void> Engine::require_sleep_mode(const char* call) const {
  if (options_.enable_sleep_mode) return {};
  return invalid_argument(std::string(call) +
                          " needs sleep mode, which is off; start siesta serve with --enable-sleep-mode");
}

// The turn of one lifecycle call: taken with the caller's deadline, given
// back when destroyed.
class LifecycleTurn {
 public:
  static Result<LifecycleTurn> take(Engine::LifecycleGate& gate, Deadline deadline, const char* call) {
    std::unique_lock<std::mutex> lock(gate.mu);
    if (!gate.cv.wait_until(lock, deadline, [&] { return !gate.busy; }))
      return timeout(std::string(call) + ": another lifecycle call (pause, sleep, wake_up, ...) was still running at "
                     "the deadline; try again");
    gate.busy = true;
    return LifecycleTurn(gate);
  }
  LifecycleTurn(LifecycleTurn&& other) noexcept : gate_(std::exchange(other.gate_, nullptr)) {}
  LifecycleTurn& operator=(LifecycleTurn&&) = delete;
  ~LifecycleTurn() {
    if (!gate_) return;
    {
      std::lock_guard<std::mutex> lock(gate_->mu);
      gate_->busy = false;
    }
    gate_->cv.notify_one();
  }

 private:
  explicit LifecycleTurn(Engine::LifecycleGate& gate) : gate_(&gate) {}
  Engine::LifecycleGate* gate_;
};

namespace {

// The deadline of work on the loop: a little before the caller's, so that
// the work ends (and says why) before the caller stops waiting for it.
Deadline loop_deadline(Deadline caller) {
  const auto left = caller - Clock::now();
  return caller - std::min<Clock::duration>(std::chrono::milliseconds(500), left / 10);
}

// The end of a request the scheduler never ran (shut down, refused, held too
// long, dropped): no output, nothing cached; `error` says why, where the
// engine failed it.
RequestDelta ended_before_start(const EngineRequest& request, std::optional<Status> error) {
  RequestDelta d;
  d.finish = RequestFinish{FinishReason::kAbort, {}, static_cast<int32_t>(request.prompt_tokens.size()), 0, 0,
                           std::move(error), nullptr};
  return d;
}

void add(memory::TagBytes& into, const memory::TagBytes& bytes) {
  for (size_t i = 0; i < memory::kNumTags; ++i) into[i] += bytes[i];
}

}  // namespace

EngineStatus Engine::status_after(Clock::time_point start, EngineCallReport report) const {
  EngineStatus s = status();
  report.seconds = seconds_since(start);
  s.call = std::move(report);
  return s;
}

EngineStatus Engine::status() const {
  EngineStatus s;
  s.state = state_.load();
  s.resident = memory_->resident_tags();
  for (memory::Tag t : memory::kAllTags)
    if (!s.resident.contains(t)) s.not_resident.insert(t);
  {
    std::lock_guard<std::mutex> lock(weights_mu_);
    s.weights_loaded = weights_loaded_;
    s.weights_dir = weights_dir_.string();
    s.weights_source = weight_source_name(weights_source_);
    if (!weights_loaded_)
      for (bool w : weights_written_) s.weights_unwritten += w ? 0 : 1;
  }
  {
    std::lock_guard<std::mutex> lock(inbox_->mu);
    s.held_requests = static_cast<int32_t>(inbox_->submissions.size());
  }
  const EngineMetricsSnapshot m = metrics_.snapshot();
  s.running_requests = m.num_requests_running;
  s.waiting_requests = m.num_requests_waiting;
  return s;
}

EngineMemoryReport Engine::memory_report(Deadline deadline) const {
  EngineMemoryReport r;
  r.pool = memory_->usage();
  if (auto rss = memory::process_resident_bytes()) r.process_resident_bytes = *rss;
  r.backend = memory_->backend().kind();
  // The backend belongs to the loop thread; ask it there.
  std::optional<memory::DeviceMemoryInfo> device;
  std::string description;
  uint64_t pinned = 0;
  auto asked = run_on_loop(
      [this, &device, &description, &pinned]() -> Result<void> {
        description = memory_->backend().description();
        if (auto info = memory_->backend().memory_info()) device = *info;
        pinned = memory_->pinned_host_bytes();
        return {};
      },
      deadline);
  if (asked) {
    r.device = device;
    r.backend_description = std::move(description);
    r.pinned_host_bytes = pinned;
  }
  return r;
}

namespace {

// "sleep level 1: ...; the engine is running as before (nothing was released)".
Status with_state(const Status& why, const std::string& what_now) { return Status{why.code, why.message + "; " + what_now}; }

}  // namespace

bool Engine::wait_until_stopped(std::unique_lock<std::mutex>& state_lock, Deadline deadline) {
  return state_cv_.wait_until(state_lock, deadline,
                              [&] { return !engine_schedules(state_.load()) || resumes_waiting_.load() > 0; });
}

Result<void> Engine::undo_pause(EngineState before) {
  if (!engine_schedules(before) || engine_schedules(state_.load())) return {};
  return run_on_loop(
      [this]() -> Result<void> {
        SIESTA_TRY(transition(EngineEvent::kResume));
        return {};
      },
      Clock::now() + std::chrono::seconds(30));
}

Result<EngineStatus> Engine::pause(PauseMode mode, Deadline deadline, bool clear_cache) {
  SIESTA_ASSIGN_OR_RETURN(LifecycleTurn turn, LifecycleTurn::take(lifecycle_, deadline, "pause"));
  const Clock::time_point start = Clock::now();
  const EngineState before = state_.load();
  SIESTA_TRY(run_on_loop([this, mode] { return pause_on_loop(mode); }, deadline));
  {
    std::unique_lock<std::mutex> state_lock(state_mu_);
    if (!wait_until_stopped(state_lock, deadline))
      return timeout("pause(wait): requests are still running at the deadline; the engine stays draining "
                     "(call pause again to keep waiting, or resume)");
  }
  if (engine_schedules(state_.load()))
    return conflict("pause(wait): a resume came while the engine drained its requests; it did not pause and runs on");
  EngineCallReport report;
  if (clear_cache) {
    auto cleared = run_on_loop(
        [this, deadline, &report]() -> Result<void> {
          SIESTA_ASSIGN_OR_RETURN(KvReleaseReport kv,
                                  release_kv_blocks(KvReleaseScope::kReset, "pause", loop_deadline(deadline)));
          if (connector_) report.kv_transfer = std::move(kv);
          return {};
        },
        deadline);
    if (!cleared) {
      // A pause that cannot clear the cache does not pause: the engine goes on as it was.
      const bool undone = static_cast<bool>(undo_pause(before));
      return with_state(cleared.error().with_context("pause: the prefix cache was not cleared"),
                        std::string("the engine is ") + engine_state_name(state_.load()) +
                            (undone ? " as before the call" : "") + " (call pause again, or pause with clear_cache=false)");
    }
  }
  return status_after(start, std::move(report));
}

Result<void> Engine::pause_on_loop(PauseMode mode) {
  switch (mode) {
    case PauseMode::kAbort:
      // vLLM's abort: each request ends with finish_reason "abort" and what it generated so far (an RL
      // framework resubmits the partial rollout after the weight update).
      abort_all(std::nullopt);
      SIESTA_TRY(transition(EngineEvent::kPauseNow));
      return {};
    case PauseMode::kKeep: {
      const int32_t n = scheduler_->preempt_all();
      if (n > 0) SIESTA_LOG_INFO("engine: pause keeps {} running requests; they recompute after resume", n);
      SIESTA_TRY(transition(EngineEvent::kPauseNow));
      return {};
    }
    case PauseMode::kWait:
      SIESTA_TRY(transition(scheduler_->has_unfinished() ? EngineEvent::kPauseWhenDrained : EngineEvent::kPauseNow));
      return {};
  }
  return {};
}

Result<EngineStatus> Engine::resume(Deadline deadline) {
  // A lifecycle call that waits for KV blocks or for requests to drain gives
  // up when it sees a resume coming, so that the resume is not stuck behind it.
  resumes_waiting_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(state_mu_);
    state_cv_.notify_all();
  }
  auto turn = LifecycleTurn::take(lifecycle_, deadline, "resume");
  resumes_waiting_.fetch_sub(1);
  if (!turn) return turn.error();
  const Clock::time_point start = Clock::now();
  EngineCallReport report;
  SIESTA_TRY(run_on_loop(
      [this, &report]() -> Result<void> {
        if (state_.load() == EngineState::kPausedKvReleased) {
          // The KV cache was released after a pause: map it first, then serve.
          SIESTA_TRY(wake_on_loop(memory::TagSet{memory::Tag::kKvCache}, report));
        }
        SIESTA_TRY(next_engine_state(state_.load(), EngineEvent::kResume));
        restore_kv_registration("resume");
        SIESTA_TRY(transition(EngineEvent::kResume));
        return {};
      },
      deadline));
  return status_after(start, std::move(report));
}

Result<EngineStatus> Engine::reset_prefix_cache(bool reset_running_requests, Deadline deadline) {
  SIESTA_ASSIGN_OR_RETURN(LifecycleTurn turn, LifecycleTurn::take(lifecycle_, deadline, "reset_prefix_cache"));
  const Clock::time_point start = Clock::now();
  EngineCallReport report;
  SIESTA_TRY(run_on_loop(
      [this, reset_running_requests, deadline, &report]() -> Result<void> {
        const SchedulerStats ss = scheduler_->stats();
        if (!reset_running_requests && ss.num_running > 0)
          return conflict("cannot reset the prefix cache: " + std::to_string(ss.num_running) +
                          " requests are running; retry when they finish, or reset with reset_running_requests=true "
                          "to preempt them (they recompute)");
        SIESTA_ASSIGN_OR_RETURN(KvReleaseReport kv, release_kv_blocks(KvReleaseScope::kReset, "reset_prefix_cache",
                                                                      loop_deadline(deadline)));
        if (connector_) report.kv_transfer = std::move(kv);
        return {};
      },
      deadline));
  return status_after(start, std::move(report));
}

Result<EngineStatus> Engine::sleep(int level, PauseMode mode, Deadline deadline) {
  SIESTA_TRY(require_sleep_mode("sleep"));
  if (level < 0 || level > 2)
    return invalid_argument("sleep level must be 0 (pause only), 1 (offload weights, release the rest) or 2 "
                            "(release everything), got " + std::to_string(level));
  SIESTA_ASSIGN_OR_RETURN(LifecycleTurn turn, LifecycleTurn::take(lifecycle_, deadline, "sleep"));
  const Clock::time_point start = Clock::now();
  const EngineState before = state_.load();
  // Stop scheduling first, as pause(mode) does; a stopped engine stays as it is.
  if (engine_schedules(before)) {
    SIESTA_TRY(run_on_loop([this, mode] { return pause_on_loop(mode); }, deadline));
    std::unique_lock<std::mutex> state_lock(state_mu_);
    if (!wait_until_stopped(state_lock, deadline))
      return timeout("sleep (mode wait): requests are still running at the deadline; nothing was released and the "
                     "engine stays draining (call sleep again to keep waiting, or use mode keep)");
    state_lock.unlock();
    if (engine_schedules(state_.load()))
      return conflict("sleep (mode wait): a resume came while the engine drained its requests; nothing was released "
                      "and the engine runs on");
  }
  EngineCallReport report;
  if (auto slept = run_on_loop(
          [this, level, deadline, &report] { return sleep_on_loop(level, loop_deadline(deadline), report); }, deadline);
      !slept) {
    // What failed before anything was released undoes the pause: the engine goes on as it was.
    bool undone = false;
    if (!engine_is_sleeping(state_.load())) undone = static_cast<bool>(undo_pause(before));
    const EngineState now = state_.load();
    return with_state(slept.error(), std::string("the engine is ") + engine_state_name(now) +
                                         (engine_is_sleeping(now) ? " (call sleep or wake_up again)"
                                          : undone ? " as before the call; nothing was released (call sleep again)"
                                                   : " (call sleep again, or resume to serve)"));
  }
  return status_after(start, std::move(report));
}

Result<void> Engine::sleep_on_loop(int level, Deadline deadline, EngineCallReport& report) {
  const EngineState from = state_.load();
  EngineEvent event = level == 0 ? EngineEvent::kSleepLevel0
                      : level == 1 ? EngineEvent::kSleepLevel1 : EngineEvent::kSleepLevel2;
  SIESTA_TRY(next_engine_state(from, event));  // refused calls change nothing
  if (level == 0) {
    SIESTA_TRY(transition(event));
    return {};
  }

  SIESTA_ASSIGN_OR_RETURN(KvReleaseReport kv, release_kv_blocks(KvReleaseScope::kMemory, "sleep", deadline));
  const bool deregistered = kv.deregistered;
  if (connector_) report.kv_transfer = std::move(kv);
  if (deregistered) kv_.close_transfer_export();  // no one else holds a copy now
  bool weights_loaded = false;
  {
    std::lock_guard<std::mutex> lock(weights_mu_);
    weights_loaded = weights_loaded_;
  }
  // Level 1 keeps the weights in host memory; weights that hold no checkpoint
  // (woken after level 2, not reloaded) are not worth copying: that is level 2.
  memory::TagSet offload;
  if (level == 1 && weights_loaded) offload.insert(memory::Tag::kWeights);
  if (level == 1 && !weights_loaded) {
    SIESTA_LOG_INFO("engine: sleep level 1 with weights that hold no checkpoint: releasing them (level 2)");
    event = EngineEvent::kSleepLevel2;
  }
  auto slept = memory_->sleep(offload);
  note_weights_released();
  if (!slept) {
    // The pool copies before it releases anything; whatever it did release
    // must not be scheduled on: say the engine sleeps, and let the caller retry.
    if (memory_->resident_tags() != memory::TagSet::all()) {
      (void)transition(EngineEvent::kSleepLevel2);
    } else if (deregistered) {
      restore_kv_registration("sleep");
    }
    return slept.error().with_context("sleep level " + std::to_string(level));
  }
  add(report.released_bytes, slept->released_bytes);
  add(report.offloaded_bytes, slept->offloaded_bytes);
  if (level == 2) {
    // Host copies from an earlier level-1 sleep go too.
    auto dropped = memory_->discard(memory::TagSet::all());
    if (!dropped) return dropped.error().with_context("sleep level 2: dropping the host copy of the weights");
    report.discarded_bytes = *dropped;
    note_weights_released();
  }
  SIESTA_LOG_INFO("engine: sleep level {}: released {} ({} copied to host first) in {:.3f} s + {:.3f} s", level,
                  memory::format_bytes(memory::sum(slept->released_bytes)),
                  memory::format_bytes(memory::sum(slept->offloaded_bytes)), slept->offload_seconds,
                  slept->release_seconds);
  SIESTA_TRY(transition(event));
  return {};
}
Result<EngineStatus> Engine::wake_up(memory::TagSet tags, Deadline deadline) {
  SIESTA_ASSIGN_OR_RETURN(LifecycleTurn turn, LifecycleTurn::take(lifecycle_, deadline, "wake_up"));
  const Clock::time_point start = Clock::now();
  EngineCallReport report;
  SIESTA_TRY(run_on_loop([this, tags, &report] { return wake_on_loop(tags, report); }, deadline));
  return status_after(start, std::move(report));
}

Result<void> Engine::wake_on_loop(memory::TagSet tags, EngineCallReport& report) {
  if (tags.empty()) tags = memory::TagSet::all();
  // Scratch belongs with the KV cache: both are working memory of a step.
  if (tags.contains(memory::Tag::kKvCache)) tags.insert(memory::Tag::kScratch);
  auto woken = memory_->wake(tags);
  if (!woken) {
    // Some allocations may be mapped now; the state stays asleep (or moves
    // to partially awake) and the next wake_up continues.
    if (engine_is_sleeping(state_.load())) (void)transition(EngineEvent::kWakePartial);
    return woken.error().with_context("wake_up (" + tags.to_string() + ")");
  }
  add(report.mapped_bytes, woken->mapped_bytes);
  add(report.restored_bytes, woken->restored_bytes);
  if (memory::sum(woken->mapped_bytes) > 0)
    SIESTA_LOG_INFO("engine: wake_up {}: mapped {} ({} restored from host) in {:.3f} s + {:.3f} s; not resident: {}",
                    tags.to_string(), memory::format_bytes(memory::sum(woken->mapped_bytes)),
                    memory::format_bytes(memory::sum(woken->restored_bytes)), woken->map_seconds,
                    woken->restore_seconds, woken->not_resident.to_string());
  // The KV cache is back (new memory at the same address): peers see it
  // under a new epoch. A failure leaves the engine serving without P/D
  // transfers (loads recompute, no blocks are offered to readers) until a
  // later wake_up or resume registers it.
  restore_kv_registration("wake_up");
  if (!woken->not_resident.empty()) {
    SIESTA_TRY(transition(EngineEvent::kWakePartial));
    return {};
  }
  bool weights_loaded = false;
  bool pushed = false;
  int32_t written = 0;
  std::filesystem::path dir;
  {
    std::lock_guard<std::mutex> lock(weights_mu_);
    weights_loaded = weights_loaded_;
    pushed = weights_pushed_;
    for (bool w : weights_written_) written += w ? 1 : 0;
    dir = weights_dir_;
  }
  if (!weights_loaded && (pushed || written > 0)) {
    // Reading the old checkpoint now would serve weights nobody asked for:
    // the pushed tensors (or the ones pushed before the release) are not in it.
    (void)transition(EngineEvent::kWakePartial);
    const int32_t missing = static_cast<int32_t>(num_weight_tensors_) - written;
    return conflict(
        "wake_up: every tag is resident, but the weights are incomplete: " + std::to_string(missing) + " of " +
        std::to_string(num_weight_tensors_) + " tensors were not written since the sleep that released them" +
        (written > 0 ? "" : ", and they held pushed tensors (update_weights), which " + dir.string() + " does not hold") +
        "; push the rest (POST /update_weights, or with \"complete\": true) or read a checkpoint (POST "
        "/reload_weights), then wake_up again");
  }
  if (!weights_loaded) {
    // Level 2 left the weights zero and no reload_weights came: read the
    // checkpoint they held, so the engine never serves from empty weights.
    SIESTA_LOG_INFO("engine: wake_up: the weights hold no checkpoint since sleep level 2; reading {} again",
                    dir.string());
    WeightUpdate again;
    again.source = WeightSource::kDir;
    again.path = dir;
    if (auto ok = update_on_loop(again, "wake_up", /*reset_kv=*/false, Clock::now() + std::chrono::minutes(10), report);
        !ok) {
      (void)transition(EngineEvent::kWakePartial);
      return ok.error().with_context("wake_up: every tag is resident but the weights could not be read again; call "
                                     "reload_weights with a checkpoint of this model, then wake_up");
    }
  }
  SIESTA_TRY(transition(EngineEvent::kWakeAll));
  return {};
}

Result<EngineStatus> Engine::release_kv_cache_memory(Deadline deadline) {
  SIESTA_TRY(require_sleep_mode("release_kv_cache_memory"));
  SIESTA_ASSIGN_OR_RETURN(LifecycleTurn turn, LifecycleTurn::take(lifecycle_, deadline, "release_kv_cache_memory"));
  const Clock::time_point start = Clock::now();
  EngineCallReport report;
  SIESTA_TRY(run_on_loop([this, deadline, &report] { return release_kv_on_loop(loop_deadline(deadline), report); },
                         deadline));
  return status_after(start, std::move(report));
}

Result<void> Engine::release_kv_on_loop(Deadline deadline, EngineCallReport& report) {
  const EngineState from = state_.load();
  if (engine_schedules(from))
    return conflict(std::string("release_kv_cache_memory needs a paused engine, and it is ") + engine_state_name(from) +
                    "; call POST /pause first (mode keep keeps the running requests)");
  SIESTA_TRY(next_engine_state(from, EngineEvent::kReleaseKvCache));
  SIESTA_ASSIGN_OR_RETURN(KvReleaseReport kv,
                          release_kv_blocks(KvReleaseScope::kMemory, "release_kv_cache_memory", deadline));
  const bool deregistered = kv.deregistered;
  if (connector_) report.kv_transfer = std::move(kv);
  if (deregistered) kv_.close_transfer_export();  // no one else holds a copy now
  memory::SleepOptions only_kv;
  only_kv.tags = memory::TagSet{memory::Tag::kKvCache};
  auto slept = memory_->sleep({}, only_kv);
  if (!slept) {
    if (!memory_->is_resident(memory::Tag::kKvCache))
      (void)transition(EngineEvent::kReleaseKvCache);
    else if (deregistered)
      restore_kv_registration("release_kv_cache_memory");
    return slept.error().with_context("release_kv_cache_memory");
  }
  add(report.released_bytes, slept->released_bytes);
  SIESTA_LOG_INFO("engine: release_kv_cache_memory: released {} in {:.3f} s",
                  memory::format_bytes(memory::sum(slept->released_bytes)), slept->release_seconds);
  SIESTA_TRY(transition(EngineEvent::kReleaseKvCache));
  return {};
}
Result<void> Engine::require_weights_writable(const std::string& call) const {
  const EngineState state = state_.load();
  if (engine_schedules(state)) {
    const SchedulerStats ss = scheduler_->stats();
    return conflict(call + " while the engine is " + std::string(engine_state_name(state)) + " (" +
                    std::to_string(ss.num_running) + " requests running, " + std::to_string(ss.num_waiting) +
                    " waiting): pause (POST /pause?mode=keep) or sleep first");
  }
  if (!memory_->is_resident(memory::Tag::kWeights))
    return conflict(call + ": the weights memory is not resident (engine " + std::string(engine_state_name(state)) +
                    "); call POST /wake_up?tags=weights first");
  return {};
}

Result<EngineStatus> Engine::reload_weights(std::optional<std::filesystem::path> model_dir, Deadline deadline) {
  SIESTA_ASSIGN_OR_RETURN(LifecycleTurn turn, LifecycleTurn::take(lifecycle_, deadline, "reload_weights"));
  const Clock::time_point start = Clock::now();
  EngineCallReport report;
  SIESTA_TRY(run_on_loop(
      [this, &model_dir, deadline, &report]() -> Result<void> {
        SIESTA_TRY(require_weights_writable("reload_weights"));
        WeightUpdate u;
        u.source = WeightSource::kDir;
        {
          std::lock_guard<std::mutex> lock(weights_mu_);
          u.path = model_dir.value_or(weights_dir_);
        }
        return update_on_loop(u, "reload_weights", /*reset_kv=*/true, loop_deadline(deadline), report);
      },
      deadline));
  return status_after(start, std::move(report));
}

Result<EngineStatus> Engine::update_weights(WeightUpdate update, Deadline deadline) {
  SIESTA_ASSIGN_OR_RETURN(LifecycleTurn turn, LifecycleTurn::take(lifecycle_, deadline, "update_weights"));
  const Clock::time_point start = Clock::now();
  EngineCallReport report;
  SIESTA_TRY(run_on_loop(
      [this, &update, deadline, &report]() -> Result<void> {
        SIESTA_TRY(require_weights_writable("update_weights"));
        if (update.source == WeightSource::kDir && update.path.empty()) {
          std::lock_guard<std::mutex> lock(weights_mu_);
          update.path = weights_dir_;
        }
        return update_on_loop(update, "update_weights", /*reset_kv=*/true, loop_deadline(deadline), report);
      },
      deadline));
  EngineStatus s = status();
  report.seconds = seconds_since(start);
  s.call = std::move(report);
  return s;
}

Result<void> Engine::update_on_loop(const WeightUpdate& update, const std::string& call, bool reset_kv,
                                    Deadline deadline, EngineCallReport& report) {
  // Everything is checked (and the sources opened) before anything changes.
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<PreparedWeightUpdate> prepared, prepare_weights_(update));
  if (reset_kv) {
    // Cached KV, and KV held for P/D transfers, came from the old weights.
    SIESTA_ASSIGN_OR_RETURN(KvReleaseReport kv, release_kv_blocks(KvReleaseScope::kReset, call, deadline));
    if (connector_) report.kv_transfer = std::move(kv);
  }
  auto written = prepared->apply();
  if (!written) {
    std::lock_guard<std::mutex> lock(weights_mu_);
    weights_loaded_ = false;
    weights_written_.assign(num_weight_tensors_, false);
    return written.error().with_context(call + " (the weights must be written again: POST /update_weights or "
                                               "/reload_weights)");
  }
  {
    std::lock_guard<std::mutex> lock(weights_mu_);
    if (update.source == WeightSource::kDir) {
      weights_loaded_ = true;
      weights_dir_ = update.path;
      weights_pushed_ = false;
      weights_written_.assign(num_weight_tensors_, true);
    } else {
      weights_pushed_ = true;
      for (int i : written->written) weights_written_[static_cast<size_t>(i)] = true;
      if (!weights_loaded_ && std::all_of(weights_written_.begin(), weights_written_.end(), [](bool w) { return w; }))
        weights_loaded_ = true;
    }
    weights_source_ = update.source;
  }
  if (update.source == WeightSource::kDir) report.weights_loaded_from = update.path.string();
  SIESTA_LOG_INFO("engine: {}: {} tensors ({}) written from {} in {:.3f} s ({:.1f} GB/s; checks {:.3f} s)", call,
                  written->tensors, memory::format_bytes(written->bytes), written->from, written->write_seconds,
                  written->gb_per_s(), written->prepare_seconds);
  if (!reset_kv) {
    // Cached KV was computed with the old weights.
    if (auto ok = scheduler_->reset_prefix_cache(/*reset_running_requests=*/true); !ok)
      SIESTA_LOG_WARN("engine: after {} the prefix cache could not be emptied ({}); cached blocks of the old weights "
                      "may be reused until it is (POST /reset_prefix_cache)",
                      call, ok.error().message);
  }
  report.weights_update = std::move(*written);
  return {};
}

Result<KvReleaseReport> Engine::release_kv_blocks(KvReleaseScope scope, const std::string& call, Deadline deadline) {
  KvReleaseReport report;
  if (!memory_->is_resident(memory::Tag::kKvCache)) return report;  // released already: every block is free
  const int32_t n = scheduler_->free_request_blocks();
  if (n > 0) SIESTA_LOG_INFO("engine: {}: {} requests give their KV blocks back and recompute", call, n);
  if (connector_) {
    auto ended = connector_->release_transfer_kv(scope, deadline);
    if (!ended)
      return ended.error().with_context(call + ": the P/D connector could not end its transfers (nothing was reset " +
                                        "or released)");
    report = std::move(*ended);
    if (report.deregistered) kv_registered_ = false;
  }
  // Every block comes back: the ended loads give theirs once nothing can
  // write them any more, the ended sends once no write of ours reads them.
  for (;;) {
    poll_connector();
    (void)scheduler_->free_request_blocks();  // a load that ended with its KV: its request recomputes too
    const BlockPoolStats ps = pool_->stats();
    if (ps.num_free_blocks == ps.num_blocks) break;
    std::string why;
    ErrorCode code = ErrorCode::kTimeout;
    if (resumes_waiting_.load() > 0) {
      why = "a resume came meanwhile";
      code = ErrorCode::kConflict;
    } else if (Clock::now() >= deadline) {
      why = "the deadline passed";
    }
    if (!why.empty()) {
      if (report.deregistered) restore_kv_registration(call);
      const int held_remote = pool_->num_held_blocks(HoldKind::kSend);
      const int held_loads = pool_->num_held_blocks(HoldKind::kLoad);
      return Status{code, call + ": " + std::to_string(ps.num_blocks - ps.num_free_blocks) + " of " +
                              std::to_string(ps.num_blocks) + " KV blocks were still held (" +
                              std::to_string(held_remote) + " for remote readers, " + std::to_string(held_loads) +
                              " for loads a peer may still write) when " + why + "; nothing was reset or released"};
    }
    std::unique_lock<std::mutex> lock(inbox_->mu);
    inbox_->cv.wait_for(lock, std::chrono::milliseconds(2), [&] { return inbox_->connector_progress; });
    inbox_->connector_progress = false;
  }
  if (auto ok = scheduler_->reset_prefix_cache(/*reset_running_requests=*/true); !ok)
    return ok.error().with_context(call);
  return report;
}

void Engine::restore_kv_registration(const std::string& call) {
  if (!connector_ || kv_registered_ || !memory_->is_resident(memory::Tag::kKvCache)) return;
  if (auto ok = connector_->on_kv_cache_mapped(kv_.export_for_transfer(options_.cuda_device)); !ok) {
    SIESTA_LOG_ERROR("engine: {}: the KV cache could not be registered for P/D transfers again ({}); this engine "
                     "serves without them until its next wake_up or resume",
                     call, ok.error().message);
    return;
  }
  kv_registered_ = true;
}

void Engine::note_weights_released() {
  if (memory_->usage()[memory::Tag::kWeights].released_bytes == 0) return;
  std::lock_guard<std::mutex> lock(weights_mu_);
  weights_loaded_ = false;
  weights_written_.assign(num_weight_tensors_, false);
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
      const bool admitting = engine_admits(state_.load());
      auto has_input = [&] {
        return inbox_->stopping || !inbox_->aborts.empty() || !inbox_->commands.empty() ||
               inbox_->connector_progress || (admitting && !inbox_->submissions.empty());
      };
      const bool busy = scheduler_->has_unfinished() && engine_schedules(state_.load());
      if (!busy)
        inbox_->cv.wait_until(lock, Clock::now() + kIdleWait, has_input);
      else if (idle_step)
        inbox_->cv.wait_until(lock, Clock::now() + kNothingScheduledWait, has_input);
      if (inbox_->stopping) break;
      inbox_->connector_progress = false;
      aborts.swap(inbox_->aborts);
      commands.swap(inbox_->commands);
      if (admitting) submissions.swap(inbox_->submissions);
    }
    admit(submissions);
    submissions.clear();
    apply_aborts(aborts);
    aborts.clear();
    if (!engine_admits(state_.load())) expire_held(Clock::now());
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
    if (engine_schedules(state_.load()) && scheduler_->has_unfinished()) idle_step = !step();
    if (state_.load() == EngineState::kDraining && !scheduler_->has_unfinished())
      (void)transition(EngineEvent::kDrained);
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
    if (connector_) connector_->on_request_dropped(s.request);
    s.stream->push(s.index,
                   ended_before_start(s.request, unavailable("the engine shut down before the request started")));
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
      if (connector_) connector_->on_request_aborted(id);
      s.stream->push(s.index, ended_before_start(s.request, ok.error()));
      metrics_.record_finish(FinishReason::kAbort, 0.0);
      continue;
    }
    outputs_.add(std::move(s.request), std::move(s.stream), s.index, s.arrival);
    if (plan.load_remote_kv) {
      auto target = scheduler_->await_remote_kv(id);
      if (target) {
        connector_->start_load(id, *target);
      } else {
        SIESTA_LOG_WARN("engine: request {}: no remote KV load ({}); it computes its prompt here", id,
                        target.error().message);
        connector_->on_load_skipped(id);
      }
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
    if (connector_) connector_->on_request_dropped(s.request);
    s.stream->push(s.index, ended_before_start(s.request, std::nullopt));
    metrics_.record_finish(FinishReason::kAbort, std::chrono::duration<double>(now - s.arrival).count());
  }
}

void Engine::expire_held(Clock::time_point now) {
  const auto limit = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options_.max_held_seconds));
  std::vector<EngineSubmission> expired;
  {
    std::lock_guard<std::mutex> lock(inbox_->mu);
    auto& subs = inbox_->submissions;
    if (subs.empty() || now - subs.front().arrival < limit) return;
    for (auto it = subs.begin(); it != subs.end();) {
      if (now - it->arrival < limit) {
        ++it;
        continue;
      }
      inbox_->live_ids.erase(it->request.id);
      expired.push_back(std::move(*it));
      it = subs.erase(it);
    }
  }
  const EngineState state = state_.load();
  const Status why = unavailable(
      "the request waited " + std::to_string(static_cast<int64_t>(options_.max_held_seconds)) + " s (--max-held-seconds) for an engine that is " +
      engine_state_name(state) + "; it was not started. Send it again after " +
      (engine_is_sleeping(state) || state == EngineState::kPausedKvReleased ? "POST /wake_up" : "POST /resume"));
  for (EngineSubmission& s : expired) {
    if (connector_) connector_->on_request_dropped(s.request);
    s.stream->push(s.index, ended_before_start(s.request, why));
    metrics_.record_finish(FinishReason::kAbort, std::chrono::duration<double>(now - s.arrival).count());
  }
  SIESTA_LOG_WARN("engine: {} requests held longer than {} s while {} ended with an error", expired.size(),
                  options_.max_held_seconds, engine_state_name(state));
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
  std::vector<RequestOutput> first_tokens;
  for (const FinishedLoad& f : u.finished_loads) {
    if (f.loaded && f.first_logits) {
      if (auto out = continue_from_remote_logits(f)) {
        first_tokens.push_back(std::move(*out));
        continue;
      }
    }
    if (auto ok = scheduler_->finish_remote_kv(f.id, f.loaded, f.blocks_may_change); !ok)
      SIESTA_LOG_WARN("engine: remote KV for {}: {}", f.id, ok.error().message);
  }
  if (!first_tokens.empty()) outputs_.process(first_tokens, *scheduler_, connector_.get(), Clock::now());
  for (const HoldKey& owner : u.releasable_holds)
    if (auto ok = scheduler_->release_hold(owner); !ok)
      SIESTA_LOG_WARN("engine: releasing hold {}: {}", to_string(owner), ok.error().message);
}

std::optional<RequestOutput> Engine::continue_from_remote_logits(const FinishedLoad& f) {
  const Request* req = scheduler_->find(f.id);
  if (!req) return std::nullopt;
  const auto vocab = static_cast<size_t>(model_->config().vocab_size);
  if (f.first_logits->size() != vocab) {
    SIESTA_LOG_WARN("engine: request {}: the producer sent {} logits for a vocabulary of {}; the last prompt token "
                    "is computed here",
                    f.id, f.first_logits->size(), vocab);
    return std::nullopt;
  }
  // The first token, sampled as a colocated engine samples it after its own
  // prefill: the same logits, parameters and step.
  const SampledToken first =
      sampler_.sample(*f.first_logits, req->params, 0, TokenHistory{req->tokens, {}});
  auto out = scheduler_->finish_remote_kv_sampled(f.id, first);
  if (!out) {
    SIESTA_LOG_WARN("engine: remote KV for {}: {}", f.id, out.error().message);
    return std::nullopt;
  }
  return std::move(*out);
}

bool Engine::step() {
  const Clock::time_point start = Clock::now();
  StepShape shape;
  auto outs = run_step(*scheduler_, *model_, kv_.view(), sampler_, logits_, options_.sample_on_device, &shape);
  if (!outs) {
    // No request advanced; the requests cannot be trusted to go on either.
    SIESTA_LOG_ERROR("engine: step failed, aborting every request: {}", outs.error().message);
    abort_all(outs.error().with_context("the engine step failed"));
    return true;
  }
  if (outs->empty()) return false;
  const Clock::time_point computed = Clock::now();
  outputs_.process(*outs, *scheduler_, connector_.get(), computed);
  if (options_.step_observer) options_.step_observer(EngineStepRecord{start, computed, Clock::now(), shape});
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
  metrics_.set_kv_blocks(ps.num_blocks - ps.num_free_blocks, pool_->num_held_blocks(HoldKind::kSend),
                         pool_->num_held_blocks(HoldKind::kLoad));
}

}  // namespace siesta
