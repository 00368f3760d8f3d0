#include "proxy/proxy_metrics.h"

#include <fmt/format.h>

namespace siesta::proxy {

void ProxyMetrics::count_request(Endpoint endpoint) {
  (endpoint == Endpoint::kCompletions ? completions_ : chat_completions_).fetch_add(1, std::memory_order_relaxed);
}

void ProxyMetrics::record_wake_wait(Role role, double seconds) {
  const int r = static_cast<int>(role);
  size_t b = 0;
  while (b < kNumBuckets && seconds > kWakeBuckets[b]) ++b;
  wake_wait_buckets_[r][b].fetch_add(1, std::memory_order_relaxed);
  wake_wait_us_[r].fetch_add(static_cast<uint64_t>(seconds * 1e6), std::memory_order_relaxed);
}

std::string ProxyMetrics::render(const InstanceSet& prefill, const InstanceSet& decode) const {
  auto load = [](const std::atomic<uint64_t>& counter) { return counter.load(std::memory_order_relaxed); };
  std::string out;
  auto family = [&](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  family("siesta_proxy_requests_total", "counter", "Client requests received, by endpoint.");
  out += fmt::format("siesta_proxy_requests_total{{endpoint=\"/v1/completions\"}} {}\n", load(completions_));
  out += fmt::format("siesta_proxy_requests_total{{endpoint=\"/v1/chat/completions\"}} {}\n", load(chat_completions_));
  family("siesta_proxy_prefill_failures_total", "counter",
         "Requests failed because the prefill leg failed (no answer, error, bad kv_transfer_params).");
  out += fmt::format("siesta_proxy_prefill_failures_total {}\n", load(prefill_failures_));
  family("siesta_proxy_decode_failures_total", "counter", "Requests failed because the decode leg failed.");
  out += fmt::format("siesta_proxy_decode_failures_total {}\n", load(decode_failures_));
  family("siesta_proxy_client_disconnects_total", "counter", "Requests whose client hung up before the answer ended.");
  out += fmt::format("siesta_proxy_client_disconnects_total {}\n", load(client_disconnects_));
  family("siesta_proxy_admin_calls_total", "counter", "Admin calls forwarded to instances.");
  out += fmt::format("siesta_proxy_admin_calls_total {}\n", load(admin_calls_));
  family("siesta_proxy_retries_total", "counter",
         "Requests tried again on other instances after a failure before anything reached the client.");
  out += fmt::format("siesta_proxy_retries_total {}\n", load(retries_));

  const auto p = prefill.snapshot();
  const auto d = decode.snapshot();
  auto per_instance = [&](const char* name, const char* type, const char* help, auto value) {
    family(name, type, help);
    for (const auto* set : {&p, &d})
      for (const InstanceStatus& s : *set)
        out += fmt::format("{}{{role=\"{}\",instance=\"{}\"}} {}\n", name, role_name(s.role), s.url.text, value(s));
  };
  per_instance("siesta_proxy_instance_up", "gauge", "1 when the instance's last health check (or request) succeeded.",
               [](const InstanceStatus& s) { return s.up ? 1 : 0; });
  per_instance("siesta_proxy_instance_requests_total", "counter", "Requests routed to the instance.",
               [](const InstanceStatus& s) { return s.picked; });
  per_instance("siesta_proxy_instance_failures_total", "counter", "Requests to the instance that failed.",
               [](const InstanceStatus& s) { return s.failures; });
  per_instance("siesta_proxy_instance_in_flight", "gauge", "Requests the proxy has at the instance now.",
               [](const InstanceStatus& s) { return s.in_flight; });
  per_instance("siesta_proxy_instance_engine_requests", "gauge",
               "Requests the instance reported running or waiting at its last check.",
               [](const InstanceStatus& s) { return s.engine_running + s.engine_waiting; });
  per_instance("siesta_proxy_instance_kv_cache_usage", "gauge",
               "KV cache usage (0..1) the instance reported at its last check.",
               [](const InstanceStatus& s) { return s.kv_usage; });
  per_instance("siesta_proxy_instance_wakes_total", "counter", "wake_up calls the proxy made to the instance.",
               [](const InstanceStatus& s) { return s.wakes; });
  per_instance("siesta_proxy_instance_wake_failures_total", "counter", "Those that failed.",
               [](const InstanceStatus& s) { return s.wake_failures; });
  per_instance("siesta_proxy_instance_parks_total", "counter",
               "Sleep calls the proxy made to the instance because it was idle.",
               [](const InstanceStatus& s) { return s.parks; });
  family("siesta_proxy_instance_state", "gauge",
         "1 for the instance's state: up (serving), asleep, paused (also draining), waking, or failing (down).");
  for (const auto* set : {&p, &d})
    for (const InstanceStatus& s : *set)
      for (const char* state : {"up", "asleep", "paused", "waking", "failing"}) {
        const char* now = !s.up ? "failing"
                          : s.condition == Condition::kServing ? "up"
                                                               : condition_name(s.condition);
        out += fmt::format("siesta_proxy_instance_state{{role=\"{}\",instance=\"{}\",state=\"{}\"}} {}\n",
                           role_name(s.role), s.url.text, state, std::string_view(now) == state ? 1 : 0);
      }
  family("siesta_proxy_wake_wait_seconds", "histogram",
         "How long requests waited for an instance to wake up (--wake-on-demand), by role.");
  for (Role role : {Role::kPrefill, Role::kDecode}) {
    const int r = static_cast<int>(role);
    uint64_t cumulative = 0;
    for (size_t b = 0; b <= kNumBuckets; ++b) {
      cumulative += load(wake_wait_buckets_[r][b]);
      const std::string le = b < kNumBuckets ? fmt::format("{}", kWakeBuckets[b]) : "+Inf";
      out += fmt::format("siesta_proxy_wake_wait_seconds_bucket{{role=\"{}\",le=\"{}\"}} {}\n", role_name(role), le,
                         cumulative);
    }
    out += fmt::format("siesta_proxy_wake_wait_seconds_sum{{role=\"{}\"}} {}\n", role_name(role),
                       static_cast<double>(load(wake_wait_us_[r])) / 1e6);
    out += fmt::format("siesta_proxy_wake_wait_seconds_count{{role=\"{}\"}} {}\n", role_name(role), cumulative);
  }
  family("siesta_proxy_wake_timeouts_total", "counter",
         "Requests answered 503 because no instance of the role woke up within --wake-timeout-s.");
  for (Role role : {Role::kPrefill, Role::kDecode})
    out += fmt::format("siesta_proxy_wake_timeouts_total{{role=\"{}\"}} {}\n", role_name(role),
                       load(wake_timeouts_[static_cast<int>(role)]));
  return out;
}

}  // namespace siesta::proxy
