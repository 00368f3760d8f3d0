#include "server/openai_request.h"

#include "server/json_fields.h"
#include "server/request_fields.h"

namespace siesta::server {
namespace {

// "'key[i]'" for messages. (Built by appending: GCC 12 warns falsely about "lit" + std::string&&.)
std::string at(const char* key, size_t i) {
  std::string s = "'";
  s.append(key).append("[").append(std::to_string(i)).append("]");
  return s;
}

std::string type_of(const nlohmann::ordered_json& v) { return json_type_name(nlohmann::json(v)); }

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
  for (auto it = so.begin(); it != so.end(); ++it)
    if (it.key() != "include_usage" && it.key() != "continuous_usage_stats" && !it.value().is_null())
      return invalid_argument("'stream_options." + it.key() +
                              "' is not supported; stream_options takes include_usage and continuous_usage_stats");
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> usage, read_bool(so, "include_usage"));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> continuous, read_bool(so, "continuous_usage_stats"));
  if (!so.empty() && !job.stream) return invalid_argument("Stream options can only be defined when `stream=True`.");
  job.include_usage = usage.value_or(false);
  if (continuous.value_or(false) && !job.include_usage)
    return invalid_argument(
        "'stream_options.continuous_usage_stats' needs 'stream_options.include_usage': true "
        "(vLLM sends per-chunk usage only then)");
  job.continuous_usage = continuous.value_or(false);
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> ids, read_bool(body, "return_token_ids"));
  job.return_token_ids = ids.value_or(false);
  SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> request_id, read_string(body, "request_id"));
  if (request_id && request_id->empty()) return invalid_argument("'request_id' must not be empty");
  job.request_id = request_id;
  return {};
}

Result<void> check_response_format(const nlohmann::json& body) {
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json format, read_object(body, "response_format"));
  if (format.empty()) return {};
  const std::string type =
      format.contains("type") && format["type"].is_string() ? format["type"].get<std::string>() : "";
  if (type == "text") return {};
  return invalid_argument("'response_format' of type '" + type +
                          "' is not supported by this server: constrained decoding is not implemented; use "
                          "{\"type\": \"text\"} or leave it out");
}

// truncate_prompt_tokens: the last (or first) k tokens.
Result<void> truncate(std::vector<int32_t>& ids, const SamplingRequest& s, const RequestContext& ctx) {
  if (!s.truncate_prompt_tokens) return {};
  int64_t k = *s.truncate_prompt_tokens;
  if (k == -1) {
    if (ctx.max_model_len <= 0) return {};
    k = ctx.max_model_len;
  }
  if (ctx.max_model_len > 0 && k > ctx.max_model_len)
    return invalid_argument("truncate_prompt_tokens value (" + std::to_string(k) + ") is greater than max_model_len (" +
                            std::to_string(ctx.max_model_len) + "). Please request a smaller truncation size.");
  if (static_cast<int64_t>(ids.size()) <= k) return {};
  if (s.truncate_left)
    ids.erase(ids.begin(), ids.end() - k);
  else
    ids.resize(static_cast<size_t>(k));
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

Result<nlohmann::json> kv_params(const nlohmann::json& body, const SamplingRequest& s) {
  auto it = body.find("kv_transfer_params");
  if (it == body.end() || it->is_null()) return nlohmann::json();
  if (!it->is_object()) return invalid_argument("'kv_transfer_params' must be an object, got " + json_type_name(*it));
  if (s.params.prompt_logprobs && it->value("do_remote_prefill", false))
    return invalid_argument(
        "'prompt_logprobs' with a remote prefill ('kv_transfer_params.do_remote_prefill') is not "
        "supported: this engine does not compute the prompt");
  return *it;
}

Result<SamplingRequest> sampling_of(const nlohmann::json& body, ApiKind kind, const RequestContext& ctx,
                                    GenerationJob& job) {
  SIESTA_ASSIGN_OR_RETURN(SamplingRequest s, parse_sampling(body, kind, ctx.defaults, ctx.tokenizer));
  if (s.params.prompt_logprobs && job.stream)
    return invalid_argument("`prompt_logprobs` are not available when `stream=True`.");
  job.logprobs = s.params.logprobs;
  job.chat_logprobs = s.chat_logprobs;
  job.return_tokens_as_token_ids = s.return_tokens_as_token_ids;
  SIESTA_TRY(check_response_format(body));
  return s;
}

// ---- chat -----------------------------------------------------------------------------------------------------

const char* kMessageKeys[] = {"role",         "content",           "name",    "tool_calls",  "tool_call_id",
                              "reasoning",    "reasoning_content", "refusal", "annotations", "audio",
                              "function_call"};

Result<std::string> text_content(const nlohmann::ordered_json& c, const std::string& where) {
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array())
    return invalid_argument(where + ".content' must be a string or an array of text parts, got " + type_of(c));
  std::string out;
  for (size_t k = 0; k < c.size(); ++k) {
    const nlohmann::ordered_json& part = c[k];
    const std::string pw = where + ".content[" + std::to_string(k) + "]";
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      return invalid_argument(pw + "' must be a content part object with a 'type'");
    const std::string type = part["type"].get<std::string>();
    if (type != "text")
      return invalid_argument(pw + "' is of type '" + type +
                              "': this server serves text models; only {\"type\": \"text\", \"text\": ...} parts are "
                              "supported");
    if (!part.contains("text") || !part["text"].is_string()) return invalid_argument(pw + ".text' must be a string");
    if (k > 0) out += "\n";
    out += part["text"].get<std::string>();
  }
  return out;
}

