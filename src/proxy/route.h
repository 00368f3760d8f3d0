// Route: one client request (/v1/completions or /v1/chat/completions) taken
// through one prefill and one decode instance.
//
//   1. Parse the client's body: 400 unless it is a JSON object whose "stream",
//      if present, is a boolean.
//   2. Pick a prefill and a decode instance, round robin among those up; 503
//      naming every instance's state when a role has none up.
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
#include <string>
#include <string_view>

#include "proxy/instance_set.h"
#include "proxy/pd_request.h"
#include "proxy/proxy_config.h"
#include "proxy/proxy_metrics.h"
#include "proxy/request_id.h"

namespace siesta::proxy {

struct RouteContext {
  const ProxyConfig* config = nullptr;
  InstanceSet* prefill = nullptr;
  InstanceSet* decode = nullptr;
  ProxyMetrics* metrics = nullptr;
  RequestIdSource* ids = nullptr;
  const std::atomic<bool>* stopping = nullptr;
};

void serve_generate(const RouteContext& ctx, Endpoint endpoint, const httplib::Request& req, httplib::Response& res);

// Sets an OpenAI error JSON answer (openai_error.h).
void reply_error(httplib::Response& res, int status, std::string_view code, const std::string& message,
                 const std::string& param = {});

}  // namespace siesta::proxy
