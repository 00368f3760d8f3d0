#include "proxy/proxy_config.h"

#include <set>

namespace siesta::proxy {

Result<ProxyMode> parse_proxy_mode(std::string_view text) {
  if (text == "concurrent") return ProxyMode::kConcurrent;
  if (text == "sequential") return ProxyMode::kSequential;
  return invalid_argument("--mode: expected concurrent or sequential, got \"" + std::string(text) + "\"");
}

const char* proxy_mode_name(ProxyMode mode) { return mode == ProxyMode::kConcurrent ? "concurrent" : "sequential"; }

Result<void> validate_proxy_config(const ProxyConfig& config) {
  auto check_role = [](const std::vector<InstanceUrl>& urls, const char* option) -> Result<void> {
    if (urls.empty()) return invalid_argument(std::string(option) + ": at least one instance URL is required");
    std::set<std::string> seen;
    for (const InstanceUrl& url : urls)
      if (!seen.insert(url.text).second)
        return invalid_argument(std::string(option) + ": " + url.text + " is listed twice");
    return {};
  };
  SIESTA_TRY(check_role(config.prefill, "--prefill"));
  SIESTA_TRY(check_role(config.decode, "--decode"));
  if (config.port < 0 || config.port > 65535) return invalid_argument("--port: expected 0-65535");
  if (config.timeout.count() <= 0) return invalid_argument("--timeout-s: must be positive");
  if (config.connect_timeout.count() <= 0) return invalid_argument("--connect-timeout-s: must be positive");
  if (config.health_interval.count() <= 0) return invalid_argument("--health-interval-s: must be positive");
  if (config.health_timeout.count() <= 0) return invalid_argument("--health-timeout-s: must be positive");
  if (config.max_connections == 0) return invalid_argument("--max-connections: must be positive");
  if (config.metrics_require_key && config.api_key.empty())
    return invalid_argument("--metrics-require-key: needs --api-key (the key /metrics would require)");
  if (config.retries < 0 || config.retries > 8) return invalid_argument("--retries: expected 0-8");
  if (config.wake_timeout.count() <= 0) return invalid_argument("--wake-timeout-s: must be positive");
  if (config.park_idle_after && config.park_idle_after->count() <= 0)
    return invalid_argument("--park-idle-after: must be positive");
  if (config.park_idle_after && !config.wake_on_demand)
    return invalid_argument("--park-idle-after: needs --wake-on-demand (parked instances are woken only by it; "
                            "without it the proxy would stop serving once every instance of a role is parked)");
  return {};
}

}  // namespace siesta::proxy