Result<nlohmann::ordered_json> tool_calls_of(const nlohmann::ordered_json& calls, const std::string& where) {
  if (!calls.is_array()) return invalid_argument(where + ".tool_calls' must be an array, got " + type_of(calls));
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    const std::string cw = where + ".tool_calls[" + std::to_string(k) + "]";
    nlohmann::ordered_json call = calls[k];
    if (!call.is_object() || !call.contains("function") || !call["function"].is_object())
      return invalid_argument(cw +
                              "' must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}");
    nlohmann::ordered_json& fn = call["function"];
    if (!fn.contains("name") || !fn["name"].is_string())
      return invalid_argument(cw + ".function.name' must be a string");
    // As vLLM does before rendering: arguments become an object ({} when empty).
    auto args = fn.find("arguments");
    if (args == fn.end() || args->is_null() || (args->is_string() && args->get<std::string>().empty())) {
      fn["arguments"] = nlohmann::ordered_json::object();
    } else if (args->is_string()) {
      nlohmann::ordered_json parsed = nlohmann::ordered_json::parse(args->get<std::string>(), nullptr, false);
      if (parsed.is_discarded())
        return invalid_argument(cw + ".function.arguments' is not valid JSON: " + args->get<std::string>());
      fn["arguments"] = std::move(parsed);
    } else if (!args->is_object() && !args->is_array()) {
      return invalid_argument(cw + ".function.arguments' must be a JSON string");
    }
    out.push_back(std::move(call));
  }
  return out;
}

// The text after the prompt's last <|im_start|>: the turn being generated.
std::string generation_turn(const std::string& prompt) {
  const size_t p = prompt.rfind("<|im_start|>");
  return p == std::string::npos ? prompt : prompt.substr(p);
}

// The turn being generated has closed its reasoning already (thinking off, or
// a continued message past its </think>).
bool reasoning_closed(const std::string& prompt) {
  const std::string turn = generation_turn(prompt);
  const size_t end = turn.rfind("</think>");
  if (end == std::string::npos) return false;
  const size_t open = turn.rfind("<think>");
  return open == std::string::npos || open < end;
}

struct ToolChoiceSpec {
  ToolChoice choice = ToolChoice::kNone;
  std::string name;
};

