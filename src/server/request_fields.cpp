#include "server/request_fields.h"

#include <algorithm>

#include "server/json_fields.h"

namespace siesta::server {
namespace {

using Fields = std::vector<std::string_view>;

// Read by the request parsers (openai_request.cpp, sampling_request.cpp).
const Fields kCommonHandled = {"model",
                               "frequency_penalty",
                               "logit_bias",
                               "max_tokens",
                               "n",
                               "presence_penalty",
                               "seed",
                               "stop",
                               "stream",
                               "stream_options",
                               "temperature",
                               "top_p",
                               "top_k",
                               "min_p",
                               "repetition_penalty",
                               "stop_token_ids",
                               "include_stop_str_in_output",
                               "ignore_eos",
                               "min_tokens",
                               "skip_special_tokens",
                               "truncate_prompt_tokens",
                               "truncation_side",
                               "allowed_token_ids",
                               "prompt_logprobs",
                               "bad_words",
                               "request_id",
                               "return_tokens_as_token_ids",
                               "return_token_ids",
                               "cache_salt",
                               "kv_transfer_params",
                               "echo",
                               "logprobs",
                               "use_beam_search",
                               "best_of",
                               "priority",
                               "response_format",
                               "add_special_tokens"};
const Fields kCompletionHandled = {"prompt", "suffix"};
const Fields kChatHandled = {"messages",
                             "top_logprobs",
                             "max_completion_tokens",
                             "tools",
                             "tool_choice",
                             "parallel_tool_calls",
                             "reasoning_effort",
                             "include_reasoning",
                             "add_generation_prompt",
                             "continue_final_message",
                             "documents",
                             "chat_template",
                             "chat_template_kwargs",
                             "return_prompt_text"};

// Accepted, no effect, as in vLLM: `user` (vLLM: "will be ignored");
// spaces_between_special_tokens (vLLM's fast-tokenizer detokenizer ignores
// it, and Qwen tokenizers are fast ones); length_penalty (beam search only);
// session_id (a routing hint vLLM does not act on in one engine);
// return_token_offsets and return_mm_kwargs (vLLM: render endpoints only);
// routed_experts_prompt_start (MoE routing output, which this server never returns).
const Fields kIgnored = {"user",
                         "spaces_between_special_tokens",
                         "length_penalty",
                         "session_id",
                         "return_token_offsets",
                         "return_mm_kwargs",
                         "routed_experts_prompt_start"};

// Known to vLLM, not implemented here: refused unless absent, null or neutral.
struct Unsupported {
  std::string_view name;
  const char* why;
};
const std::vector<Unsupported> kUnsupported = {
    {"structured_outputs", "constrained decoding is not implemented by this server"},
    {"guided_json", "constrained decoding is not implemented by this server"},
    {"guided_regex", "constrained decoding is not implemented by this server"},
    {"guided_choice", "constrained decoding is not implemented by this server"},
    {"guided_grammar", "constrained decoding is not implemented by this server"},
    {"guided_json_object", "constrained decoding is not implemented by this server"},
    {"guided_decoding_backend", "constrained decoding is not implemented by this server"},
    {"guided_whitespace_pattern", "constrained decoding is not implemented by this server"},
    {"logits_processors", "custom logits processors are not supported"},
    {"logprob_token_ids", "log-probabilities of chosen token ids are not implemented; use logprobs/top_logprobs"},
    {"prompt_embeds", "prompt embeddings are not supported; send token ids or text"},
    {"mm_processor_kwargs", "this server serves text models only"},
    {"media_io_kwargs", "this server serves text models only"},
    {"ec_transfer_params", "encoder-cache transfer is not supported (text models only)"},
    {"vllm_xargs", "extension arguments are not supported"},
    {"repetition_detection", "repetition detection is not implemented"},
    {"thinking_token_budget", "thinking token budgets are not implemented"},
    {"watermarking", "watermarking is not implemented"},
    {"stream_interval", "stream_interval other than 1 is not supported (every token is sent as it comes)"},
};

bool contains(const Fields& f, std::string_view name) { return std::find(f.begin(), f.end(), name) != f.end(); }

// Absent-equivalent values of an unsupported field.
bool neutral(std::string_view name, const nlohmann::json& v) {
  if (v.is_null()) return true;
  // Empty kwargs say nothing; an empty schema or grammar still constrains.
  if ((v.is_object() || v.is_array()) && v.empty())
    return name == "mm_processor_kwargs" || name == "media_io_kwargs" || name == "vllm_xargs" ||
           name == "logits_processors";
  if (v.is_boolean() && !v.get<bool>()) return true;
  if (name == "thinking_token_budget" && v.is_number_integer() && v.get<int64_t>() == -1) return true;
  if (name == "stream_interval" && v.is_number_integer() && v.get<int64_t>() == 1) return true;
  return false;
}

std::string endpoint(ApiKind kind) { return kind == ApiKind::kChat ? "/v1/chat/completions" : "/v1/completions"; }

}  // namespace

const std::vector<std::string_view>& ignored_fields(ApiKind) { return kIgnored; }

Result<void> check_request_fields(const nlohmann::json& body, ApiKind kind) {
  if (!body.is_object()) return {};  // the parsers report the shape
  const Fields& own = kind == ApiKind::kChat ? kChatHandled : kCompletionHandled;
  for (auto it = body.begin(); it != body.end(); ++it) {
    const std::string& name = it.key();
    if (contains(kCommonHandled, name) || contains(own, name) || contains(kIgnored, name)) continue;
    auto u =
        std::find_if(kUnsupported.begin(), kUnsupported.end(), [&](const Unsupported& x) { return x.name == name; });
    if (u != kUnsupported.end()) {
      if (neutral(name, it.value())) continue;
      return invalid_argument("'" + name + "' is not supported by this server: " + u->why + "; remove the field");
    }
    const Fields& other = kind == ApiKind::kChat ? kCompletionHandled : kChatHandled;
    if (contains(other, name))
      return invalid_argument("'" + name + "' is not a field of " + endpoint(kind) + " (it belongs to " +
                              endpoint(kind == ApiKind::kChat ? ApiKind::kCompletion : ApiKind::kChat) + ")");
    return invalid_argument("'" + name + "' is not a field of " + endpoint(kind) +
                            " this server knows; remove it (siesta refuses fields it would otherwise ignore)");
  }
  return {};
}

}  // namespace siesta::server
