#include "server/info_handlers.h"

#include <sys/utsname.h>
#include <unistd.h>

#include <fstream>

#include "server/json_fields.h"
#include "server/prometheus_text.h"

namespace siesta::server {
namespace {

const char* kTokenizeFields[] = {"model", "prompt", "messages", "tools", "documents", "add_generation_prompt",
                                 "continue_final_message", "add_special_tokens", "return_token_strs", "chat_template",
                                 "chat_template_kwargs", "reasoning_effort", "mm_processor_kwargs"};

// The text /tokenize encodes: a prompt, or a conversation rendered as
// /v1/chat/completions renders it.
Result<std::string> tokenize_text(const ServerContext& ctx, const nlohmann::json& body, const std::string& raw) {
  if (!body.is_object()) return invalid_argument("the request body must be a JSON object, got " + json_type_name(body));
  for (auto it = body.begin(); it != body.end(); ++it) {
    bool known = false;
    for (const char* k : kTokenizeFields) known |= it.key() == k;
    if (!known) return invalid_argument("'" + it.key() + "' is not a field of /tokenize this server knows; remove it");
  }
  SIESTA_ASSIGN_OR_RETURN(nlohmann::json mm, read_object(body, "mm_processor_kwargs"));
  if (!mm.empty())
    return invalid_argument("'mm_processor_kwargs' is not supported: this server serves text models only");
  SIESTA_ASSIGN_OR_RETURN(std::optional<bool> add_special, read_bool(body, "add_special_tokens"));
  (void)add_special;  // Qwen tokenizers add no special tokens either way
  SIESTA_ASSIGN_OR_RETURN(std::optional<std::string> prompt, read_string(body, "prompt"));
  auto m = body.find("messages");
  const bool has_messages = m != body.end() && !m->is_null();
  if (prompt && has_messages) return invalid_argument("give either 'prompt' or 'messages', not both");
  if (prompt) return *prompt;
  if (!has_messages) return invalid_argument("'prompt' (a string) or 'messages' is required");
  if (!ctx.chat_template) return internal_error(ctx.chat_template_error);
  const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(raw, nullptr, /*allow_exceptions=*/false);
  SIESTA_ASSIGN_OR_RETURN(ChatPrompt p, render_chat_prompt(ordered, request_context(ctx)));
  return p.text;
}

nlohmann::json model_card(const ServerContext& ctx) {
  return nlohmann::json{{"id", ctx.options.served_model_name},
                        {"object", "model"},
                        {"created", ctx.started_at},
                        {"owned_by", "siesta"},
                        {"root", ctx.engine.options().model_dir.string()},
                        {"parent", nullptr},
                        {"max_model_len", ctx.engine.limits().max_model_len},
                        {"permission", nlohmann::json::array()}};
}

std::string first_line_of(const char* path, const char* prefix) {
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);)
    if (line.rfind(prefix, 0) == 0) return line.substr(line.find(':') + 2);
  return {};
}

}  // namespace

void handle_models(ServerContext& ctx, const httplib::Request&, httplib::Response& res) {
  send_json(res, 200, {{"object", "list"}, {"data", nlohmann::json::array({model_card(ctx)})}});
}

void handle_model(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const std::string id = req.matches.size() > 1 ? std::string(req.matches[1]) : std::string();
  if (id != ctx.options.served_model_name)
    return send_error(res, ApiError{404, "invalid_request_error", "model_not_found",
                                    "The model `" + id + "` does not exist. This server serves `" +
                                        ctx.options.served_model_name + "`.",
                                    "model"});
  send_json(res, 200, model_card(ctx));
}