// vLLM's check_tool_usage, then the server's flags.
Result<ToolChoiceSpec> tool_choice_of(const nlohmann::json& body, bool has_tools, const ChatConfig& cfg) {
  ToolChoiceSpec spec;
  auto it = body.find("tool_choice");
  const bool given = it != body.end() && !it->is_null();
  if (!given) {
    spec.choice = has_tools ? ToolChoice::kAuto : ToolChoice::kNone;
  } else if (it->is_string() && it->get<std::string>() == "none") {
    spec.choice = ToolChoice::kNone;
  } else {
    if (!has_tools) return invalid_argument("When using `tool_choice`, `tools` must be set.");
    if (it->is_string() && it->get<std::string>() == "auto") {
      spec.choice = ToolChoice::kAuto;
    } else if (it->is_string() && it->get<std::string>() == "required") {
      spec.choice = ToolChoice::kRequired;
    } else if (it->is_object()) {
      const std::string usage = "Correct usage: `{\"type\": \"function\", \"function\": {\"name\": \"my_function\"}}`";
      auto fn = it->find("function");
      if (fn == it->end() || !fn->is_object())
        return invalid_argument("Invalid value for `function` in `tool_choice`! " + usage);
      auto name = fn->find("name");
      if (name == fn->end() || !name->is_string() || name->get<std::string>().empty())
        return invalid_argument("Invalid `name` in `function` in `tool_choice`! " + usage);
      spec.choice = ToolChoice::kNamed;
      spec.name = name->get<std::string>();
      bool found = false;
      for (const nlohmann::json& t : body["tools"])
        if (t.is_object() && t.contains("function") && t["function"].is_object() &&
            t["function"].value("name", "") == spec.name)
          found = true;
      if (!found)
        return invalid_argument("The tool specified in `tool_choice` does not match any of the specified `tools`");
    } else {
      return invalid_argument("Invalid value for `tool_choice`: " + it->dump() +
                              "! Only named tools, \"none\", \"auto\" or \"required\" are supported.");
    }
  }
  if (spec.choice == ToolChoice::kAuto && (!cfg.enable_auto_tool_choice || cfg.tool_call_parser.empty()))
    return invalid_argument("\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set");
  if ((spec.choice == ToolChoice::kRequired || spec.choice == ToolChoice::kNamed) && cfg.tool_call_parser.empty())
    return invalid_argument(std::string("tool_choice=") +
                            (spec.choice == ToolChoice::kRequired ? "\"required\"" : "function \"" + spec.name + "\"") +
                            " requires --tool-call-parser to be set");
  return spec;
}

}  // namespace

Result<nlohmann::ordered_json> conversation_of(const nlohmann::ordered_json& messages) {
  if (!messages.is_array()) return invalid_argument("'messages' must be an array, got " + type_of(messages));
  if (messages.empty()) return invalid_argument("'messages' must hold at least one message");
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const nlohmann::ordered_json& m = messages[i];
    const std::string where = at("messages", i);
    if (!m.is_object()) return invalid_argument(where + "' must be an object, got " + type_of(m));
    for (auto it = m.begin(); it != m.end(); ++it) {
      bool known = false;
      for (const char* k : kMessageKeys) known |= it.key() == k;
      if (!known && !it.value().is_null())
        return invalid_argument(where + "." + it.key() + "' is not a message field this server knows");
    }
    if (!m.contains("role") || !m["role"].is_string()) return invalid_argument(where + ".role' is required (a string)");
    std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "tool" && role != "developer")
      return invalid_argument(where + ".role' must be system, developer, user, assistant or tool, got '" + role + "'");
    for (const char* k : {"audio", "function_call"})
      if (m.contains(k) && !m[k].is_null())
        return invalid_argument(where + "." + k + "' is not supported (" +
                                (std::string(k) == "audio" ? "text models only" : "use tool_calls") + ")");
    // OpenAI's developer messages are system messages for models without a
    // separate developer role (Qwen's templates know none).
    if (role == "developer") role = "system";
    nlohmann::ordered_json msg = nlohmann::ordered_json::object();
    msg["role"] = role;
    auto c = m.find("content");
    if (c == m.end() || c->is_null()) {
      if (role != "assistant") return invalid_argument(where + ".content' is required");
      msg["content"] = "";
    } else {
      SIESTA_ASSIGN_OR_RETURN(std::string text, text_content(*c, where));
      msg["content"] = std::move(text);
    }
    if (m.contains("name") && !m["name"].is_null()) {
      if (!m["name"].is_string()) return invalid_argument(where + ".name' must be a string");
      msg["name"] = m["name"];
    }
    if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      if (role != "assistant") return invalid_argument(where + ".tool_calls' belongs to assistant messages only");
      SIESTA_ASSIGN_OR_RETURN(nlohmann::ordered_json calls, tool_calls_of(m["tool_calls"], where));
      msg["tool_calls"] = std::move(calls);
    }
    if (m.contains("tool_call_id") && !m["tool_call_id"].is_null()) {
      if (!m["tool_call_id"].is_string()) return invalid_argument(where + ".tool_call_id' must be a string");
      msg["tool_call_id"] = m["tool_call_id"];
    }
    for (const char* k : {"reasoning", "reasoning_content"}) {
      if (!m.contains(k) || m[k].is_null()) continue;
      if (!m[k].is_string()) return invalid_argument(where + "." + k + "' must be a string");
      if (role != "assistant") return invalid_argument(where + "." + k + "' belongs to assistant messages only");
      // vLLM passes the reasoning under both names.
      msg["reasoning"] = m[k];
      msg["reasoning_content"] = m[k];
    }
    out.push_back(std::move(msg));
  }
  return out;
}

