#include "proxy/proxy.h"

#include <cctype>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/exception_text.h"
#include "common/listen_backlog.h"
#include "common/log.h"
#include "proxy/admin_fanout.h"
#include "proxy/leg.h"
#include "proxy/openai_error.h"

namespace siesta::proxy {
namespace {

using nlohmann::json;

constexpr const char* kAdminPosts[] = {
    "/sleep", "/wake_up", "/pause", "/resume", "/reset_prefix_cache", "/release_kv_cache_memory", "/reload_weights"};
constexpr const char* kAdminGets[] = {"/is_sleeping", "/is_paused", "/memory"};

std::string percent_encode(const std::string& text) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : text) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
        c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  return out;
}

// The request's path and query, without the parameters meant for the proxy.
std::string forwarded_target(const httplib::Request& req) {
  std::string query;
  for (const auto& [name, value] : req.params) {
    if (name == "instance" || name == "role") continue;
    query += (query.empty() ? "?" : "&") + percent_encode(name) + "=" + percent_encode(value);
  }
  return req.path + query;
}

std::optional<std::string> param(const httplib::Request& req, const char* name) {
  if (!req.has_param(name)) return std::nullopt;
  return req.get_param_value(name);
}

bool is_admin_path(const std::string& path) {
  for (const char* p : kAdminPosts)
    if (path == p) return true;
  for (const char* p : kAdminGets)
    if (path == p) return true;
  return false;
}

// "Bearer KEY", the scheme in any case; compared in time that depends only on the lengths.
bool bearer_matches(const std::string& header, const std::string& key) {
  constexpr std::string_view kScheme = "bearer ";
  if (header.size() < kScheme.size()) return false;
  for (size_t i = 0; i < kScheme.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(header[i])) != kScheme[i]) return false;
  size_t start = kScheme.size();
  while (start < header.size() && header[start] == ' ') ++start;
  const std::string_view token = std::string_view(header).substr(start);
  if (token.size() != key.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < key.size(); ++i) diff |= static_cast<unsigned char>(token[i] ^ key[i]);
  return diff == 0;
}

}  // namespace

namespace {

HttpServerOptions http_options(const ProxyConfig& config) {
  HttpServerOptions http = config.http;
  http.worker_threads = config.max_connections;
  return http;
}

}  // namespace

Proxy::Proxy(ProxyConfig config)
    : config_(std::move(config)),
      prefill_(Role::kPrefill, config_.prefill, config_.affinity_slack),
      decode_(Role::kDecode, config_.decode),
      sleep_({&prefill_, &decode_},
             SleepOptions{config_.wake_on_demand, config_.wake_timeout, config_.park_idle_after,
                          config_.connect_timeout, config_.timeout, instance_headers()}),
      route_ctx_{&config_, &prefill_, &decode_, &metrics_, &ids_, &stopping_, &sleep_},
      health_({&prefill_, &decode_},
              HealthOptions{config_.health_interval, config_.health_timeout, instance_headers()}),
      server_(http_options(config_)) {}

Result<std::unique_ptr<Proxy>> Proxy::start(ProxyConfig config) {
  SIESTA_TRY(validate_proxy_config(config));
  std::unique_ptr<Proxy> proxy(new Proxy(std::move(config)));
  const ProxyConfig& cfg = proxy->config_;
  proxy->install_routes();
  proxy->server_.set_tcp_nodelay(true);
  // SO_REUSEADDR without httplib's SO_REUSEPORT (a port in use must be refused), and a
  // backlog for bursts of clients (common/listen_backlog.h).
  ListenBacklog backlog;
  proxy->server_.set_socket_options(backlog.socket_options());
  bool bound = false;
  if (cfg.port == 0) {
    proxy->port_ = proxy->server_.bind_to_any_port(cfg.host);
    bound = proxy->port_ > 0;
  } else {
    bound = proxy->server_.bind_to_port(cfg.host, cfg.port);
    proxy->port_ = cfg.port;
  }
  if (!bound)
    return io_error("cannot listen on " + cfg.host + ":" + std::to_string(cfg.port) +
                    " (address in use, or not an address of this machine)");
  SIESTA_TRY(backlog.raise());
  proxy->health_.check_all();
  proxy->health_.start();
  proxy->sleep_.start();
  proxy->listener_ = std::thread([raw = proxy.get()] { raw->server_.listen_after_bind(); });
  // stop() only reaches a server that is already accepting; wait for that.
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!proxy->server_.is_running()) {
    if (Clock::now() >= deadline) return internal_error("the HTTP server did not start accepting within 10 s");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  SIESTA_LOG_INFO("proxy: listening on {}:{} ({} mode; {} of {} prefill and {} of {} decode instances up)", cfg.host,
                  proxy->port_, proxy_mode_name(cfg.mode), proxy->prefill_.up_count(), proxy->prefill_.size(),
                  proxy->decode_.up_count(), proxy->decode_.size());
  return proxy;
}

