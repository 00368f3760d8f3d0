// Proxy: `siesta proxy`, the P/D router. It serves the OpenAI endpoints to
// clients and takes each request through a prefill and a decode instance
// (route.h), forwards admin calls to the instances (admin_fanout.h), checks
// their health (health_monitor.h) and reports on itself (/health, /metrics).
// It knows HTTP and vLLM's kv_transfer_params, nothing of engines.
//
// Endpoints:
//   POST /v1/completions, /v1/chat/completions      routed P then D (route.h)
//   GET  /v1/models                                 from the first decode instance up
//   GET  /health      200 when at least one prefill and one decode instance are up, else 503;
//                     the body names each instance's state (up, asleep, paused, waking, failing) and load
//   GET  /status      the same body, always 200 (the status page; open like /metrics)
//   GET  /metrics     Prometheus text (proxy_metrics.h)
//   POST /sleep /wake_up /pause /resume /reset_prefix_cache
//        /release_kv_cache_memory /reload_weights
//   GET  /is_sleeping /is_paused /memory
//        forwarded to every instance, or ?instance=URL, or ?role=prefill|decode
// With an API key, every endpoint but /health and /metrics (and /metrics too
// with metrics_require_key) requires "Authorization: Bearer <key>" (401
// otherwise); the scheme's case does not matter. Without one, the admin calls
// are refused (403) unless allow_unauthenticated_admin. Instances get the
// proxy's own key, never a client's Authorization header.
// Requests are read whole before a handler runs (common/http_server.h): body
// and head limits, JSON depth, deadlines, connections per address.
//
// Lifecycle:
//   1. Proxy::start(config): validates, binds host:port, runs one health round
//      (so the first requests see real states), starts the health monitor,
//      the sleep controller (sleep_controller.h) and the HTTP server's
//      thread; port() is the bound port.
//   2. stop() (or the destructor): refuses new work, ends waits in progress
//      (their clients get 503), stops the server, the sleep controller and
//      the monitor, joins.
//
// Threads: start/stop/port from the owner; everything else runs on the
// server's worker threads (one per request being served, up to
// config.max_connections; the server's intake thread reads requests), and the
// monitor's thread.
#pragma once

#include <atomic>
#include <memory>
#include <thread>

#include "common/status.h"
#include "common/http_server.h"
#include "proxy/health_monitor.h"
#include "proxy/instance_set.h"
#include "proxy/proxy_config.h"
#include "proxy/proxy_metrics.h"
#include "proxy/request_id.h"
#include "proxy/route.h"
#include "proxy/sleep_controller.h"

namespace siesta::proxy {

class Proxy {
 public:
  static Result<std::unique_ptr<Proxy>> start(ProxyConfig config);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  int port() const { return port_; }
  void stop();

 private:
  explicit Proxy(ProxyConfig config);
  void install_routes();
  void serve_admin(const httplib::Request& req, const std::string& body, httplib::Response& res);
  void serve_models(const httplib::Request& req, httplib::Response& res);
  void serve_health(httplib::Response& res, bool always_200) const;
  // Whether the request may go on; false after answering 401 or 403.
  bool authorize(const httplib::Request& req, httplib::Response& res) const;
  std::vector<std::pair<std::string, std::string>> instance_headers() const;

  const ProxyConfig config_;
  InstanceSet prefill_;
  InstanceSet decode_;
  ProxyMetrics metrics_;
  RequestIdSource ids_;
  std::atomic<bool> stopping_{false};
  SleepController sleep_;
  RouteContext route_ctx_;
  HealthMonitor health_;
  HttpServer server_;
  std::thread listener_;
  int port_ = 0;
};

}  // namespace siesta::proxy
