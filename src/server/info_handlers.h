// The small routes: /v1/models, /health, /tokenize, /detokenize, /metrics,
// /version, /server_info, in vLLM's shapes:
//   GET  /v1/models   {"object": "list", "data": [{"id", "object": "model", "created", "owned_by", "root",
//                      "parent", "max_model_len", "permission"}]}
//   GET  /v1/models/{id}  that model card, or 404 model_not_found
//   POST /tokenize    {"prompt": TEXT} or vLLM's chat form {"messages", "tools", "add_generation_prompt",
//                     "continue_final_message", "chat_template_kwargs", ...} (+ "return_token_strs")
//                     -> {"count", "max_model_len", "tokens", "token_strs"}; the chat form's tokens are
//                     exactly what /v1/chat/completions prefills for the same fields
//   POST /detokenize  {"tokens": [ids]} -> {"prompt": TEXT}
//   GET  /metrics     Prometheus text (prometheus_text.h)
//   GET  /server_info[?config_format=text|json]  {"vllm_config", "siesta_config", "vllm_env", "system_env"}
//   GET  /health      200, empty body
// Called on the HTTP thread pool; read-only over the engine.
#pragma once

#include <httplib.h>

#include "server/server_context.h"

namespace siesta::server {

void handle_models(ServerContext& ctx, const httplib::Request& req, httplib::Response& res);
void handle_model(ServerContext& ctx, const httplib::Request& req, httplib::Response& res);
void handle_server_info(ServerContext& ctx, const httplib::Request& req, httplib::Response& res);
void handle_tokenize(ServerContext& ctx, const std::string& body, httplib::Response& res);
void handle_detokenize(ServerContext& ctx, const std::string& body, httplib::Response& res);
void handle_metrics(ServerContext& ctx, const httplib::Request& req, httplib::Response& res);

}  // namespace siesta::server
