// A /v1/completions or /v1/chat/completions body, read into a
// GenerationJob: the engine requests to submit (one per choice) and how to
// render their outputs. Reading only: no engine, no sockets.
//
//   RequestContext ctx{tokenizer, defaults, &chat_template, chat_config, max_model_len};
//   SIESTA_ASSIGN_OR_RETURN(GenerationJob job, parse_completion_request(body, ctx));
//   assign_request_ids(job, "cmpl-3f2a...");     // request ids: BASE-0, BASE-1, ...
//   engine.submit(job.requests) ...
//
// Every field is checked first (request_fields.h): unknown fields and
// fields this server cannot honour are refused, naming the field.
// Completions: `prompt` is a string, a list of token ids, or a list of either
// (a batch); each prompt gives `n` choices, choice index = prompt * n + k, as
// vLLM numbers them. With a seed, choice k of a prompt samples with seed + k
// (vLLM's parallel sampling). `echo` prepends the prompt's text to each
// choice; with `logprobs` the prompt's tokens lead the logprobs (the first
// one without a value), as vLLM does.
// Chat: `messages` rendered by the model's chat template (chat_template.h)
// after vLLM's conversion (text parts joined with "\n", tool call arguments
// parsed into objects, `developer` read as `system`), with `tools`,
// `documents`, `add_generation_prompt`, `continue_final_message` and
// `chat_template_kwargs` (reasoning_effort "none" turns enable_thinking
// off). tool_choice auto / required / named as vLLM validates them; required
// and named make the model's answer start with the <tool_call> (right after
// its reasoning when it reasons) instead of vLLM's constrained decoding.
// Both: `stream`, `stream_options.include_usage` and
// `.continuous_usage_stats`, vLLM's `return_token_ids`,
// `return_tokens_as_token_ids`, `prompt_logprobs`, `truncate_prompt_tokens`,
// `request_id` (the response id, unless the X-Request-Id header gives one),
// `kv_transfer_params` (passed to the engine as is). Pure functions.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/engine_request.h"
#include "model/tokenizer.h"
#include "server/chat_config.h"
#include "server/chat_output.h"
#include "server/chat_template.h"
#include "server/sampling_request.h"

namespace siesta::server {

struct RequestContext {
  const Tokenizer& tokenizer;
  const SamplingDefaults& defaults;
  const ChatTemplate* chat_template = nullptr;  // required for chat
  ChatConfig chat;
  int32_t max_model_len = 0;                    // 0: truncate_prompt_tokens unchecked
};

enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

struct GenerationJob {
  ApiKind kind = ApiKind::kCompletion;
  std::optional<std::string> model;          // as the client named it
  std::optional<std::string> request_id;     // the client's request_id
  std::vector<EngineRequest> requests;       // one per choice, in choice order
  std::vector<size_t> prompt_of_choice;      // the prompt each choice continues
  std::vector<std::string> echo;             // per choice: text put before the output
  std::string prompt_text;                   // chat: the rendered conversation
  bool return_prompt_text = false;           // chat: prompt_text in the response
  bool stream = false;
  bool include_usage = false;                // stream_options.include_usage
  bool continuous_usage = false;             // stream_options.continuous_usage_stats
  bool return_token_ids = false;
  bool return_tokens_as_token_ids = false;
  std::optional<int32_t> logprobs;           // top-n per token (chat: top_logprobs)
  bool chat_logprobs = false;                // chat: `logprobs: true`
  bool echo_logprobs = false;                // completions: echo with logprobs
  bool prompt_logprobs = false;              // prompt_logprobs in the response
  // chat
  std::string role = "assistant";            // the answer's role
  ChatOutputOptions output;
  ToolChoice tool_choice = ToolChoice::kNone;
};

Result<GenerationJob> parse_completion_request(const nlohmann::json& body, const RequestContext& ctx);
// `ordered`: the same body with its objects in the client's order (tools and
// kwargs reach the template, and its tojson, in that order).
Result<GenerationJob> parse_chat_request(const nlohmann::json& body, const nlohmann::ordered_json& ordered,
                                         const RequestContext& ctx);

// The chat prompt a body renders to, as /v1/chat/completions prefills it:
// messages, tools, documents, add_generation_prompt, continue_final_message,
// chat_template_kwargs, reasoning_effort (also /tokenize's chat form).
struct ChatPrompt {
  std::string text;
  bool thinking = true;            // chat_template_kwargs.enable_thinking (default true)
};
Result<ChatPrompt> render_chat_prompt(const nlohmann::ordered_json& body, const RequestContext& ctx,
                                      bool with_tools = true);

// vLLM's conversation from OpenAI `messages`: string contents, tool calls
// with parsed arguments, developer as system.
Result<nlohmann::ordered_json> conversation_of(const nlohmann::ordered_json& messages);
// vLLM's tool dicts: {type, function: {name, description, parameters, ...}}.
Result<nlohmann::ordered_json> tools_of(const nlohmann::ordered_json& tools);

void assign_request_ids(GenerationJob& job, const std::string& base);

}  // namespace siesta::server
