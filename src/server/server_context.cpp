#include "server/server_context.h"

#include <strings.h>

#include <random>

#include "common/json_depth.h"

namespace siesta::server {

std::string dump_json(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void send_json(httplib::Response& res, int status, const nlohmann::json& body) {
  res.status = status;
  res.set_content(dump_json(body), "application/json");
}

void send_error(httplib::Response& res, const ApiError& error) { send_json(res, error.status, error.to_json()); }

bool read_body(const httplib::Request& req, const httplib::ContentReader& reader, httplib::Response& res,
               std::string& body) {
  // As cpp-httplib tells a chunked body (case-insensitive "chunked").
  const bool chunked = strcasecmp(req.get_header_value("Transfer-Encoding").c_str(), "chunked") == 0;
  if (!req.has_header("Content-Length") && !chunked) return true;
  const bool ok = reader([&](const char* data, size_t len) {
    body.append(data, len);
    return true;
  });
  if (ok) return true;
  // cpp-httplib sets 413 itself for a body over the limit; the error handler words it.
  if (res.status != 413) send_error(res, bad_request("the request body could not be read"));
  return false;
}

std::optional<ApiError> parse_json_text(const std::string& body, nlohmann::json& out) {
  // The HTTP intake refuses bodies deeper than --max-json-depth before a
  // handler runs; this holds where nothing else did (the intake's check off).
  Result<nlohmann::json> parsed = parse_json(body, kMaxJsonDepthLimit);
  if (!parsed && parsed.error().code == ErrorCode::kInvalidArgument)
    return ApiError{400, "invalid_request_error", "json_too_deep", "the request body: " + parsed.error().message,
                    {}};
  if (!parsed)
    return ApiError{400, "invalid_request_error", "invalid_json",
                    body.empty() ? "the request body is empty; send a JSON object" : "the request body is not valid JSON",
                    {}};
  out = std::move(*parsed);
  return std::nullopt;
}

bool parse_json_body(const std::string& body, httplib::Response& res, nlohmann::json& out) {
  if (auto error = parse_json_text(body, out)) {
    send_error(res, *error);
    return false;
  }
  return true;
}

bool check_model(const ServerContext& ctx, const nlohmann::json& body, httplib::Response& res) {
  if (!body.is_object()) return true;  // the parser reports the shape
  auto it = body.find("model");
  if (it == body.end() || it->is_null()) return true;
  if (!it->is_string()) {
    send_error(res, bad_request("'model' must be a string", "model"));
    return false;
  }
  if (it->get<std::string>() == ctx.options.served_model_name) return true;
  send_error(res, ApiError{404, "invalid_request_error", "model_not_found",
                           "The model `" + it->get<std::string>() + "` does not exist. This server serves `" +
                               ctx.options.served_model_name + "`.",
                           "model"});
  return false;
}

RequestContext request_context(const ServerContext& ctx) {
  return RequestContext{ctx.engine.tokenizer(), ctx.sampling_defaults, ctx.chat_template.get(), ctx.options.chat,
                        ctx.engine.limits().max_model_len};
}

std::string random_id(const char* prefix) {
  thread_local std::mt19937_64 rng(std::random_device{}());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id(prefix);
  for (int i = 0; i < 2; ++i) {
    uint64_t v = rng();
    for (int k = 0; k < 16; ++k, v >>= 4) id.push_back(kHex[v & 0xF]);
  }
  return id;
}

}  // namespace siesta::server
