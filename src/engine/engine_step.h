// run_step: one engine step on the calling thread: schedule, forward, sample,
// update. The engine loop calls it repeatedly; `siesta generate` and tests
// call it directly.
//
//   ForwardOutput logits;                       // reused across steps
//   while (scheduler.has_unfinished()) {
//     Result<std::vector<RequestOutput>> outs = run_step(scheduler, model, kv, sampler, logits);
//     if (!outs) ...;                           // forward failed: see below
//   }
//
// A model that chooses tokens on its device (Model::chooses_tokens, the CUDA
// model) picks them there with the sampler's settings and draws, and only
// the tokens come back, unless choose_on_device is false (then every row
// comes back and the host samples). In one forward_choose call, a sequence
// that needs its logits here (log-probabilities, a P/D producer's first
// token, penalties, logit_bias, allowed or bad tokens, a forced token, a
// scored prompt) gets its rows back and the host sampler picks its token
// with the same draw, while its batch-mates are still chosen on the device:
// each sequence takes the path its own request decides, so what it is
// batched with does not change how its token is picked. A scored prompt
// (SamplingParams::prompt_logprobs) takes all its chunk's rows and hands
// their log-probabilities to Scheduler::update.
//
// `shape`, when given, gets the step's batch in numbers (step_record.h), also
// when the forward fails; an empty step leaves it zero.
//
// An empty result means nothing was scheduled (all waiting for blocks or for
// remote KV). If forward fails, no request advances (computed tokens move only
// in update) and the error is returned; the caller decides whether to retry or
// to abort the requests of that step (SchedulerOutput is not kept).
#pragma once

#include <optional>
#include <vector>

#include "common/status.h"
#include "engine/request_output.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/step_record.h"
#include "model/forward.h"

namespace siesta {

Result<std::vector<RequestOutput>> run_step(Scheduler& scheduler, Model& model, const KvCacheView& kv,
                                            Sampler& sampler, ForwardOutput& logits, bool choose_on_device = true,
                                            StepShape* shape = nullptr);

}  // namespace siesta