Proxy::~Proxy() { stop(); }

void Proxy::stop() {
  if (stopping_.exchange(true)) return;
  server_.stop();
  if (listener_.joinable()) listener_.join();
  sleep_.stop();
  health_.stop();
}

std::vector<std::pair<std::string, std::string>> Proxy::instance_headers() const {
  if (config_.api_key.empty()) return {};
  return {{"Authorization", "Bearer " + config_.api_key}};
}

bool Proxy::authorize(const httplib::Request& req, httplib::Response& res) const {
  if (config_.api_key.empty()) {
    if (!is_admin_path(req.path) || config_.allow_unauthenticated_admin) return true;
    reply_error(res, 403, error_code::kAdminNotAllowed,
                req.method + " " + req.path +
                    " is an admin call, which this proxy forwards only with authentication: start it with --api-key "
                    "(clients then send \"Authorization: Bearer <key>\"), or with --allow-unauthenticated-admin");
    return false;
  }
  if (req.path == "/health") return true;
  if ((req.path == "/metrics" || req.path == "/status") && !config_.metrics_require_key) return true;
  if (bearer_matches(req.get_header_value("Authorization"), config_.api_key)) return true;
  reply_error(res, 401, error_code::kInvalidApiKey, "missing or wrong API key (expected \"Authorization: Bearer <key>\")");
  return false;
}

void Proxy::install_routes() {
  server_.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    return authorize(req, res) ? httplib::Server::HandlerResponse::Unhandled
                               : httplib::Server::HandlerResponse::Handled;
  });
  server_.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    serve_generate(route_ctx_, Endpoint::kCompletions, req, res);
  });
  server_.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    serve_generate(route_ctx_, Endpoint::kChatCompletions, req, res);
  });
  server_.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) { serve_models(req, res); });
  server_.Get("/health", [this](const httplib::Request&, httplib::Response& res) { serve_health(res, false); });
  server_.Get("/status", [this](const httplib::Request&, httplib::Response& res) { serve_health(res, true); });
  server_.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_.render(prefill_, decode_), "text/plain; version=0.0.4");
  });
  // Admin POSTs often come without a body and without Content-Length
  // (`curl -X POST host/sleep?level=1`). httplib 0.11 would wait for such a
  // body until the connection closes and answer 400, so these handlers read
  // the body themselves, only when the request announces one.
  auto admin_post = [this](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& read) {
    std::string body;
    if (req.has_header("Content-Length") || req.get_header_value("Transfer-Encoding") == "chunked") {
      const bool complete = read([&](const char* data, size_t size) {
        body.append(data, size);
        return true;
      });
      if (!complete) return reply_error(res, 400, error_code::kInvalidValue, "the request body did not arrive whole");
    }
    serve_admin(req, body, res);
  };
  for (const char* path : kAdminPosts) server_.Post(path, httplib::Server::HandlerWithContentReader(admin_post));
  for (const char* path : kAdminGets)
    server_.Get(path, [this](const httplib::Request& req, httplib::Response& res) { serve_admin(req, req.body, res); });
  // Errors httplib produces itself (404, 400 on a malformed request) in OpenAI's shape.
  server_.set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty() || res.status == 499) return httplib::Server::HandlerResponse::Unhandled;
        if (res.status == 404) {
          reply_error(res, 404, error_code::kNotFound, "no route for " + req.method + " " + req.path);
        } else if (res.status == 400) {
          reply_error(res, 400, error_code::kInvalidValue,
                      "the request could not be read (malformed HTTP or a body "
                      "shorter than announced)");
        } else {
          reply_error(res, res.status, res.status >= 500 ? error_code::kInternal : error_code::kInvalidValue,
                      "HTTP " + std::to_string(res.status));
        }
        return httplib::Server::HandlerResponse::Handled;
      }));
  server_.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    const std::string what = exception_text(ep);
    SIESTA_LOG_ERROR("proxy: handler threw: {}", what);
    reply_error(res, 500, error_code::kInternal, "internal error in the proxy: " + what);
  });
}