void handle_server_info(ServerContext& ctx, const httplib::Request& req, httplib::Response& res) {
  const std::string format = req.has_param("config_format") ? req.get_param_value("config_format") : "text";
  if (format != "text" && format != "json")
    return send_error(res, bad_request("query parameter 'config_format' must be text or json, got '" + format + "'",
                                       "config_format"));
  const EngineLimits& l = ctx.engine.limits();
  const EngineOptions& o = ctx.engine.options();
  nlohmann::json config{{"model", o.model_dir.string()},
                        {"served_model_name", ctx.options.served_model_name},
                        {"device", o.device == Device::kCpu ? "cpu" : "cuda:" + std::to_string(o.cuda_device)},
                        {"tensor_parallel_size", o.tensor_parallel_size},
                        {"max_model_len", l.max_model_len},
                        {"max_num_seqs", l.max_num_seqs},
                        {"max_num_batched_tokens", l.max_num_batched_tokens},
                        {"num_kv_blocks", l.num_kv_blocks},
                        {"block_size", l.block_size},
                        {"kv_cache_bytes", l.kv_cache_bytes},
                        {"enable_prefix_caching", l.enable_prefix_caching},
                        {"enable_sleep_mode", o.enable_sleep_mode},
                        {"chat_template", ctx.chat_template ? ctx.chat_template->origin() : std::string()},
                        {"enable_auto_tool_choice", ctx.options.chat.enable_auto_tool_choice},
                        {"tool_call_parser", ctx.options.chat.tool_call_parser},
                        {"reasoning_parser", ctx.options.chat.reasoning_parser},
                        {"engine_state", engine_state_name(ctx.engine.state())}};
  if (ctx.options.server_info.is_object())
    for (auto& [k, v] : ctx.options.server_info.items()) config[k] = v;
  nlohmann::json env = nlohmann::json::object();
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    const std::string key = kv.substr(0, eq);
    if ((key.rfind("VLLM_", 0) == 0 || key.rfind("SIESTA_", 0) == 0) && key.find("KEY") == std::string::npos)
      env[key] = eq == std::string::npos ? std::string() : kv.substr(eq + 1);
  }
  utsname u{};
  uname(&u);
  nlohmann::json system{{"os", std::string(u.sysname) + " " + u.release},
                        {"machine", u.machine},
                        {"cpu", first_line_of("/proc/cpuinfo", "model name")}};
  send_json(res, 200,
            {{"vllm_config", format == "json" ? config : nlohmann::json(config.dump())},
             {"siesta_config", config},
             {"vllm_env", std::move(env)},
             {"system_env", std::move(system)}});
}

void handle_tokenize(ServerContext& ctx, const std::string& text, httplib::Response& res) {
  nlohmann::json body;
  if (!parse_json_body(text, res, body) || !check_model(ctx, body, res)) return;
  Result<std::string> prompt = tokenize_text(ctx, body, text);
  if (!prompt) return send_error(res, ApiError::from_status(prompt.error()));
  Result<std::optional<bool>> strs = read_bool(body, "return_token_strs");
  if (!strs) return send_error(res, ApiError::from_status(strs.error()));
  const Tokenizer& tok = ctx.engine.tokenizer();
  const std::vector<int32_t> ids = tok.encode(*prompt);
  nlohmann::json token_strs = nullptr;
  if (strs->value_or(false)) {
    token_strs = nlohmann::json::array();
    for (int32_t id : ids) token_strs.push_back(tok.decode({id}));
  }
  send_json(res, 200,
            {{"count", ids.size()},
             {"max_model_len", ctx.engine.limits().max_model_len},
             {"tokens", ids},
             {"token_strs", token_strs}});
}

void handle_detokenize(ServerContext& ctx, const std::string& text, httplib::Response& res) {
  nlohmann::json body;
  if (!parse_json_body(text, res, body) || !check_model(ctx, body, res)) return;
  if (!body.is_object())
    return send_error(res, bad_request("the request body must be a JSON object, got " + json_type_name(body)));
  auto it = body.find("tokens");
  if (it == body.end() || !it->is_array())
    return send_error(res, bad_request("'tokens' (an array of token ids) is required", "tokens"));
  const Tokenizer& tok = ctx.engine.tokenizer();
  std::vector<int32_t> ids;
  for (size_t i = 0; i < it->size(); ++i) {
    Result<int32_t> id = token_id_at((*it)[i], "'tokens[" + std::to_string(i) + "]'", tok.vocab_size());
    if (!id) return send_error(res, ApiError::from_status(id.error()));
    ids.push_back(*id);
  }
  send_json(res, 200, {{"prompt", tok.decode(ids)}});
}

void handle_metrics(ServerContext& ctx, const httplib::Request&, httplib::Response& res) {
  res.status = 200;
  PrometheusOptions o;
  o.state = ctx.engine.state();
  o.vllm_names = ctx.options.vllm_metric_names;
  res.set_content(render_prometheus(ctx.engine.metrics(), ctx.options.served_model_name, o), kPrometheusContentType);
}

}  // namespace siesta::server
