// SamplingParams: how one request turns logits into tokens and when it stops.
// A plain value, copied into the request at submission; the same fields and
// defaults as vLLM's SamplingParams where vLLM has them.
//
//   SamplingParams p;                  // temperature 1, no filters, 16 tokens
//   p.temperature = 0;                 // greedy
//   p.seed = 42;                       // reproducible whatever else is batched
//   if (auto ok = p.validate(); !ok) return ok.error();   // one line naming the field
//
// Filters apply in vLLM's order: temperature, then min-p, then top-k, then
// top-p over what is left. Logprobs are always those of the raw logits.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace siesta {

struct SamplingParams {
  // Below this, sampling is greedy (vLLM's _SAMPLING_EPS).
  static constexpr double kGreedyTemperature = 1e-5;
  static constexpr int kMaxLogprobs = 20;

  double temperature = 1.0;       // >= 0; 0 = greedy (ties: the lowest token id)
  double top_p = 1.0;             // (0, 1]; 1 = off
  int32_t top_k = 0;              // 0 or -1 = off, else >= 1
  double min_p = 0.0;             // [0, 1]; 0 = off
  std::optional<uint64_t> seed;   // set: draws come from the request's own stream

  // Tokens to generate at most; unset = until the model's length limit.
  std::optional<int32_t> max_tokens = 16;
  // No stop (eos, stop token, stop string) before this many tokens; eos and
  // stop token ids are masked out of sampling until then.
  int32_t min_tokens = 0;
  std::vector<int32_t> stop_token_ids;  // end the request after any of these (the token is kept)
  std::vector<std::string> stop;        // stop strings, matched on the detokenized text
  bool include_stop_str_in_output = false;
  bool ignore_eos = false;              // the model's eos ids do not end the request

  // Top-n log-probabilities per generated token (0..20), plus the chosen
  // token's; unset = none.
  std::optional<int32_t> logprobs;

  bool greedy() const { return temperature < kGreedyTemperature; }

  // Checks every range; the message names the field, the rule and the value.
  Result<void> validate() const;
};

}  // namespace siesta
