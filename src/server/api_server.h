// ApiServer: the OpenAI-compatible HTTP API over one Engine (cpp-httplib).
//
// Lifecycle
//   ApiServer server(engine, options);        // engine outlives the server
//   Result<int> port = server.bind();         // options.port 0: any free port
//   server.serve();                           // blocks, answering requests on a thread pool
//   server.stop();                            // from another thread (a signal handler thread):
//                                             // waiting handlers abort their requests, serve() returns
//
// With options.weight_socket, bind() also listens on that Unix socket
// (weight_socket.h: /update_weights with a memfd passed as a descriptor;
// needs sleep mode), serve() answers it on a thread of its own, and stop()
// ends that thread and removes the socket file.
//
// Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
// GET /health, POST /tokenize, POST /detokenize, GET /metrics, GET /version,
// GET /kv_transfer_info (P/D: where this engine's transfer side channel
// listens, so that a decode engine in WRITE mode finds a prefill engine from
// its URL), and the sleep-mode admin routes (admin_handlers.h).
// With options.api_key, every route but /health needs `Authorization: Bearer
// KEY` (401 otherwise); /kv_transfer_info too (a decode engine sends its own key). Errors are OpenAI error JSON
// (api_error.h): malformed JSON, wrong types and out-of-range values 400, an
// unknown model 404 (model_not_found), an unknown path 404. Requests are read
// whole by the HTTP intake before a handler runs (common/http_server.h:
// head and body deadlines, connection limits): a body over
// http.limits.max_body_bytes is 413 (chunked too, as soon as it passes the
// limit), JSON nested deeper than http.limits.max_json_depth 400, duplicate or
// malformed Content-Length 400, a slow request 408. Handlers parse, validate
// and translate; the engine does the work. A client that disconnects has its
// requests aborted.
//
// Thread safety: bind and serve from one thread; stop from any thread.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>

#include "common/http_server.h"
#include "common/status.h"
#include "engine/engine.h"
#include "server/chat_config.h"

namespace siesta::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;                      // empty: no authentication
  std::string served_model_name;            // the name clients use in "model"
  // How requests are read: limits, deadlines, connections (common/http_server.h).
  // Its worker_threads is replaced by http_threads.
  HttpServerOptions http;
  size_t http_threads = 0;                  // 0: max_num_seqs + 64 (a request holds a thread while it runs)
  // How often a handler that waits for the engine looks at its client.
  std::chrono::milliseconds client_poll_interval{50};
  // P/D: what GET /kv_transfer_info answers (the connector's engine id and
  // side channel, SiestaConnector::info()); null without --kv-transfer-config (404).
  nlohmann::json kv_transfer_info;
  // Chat: the template (--chat-template: a file or the template; empty: the
  // model's) and how answers are read.
  std::string chat_template;
  ChatConfig chat;
  // /metrics needs the API key too (a scraper without one gets 401).
  bool metrics_require_key = false;
  // /metrics adds vllm:-named copies of the metrics vLLM dashboards chart.
  bool vllm_metric_names = false;
  // What GET /server_info reports of the serve flags (the CLI fills it).
  nlohmann::json server_info;
  // --weight-socket: where a trainer passes memfds for /update_weights
  // (weight_socket.h); empty: no such socket.
  std::filesystem::path weight_socket;
};

struct ServerContext;
class WeightSocket;

class ApiServer {
 public:
  ApiServer(Engine& engine, ServerOptions options);
  ~ApiServer();
  ApiServer(const ApiServer&) = delete;
  ApiServer& operator=(const ApiServer&) = delete;

  // kIo naming the address when it cannot be bound.
  Result<int> bind();
  Result<void> serve();
  void stop();

 private:
  struct Http;
  std::unique_ptr<ServerContext> ctx_;
  std::unique_ptr<Http> http_;
  std::unique_ptr<WeightSocket> weight_socket_;
};

}  // namespace siesta::server
