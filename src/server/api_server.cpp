#include "server/api_server.h"

#include <algorithm>
#include <cctype>
#include <ctime>
#include <span>

#include "common/exception_text.h"
#include "common/listen_backlog.h"
#include "common/log.h"
#include "server/admin_handlers.h"
#include "server/admin_params.h"
#include "server/generation_handler.h"
#include "server/info_handlers.h"
#include "server/server_context.h"
#include "server/weight_socket.h"

namespace siesta::server {
namespace {

// Compares in time that depends only on the lengths.
bool same_secret(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

// `Authorization: Bearer KEY`, the scheme in any case (RFC 7235).
bool bearer_matches(const std::string& header, const std::string& key) {
  size_t i = header.find_first_not_of(' ');
  if (i == std::string::npos || header.size() - i < 7) return false;
  for (size_t k = 0; k < 6; ++k)
    if (std::tolower(static_cast<unsigned char>(header[i + k])) != "bearer"[k]) return false;
  i += 6;
  if (header[i] != ' ') return false;
  i = header.find_first_not_of(' ', i);
  if (i == std::string::npos) return false;
  size_t e = header.find_last_not_of(' ');
  return same_secret(header.substr(i, e + 1 - i), key);
}

// Routes a client without the API key may call: liveness and what peers and
// scrapers read (/metrics unless --metrics-require-key).
bool open_route(const ServerOptions& o, const std::string& path) {
  return path == "/health" || path == "/ping" || path == "/version" || (path == "/metrics" && !o.metrics_require_key);
}

ApiError error_for_status(const httplib::Request& req, int status, size_t max_body) {
  switch (status) {
    case 404:
      return ApiError{404, "invalid_request_error", "not_found", "no route for " + req.method + " " + req.path, {}};
    case 413:
      return ApiError{413, "invalid_request_error", "request_too_large",
                      "the request body is larger than the limit of " + std::to_string(max_body) + " bytes",
                      {}};
    case 400:
      return ApiError{400, "invalid_request_error", "bad_request", "the HTTP request could not be read", {}};
    default:
      break;
  }
  if (status < 500)
    return ApiError{status, "invalid_request_error", "http_" + std::to_string(status),
                    "HTTP error " + std::to_string(status), {}};
  return ApiError{status, "server_error", "http_" + std::to_string(status), "HTTP error " + std::to_string(status), {}};
}

}  // namespace

struct ApiServer::Http {
  explicit Http(HttpServerOptions options) : server(std::move(options)) {}
  HttpServer server;
  ListenBacklog backlog;
  int port = -1;
};

namespace {

// The HTTP options with the worker count resolved: a request holds a worker while it runs.
HttpServerOptions http_options(const ServerOptions& o, const Engine& engine) {
  HttpServerOptions http = o.http;
  http.worker_threads =
      o.http_threads > 0 ? o.http_threads : static_cast<size_t>(engine.limits().max_num_seqs) + 64;
  return http;
}

}  // namespace

ApiServer::ApiServer(Engine& engine, ServerOptions options)
    : ctx_(new ServerContext{engine, std::move(options), SamplingDefaults::load(engine.options().model_dir),
                             static_cast<int64_t>(std::time(nullptr))}),
      http_(std::make_unique<Http>(http_options(ctx_->options, engine))) {
  ServerContext& ctx = *ctx_;
  if (auto t = ChatTemplate::load(engine.options().model_dir, ctx.options.chat_template))
    ctx.chat_template = std::make_shared<const ChatTemplate>(std::move(*t));
  else
    ctx.chat_template_error = t.error().message;
  httplib::Server& s = http_->server;
  s.set_tcp_nodelay(true);
  // SO_REUSEADDR without httplib's SO_REUSEPORT (a port in use must be refused), and a
  // backlog for bursts of clients (common/listen_backlog.h).
  s.set_socket_options(http_->backlog.socket_options());

  s.set_pre_routing_handler([&ctx](const httplib::Request& req, httplib::Response& res) {
    // CORS preflight: answered for every path, with no key (browsers send none).
    if (req.method == "OPTIONS") {
      res.status = 204;
      res.set_header("Access-Control-Allow-Origin", "*");
      res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      const std::string asked = req.get_header_value("Access-Control-Request-Headers");
      res.set_header("Access-Control-Allow-Headers", asked.empty() ? std::string("*") : asked);
      res.set_header("Access-Control-Max-Age", "600");
      return httplib::Server::HandlerResponse::Handled;
    }
    // /kv_transfer_info needs the key too: a decode engine reads it with its
    // own key (the proxy gives both engines the same one).
    if (ctx.options.api_key.empty() || open_route(ctx.options, req.path))
      return httplib::Server::HandlerResponse::Unhandled;
    if (bearer_matches(req.get_header_value("Authorization"), ctx.options.api_key))
      return httplib::Server::HandlerResponse::Unhandled;
    send_error(res, ApiError{401, "authentication_error", "invalid_api_key",
                             "a valid API key is required: send 'Authorization: Bearer <key>'", {}});
    return httplib::Server::HandlerResponse::Handled;
  });
  // Browsers read answers to other origins only with this header (vLLM's
  // CORS middleware allows every origin by default).
  s.set_post_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    if (req.has_header("Origin") && !res.has_header("Access-Control-Allow-Origin"))
      res.set_header("Access-Control-Allow-Origin", "*");
  });
  // Every answer of 400 and above that has no body yet (unknown path, body
  // too large, unreadable HTTP) gets OpenAI error JSON.
  s.set_error_handler(httplib::Server::HandlerWithResponse(
      [&ctx](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty() || res.status == 499) return httplib::Server::HandlerResponse::Unhandled;
        send_error(res, error_for_status(req, res.status, ctx.options.http.limits.max_body_bytes));
        return httplib::Server::HandlerResponse::Handled;
      }));
  s.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
    const std::string what = exception_text(ep);
    SIESTA_LOG_ERROR("server: {} {}: {}", req.method, req.path, what);
    send_error(res, ApiError{500, "server_error", "internal_error", "internal error: " + what, {}});
  });

  // POST routes read their body through a content reader (server_context.h says why).
  auto post = [&s, &ctx](const char* path, auto handler) {
    s.Post(path, [&ctx, handler](const httplib::Request& req, httplib::Response& res,
                                 const httplib::ContentReader& reader) {
      std::string body;
      if (read_body(req, reader, res, body)) handler(req, body, res);
    });
  };
  post("/v1/completions", [&ctx](const httplib::Request& req, const std::string& body, httplib::Response& res) {
    handle_generation(ctx, ApiKind::kCompletion, req, body, res);
  });
  post("/v1/chat/completions", [&ctx](const httplib::Request& req, const std::string& body, httplib::Response& res) {
    handle_generation(ctx, ApiKind::kChat, req, body, res);
  });
  post("/tokenize", [&ctx](const httplib::Request&, const std::string& body, httplib::Response& res) {
    handle_tokenize(ctx, body, res);
  });
  post("/detokenize", [&ctx](const httplib::Request&, const std::string& body, httplib::Response& res) {
    handle_detokenize(ctx, body, res);
  });
  s.Get("/v1/models", [&ctx](const httplib::Request& req, httplib::Response& res) { handle_models(ctx, req, res); });
  s.Get(R"(/v1/models/(.+))",
        [&ctx](const httplib::Request& req, httplib::Response& res) { handle_model(ctx, req, res); });
  s.Get("/server_info",
        [&ctx](const httplib::Request& req, httplib::Response& res) { handle_server_info(ctx, req, res); });
  s.Get("/ping", [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
  s.Get("/metrics", [&ctx](const httplib::Request& req, httplib::Response& res) { handle_metrics(ctx, req, res); });
  s.Get("/health", [](const httplib::Request&, httplib::Response& res) { res.status = 200; });
  s.Get("/version", [](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200, {{"version", "0.1.0"}});
  });
  s.Get("/kv_transfer_info", [&ctx](const httplib::Request&, httplib::Response& res) {
    if (ctx.options.kv_transfer_info.is_null()) {
      send_error(res, ApiError{404, "invalid_request_error", "not_found",
                               "this server has no KV transfer connector (start it with --kv-transfer-config)", {}});
      return;
    }
    send_json(res, 200, ctx.options.kv_transfer_info);
  });
  add_admin_routes(s, ctx);  // sleep mode (admin_handlers.h)
}

