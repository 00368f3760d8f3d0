#include "server/openai_request.h"

#include "server/chat_prompt.h"
#include "server/json_fields.h"

namespace siesta::server {
namespace {

// "'key[i]'" for messages. (Built by appending: GCC 12 warns falsely about "lit" + std::string&&.)
std::string at(const char* key, size_t i) {
  std::string s = "'";
  s.append(key).append("[").append(std::to_string(i)).append("]");
  return s;
}

// One prompt: a string, or a non-empty list of token ids.
Result<std::vector<int32_t>> prompt_tokens(const nlohmann::json& v, const std::string& where, const Tokenizer& tok,
                                           std::string& text) {
  if (v.is_string()) {
    text = v.get<std::string>();
    std::vector<int32_t> ids = tok.encode(text);
    if (ids.empty()) return invalid_argument(where + "' is empty: the prompt must have at least one token");
    return ids;
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i < v.size(); ++i) {
    std::string item = where;
    item.append("[").append(std::to_string(i)).append("]'");
    SIESTA_ASSIGN_OR_RETURN(int32_t id, token_id_at(v[i], item, tok.vocab_size()));
    ids.push_back(id);
  }
  if (ids.empty()) return invalid_argument(where + "' is an empty list: the prompt must have at least one token");
  text = tok.decode(ids, false);
  return ids;
}

bool is_token_list(const nlohmann::json& v) {
  if (!v.is_array() || v.empty()) return false;
  for (const nlohmann::json& e : v)
    if (!e.is_number()) return false;
  return true;
}

Result<void> read_stream_fields(const nlohmann::json& body, GenerationJob& job) {
  SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> model, read_string(body, "model"));
  job.model = model;
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> stream, read_bool(body, "stream"));
  job.stream = stream.value_or(false);
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json so, read_object(body, "stream_options"));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> usage, read_bool(so, "include_usage"));
  if (!so.empty() && !job.stream) return invalid_argument("'stream_options' is only allowed when 'stream' is true");
  job.include_usage = usage.value_or(false);
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> ids, read_bool(body, "return_token_ids"));
  job.return_token_ids = ids.value_or(false);
  SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> suffix, read_string(body, "suffix"));
  if (suffix && !suffix->empty()) return invalid_argument("'suffix' is not supported by this server");
  return {};
}

// Adds n choices for one prompt.
void add_choices(GenerationJob& job, const SamplingRequest& s, std::vector<int32_t> prompt, size_t prompt_index,
                 const std::string& echo, const nlohmann::json& kv_transfer_params) {
  for (int32_t k = 0; k < s.n; ++k) {
    EngineRequest r;
    r.prompt_tokens = prompt;
    r.params = s.params;
    if (r.params.seed) r.params.seed = *r.params.seed + static_cast<uint64_t>(k);
    r.cache_salt = s.cache_salt;
    r.skip_special_tokens = s.skip_special_tokens;
    r.kv_transfer_params = kv_transfer_params;
    job.requests.push_back(std::move(r));
    job.prompt_of_choice.push_back(prompt_index);
    job.echo.push_back(echo);
  }
}

Result<nlohmann::json> kv_params(const nlohmann::json& body) {
  auto it = body.find("kv_transfer_params");
  if (it == body.end() || it->is_null()) return nlohmann::json();
  if (!it->is_object())
    return invalid_argument("'kv_transfer_params' must be an object, got " + json_type_name(*it));
  return *it;
}

}  // namespace

Result<GenerationJob> parse_completion_request(const nlohmann::json& body, const Tokenizer& tok,
                                               const SamplingDefaults& defaults) {
  if (!body.is_object()) return invalid_argument("the request body must be a JSON object, got " + json_type_name(body));
  GenerationJob job;
  job.kind = ApiKind::kCompletion;
  SIESTA_TRY(read_stream_fields(body, job));
  SIESTA_ASSIGN_OR_RETURN(SamplingRequest s, parse_sampling(body, ApiKind::kCompletion, defaults, tok.vocab_size()));
  job.logprobs = s.params.logprobs;
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> echo, read_bool(body, "echo"));
  if (echo.value_or(false) && job.logprobs)
    return invalid_argument("'echo' together with 'logprobs' is not supported by this server (prompt logprobs "
                            "are not computed); drop one of them");
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json kv, kv_params(body));

  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return invalid_argument("'prompt' is required");
  const nlohmann::json& prompt = *it;
  std::vector<nlohmann::json> prompts;
  if (prompt.is_string() || is_token_list(prompt)) {
    prompts.push_back(prompt);
  } else if (prompt.is_array()) {
    if (prompt.empty()) return invalid_argument("'prompt' is an empty list");
    for (size_t i = 0; i < prompt.size(); ++i) {
      if (!prompt[i].is_string() && !prompt[i].is_array())
        return invalid_argument(at("prompt", i) + "' must be a string or a list of token ids, got " +
                                json_type_name(prompt[i]));
      prompts.push_back(prompt[i]);
    }
  } else {
    return invalid_argument("'prompt' must be a string, a list of token ids, or a list of those, got " +
                            json_type_name(prompt));
  }
  for (size_t i = 0; i < prompts.size(); ++i) {
    std::string text;
    SIESTA_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                            prompt_tokens(prompts[i], prompts.size() == 1 ? std::string("'prompt") : at("prompt", i), tok, text));
    add_choices(job, s, std::move(ids), i, echo.value_or(false) ? text : std::string(), kv);
  }
  return job;
}

