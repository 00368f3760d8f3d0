// SamplingParams: how one request turns logits into tokens and when it stops.
// A plain value, copied into the request at submission; the same fields and
// defaults as vLLM's SamplingParams where vLLM has them.
//
//   SamplingParams p;                  // temperature 1, no filters, 16 tokens
//   p.temperature = 0;                 // greedy
//   p.seed = 42;                       // reproducible whatever else is batched
//   if (auto ok = p.validate(); !ok) return ok.error();   // one line naming the field
//
// The logits are adjusted first, in vLLM's order: allowed_token_ids, then
// bad_words, then min_tokens, then logit_bias, then the repetition,
// frequency and presence penalties. Then the filters, in vLLM's order:
// temperature, then min-p, then top-k, then top-p over what is left.
// Logprobs are always those of the raw logits (vLLM's raw_logprobs).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
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
  // Top-n log-probabilities of every prompt token after the first (0..20),
  // plus the prompt token's own; unset = none. Such a request never reads the
  // prefix cache (as in vLLM: every prompt position needs its logits).
  std::optional<int32_t> prompt_logprobs;

  // Penalties, as vLLM (and OpenAI) define them. presence and frequency
  // count the generated tokens only: logit -= frequency * count + presence *
  // (count > 0). repetition counts prompt and generated tokens: a token seen
  // in either has a positive logit multiplied by 1/repetition and a negative
  // one by repetition.
  double presence_penalty = 0.0;    // [-2, 2]; 0 = off
  double frequency_penalty = 0.0;   // [-2, 2]; 0 = off
  double repetition_penalty = 1.0;  // > 0; 1 = off
  // Added to the token's logit (token id, bias in [-100, 100]); ascending ids, each once.
  std::vector<std::pair<int32_t, double>> logit_bias;
  // Only these tokens may be chosen (ascending, each once); empty = any.
  std::vector<int32_t> allowed_token_ids;
  // Token sequences that may not be generated: the last token of one is
  // banned when the generated tokens end with the others (vLLM's bad_words,
  // tokenized by the server).
  std::vector<std::vector<int32_t>> bad_words_token_ids;
  // Tokens emitted as they are instead of sampled, starting at the first
  // generated token, or right after the first generated `force_after_token`
  // when that is set (a tool call forced after the model's reasoning ends).
  std::vector<int32_t> forced_tokens;
  std::optional<int32_t> force_after_token;

  bool greedy() const { return temperature < kGreedyTemperature; }
  // Something adjusts the logits before the filters (penalties, bias,
  // allowed or bad tokens): the device samplers leave such rows to the host.
  bool adjusts_logits() const {
    return presence_penalty != 0.0 || frequency_penalty != 0.0 || repetition_penalty != 1.0 || !logit_bias.empty() ||
           !allowed_token_ids.empty() || !bad_words_token_ids.empty();
  }

  // Checks every range; the message names the field, the rule and the value.
  Result<void> validate() const;
};

}  // namespace siesta