Result<nlohmann::ordered_json> tools_of(const nlohmann::ordered_json& tools) {
  if (!tools.is_array()) return invalid_argument("'tools' must be an array, got " + type_of(tools));
  if (tools.empty())
    return invalid_argument(
        "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.");
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const nlohmann::ordered_json& t = tools[i];
    const std::string where = at("tools", i);
    if (!t.is_object()) return invalid_argument(where + "' must be an object, got " + type_of(t));
    if (t.contains("type") && !(t["type"].is_string() && t["type"] == "function"))
      return invalid_argument(where + ".type' must be \"function\" (other tool types are not supported)");
    for (auto it = t.begin(); it != t.end(); ++it)
      if (it.key() != "type" && it.key() != "function" && !it.value().is_null())
        return invalid_argument(where + "." + it.key() + "' is not a tool field this server knows");
    if (!t.contains("function") || !t["function"].is_object())
      return invalid_argument(where + ".function' is required (an object)");
    const nlohmann::ordered_json& f = t["function"];
    if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty())
      return invalid_argument(where + ".function.name' is required (a string)");
    if (f.contains("description") && !f["description"].is_null() && !f["description"].is_string())
      return invalid_argument(where + ".function.description' must be a string");
    if (f.contains("parameters") && !f["parameters"].is_null() && !f["parameters"].is_object())
      return invalid_argument(where + ".function.parameters' must be an object (a JSON schema)");
    // pydantic's model_dump of vLLM's FunctionDefinition: its fields first
    // (null when absent), then any others as given.
    nlohmann::ordered_json fn = nlohmann::ordered_json::object();
    fn["name"] = f["name"];
    fn["description"] = f.contains("description") ? f["description"] : nlohmann::ordered_json();
    fn["parameters"] = f.contains("parameters") ? f["parameters"] : nlohmann::ordered_json();
    for (auto it = f.begin(); it != f.end(); ++it)
      if (it.key() != "name" && it.key() != "description" && it.key() != "parameters") fn[it.key()] = it.value();
    out.push_back(nlohmann::ordered_json{{"type", "function"}, {"function", std::move(fn)}});
  }
  return out;
}

