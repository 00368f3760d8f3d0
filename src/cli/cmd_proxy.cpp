// siesta proxy --prefill URL... --decode URL... [--host H] [--port N]
//              [--mode concurrent|sequential] [--timeout-s S] [--api-key K]
//              [--connect-timeout-s S] [--health-interval-s S] [--health-timeout-s S] [--max-connections N]
//              [--allow-unauthenticated-admin] [--metrics-require-key] [HTTP limits: cli/http_flags.h]
//              [--wake-on-demand] [--wake-timeout-s S] [--park-idle-after S]
//              [--prefix-affinity-chars N] [--affinity-slack N] [--retries N]
//
// The P/D router (src/proxy/README.md). Prints "siesta proxy: listening on
// http://H:N" on stdout once it accepts connections, runs until SIGINT or
// SIGTERM, then stops cleanly.
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <iostream>

#include "cli/commands.h"
#include "cli/http_flags.h"
#include "proxy/proxy.h"

namespace siesta::cli {
namespace {

struct ProxyOptions {
  std::vector<std::string> prefill;
  std::vector<std::string> decode;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string mode = "concurrent";
  double timeout_s = 300;
  double connect_timeout_s = 5;
  double health_interval_s = 5;
  double health_timeout_s = 2;
  std::string api_key;
  bool allow_unauthenticated_admin = false;
  bool metrics_require_key = false;
  size_t max_connections = 128;
  bool wake_on_demand = false;
  double wake_timeout_s = 60;
  double park_idle_after_s = 0;  // 0: never
  size_t prefix_affinity_chars = 256;
  uint64_t affinity_slack = 2;
  int retries = 0;
  HttpFlags http;
};

Result<std::chrono::milliseconds> millis(double seconds, const char* option) {
  if (!std::isfinite(seconds) || seconds <= 0 || seconds > 1e7)
    return invalid_argument(std::string(option) + ": expected a positive number of seconds");
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000)));
}

Result<proxy::ProxyConfig> make_config(const ProxyOptions& opt) {
  proxy::ProxyConfig config;
  for (const std::string& text : opt.prefill) {
    SIESTA_ASSIGN_OR_RETURN(proxy::InstanceUrl url, proxy::parse_instance_url(text));
    config.prefill.push_back(std::move(url));
  }
  for (const std::string& text : opt.decode) {
    SIESTA_ASSIGN_OR_RETURN(proxy::InstanceUrl url, proxy::parse_instance_url(text));
    config.decode.push_back(std::move(url));
  }
  config.host = opt.host;
  config.port = opt.port;
  SIESTA_ASSIGN_OR_RETURN(config.mode, proxy::parse_proxy_mode(opt.mode));
  SIESTA_ASSIGN_OR_RETURN(config.timeout, millis(opt.timeout_s, "--timeout-s"));
  SIESTA_ASSIGN_OR_RETURN(config.connect_timeout, millis(opt.connect_timeout_s, "--connect-timeout-s"));
  SIESTA_ASSIGN_OR_RETURN(config.health_interval, millis(opt.health_interval_s, "--health-interval-s"));
  SIESTA_ASSIGN_OR_RETURN(config.health_timeout, millis(opt.health_timeout_s, "--health-timeout-s"));
  config.api_key = opt.api_key;
  config.allow_unauthenticated_admin = opt.allow_unauthenticated_admin;
  config.metrics_require_key = opt.metrics_require_key;
  config.max_connections = opt.max_connections;
  config.wake_on_demand = opt.wake_on_demand;
  SIESTA_ASSIGN_OR_RETURN(config.wake_timeout, millis(opt.wake_timeout_s, "--wake-timeout-s"));
  if (opt.park_idle_after_s != 0) {
    SIESTA_ASSIGN_OR_RETURN(std::chrono::milliseconds idle, millis(opt.park_idle_after_s, "--park-idle-after"));
    config.park_idle_after = idle;
  }
  config.prefix_affinity_chars = opt.prefix_affinity_chars;
  config.affinity_slack = opt.affinity_slack;
  config.retries = opt.retries;
  SIESTA_ASSIGN_OR_RETURN(config.http, opt.http.options());
  SIESTA_TRY(proxy::validate_proxy_config(config));
  return config;
}

