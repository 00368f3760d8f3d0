// ServerContext: what every handler of an ApiServer shares (the engine, the
// options, the sampling defaults), and the helpers that write JSON answers.
// Handlers run on the HTTP thread pool; everything here is safe to use from
// several of them at once (the engine is thread-safe, the rest is read-only
// or atomic).
#pragma once

#include <httplib.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include "engine/engine.h"
#include "server/api_error.h"
#include "server/api_server.h"
#include "server/chat_template.h"
#include "server/openai_request.h"
#include "server/sampling_request.h"

namespace siesta::server {

struct ServerContext {
  Engine& engine;
  ServerOptions options;
  SamplingDefaults sampling_defaults;
  int64_t started_at = 0;               // unix seconds
  std::atomic<bool> stopping{false};    // waiting handlers give up when set
  // The chat template (loaded at construction; null when it failed, with why).
  std::shared_ptr<const ChatTemplate> chat_template;
  std::string chat_template_error;
};

// What the request parsers need from the server.
RequestContext request_context(const ServerContext& ctx);

// JSON text; invalid UTF-8 (never expected) is replaced rather than thrown on.
std::string dump_json(const nlohmann::json& j);
void send_json(httplib::Response& res, int status, const nlohmann::json& body);
void send_error(httplib::Response& res, const ApiError& error);
// Reads a POST body through cpp-httplib's content reader. Bodies are read
// this way, not into Request::body, so that a JSON body sent with curl's
// default form content type is not parsed as a form (which cpp-httplib caps at
// 8 KiB). A request with neither Content-Length nor chunked transfer encoding
// has no body (HTTP/1.1; `curl -X POST host/sleep?level=1` sends such
// requests): read as empty at once, where cpp-httplib's reader would wait for
// the connection to close. false after answering 400 (the HTTP intake has
// refused bodies over the limit before a handler runs).
bool read_body(const httplib::Request& req, const httplib::ContentReader& reader, httplib::Response& res,
               std::string& body);
// The body as a JSON value, or false after answering 400 for malformed JSON.
bool parse_json_body(const std::string& body, httplib::Response& res, nlohmann::json& out);
// The same without a response: the 400 it would answer, or nullopt and `out` set.
std::optional<ApiError> parse_json_text(const std::string& body, nlohmann::json& out);
// 404 model_not_found when the body names a model other than the served one
// (a missing "model" means the served model). Returns false after answering.
bool check_model(const ServerContext& ctx, const nlohmann::json& body, httplib::Response& res);
// "cmpl-" + 32 random hex digits, etc.
std::string random_id(const char* prefix);

}  // namespace siesta::server
