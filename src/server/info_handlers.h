// The small routes: /v1/models, /health, /tokenize, /detokenize, /metrics,
// /version, in vLLM's shapes:
//   GET  /v1/models   {"object": "list", "data": [{"id", "object": "model", "created", "owned_by", "root",
//                      "parent", "max_model_len", "permission"}]}
//   POST /tokenize    {"prompt": TEXT} or {"messages": [...], "add_generation_prompt", "chat_template_kwargs"}
//                     (+ "return_token_strs") -> {"count", "max_model_len", "tokens", "token_strs"}
//   POST /detokenize  {"tokens": [ids]} -> {"prompt": TEXT}
//   GET  /metrics     Prometheus text (prometheus_text.h)
//   GET  /health      200, empty body
// Called on the HTTP thread pool; read-only over the engine.
#pragma once

#include <httplib.h>

#include "server/server_context.h"

namespace siesta::server {

void handle_models(ServerContext& ctx, const httplib::Request& req, httplib::Response& res);
void handle_tokenize(ServerContext& ctx, const std::string& body, httplib::Response& res);
void handle_detokenize(ServerContext& ctx, const std::string& body, httplib::Response& res);
void handle_metrics(ServerContext& ctx, const httplib::Request& req, httplib::Response& res);

}  // namespace siesta::server
