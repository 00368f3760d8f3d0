#include "proxy/proxy_metrics.h"

#include <fmt/format.h>

namespace siesta::proxy {

void ProxyMetrics::count_request(Endpoint endpoint) {
  (endpoint == Endpoint::kCompletions ? completions_ : chat_completions_).fetch_add(1, std::memory_order_relaxed);
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
  return out;
}

}  // namespace siesta::proxy