int run_proxy(const ProxyOptions& opt) {
  Result<proxy::ProxyConfig> config = make_config(opt);
  if (!config) {
    std::cerr << "siesta proxy: " << config.error().message << "\n";
    return kExitUsage;
  }
  // Signals go to this thread only (sigwait below); every thread the proxy
  // starts inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  // A client or instance that hangs up makes a write fail with EPIPE; the
  // proxy handles that, so the signal must not end the process.
  signal(SIGPIPE, SIG_IGN);
  raise_open_file_limit();
  if (opt.api_key.empty() && opt.allow_unauthenticated_admin)
    std::cerr << "siesta proxy: warning: --allow-unauthenticated-admin without --api-key: anyone who reaches this "
                 "port can sleep, pause and reload every instance\n";

  Result<std::unique_ptr<proxy::Proxy>> running = proxy::Proxy::start(std::move(*config));
  if (!running) {
    std::cerr << "siesta proxy: " << running.error().message << "\n";
    return kExitFailure;
  }
  const bool v6 = opt.host.find(':') != std::string::npos;
  std::cout << "siesta proxy: listening on http://" << (v6 ? "[" + opt.host + "]" : opt.host) << ":"
            << (*running)->port() << std::endl;
  int signal_number = 0;
  sigwait(&signals, &signal_number);
  (*running)->stop();
  return 0;
}

}  // namespace

void add_proxy_command(CLI::App& app) {
  auto* cmd = app.add_subcommand("proxy", "Route OpenAI requests through prefill and decode instances (P/D)");
  auto opt = std::make_shared<ProxyOptions>();
  cmd->add_option("--prefill", opt->prefill, "Prefill instance URLs (http://host:port), repeatable")
      ->required()
      ->delimiter(',');
  cmd->add_option("--decode", opt->decode, "Decode instance URLs (http://host:port), repeatable")
      ->required()
      ->delimiter(',');
  cmd->add_option("--host", opt->host, "Address to listen on")->capture_default_str();
  cmd->add_option("--port", opt->port, "Port to listen on (0: any free port)")->capture_default_str();
  cmd->add_option("--mode", opt->mode,
                  "concurrent: prefill and decode at once (WRITE-mode P/D); sequential: decode after prefill "
                  "answered, with its kv_transfer_params (READ mode)")
      ->capture_default_str();
  cmd->add_option("--timeout-s", opt->timeout_s,
                  "Deadline of every wait on an instance: prefill's whole answer, decode's first bytes and each "
                  "silence after, admin calls")
      ->capture_default_str();
  cmd->add_option("--connect-timeout-s", opt->connect_timeout_s, "Deadline to open a connection to an instance")
      ->capture_default_str();
  cmd->add_option("--health-interval-s", opt->health_interval_s, "Seconds between health checks")
      ->capture_default_str();
  cmd->add_option("--health-timeout-s", opt->health_timeout_s, "Deadline of one health check")->capture_default_str();
  cmd->add_option("--api-key", opt->api_key,
                  "Required from clients as \"Authorization: Bearer K\"; sent to instances the same way");
  cmd->add_flag("--allow-unauthenticated-admin", opt->allow_unauthenticated_admin,
                "Without --api-key, forward admin calls (/sleep, /pause, /reload_weights, ...) for anyone; by default "
                "they are refused (403)");
  cmd->add_flag("--metrics-require-key", opt->metrics_require_key, "With --api-key, /metrics needs the key too");
  cmd->add_option("--max-connections", opt->max_connections,
                  "Client requests served at once (one thread each; requests are read before they take one)")
      ->capture_default_str();
  cmd->add_flag("--wake-on-demand", opt->wake_on_demand,
                "When every instance of a role that is up is asleep, wake one (POST /wake_up) and hold the request "
                "until it serves (at most --wake-timeout-s, then 503 wake_timeout)");
  cmd->add_option("--wake-timeout-s", opt->wake_timeout_s, "How long a request waits for a wake")
      ->capture_default_str();
  cmd->add_option("--park-idle-after", opt->park_idle_after_s,
                  "Seconds without traffic after which an instance is put to sleep (level 1); needs "
                  "--wake-on-demand (0: never)")
      ->capture_default_str();
  cmd->add_option("--prefix-affinity-chars", opt->prefix_affinity_chars,
                  "Prompts whose first N characters agree go to the same prefill instance (its prefix cache) while "
                  "its load is within --affinity-slack of the least loaded (0: by load only)")
      ->capture_default_str();
  cmd->add_option("--affinity-slack", opt->affinity_slack,
                  "Requests in flight by which the prefix's prefill instance may exceed the least loaded one")
      ->capture_default_str();
  cmd->add_option("--retries", opt->retries,
                  "Tries more, on other instances, for a request that failed before anything reached its client "
                  "(the instance is marked down)")
      ->capture_default_str();
  opt->http.add_to(*cmd);
  cmd->callback([opt] {
    const int code = run_proxy(*opt);
    if (code != 0) throw CLI::RuntimeError(code);
  });
}

}  // namespace siesta::cli