Result<ChatPrompt> render_chat_prompt(const nlohmann::ordered_json& body, const RequestContext& ctx, bool with_tools) {
  if (!ctx.chat_template) return internal_error("no chat template loaded");
  ChatRenderInput in;
  auto m = body.find("messages");
  if (m == body.end() || m->is_null()) return invalid_argument("'messages' is required");
  SIESTA_ASSIGN_OR_RETURN(in.messages, conversation_of(*m));
  if (auto t = body.find("tools"); with_tools && t != body.end() && !t->is_null()) {
    SIESTA_ASSIGN_OR_RETURN(in.tools, tools_of(*t));
  }
  if (auto d = body.find("documents"); d != body.end() && !d->is_null()) {
    if (!d->is_array()) return invalid_argument("'documents' must be an array of objects");
    for (const auto& doc : *d)
      if (!doc.is_object()) return invalid_argument("'documents' must be an array of objects ({\"title\", \"text\"})");
    in.documents = *d;
  }
  auto boolean = [&](const char* key) -> Result<std::optional<bool>> {
    auto it = body.find(key);
    if (it == body.end() || it->is_null()) return std::optional<bool>();
    if (!it->is_boolean()) return invalid_argument(std::string("'") + key + "' must be a boolean, got " + type_of(*it));
    return std::optional<bool>(it->get<bool>());
  };
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> agp, boolean("add_generation_prompt"));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> cfm, boolean("continue_final_message"));
  in.continue_final_message = cfm.value_or(false);
  in.add_generation_prompt = agp.value_or(!in.continue_final_message);

  in.kwargs = ctx.chat.default_chat_template_kwargs;
  if (auto k = body.find("chat_template_kwargs"); k != body.end() && !k->is_null()) {
    if (!k->is_object()) return invalid_argument("'chat_template_kwargs' must be an object, got " + type_of(*k));
    for (auto it = k->begin(); it != k->end(); ++it) in.kwargs[it.key()] = it.value();
  }
  std::optional<ChatTemplate> request_template;
  auto own = body.find("chat_template");
  const bool own_given = own != body.end() && !own->is_null();
  if (own_given || (in.kwargs.contains("chat_template") && !in.kwargs["chat_template"].is_null())) {
    if (!ctx.chat.trust_request_chat_template)
      return invalid_argument(
          "Chat template is passed with request, but --trust-request-chat-template is not set. "
          "Refused request with untrusted chat template.");
    const nlohmann::ordered_json& src = own_given ? *own : in.kwargs["chat_template"];
    if (!src.is_string()) return invalid_argument("'chat_template' must be a string");
    SIESTA_ASSIGN_OR_RETURN(request_template,
                            ChatTemplate::from_source(src.get<std::string>(), "the request's chat_template"));
  }
  in.kwargs.erase("chat_template");
  if (auto e = body.find("reasoning_effort"); e != body.end() && !e->is_null()) {
    static const char* kEfforts[] = {"none", "minimal", "low", "medium", "high", "xhigh", "max"};
    bool ok = false;
    if (e->is_string())
      for (const char* x : kEfforts) ok |= e->get<std::string>() == x;
    if (!ok) return invalid_argument("'reasoning_effort' must be one of none, minimal, low, medium, high, xhigh, max");
    in.kwargs["reasoning_effort"] = *e;
    if (!in.kwargs.contains("enable_thinking")) in.kwargs["enable_thinking"] = *e != "none";
  }
  ChatPrompt out;
  if (auto t = in.kwargs.find("enable_thinking"); t != in.kwargs.end() && t->is_boolean())
    out.thinking = t->get<bool>();
  const ChatTemplate& tmpl = request_template ? *request_template : *ctx.chat_template;
  SIESTA_ASSIGN_OR_RETURN(out.text, tmpl.render(in));
  return out;
}

Result<GenerationJob> parse_completion_request(const nlohmann::json& body, const RequestContext& ctx) {
  if (!body.is_object()) return invalid_argument("the request body must be a JSON object, got " + json_type_name(body));
  SIESTA_TRY(check_request_fields(body, ApiKind::kCompletion));
  const Tokenizer& tok = ctx.tokenizer;
  GenerationJob job;
  job.kind = ApiKind::kCompletion;
  SIESTA_TRY(read_stream_fields(body, job));
  SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> suffix, read_string(body, "suffix"));
  if (suffix && !suffix->empty()) return invalid_argument("'suffix' is not supported by this server");
  SIESTA_ASSIGN_OR_RETURN(SamplingRequest s, sampling_of(body, ApiKind::kCompletion, ctx, job));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> echo, read_bool(body, "echo"));
  if (echo.value_or(false) && job.logprobs) {
    // vLLM: the prompt's log-probabilities lead the choice's logprobs.
    job.echo_logprobs = true;
    if (!s.params.prompt_logprobs) s.params.prompt_logprobs = job.logprobs;
  }
  job.prompt_logprobs = s.params.prompt_logprobs.has_value();
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json kv, kv_params(body, s));

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
    SIESTA_ASSIGN_OR_RETURN(
        std::vector<int32_t> ids,
        prompt_tokens(prompts[i], prompts.size() == 1 ? std::string("'prompt") : at("prompt", i), tok, text));
    const size_t before = ids.size();
    SIESTA_TRY(truncate(ids, s, ctx));
    if (ids.size() != before) text = tok.decode(ids, false);
    add_choices(job, s, std::move(ids), i, echo.value_or(false) ? text : std::string(), kv);
  }
  return job;
}

