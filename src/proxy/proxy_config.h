// ProxyConfig: everything `siesta proxy` is told on its command line, as one
// value. Built by the CLI (or a test), checked by validate_proxy_config(),
// then handed to Proxy::start() and never changed.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/http_server.h"
#include "common/status.h"
#include "proxy/instance_url.h"

namespace siesta::proxy {

// How the decode leg is timed against the prefill leg.
enum class ProxyMode {
  kConcurrent,  // WRITE-mode P/D: both legs at once; prefill's parameters travel
                // between the engines (side channel)
  kSequential,  // READ-mode P/D: decode starts with the kv_transfer_params that
                // prefill returned
};
Result<ProxyMode> parse_proxy_mode(std::string_view text);  // "concurrent" | "sequential"
const char* proxy_mode_name(ProxyMode mode);

struct ProxyConfig {
  std::vector<InstanceUrl> prefill;
  std::vector<InstanceUrl> decode;
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (Proxy::port() says which)
  ProxyMode mode = ProxyMode::kConcurrent;
  // Every wait on an instance: prefill's whole answer, decode's
  // response headers and each silence between its chunks, admin calls.
  std::chrono::milliseconds timeout{300'000};
  std::chrono::milliseconds connect_timeout{5'000};  // to open a connection to an instance
  std::chrono::milliseconds health_interval{5'000};  // between health rounds
  std::chrono::milliseconds health_timeout{2'000};   // for one GET /health
  std::string api_key;                               // empty: none; else required from clients, sent to instances
  // Without api_key the admin calls (/sleep, /pause, ...) are refused (403)
  // unless this says to forward them for anyone.
  bool allow_unauthenticated_admin = false;
  // With api_key: /metrics needs it too (as siesta serve's --metrics-require-key).
  bool metrics_require_key = false;
  // Sleep mode (sleep_controller.h): wake an instance when every one of a
  // role is asleep, holding the request up to wake_timeout; put one with no
  // traffic for park_idle_after to sleep (level 1; needs wake_on_demand).
  bool wake_on_demand = false;
  std::chrono::milliseconds wake_timeout{60'000};
  std::optional<std::chrono::milliseconds> park_idle_after;
  // Prefill choice by prompt prefix (instance_set.h): prompts whose first
  // prefix_affinity_chars characters agree go to the same prefill instance
  // while its load is within affinity_slack requests of the least loaded one.
  // 0: by load only.
  size_t prefix_affinity_chars = 256;
  // Tries more on other instances for a request whose try failed before
  // anything reached its client, at an instance now marked down (route.h).
  int retries = 0;
  uint64_t affinity_slack = 2;
  size_t max_connections = 128;                      // client requests served at once (one thread each)
  // How client requests are read: limits, deadlines, connection limits
  // (common/http_server.h); its worker_threads is replaced by max_connections.
  HttpServerOptions http;
};

// Refuses empty instance lists, an instance listed twice in one role,
// non-positive timeouts and a bad port, with a message naming the option.
Result<void> validate_proxy_config(const ProxyConfig& config);

}  // namespace siesta::proxy
