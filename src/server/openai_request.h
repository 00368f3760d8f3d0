// A /v1/completions or /v1/chat/completions body, read into a
// GenerationJob: the engine requests to submit (one per choice) and how to
// render their outputs. Reading only: no engine, no sockets.
//
//   SIESTA_ASSIGN_OR_RETURN(GenerationJob job, parse_completion_request(body, tokenizer, defaults));
//   assign_request_ids(job, "cmpl-3f2a...");     // request ids: BASE-0, BASE-1, ...
//   engine.submit(job.requests) ...
//
// Completions: `prompt` is a string, a list of token ids, or a list of either
// (a batch); each prompt gives `n` choices, choice index = prompt * n + k, as
// vLLM numbers them. With a seed, choice k of a prompt samples with seed + k
// (vLLM's parallel sampling). `echo` prepends the prompt's text to each choice
// (refused together with logprobs: prompt logprobs are not computed).
// Chat: `messages` rendered in the Qwen3 chat format (chat_prompt.h), with
// `chat_template_kwargs.enable_thinking`, `add_generation_prompt` and
// `continue_final_message`; text parts of a content array are joined with
// "\n". Tools and non-text content are refused.
// Both: `stream`, `stream_options.include_usage`, vLLM's `return_token_ids`,
// `kv_transfer_params` (passed to the engine as is). Pure functions.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/engine_request.h"
#include "model/tokenizer.h"
#include "server/chat_prompt.h"
#include "server/sampling_request.h"

namespace siesta::server {

struct GenerationJob {
  ApiKind kind = ApiKind::kCompletion;
  std::optional<std::string> model;          // as the client named it
  std::vector<EngineRequest> requests;       // one per choice, in choice order
  std::vector<size_t> prompt_of_choice;      // the prompt each choice continues
  std::vector<std::string> echo;             // per choice: text put before the output (completions' echo)
  std::string prompt_text;                   // chat: the rendered conversation
  bool stream = false;
  bool include_usage = false;                // stream_options.include_usage
  bool return_token_ids = false;
  std::optional<int32_t> logprobs;           // top-n per token (chat: top_logprobs)
  bool chat_logprobs = false;                // chat: `logprobs: true`
};

Result<GenerationJob> parse_completion_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                               const SamplingDefaults& defaults);
Result<GenerationJob> parse_chat_request(const nlohmann::json& body, const Tokenizer& tokenizer,
                                         const SamplingDefaults& defaults);

// Reads a chat `messages` array (also used by /tokenize).
Result<std::vector<ChatMessage>> parse_chat_messages(const nlohmann::json& messages);

// The Qwen3 chat prompt of `messages` with the body's add_generation_prompt,
// continue_final_message and chat_template_kwargs.enable_thinking, as
// /v1/chat/completions and /tokenize render it.
Result<std::string> render_chat_body(const nlohmann::json& body, const nlohmann::json& messages);

void assign_request_ids(GenerationJob& job, const std::string& base);

}  // namespace siesta::server