Result<GenerationJob> parse_chat_request(const nlohmann::json& body, const nlohmann::ordered_json& ordered,
                                         const RequestContext& ctx) {
  if (!body.is_object()) return invalid_argument("the request body must be a JSON object, got " + json_type_name(body));
  SIESTA_TRY(check_request_fields(body, ApiKind::kChat));
  const Tokenizer& tok = ctx.tokenizer;
  GenerationJob job;
  job.kind = ApiKind::kChat;
  SIESTA_TRY(read_stream_fields(body, job));
  SIESTA_ASSIGN_OR_RETURN(SamplingRequest s, sampling_of(body, ApiKind::kChat, ctx, job));
  job.prompt_logprobs = s.params.prompt_logprobs.has_value();
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json kv, kv_params(body, s));

  const bool has_tools = body.contains("tools") && !body["tools"].is_null();
  if (has_tools && body["tools"].is_array() && body["tools"].empty())
    return invalid_argument(
        "`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.");
  SIESTA_ASSIGN_OR_RETURN(ToolChoiceSpec choice, tool_choice_of(body, has_tools, ctx.chat));
  job.tool_choice = choice.choice;
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> parallel, read_bool(body, "parallel_tool_calls"));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> include_reasoning, read_bool(body, "include_reasoning"));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> echo, read_bool(body, "echo"));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> prompt_text, read_bool(body, "return_prompt_text"));
  job.return_prompt_text = prompt_text.value_or(false);

  const bool render_tools = !(choice.choice == ToolChoice::kNone && ctx.chat.exclude_tools_when_tool_choice_none);
  SIESTA_ASSIGN_OR_RETURN(ChatPrompt rendered, render_chat_prompt(ordered, ctx, render_tools));
  job.prompt_text = rendered.text;
  std::vector<int32_t> ids = tok.encode(job.prompt_text);
  if (ids.empty()) return invalid_argument("the conversation renders to no tokens");
  SIESTA_TRY(truncate(ids, s, ctx));

  // The answer's role (vLLM: the last message's when no generation prompt is added).
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> agp, read_bool(body, "add_generation_prompt"));
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> cfm, read_bool(body, "continue_final_message"));
  const nlohmann::ordered_json& last = ordered["messages"].back();
  const std::string last_role = last.value("role", "");
  if (!agp.value_or(!cfm.value_or(false))) job.role = last_role == "developer" ? "system" : last_role;

  // Reading the answer.
  ChatOutputOptions& o = job.output;
  if (ctx.chat.reasoning_parser == "qwen3")
    o.reasoning =
        !rendered.thinking || reasoning_closed(job.prompt_text) ? ReasoningMode::kContentOnly : ReasoningMode::kSplit;
  o.include_reasoning = include_reasoning.value_or(true);
  o.parse_tools = !ctx.chat.tool_call_parser.empty() && choice.choice != ToolChoice::kNone;
  o.single_tool_call = choice.choice == ToolChoice::kNamed || !parallel.value_or(true);

  // required / named: the answer opens with the tool call, after the
  // reasoning when the model reasons in this turn.
  if (choice.choice == ToolChoice::kRequired || choice.choice == ToolChoice::kNamed) {
    std::string prefix = "<tool_call>\n";
    if (choice.choice == ToolChoice::kNamed)
      prefix += "{\"name\": " + nlohmann::json(choice.name).dump() + ", \"arguments\": ";
    const std::optional<int32_t> end_think = tok.token_to_id("</think>");
    if (rendered.thinking && end_think && !reasoning_closed(job.prompt_text)) {
      s.params.force_after_token = *end_think;
      prefix = "\n\n" + prefix;
    } else if (o.reasoning == ReasoningMode::kSplit) {
      o.reasoning = ReasoningMode::kContentOnly;  // the answer starts with the call: no reasoning first
    }
    s.params.forced_tokens = tok.encode(prefix);
  }

  // vLLM computes the prompt's log-probabilities of an echoed chat (top_logprobs of them).
  if (echo.value_or(false) && !s.params.prompt_logprobs && !job.stream) {
    s.params.prompt_logprobs = s.params.logprobs.value_or(0);
    job.prompt_logprobs = true;
  }
  if (echo.value_or(false) && last.contains("content") && last_role == job.role) {
    auto text = text_content(last["content"], at("messages", ordered["messages"].size() - 1));
    if (text)
      add_choices(job, s, std::move(ids), 0, *text, kv);
    else
      add_choices(job, s, std::move(ids), 0, std::string(), kv);
  } else {
    add_choices(job, s, std::move(ids), 0, std::string(), kv);
  }
  return job;
}

void assign_request_ids(GenerationJob& job, const std::string& base) {
  for (size_t i = 0; i < job.requests.size(); ++i) job.requests[i].id = base + "-" + std::to_string(i);
}

}  // namespace siesta::server
