#include "server/info_handlers.h"

#include "server/json_fields.h"
#include "server/prometheus_text.h"
#include "server/tokenize_request.h"

namespace siesta::server {

void handle_models(ServerContext& ctx, const httplib::Request&, httplib::Response& res) {
  nlohmann::json model{{"id", ctx.options.served_model_name},
                       {"object", "model"},
                       {"created", ctx.started_at},
                       {"owned_by", "siesta"},
                       {"root", ctx.engine.options().model_dir.string()},
                       {"parent", nullptr},
                       {"max_model_len", ctx.engine.limits().max_model_len},
                       {"permission", nlohmann::json::array()}};
  send_json(res, 200, {{"object", "list"}, {"data", nlohmann::json::array({std::move(model)})}});
}

void handle_tokenize(ServerContext& ctx, const std::string& text, httplib::Response& res) {
  nlohmann::json body;
  if (!parse_json_body(text, res, body) || !check_model(ctx, body, res)) return;
  Result<std::string> prompt = tokenize_text(body);
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
  res.set_content(render_prometheus(ctx.engine.metrics(), ctx.options.served_model_name), kPrometheusContentType);
}

}  // namespace siesta::server