ApiServer::~ApiServer() { stop(); }

Result<int> ApiServer::bind() {
  const ServerOptions& o = ctx_->options;
  if (!ctx_->chat_template) return invalid_argument("the chat template cannot be used: " + ctx_->chat_template_error);
  if (!o.weight_socket.empty() && !ctx_->engine.options().enable_sleep_mode)
    return invalid_argument("--weight-socket " + o.weight_socket.string() +
                            ": the weight socket answers /update_weights, an admin call of sleep mode; add "
                            "--enable-sleep-mode");
  if (o.port == 0) {
    http_->port = http_->server.bind_to_any_port(o.host);
  } else if (http_->server.bind_to_port(o.host, o.port)) {
    http_->port = o.port;
  }
  if (http_->port <= 0)
    return io_error("cannot listen on " + o.host + ":" + std::to_string(o.port) +
                    " (address in use, or not an address of this host); choose another --host or --port");
  SIESTA_TRY(http_->backlog.raise());
  if (!o.weight_socket.empty() && !weight_socket_) {
    // The same call as POST /update_weights (admin_handlers.h), with the packet's descriptors.
    Engine& engine = ctx_->engine;
    WeightSocketOptions wo;
    wo.max_packet_bytes = std::min(wo.max_packet_bytes, o.http.limits.max_body_bytes);
    auto ws = WeightSocket::listen(
        o.weight_socket,
        [&engine](const std::string& body, std::span<const int> fds) {
          return update_weights_answer(engine, body, PassedDescriptors{true, fds}, default_admin_deadline());
        },
        wo);
    if (!ws) return ws.error().with_context("--weight-socket");
    weight_socket_ = std::move(*ws);
    SIESTA_LOG_INFO("server: /update_weights also on the Unix socket {} (descriptors passed as SCM_RIGHTS)",
                    o.weight_socket.string());
  }
  return http_->port;
}

Result<void> ApiServer::serve() {
  if (http_->port <= 0) return conflict("serve() before a successful bind()");
  if (weight_socket_) weight_socket_->start();
  const bool listened = http_->server.listen_after_bind();
  if (weight_socket_) weight_socket_->stop();
  if (!listened && !ctx_->stopping.load())
    return io_error("the HTTP server stopped listening on port " + std::to_string(http_->port));
  return {};
}

void ApiServer::stop() {
  ctx_->stopping.store(true);
  if (http_->server.is_running()) http_->server.stop();
  if (weight_socket_) weight_socket_->stop();
}

}  // namespace siesta::server
