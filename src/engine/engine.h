// Engine: one model serving requests. Owns the memory pool (every byte of
// weights, KV cache and activation scratch), the model, the tokenizer, the
// BlockPool, the Scheduler, the Sampler and the thread that runs the engine
// loop (run_step, again and again, while there is work).
//
// Lifecycle
//   auto engine = Engine::create(options).value();    // loads, allocates, starts the loop
//   OutputStream s = engine->submit({request}).value();  // any thread
//   ... s.next(deadline) until s.finished() ...        // see engine_stream.h
//   engine->abort(id);                                 // any thread, any state
//   engine->pause(PauseMode::kKeep, deadline); engine->resume(deadline);
//   // with options.enable_sleep_mode (engine_state.h has the state table):
//   engine->sleep(1, PauseMode::kKeep, deadline);      // weights to host, KV and scratch released
//   engine->wake_up({memory::Tag::kWeights}, deadline); // partial: still not scheduling
//   engine->reload_weights(dir, deadline);             // optional: new weights in place
//   engine->update_weights(update, deadline);          // or pushed ones (shm, CUDA IPC; weight_update.h)
//   engine->wake_up(memory::TagSet::all(), deadline);  // everything resident: scheduling resumes
//   engine.reset();                                    // stops the loop; unfinished requests
//                                                      // end as aborted with an error
//
// Sleep and wake. Requests kept by a pause (mode keep) or running when sleep
// is called recompute after wake (their KV is gone), never fail. Requests
// submitted while the engine does not admit (paused or asleep) wait in the
// inbox, at most options.max_held_requests; beyond that submit answers
// kUnavailable. The KV cache comes back with every block free and the prefix
// cache empty. After a level-2 sleep the weights are zero when woken: the
// wake that makes every tag resident reads the checkpoint of weights_dir
// again unless reload_weights or update_weights already wrote every tensor;
// when some tensors were pushed since, or the weights last held pushed
// tensors, it reads nothing (that would serve weights nobody asked for) and
// refuses (kConflict) until the rest is pushed or reloaded. Before the KV cache is released
// the KvConnector's release_transfer_kv ends transfers.
//
// Every lifecycle call (pause, resume, sleep, wake_up, release_kv_cache_memory,
// reload_weights, reset_prefix_cache) is idempotent, waits with a deadline,
// and answers the EngineStatus it left (engine_status.h); a call the state
// does not allow is kConflict saying what to call first; nothing changes then.
// A failure in the middle (out of memory at wake) leaves a state the next call
// can repair, and says so.
//
// Thread safety: submit, abort, the lifecycle calls, status, memory_report,
// metrics, state and the const accessors may be called from any thread at any
// time; lifecycle calls are serialised among themselves. The model, the pool's
// state changes and the scheduler are touched only by the loop thread; calls
// that must change them run on the loop between two steps (run_on_loop) and
// wait for it with a deadline.
//
// The loop: take new submissions (while admitting) and aborts from the inbox,
// run queued commands, poll the KvConnector, run one step while scheduling,
// send each request's new tokens and text to its stream, publish metrics. When
// there is nothing to do it waits for the inbox (with a deadline, so it never
// sleeps unbounded).
//
// P/D: a KvConnector given to create() is called at the points
// engine_connector.h lists; EngineRequest carries kv_transfer_params and
// RequestFinish returns the connector's answer.
#pragma once

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
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
#include "engine/engine_status.h"
#include "engine/engine_stream.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "memory/memory_pool.h"
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
  // Pausing a paused or sleeping engine applies the mode and changes no state.
  // clear_cache (vLLM's default over HTTP): then the prefix cache is emptied
  // as reset_prefix_cache(true) does, P/D transfers ended first; if that
  // fails the pause is undone and the answer says so.
  Result<EngineStatus> pause(PauseMode mode, Deadline deadline, bool clear_cache = false);
  // Scheduling again. A KV cache released by release_kv_cache_memory is
  // mapped first. kConflict while asleep (wake_up first). A lifecycle call
  // that is waiting (for KV blocks held by transfers, or for requests to
  // drain) when resume comes gives up, says so, and leaves the engine as it
  // was; the resume then runs.
  Result<EngineStatus> resume(Deadline deadline);

  // Sleep mode (options.enable_sleep_mode; kInvalidArgument without it).
  // Level 0: pause only. Level 1: weights copied to host memory, then weights,
  // KV cache and scratch released. Level 2: everything released. A running
  // engine is paused first with `mode`. Sleeping deeper than now works (1 then
  // 2 drops the host copy); shallower changes nothing.
  Result<EngineStatus> sleep(int level, PauseMode mode, Deadline deadline);
  // Maps the tags' memory again at the same addresses (kv_cache brings scratch
  // with it): weights restored from the host copy, or zero after level 2; the
  // KV cache with every block free. Scheduling resumes only when every tag is
  // resident (status.not_resident says what is missing after a partial wake).
  Result<EngineStatus> wake_up(memory::TagSet tags, Deadline deadline);
  // Releases the KV cache of a paused engine (kConflict when it schedules).
  Result<EngineStatus> release_kv_cache_memory(Deadline deadline);
  // Reads a checkpoint into the weights in place: `model_dir`, or the one the
  // weights hold now. Only while the scheduler is stopped (kConflict while it
  // runs: pause or sleep first) and the weights are resident (wake_up
  // tags=weights first); the checkpoint must have the model's shapes
  // (kInvalidArgument naming the differences). The prefix cache is emptied:
  // its KV came from the old weights.
  Result<EngineStatus> reload_weights(std::optional<std::filesystem::path> model_dir, Deadline deadline);
  // Writes new weights in place (model/weight_update.h): tensors pushed by a
  // trainer through host shared memory (CPU and CUDA) or CUDA IPC (CUDA), or
  // a checkpoint directory (an empty path: the one the weights hold). The
  // same states as reload_weights (kConflict otherwise). Every name, shape,
  // dtype and byte range is checked before the first byte is written
  // (kInvalidArgument naming each tensor at fault; nothing changes); then KV
  // transfers end and the prefix cache is emptied as reset_prefix_cache(true)
  // does (its KV came from the old weights; a failure there changes nothing
  // either), then the tensors are written. status.call.weights_update says
  // what was written, how many bytes, how fast.
  Result<EngineStatus> update_weights(WeightUpdate update, Deadline deadline);
  // Empties the prefix cache. Running requests refuse it (kConflict) unless
  // reset_running_requests, which preempts them (they recompute). P/D
  // transfers holding blocks are ended first (loads recompute, readers are
  // told) and the call waits, with its deadline, for their blocks.
  Result<EngineStatus> reset_prefix_cache(bool reset_running_requests, Deadline deadline);

  EngineState state() const { return state_.load(); }
  EngineStatus status() const;
  // Pool bytes per tag and state, process RSS, and the pool's device.
  EngineMemoryReport memory_report(Deadline deadline) const;

  // The engine's metrics, with the P/D connector's (kv_transfer) when it has one.
  EngineMetricsSnapshot metrics() const;
  const Tokenizer& tokenizer() const { return tokenizer_; }
  const ModelConfig& model_config() const { return model_->config(); }
  const EngineLimits& limits() const { return limits_; }
  const EngineOptions& options() const { return options_; }

 private:
  // Checks a weight update of the model (CpuQwen3 / CudaQwen3::prepare_weight_update).
  using WeightsPreparer = std::function<Result<std::unique_ptr<PreparedWeightUpdate>>(const WeightUpdate&)>;

  Engine(EngineOptions options, EngineLimits limits, Tokenizer tokenizer, std::unique_ptr<ThreadPool> threads,
         std::unique_ptr<memory::MemoryPool> memory, std::unique_ptr<Model> model, WeightsPreparer prepare_weights,
         KvCacheMemory kv, std::unique_ptr<BlockPool> pool, std::unique_ptr<Scheduler> scheduler,
         std::unique_ptr<KvConnector> connector);

  // Runs fn on the loop thread between two steps and returns its result;
  // kTimeout if the deadline passes first (a command not yet started is dropped).
  Result<void> run_on_loop(std::function<Result<void>()> fn, Deadline deadline) const;
  // The one place state_ changes (next_engine_state); logs the change.
  Result<EngineState> transition(EngineEvent event);
  Result<void> require_sleep_mode(const char* call) const;
  // The status a lifecycle call answers: status() with what the call did, timed from `start`.
  EngineStatus status_after(std::chrono::steady_clock::time_point start, EngineCallReport report) const;

  // Lifecycle work on the loop thread.
  Result<void> pause_on_loop(PauseMode mode);
  Result<void> sleep_on_loop(int level, Deadline deadline, EngineCallReport& report);
  Result<void> wake_on_loop(memory::TagSet tags, EngineCallReport& report);
  Result<void> release_kv_on_loop(Deadline deadline, EngineCallReport& report);
  // Checks `update`, then (with reset_kv) ends KV transfers and empties the
  // prefix cache as reset_prefix_cache(true) does, then writes; records what
  // the weights now hold. A failed check or reset changes nothing.
  Result<void> update_on_loop(const WeightUpdate& update, const std::string& call, bool reset_kv, Deadline deadline,
                              EngineCallReport& report);
  // Refuses (kConflict) unless the scheduler is stopped and the weights are resident.
  Result<void> require_weights_writable(const std::string& call) const;
  // Takes every KV block back so that the cache can be reset (kReset) or its
  // memory released (kMemory): running requests recompute, the connector
  // ends its transfers (release_transfer_kv), the loop polls it until every
  // block it held is free (with the deadline; a resume coming meanwhile also
  // ends the wait), then the prefix cache is emptied. A failure resets and
  // releases nothing and leaves the KV cache registered.
  Result<KvReleaseReport> release_kv_blocks(KvReleaseScope scope, const std::string& call, Deadline deadline);
  // Registers a resident KV cache with the connector again when it is not
  // (after a release that went no further, a wake, a resume); logs a failure.
  void restore_kv_registration(const std::string& call);
  // Waits on state_cv_ until the engine stops scheduling or a resume comes; false at the deadline.
  bool wait_until_stopped(std::unique_lock<std::mutex>& state_lock, Deadline deadline);
  // A call that paused an engine that was scheduling (`before`) and then failed resumes it.
  Result<void> undo_pause(EngineState before);
  // Requests held (paused or asleep) longer than max_held_seconds end with an error.
  void expire_held(std::chrono::steady_clock::time_point now);
  // weights_loaded_ is cleared when the pool says weights were released.
  void note_weights_released();

  friend class LifecycleTurn;

  void run_loop();
  void admit(std::vector<EngineSubmission>& submissions);
  void apply_aborts(const std::vector<RequestId>& ids);
  void abort_all(const std::optional<Status>& error);
  void poll_connector();
  // A load that brought the producer's logits: samples the first token from
  // them and hands it to the scheduler. nullopt: use the KV alone (the last
  // prompt token is computed here).
  std::optional<RequestOutput> continue_from_remote_logits(const FinishedLoad& f);
  bool step();
  void publish_metrics();

  const EngineOptions options_;
  const EngineLimits limits_;
  Tokenizer tokenizer_;
  std::unique_ptr<ThreadPool> threads_;
  std::unique_ptr<memory::MemoryPool> memory_;  // before everything allocated from it
  std::unique_ptr<Model> model_;
  WeightsPreparer prepare_weights_;
  const size_t num_weight_tensors_;  // updatable_tensors(config)
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
  // resume() calls waiting for their turn (a waiting lifecycle call gives up for them).
  std::atomic<int> resumes_waiting_{0};
  // The KV cache is registered with the connector (loop thread).
  bool kv_registered_ = false;
  std::mutex state_mu_;
  std::condition_variable state_cv_;
  // One lifecycle call at a time, so they never interleave; a mutex and a
  // condition variable rather than a timed_mutex, which ThreadSanitizer
  // cannot follow.
  struct LifecycleGate {
    std::mutex mu;
    std::condition_variable cv;
    bool busy = false;
  };
  LifecycleGate lifecycle_;
  // Written on the loop, read by status() from any thread.
  mutable std::mutex weights_mu_;
  bool weights_loaded_ = true;
  std::filesystem::path weights_dir_;
  // Since the weights were last released: which tensors (updatable_tensors
  // order) an update wrote again. Meaningful while !weights_loaded_.
  std::vector<bool> weights_written_;
  // The weights hold pushed tensors (shm, cuda_ipc) since the last full
  // checkpoint read; also after a release, until a checkpoint is read again.
  bool weights_pushed_ = false;
  WeightSource weights_source_ = WeightSource::kDir;

  std::thread loop_;  // last: started when everything above exists
};

}  // namespace siesta