Result<std::vector<ChatMessage>> parse_chat_messages(const nlohmann::json& messages) {
  if (!messages.is_array()) return invalid_argument("'messages' must be an array, got " + json_type_name(messages));
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const nlohmann::json& m = messages[i];
    const std::string where = at("messages", i);
    if (!m.is_object()) return invalid_argument(where + "' must be an object, got " + json_type_name(m));
    ChatMessage msg;
    SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> role, read_string(m, "role"));
    if (!role) return invalid_argument(where + ".role' is required");
    msg.role = *role;
    auto tc = m.find("tool_calls");
    if (tc != m.end() && !tc->is_null() && !(tc->is_array() && tc->empty()))
      return invalid_argument(where + ".tool_calls' is not supported by this server");
    auto c = m.find("content");
    if (c == m.end() || c->is_null()) {
      if (msg.role != "assistant") return invalid_argument(where + ".content' is required");
    } else if (c->is_string()) {
      msg.content = c->get<std::string>();
    } else if (c->is_array()) {
      for (size_t k = 0; k < c->size(); ++k) {
        const nlohmann::json& part = (*c)[k];
        const std::string pw = where + ".content[" + std::to_string(k) + "]";
        SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> type, read_string(part, "type"));
        if (!part.is_object() || type != std::optional<std::string>("text"))
          return invalid_argument(pw + "' must be {\"type\": \"text\", \"text\": ...}; other content is not supported");
        SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> text, read_string(part, "text"));
        if (!text) return invalid_argument(pw + ".text' is required");
        if (k > 0) msg.content += "\n";
        msg.content += *text;
      }
    } else {
      return invalid_argument(where + ".content' must be a string or an array of text parts, got " +
                              json_type_name(*c));
    }
    SIESTA_ASSIGN_OR_RETURN(msg.reasoning_content, read_string(m, "reasoning_content"));
    out.push_back(std::move(msg));
  }
  return out;
}

Result<std::string> render_chat_body(const nlohmann::json& body, const nlohmann::json& messages) {
  SIESTA_ASSIGN_OR_RETURN(std::vector<ChatMessage> parsed, parse_chat_messages(messages));
  ChatPromptOptions opt;
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> agp, read_bool(body, "add_generation_prompt"));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> cfm, read_bool(body, "continue_final_message"));
  opt.continue_final_message = cfm.value_or(false);
  opt.add_generation_prompt = agp.value_or(!opt.continue_final_message);
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json kwargs, read_object(body, "chat_template_kwargs"));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> thinking, read_bool(kwargs, "enable_thinking"));
  opt.enable_thinking = thinking.value_or(true);
  return render_qwen3_chat(parsed, opt);
}

Result<GenerationJob> parse_chat_request(const nlohmann::json& body, const Tokenizer& tok,
                                         const SamplingDefaults& defaults) {
  if (!body.is_object()) return invalid_argument("the request body must be a JSON object, got " + json_type_name(body));
  GenerationJob job;
  job.kind = ApiKind::kChat;
  SIESTA_TRY(read_stream_fields(body, job));
  SIESTA_ASSIGN_OR_RETURN(SamplingRequest s, parse_sampling(body, ApiKind::kChat, defaults, tok.vocab_size()));
  job.logprobs = s.params.logprobs;
  job.chat_logprobs = s.chat_logprobs;
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json kv, kv_params(body));
  auto tools = body.find("tools");
  if (tools != body.end() && !tools->is_null() && !(tools->is_array() && tools->empty()))
    return invalid_argument("'tools' is not supported by this server");
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json format, read_object(body, "response_format"));
  if (!format.empty() && format.value("type", "") != "text")
    return invalid_argument("'response_format' other than {\"type\": \"text\"} is not supported by this server");

  auto m = body.find("messages");
  if (m == body.end() || m->is_null()) return invalid_argument("'messages' is required");
  SIESTA_ASSIGN_OR_RETURN(job.prompt_text, render_chat_body(body, *m));
  std::vector<int32_t> ids = tok.encode(job.prompt_text);
  if (ids.empty()) return invalid_argument("the conversation renders to no tokens");
  add_choices(job, s, std::move(ids), 0, std::string(), kv);
  return job;
}

void assign_request_ids(GenerationJob& job, const std::string& base) {
  for (size_t i = 0; i < job.requests.size(); ++i) job.requests[i].id = base + "-" + std::to_string(i);
}

}  // namespace siesta::server
