// SchedulerOutput: what one engine step computes, as Scheduler::schedule()
// decided it.
//
// `chunks` is the batch for Model::forward, in the same order as `sequences`.
// Its spans point into the scheduler's requests: valid until the step's
// Scheduler::update() and only if nothing else is called on the scheduler in
// between.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/request.h"
#include "engine/sampling_params.h"
#include "model/forward.h"

namespace siesta {

struct ScheduledSequence {
  RequestId request_id;
  int32_t start_pos = 0;    // tokens already in the KV cache
  int32_t num_tokens = 0;   // new tokens this step
  // The step reaches the request's last known token: the logits of its last
  // new token give the next token (sample it with `params` at `sample_step`).
  bool sample = false;
  const SamplingParams* params = nullptr;
  uint64_t sample_step = 0;  // the request's number of generated tokens so far
  // Keep the sampled row of logits with the token (SampledToken::logits): the
  // first token of a request whose blocks are held for a remote reader.
  bool keep_logits = false;
  // The request's prompt and generated tokens (penalties, bad words, forced
  // tokens: Sampler's TokenHistory), and whether this step scores its prompt
  // (chunk.all_logits: the row of position p gives the log-probability of
  // prompt token p + 1). Spans valid as `chunks` are.
  std::span<const int32_t> prompt_tokens;
  std::span<const int32_t> output_tokens;
  bool prompt_logprobs = false;
};

struct SchedulerOutput {
  std::vector<SequenceChunk> chunks;
  std::vector<ScheduledSequence> sequences;
  int32_t num_batched_tokens = 0;
  std::vector<RequestId> preempted;  // sent back to the waiting queue by this step

  bool empty() const { return sequences.empty(); }
  size_t num_samples() const {
    size_t n = 0;
    for (const ScheduledSequence& s : sequences) n += s.sample;
    return n;
  }
};

}  // namespace siesta
