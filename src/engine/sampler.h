// Sampler: one row of logits -> one token, as a request's SamplingParams say.
//
//   Sampler sampler(model.config().eos_token_ids, RandomGenerator::from_entropy());
//   SampledToken t = sampler.sample(out.last(i), request.params, request.num_output_tokens());
//
// `step` is the index of the token being generated among the request's outputs
// (0 for the first). It keys a seeded request's random stream (random.h), so
// sampling step n of a request gives the same draw whatever is batched with it
// and however often it was preempted and recomputed; and it decides min_tokens
// masking (eos and stop token ids are excluded while step < min_tokens).
// `history` (the request's prompt and generated tokens) feeds the penalties,
// bad words and forced tokens; like the draw, it depends on the request alone.
//
// Before the filters the logits are adjusted in vLLM's order (sampling_params.h):
// allowed_token_ids, bad_words, min_tokens, logit_bias, then the repetition,
// frequency and presence penalties, in fp64.
// The draw is one uniform number per token, inverted through the cumulative
// distribution of the candidates that survive temperature, min-p, top-k and
// top-p (in vLLM's order), accumulated in fp64 in a fixed order. Greedy
// sampling (temperature 0) takes the largest logit, ties to the lowest id, and
// uses no randomness. NaN logits count as -inf.
//
// Thread safety: a Sampler holds scratch buffers and the engine generator; use
// one per engine loop, from one thread. The free functions are reentrant.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "engine/random.h"
#include "engine/sampled_token.h"
#include "engine/sampling_params.h"
#include "model/forward.h"

namespace siesta {

// What a request has seen so far: its prompt and the tokens it generated
// before this step. Spans into the request's own tokens; empty for callers
// that use none of the adjustments that read it.
struct TokenHistory {
  std::span<const int32_t> prompt;
  std::span<const int32_t> output;
};

class Sampler {
 public:
  // eos_token_ids: the model's end-of-sequence ids (masked during min_tokens
  // unless ignore_eos). unseeded: the generator for requests without a seed.
  Sampler(std::vector<int32_t> eos_token_ids, RandomGenerator unseeded);

  SampledToken sample(std::span<const float> logits, const SamplingParams& params, uint64_t step,
                      const TokenHistory& history = {});

  // sample() in two halves, for a model that chooses tokens on its device
  // (Model::forward_choose): draw() takes the step's random draw (from the
  // request's own stream, or one value of the engine's for an unseeded
  // random request; 0 for greedy), in the order sample() would take it;
  // device_choice() says how the device picks the token with that draw, or
  // nullopt when only the host can (log-probabilities asked for, more banned
  // ids than a device takes, logits adjusted by penalties, bias, allowed or
  // bad tokens, a forced token at this step); `banned` holds the ids the
  // choice names.
  // sample_drawn() is the host's pick with a draw already taken (a row the
  // device could not decide).
  //
  // One difference remains: when every token but the stop tokens of
  // min_tokens is -inf, sample() keeps one stop token samplable, while a
  // device bans them all; real models give finite logits to every token.
  double draw(const SamplingParams& params, uint64_t step);
  std::optional<TokenChoice> device_choice(const SamplingParams& params, uint64_t step, double u,
                                           std::vector<int32_t>& banned, const TokenHistory& history = {}) const;
  SampledToken sample_drawn(std::span<const float> logits, const SamplingParams& params, uint64_t step, double u,
                            const TokenHistory& history = {});

  const std::vector<int32_t>& eos_token_ids() const { return eos_token_ids_; }

  struct Candidate {
    double score;
    int32_t token;
  };
  // Per-token scratch of the penalties (zero between calls).
  struct Scratch {
    std::vector<Candidate> work;
    std::vector<int32_t> counts;
    std::vector<uint8_t> seen;
  };

 private:
  std::vector<int32_t> eos_token_ids_;
  RandomGenerator unseeded_;
  Scratch scratch_;
};

// One sequence, one token: the entry point for `siesta generate`. Requests
// without params.seed draw from `unseeded`.
int32_t sample(std::span<const float> logits, const SamplingParams& params, uint64_t step,
               RandomGenerator& unseeded, std::span<const int32_t> eos_token_ids = {},
               const TokenHistory& history = {});

// The token params.forced_tokens puts at `step`, if any (sampling_params.h).
std::optional<int32_t> forced_token(const SamplingParams& params, uint64_t step, const TokenHistory& history);

// Log-probabilities of the raw logits (fp64 log-softmax): the chosen token's,
// with its rank, and the top n (most likely first, ties to the lower id).
TokenLogprobs compute_logprobs(std::span<const float> logits, int32_t chosen, int32_t n);

}  // namespace siesta
