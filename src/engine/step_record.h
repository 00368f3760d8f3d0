// StepShape and EngineStepRecord: what one engine step computed and when,
// for a benchmark that sets each step against its floor (bytes read / copy
// bandwidth) or looks for where a request's time goes.
//
//   EngineOptions o;
//   o.step_observer = [&](const EngineStepRecord& r) { records.push_back(r); };  // on the loop thread
//   StepShape s;  run_step(scheduler, model, kv, sampler, logits, true, &s);       // or a step alone
//
// The engine calls options.step_observer on its loop thread after every step
// that computed something (a step with nothing scheduled, or a failed one,
// is not recorded), once its outputs reached their streams: a consumer that
// saw a request finish may get that step's record a moment later. The
// observer runs inside the loop: it must return quickly and must not call
// the engine.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

namespace siesta {

// The batch of one step (SchedulerOutput), in numbers.
struct StepShape {
  int32_t sequences = 0;       // sequences in the step
  int32_t decodes = 0;         // ... computing one token after their prompt (decode)
  int32_t samples = 0;         // ... whose step ends in a sampled token
  int32_t batched_tokens = 0;  // new tokens of every sequence
  int32_t prefill_tokens = 0;  // ... of the sequences that are not decodes (prompt chunks, recompute)
  // Positions whose KV the step's attention reads: for each sequence the
  // tokens already cached plus its new ones (start_pos + num_tokens).
  int64_t context_tokens = 0;
};

// One step as the engine loop ran it (steady clock).
struct EngineStepRecord {
  std::chrono::steady_clock::time_point start;      // before Scheduler::schedule
  std::chrono::steady_clock::time_point computed;   // run_step returned: forward, sampling, Scheduler::update
  std::chrono::steady_clock::time_point delivered;  // the step's outputs processed and pushed to their streams
  StepShape shape;
};

using StepObserver = std::function<void(const EngineStepRecord&)>;

}  // namespace siesta
