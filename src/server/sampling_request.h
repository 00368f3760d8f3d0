// The sampling fields shared by /v1/completions and /v1/chat/completions,
// read into SamplingParams with OpenAI's and vLLM's names and defaults.
//
//   SamplingDefaults d = SamplingDefaults::load(model_dir);   // generation_config.json
//   SIESTA_ASSIGN_OR_RETURN(SamplingRequest s, parse_sampling(body, ApiKind::kChat, d, vocab_size));
//
// Defaults: temperature 1, top_p 1, top_k off, min_p 0, unless the model's
// generation_config.json sets them (vLLM's --generation-config auto); a
// request's own values win. max_tokens defaults to 16 for completions and to
// "up to max_model_len" for chat (max_completion_tokens wins over
// max_tokens). Fields the sampler does not implement are refused when they
// would change the output (presence/frequency/repetition penalties,
// logit_bias, best_of > n, beam search), accepted at their neutral values.
// Pure functions and values.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "common/status.h"
#include "engine/sampling_params.h"

namespace siesta::server {

enum class ApiKind { kCompletion, kChat };

struct SamplingDefaults {
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int32_t> top_k;
  std::optional<double> min_p;

  // Reads DIR/generation_config.json if present; fields it lacks stay unset.
  static SamplingDefaults load(const std::filesystem::path& model_dir);
};

struct SamplingRequest {
  SamplingParams params;
  int32_t n = 1;                    // choices per prompt
  bool skip_special_tokens = true;
  std::string cache_salt;
  bool chat_logprobs = false;       // chat: `logprobs: true` (top_logprobs in params.logprobs)
};

inline constexpr int32_t kMaxChoices = 128;

Result<SamplingRequest> parse_sampling(const nlohmann::json& body, ApiKind kind, const SamplingDefaults& defaults,
                                       int32_t vocab_size);

}  // namespace siesta::server
