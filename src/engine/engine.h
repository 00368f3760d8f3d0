// Engine: one model serving requests. Owns the model, the tokenizer, the KV
// cache memory, the BlockPool, the Scheduler, the Sampler and the thread that
// runs the engine loop (run_step, again and again, while there is work).
//
// Lifecycle
//   auto engine = Engine::create(options).value();    // loads, allocates, starts the loop
//   OutputStream s = engine->submit({request}).value();  // any thread
//   ... s.next(deadline) until s.finished() ...        // see engine_stream.h
//   engine->abort(id);                                 // any thread, any state
//   engine->pause(PauseMode::kKeep, deadline); engine->resume();
//   engine.reset();                                    // stops the loop; unfinished requests
//                                                      // end as aborted with an error
//
// Thread safety: submit, abort, pause, resume, reset_prefix_cache, metrics,
// state and the const accessors may be called from any thread at any time.
// The model, the pool and the scheduler are touched only by the loop thread;
// calls that must change them (pause, reset_prefix_cache) run on the loop
// between two steps (run_on_loop) and wait for it with a deadline.
//
// The loop: take new submissions and aborts from the inbox, run queued
// commands, poll the KvConnector, run one step, send each request's new
// tokens and text to its stream, publish metrics. When there is nothing to do
// it waits for the inbox (with a deadline, so it never sleeps unbounded).
//
// Seams for what comes next:
//   - sleep / wake (issue 4): EngineState (engine_state.h) gains the sleep
//     states; the KV cache memory lives in one place (KvCacheMemory); pause
//     with kKeep already preempts every running request to recompute later.
//   - P/D (issue 7): a KvConnector given to create() is called at the points
//     engine_connector.h lists; EngineRequest carries kv_transfer_params and
//     RequestFinish returns the connector's answer.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/status.h"
#include "engine/block_pool.h"
#include "engine/engine_connector.h"
#include "engine/engine_kv_cache.h"
#include "engine/engine_metrics.h"
#include "engine/engine_options.h"
#include "engine/engine_output.h"
#include "engine/engine_request.h"
#include "engine/engine_state.h"
#include "engine/engine_stream.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "model/forward.h"
#include "model/tokenizer.h"

namespace siesta {

class ThreadPool;
class EngineInbox;
struct EngineSubmission;

class Engine {
 public:
  // Loads the tokenizer and the model from options.model_dir, sizes and
  // allocates the KV cache, starts the loop. Errors name what failed.
  static Result<std::unique_ptr<Engine>> create(const EngineOptions& options,
                                                std::unique_ptr<KvConnector> connector = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Validates every request (ids unique among live requests, prompt not empty
  // and shorter than max_model_len, prompt + max_tokens within max_model_len,
  // token ids inside the vocabulary, SamplingParams ranges) and queues them
  // all, or none: kInvalidArgument naming the request and the rule, kConflict
  // for an id in use, kUnavailable while shutting down.
  Result<OutputStream> submit(std::vector<EngineRequest> requests);
  // Checks one request as submit does, without queueing it.
  Result<void> validate(const EngineRequest& request) const;
  // Aborts a request in any state; unknown or finished ids are ignored.
  void abort(const RequestId& id);

  // Stops scheduling (engine_state.h). kWait returns once the scheduler is
  // empty, or kTimeout at the deadline (still draining; resume or pause again).
  Result<void> pause(PauseMode mode, Deadline deadline);
  Result<void> resume(Deadline deadline);
  EngineState state() const { return state_.load(); }
  // Scheduler::reset_prefix_cache on the loop.
  Result<void> reset_prefix_cache(bool reset_running_requests, Deadline deadline);

  EngineMetricsSnapshot metrics() const { return metrics_.snapshot(); }
  const Tokenizer& tokenizer() const { return tokenizer_; }
  const ModelConfig& model_config() const { return model_->config(); }
  const EngineLimits& limits() const { return limits_; }
  const EngineOptions& options() const { return options_; }

 private:
  Engine(EngineOptions options, EngineLimits limits, Tokenizer tokenizer, std::unique_ptr<ThreadPool> threads,
         std::unique_ptr<Model> model, KvCacheMemory kv, std::unique_ptr<BlockPool> pool,
         std::unique_ptr<Scheduler> scheduler, std::unique_ptr<KvConnector> connector);

  // Runs fn on the loop thread between two steps and returns its result;
  // kTimeout if the deadline passes first (a command not yet started is dropped).
  Result<void> run_on_loop(std::function<Result<void>()> fn, Deadline deadline);
  void set_state(EngineEvent event);

  void run_loop();
  void admit(std::vector<EngineSubmission>& submissions);
  void apply_aborts(const std::vector<RequestId>& ids);
  void abort_all(const std::optional<Status>& error);
  void poll_connector();
  bool step();
  void publish_metrics();

  const EngineOptions options_;
  const EngineLimits limits_;
  Tokenizer tokenizer_;
  std::unique_ptr<ThreadPool> threads_;
  std::unique_ptr<Model> model_;
  KvCacheMemory kv_;
  std::unique_ptr<BlockPool> pool_;
  std::unique_ptr<Scheduler> scheduler_;
  Sampler sampler_;
  ForwardOutput logits_;
  EngineMetrics metrics_;
  OutputProcessor outputs_;
  std::unique_ptr<KvConnector> connector_;
  std::shared_ptr<EngineInbox> inbox_;

  std::atomic<EngineState> state_{EngineState::kRunning};
  std::mutex state_mu_;
  std::condition_variable state_cv_;

  std::thread loop_;  // last: started when everything above exists
};

}  // namespace siesta
