// OutputProcessor: what the engine loop keeps per live request beside the
// scheduler's Request: where its outputs go (a StreamState and an index), its
// text (incremental detokenizer, stop strings) and its timings for the
// metrics. It turns each step's RequestOutputs into RequestDeltas.
//
//   outputs.add(request, stream, index, arrival);     // as the request enters the scheduler
//   outputs.process(step_outputs, scheduler, now);    // after every step
//   outputs.finish_aborted(id, &aborted, error, now); // after Scheduler::abort
//
// Stop strings: text goes through the request's StopStringChecker; a match
// ends the request through Scheduler::stop (finish reason "stop", stop_reason
// the string), even when the same token also reached the length limit, as
// vLLM does. Stop strings are looked for only in tokens after min_tokens.
//
// A step's deltas reach their streams first and wake each stream's consumer
// once after, so a stream of many requests (one submit of a batch) is not
// woken, and its lock taken from the loop, once per request.
//
// Not thread-safe: owned and called by the engine loop.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "engine/engine_connector.h"
#include "engine/engine_metrics.h"
#include "engine/engine_request.h"
#include "engine/engine_stream.h"
#include "engine/request_output.h"
#include "engine/scheduler.h"
#include "engine/stop_string_checker.h"
#include "model/tokenizer.h"

namespace siesta {

class OutputProcessor {
 public:
  using Clock = std::chrono::steady_clock;

  // released(id) is called when a request ends, before its final delta is
  // pushed (so a consumer that sees the end may reuse the id at once).
  OutputProcessor(const Tokenizer& tokenizer, EngineMetrics& metrics,
                  std::function<void(const RequestId&)> released);

  void add(EngineRequest request, std::shared_ptr<StreamState> stream, size_t index, Clock::time_point arrival);
  bool contains(const RequestId& id) const { return live_.count(id) > 0; }
  std::vector<RequestId> ids() const;
  size_t size() const { return live_.size(); }

  // One step's outputs. connector (may be null) gives finished requests their kv_transfer_params.
  void process(const std::vector<RequestOutput>& outputs, Scheduler& scheduler, KvConnector* connector,
               Clock::time_point now);
  // Ends a live request as aborted. `aborted`: what Scheduler::abort returned
  // (null if the scheduler did not have it). error: why the engine ended it, if it did.
  void finish_aborted(const RequestId& id, const RequestOutput* aborted, std::optional<Status> error,
                      Clock::time_point now);

 private:
  struct Live {
    EngineRequest request;
    std::shared_ptr<StreamState> stream;
    size_t index = 0;
    IncrementalDetokenizer detokenizer;
    StopStringChecker stops;
    Clock::time_point arrival;
    Clock::time_point last_token;
    int32_t num_output_tokens = 0;
  };

  // Pushes without waking the stream's consumer; wake_pushed() wakes each once.
  void push_quiet(Live& live, RequestDelta delta);
  void wake_pushed();
  void finish(Live& live, RequestDelta delta, RequestFinish finish, Clock::time_point now, bool notify);

  const Tokenizer& tokenizer_;
  EngineMetrics& metrics_;
  std::function<void(const RequestId&)> released_;
  std::unordered_map<RequestId, Live> live_;
  std::vector<std::shared_ptr<StreamState>> pushed_;  // streams pushed to in this process() call
};

}  // namespace siesta
