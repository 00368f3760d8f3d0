// SampledToken: what the sampler returns for one sequence in one step.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace siesta {

struct TokenLogprob {
  int32_t token = 0;
  double logprob = 0.0;  // natural log, from the raw logits' log-softmax (fp64)
  int32_t rank = 1;      // 1 + number of tokens with a strictly larger logprob
};

struct TokenLogprobs {
  TokenLogprob chosen;             // the sampled token
  std::vector<TokenLogprob> top;   // the n most likely, most likely first (ties: lower id first)
};

// One row of logits (vocab_size values), shared without copying.
using LogitsRow = std::shared_ptr<const std::vector<float>>;

struct SampledToken {
  int32_t token = 0;
  std::optional<TokenLogprobs> logprobs;  // when SamplingParams::logprobs is set
  // The logits the token was sampled from, kept only where the scheduler
  // asked (ScheduledSequence::keep_logits: a P/D producer's first token, which
  // the decode engine samples again from the same row). Null otherwise.
  LogitsRow logits;
};

}  // namespace siesta
