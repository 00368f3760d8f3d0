// HttpServer: the cpp-httplib server under `siesta serve` and `siesta proxy`,
// with the reading of requests taken off the threads that serve them.
//
// cpp-httplib serves each connection on one pool thread from its first byte
// to its last, with a timeout per read only: a client that sends a byte every
// few seconds holds a thread forever, and as many such clients as there are
// threads stop the server. Here one intake thread reads every connection that
// is between requests (epoll), frames each request as it arrives
// (http_request_framer.h: limits, Content-Length and chunked checked, JSON
// depth), and hands a worker thread only a request that has arrived whole.
// The workers (httplib's routing and handlers, streams included) never wait
// for a client to send. The intake bounds what a client can hold:
//   - a request must send its head within head_timeout of its first byte,
//     and its body within body_timeout of its head (408 otherwise); a
//     connection with no request waits idle_timeout (keep-alive), then closes;
//   - at most max_connections open connections, and max_connections_per_address
//     from one client address: a new connection over either limit closes the
//     oldest one that is only waiting (idle or part-way through its request) of
//     that address (or of any), and is refused with 503 when every one is being
//     served;
//   - request bodies held while they arrive: at most max_buffered_bytes in all.
// Refusals are answered by the intake with OpenAI error JSON and
// `Connection: close`, and the rest of what the client sends is read and
// dropped for a moment, so that it sees the answer rather than a reset.
//
// Lifecycle (as httplib::Server's):
//   HttpServer server(options);            // then add routes, handlers, ...
//   server.bind_to_port(host, port);       // or bind_to_any_port
//   server.listen_after_bind();            // blocks; the intake and workers run inside
//   server.stop();                         // from any thread: requests in service see
//                                          // the server stopping (streams end), then it returns
// Do not set new_task_queue: the server owns its task queue.
//
// Threads: httplib's accept thread hands sockets to the intake thread; workers
// serve requests. client_socket() and client_hung_up() are for a handler (or
// its content provider), which runs on a worker.
#pragma once

#include <httplib.h>

#include <chrono>
#include <cstddef>
#include <memory>

#include "common/http_request_framer.h"

namespace siesta {

struct HttpServerOptions {
  size_t worker_threads = 64;  // requests served at once (a streaming answer holds one)
  FramerLimits limits;         // head and body sizes, JSON depth
  std::chrono::milliseconds head_timeout{10'000};
  std::chrono::milliseconds body_timeout{30'000};
  std::chrono::milliseconds idle_timeout{5'000};
  size_t max_connections = 4096;  // lowered to what RLIMIT_NOFILE leaves room for
  size_t max_connections_per_address = 512;
  size_t max_buffered_bytes = 256u << 20;  // request bytes the intake holds, all connections
  size_t max_requests_per_connection = 1000;
};

// What the intake did, for logs and tests; each a running total.
struct HttpIntakeCounts {
  uint64_t accepted = 0;
  uint64_t requests = 0;          // handed to workers
  uint64_t refused = 0;           // answered by the intake (400, 408, 413, 431, 503, ...)
  uint64_t timed_out = 0;         // of refused: 408, or idle connections closed
  uint64_t evicted = 0;           // waiting connections closed for a newer one
};

class HttpServer : public httplib::Server {
 public:
  explicit HttpServer(HttpServerOptions options);
  ~HttpServer() override;

  const HttpServerOptions& options() const { return options_; }
  HttpIntakeCounts counts() const;

  // The socket of the request the calling worker serves; -1 elsewhere.
  static int client_socket();
  // The client of that request closed or reset its connection (looked at
  // without reading: a client still sending a pipelined request is not gone).
  static bool client_hung_up();

  class Intake;

 private:
  bool process_and_close_socket(socket_t sock) override;
  void serve_request(struct IntakeConnection* conn, std::string request);

  HttpServerOptions options_;
  std::shared_ptr<Intake> intake_;
};

}  // namespace siesta