void Proxy::serve_admin(const httplib::Request& req, const std::string& body, httplib::Response& res) {
  metrics_.count_admin_call();
  Result<std::vector<AdminTarget>> targets =
      select_admin_targets(prefill_, decode_, param(req, "instance"), param(req, "role"));
  if (!targets) {
    const int status = targets.error().code == ErrorCode::kNotFound ? 404 : 400;
    return reply_error(res, status, status == 404 ? error_code::kNotFound : error_code::kInvalidValue,
                       targets.error().message);
  }
  std::string content_type = req.get_header_value("Content-Type");
  if (content_type.empty()) content_type = "application/json";
  const LegRequest request{req.method, forwarded_target(req), body, content_type, instance_headers()};
  const LegLimits limits{config_.connect_timeout, config_.timeout, config_.timeout};
  const Interrupt interrupt = [this]() -> std::optional<Status> {
    if (stopping_.load()) return unavailable("the proxy is stopping");
    return std::nullopt;
  };
  AdminAnswer answer = forward_admin(*targets, request, limits, interrupt);
  // A sleep, wake, pause or resume changed what the instances can serve: the
  // next requests route by their states now, not at the next health round.
  if (req.method == "POST") health_.check_all();
  res.status = answer.status;
  res.set_content(answer.body.dump(), "application/json");
}

void Proxy::serve_models(const httplib::Request& req, httplib::Response& res) {
  const std::optional<Pick> d = decode_.first_up();
  if (!d) return reply_error(res, 503, error_code::kNoInstanceUp, decode_.describe_none_up());
  const LegLimits limits{config_.connect_timeout, config_.timeout, config_.timeout};
  std::unique_ptr<Leg> leg = Leg::start(d->url, {"GET", req.path, "", "application/json", instance_headers()}, limits);
  const Interrupt interrupt = [this]() -> std::optional<Status> {
    if (stopping_.load()) return unavailable("the proxy is stopping");
    return std::nullopt;
  };
  Result<LegHead> head = leg->wait_head(interrupt);
  Result<std::string> body = head ? leg->wait_body(interrupt) : Result<std::string>(head.error());
  if (!head || !body) {
    const Status& why = head ? body.error() : head.error();
    return reply_error(res, 502, error_code::kDecodeFailed,
                       "decode instance " + d->url.text + " failed: " + why.message);
  }
  res.status = head->status;
  res.set_content(*body, head->content_type.empty() ? "application/json" : head->content_type);
}

void Proxy::serve_health(httplib::Response& res, bool always_200) const {
  json instances = json::array();
  for (const InstanceSet* set : {&prefill_, &decode_}) {
    for (const InstanceStatus& s : set->snapshot()) {
      const std::string state = !s.up ? "failing"
                                : s.condition == Condition::kServing ? "up"
                                                                     : condition_name(s.condition);
      json entry = {{"url", s.url.text},
                    {"role", role_name(s.role)},
                    {"up", s.up},
                    {"state", state},
                    {"engine_state", s.engine_state.empty() ? json() : json(s.engine_state)},
                    {"in_flight", s.in_flight},
                    {"engine_requests", s.engine_running + s.engine_waiting},
                    {"kv_cache_usage", s.kv_usage},
                    {"requests", s.picked},
                    {"failures", s.failures},
                    {"wakes", s.wakes},
                    {"parks", s.parks}};
      if (!s.up) entry["why_down"] = s.why_down;
      instances.push_back(std::move(entry));
    }
  }
  const size_t p_up = prefill_.up_count();
  const size_t d_up = decode_.up_count();
  const bool serving = p_up > 0 && d_up > 0;
  const json body = {
      {"status", serving ? "ok" : "unavailable"},
      {"mode", proxy_mode_name(config_.mode)},
      {"prefill", {{"up", p_up}, {"total", prefill_.size()}}},
      {"decode", {{"up", d_up}, {"total", decode_.size()}}},
      {"serving", {{"prefill", prefill_.serving_count()}, {"decode", decode_.serving_count()}}},
      {"wake_on_demand", config_.wake_on_demand},
      {"instances", std::move(instances)},
  };
  res.status = serving || always_200 ? 200 : 503;
  res.set_content(body.dump(), "application/json");
}

}  // namespace siesta::proxy
