// Route: one client request (/v1/completions or /v1/chat/completions) taken
// through one prefill and one decode instance.
//
//   1. Parse the client's body: 400 unless it is a JSON object whose "stream",
//      if present, is a boolean.
//   2. Pick a prefill and a decode instance, the least loaded of those up and
//      serving (instance_set.h; prefill by prompt prefix where that pays).
//      When every instance of a role that is up is asleep and the proxy wakes
//      on demand, wake one (sleep_controller.h) and hold the request until it
//      serves, up to wake_timeout (then 503 wake_timeout). 503 no_instance_up
//      naming every instance's state when a role has none that can serve.
//      From here every answer carries x-siesta-prefill and x-siesta-decode
//      (the instances' URLs) and, after a wait for a wake, x-siesta-wake-wait-ms.
//   3. Start the prefill leg (pd_request.h), and in concurrent mode the decode
//      leg at the same time; both carry the same X-Request-Id.
//   4. Check prefill's answer. No answer in time, a broken connection, an
//      HTTP error or missing/invalid kv_transfer_params cancel the decode leg
//      (the decode instance sees its client disconnect) and answer 502 naming
//      the prefill instance and the reason; the instance is marked down until
//      its next good health check. A 4xx from prefill refused the request
//      itself and is passed on as is.
//   5. Sequential mode: start the decode leg with prefill's kv_transfer_params.
//   6. Pass decode's answer on: its JSON and status as they are, or, for
//      "stream": true, its SSE chunks one by one as they arrive. A decode leg
//      that fails before its answer starts gets a 502 naming it; one that
//      fails mid-stream ends the stream with an error event and [DONE].
// A client that hangs up at any point ends both legs (their connections are
// closed); so does the proxy stopping.
//
// Threads: serve_generate() runs on the worker thread of HttpServer
// (common/http_server.h) that serves the request, and so does the streaming
// content provider it installs.
// The RouteContext's objects must outlive every response (Proxy owns them and
// stops its server before they go).
#pragma once

#include <httplib.h>

#include <atomic>
#include <optional>
#include <string>
#include <string_view>

#include "proxy/instance_set.h"
#include "proxy/pd_request.h"
#include "proxy/proxy_config.h"
#include "proxy/proxy_metrics.h"
#include "proxy/request_id.h"
#include "proxy/sleep_controller.h"

namespace siesta::proxy {

struct RouteContext {
  const ProxyConfig* config = nullptr;
  InstanceSet* prefill = nullptr;
  InstanceSet* decode = nullptr;
  ProxyMetrics* metrics = nullptr;
  RequestIdSource* ids = nullptr;
  const std::atomic<bool>* stopping = nullptr;
  SleepController* sleep = nullptr;
};

// The affinity key of a request body: a hash of the first `chars` characters
// of its prompt ("prompt", or the chat "messages" as JSON text); nullopt when
// the prompt is shorter, or chars is 0.
std::optional<uint64_t> prefix_affinity(const nlohmann::json& body, size_t chars);

void serve_generate(const RouteContext& ctx, Endpoint endpoint, const httplib::Request& req, httplib::Response& res);

// Sets an OpenAI error JSON answer (openai_error.h).
void reply_error(httplib::Response& res, int status, std::string_view code, const std::string& message,
                 const std::string& param = {});

}  // namespace siesta::proxy
