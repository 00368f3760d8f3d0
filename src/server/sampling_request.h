// The sampling fields shared by /v1/completions and /v1/chat/completions,
// read into SamplingParams with OpenAI's and vLLM's names and defaults.
//
//   SamplingDefaults d = SamplingDefaults::load(model_dir);   // generation_config.json
//   SIESTA_ASSIGN_OR_RETURN(SamplingRequest s, parse_sampling(body, ApiKind::kChat, d, vocab_size));
//
// Defaults: temperature 1, top_p 1, top_k off, min_p 0, repetition_penalty
// 1, unless the model's generation_config.json sets them (vLLM's
// --generation-config auto); a request's own values win. max_tokens defaults
// to 16 for completions and to "up to max_model_len" for chat
// (max_completion_tokens wins over max_tokens).
// vLLM's sampling fields, with vLLM's ranges and messages where it has them:
// presence/frequency/repetition penalties, logit_bias (token id strings to
// biases, clamped to [-100, 100]), allowed_token_ids, bad_words (tokenized
// as vLLM does: the word as written and with a leading space), min_tokens,
// prompt_logprobs, truncate_prompt_tokens / truncation_side. Refused: beam
// search, best_of other than n, priority other than 0.
// Pure functions and values.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "common/status.h"
#include "engine/sampling_params.h"
#include "model/tokenizer.h"

namespace siesta::server {

enum class ApiKind { kCompletion, kChat };

struct SamplingDefaults {
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int32_t> top_k;
  std::optional<double> min_p;
  std::optional<double> repetition_penalty;

  // Reads DIR/generation_config.json if present; fields it lacks stay unset.
  static SamplingDefaults load(const std::filesystem::path& model_dir);
};

struct SamplingRequest {
  SamplingParams params;
  int32_t n = 1;                    // choices per prompt
  bool skip_special_tokens = true;
  std::string cache_salt;
  bool chat_logprobs = false;       // chat: `logprobs: true` (top_logprobs in params.logprobs)
  // truncate_prompt_tokens: keep this many prompt tokens (-1: max_model_len),
  // the last ones (truncation_side "left", the default) or the first ones.
  std::optional<int64_t> truncate_prompt_tokens;
  bool truncate_left = true;
  bool return_tokens_as_token_ids = false;
};

inline constexpr int32_t kMaxChoices = 128;

Result<SamplingRequest> parse_sampling(const nlohmann::json& body, ApiKind kind, const SamplingDefaults& defaults,
                                       const Tokenizer& tokenizer);

// vLLM's tokenization of bad_words: each word (leading whitespace dropped) as
// written, and with a leading space when that gives a different first token
// and as many tokens.
std::vector<std::vector<int32_t>> bad_words_token_ids(const std::vector<std::string>& words, const Tokenizer& tok);

}  // namespace siesta::server
