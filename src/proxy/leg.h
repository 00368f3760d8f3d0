// Leg: one HTTP exchange between the proxy and one instance (the prefill leg
// or the decode leg of a request, a health check, an admin call), run on its
// own thread so that the proxy can wait on several legs and on its client at
// once, and cancel any of them.
//
// Lifecycle:
//   1. Leg::start(to, request, limits): connects and sends on a new thread.
//   2. The owner waits: wait_head() for the status line and headers, then
//      either wait_body() for the whole body or next_chunk() repeatedly for
//      each piece as it arrives (streaming). Every wait ends by itself: when
//      `limits.total` has passed since start, when the instance was silent
//      for `limits.idle` (plus `limits.upstream` until upstream_done()), or
//      when the caller's Interrupt returns a Status (checked every few tens
//      of milliseconds). A wait that times out cancels the leg.
//   3. cancel() closes the connection (shutdown of the socket), which the
//      instance sees as a client disconnect: a serving engine aborts the
//      request. Safe to call at any time, from any thread, more than once.
//   4. The destructor cancels and joins the thread. That is bounded: once the
//      connection exists the shutdown ends the exchange at once, and opening
//      it is bounded by `limits.connect`.
//
// Threads: start() and the destructor from the owner; the waits from one
// thread at a time (the owner); cancel(), failed() and upstream_done() from
// any thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/status.h"
#include "proxy/instance_url.h"

namespace siesta::proxy {

using Clock = std::chrono::steady_clock;

// Consulted between slices of every wait; a Status ends the wait with it
// (the client hung up, the proxy is stopping, the other leg failed).
using Interrupt = std::function<std::optional<Status>()>;

struct LegRequest {
  std::string method = "POST";  // "GET" | "POST"
  std::string target;           // path with query string: "/v1/completions", "/sleep?level=1"
  std::string body;             // sent when not empty, with content_type
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;
};

struct LegLimits {
  std::chrono::milliseconds connect{5000};         // to open the TCP connection
  std::chrono::milliseconds idle{60000};           // longest silence from the instance
  std::optional<std::chrono::milliseconds> total;  // for the whole answer; none: only idle applies
  // Silence allowed on top of `idle` until upstream_done(): a decode leg sent
  // together with its prefill leg hears nothing before prefill has answered.
  std::chrono::milliseconds upstream{0};
};

struct LegHead {
  int status = 0;
  std::string content_type;
};

class Leg {
 public:
  static std::unique_ptr<Leg> start(InstanceUrl to, LegRequest request, LegLimits limits);
  ~Leg();
  Leg(const Leg&) = delete;
  Leg& operator=(const Leg&) = delete;

  const InstanceUrl& to() const { return to_; }

  Result<LegHead> wait_head(const Interrupt& interrupt);
  // The whole body (what next_chunk() has not handed out yet).
  Result<std::string> wait_body(const Interrupt& interrupt);
  // The next piece of the body as the instance sent it; nullopt at its end.
  Result<std::optional<std::string>> next_chunk(const Interrupt& interrupt);

  void cancel();
  // The exchange ended with an error (connection, timeout, cancel); never blocks.
  bool failed() const;
  // The leg this one waited on has answered: from now on the instance may be
  // silent for `limits.idle` only, counted from now.
  void upstream_done();

 private:
  Leg(InstanceUrl to, LegRequest request, LegLimits limits);
  void run();
  void adopt_socket(int fd);
  Status failure_from(int httplib_error);
  // How long the instance may be silent now (idle, plus upstream until upstream_done()).
  std::chrono::milliseconds allowed_silence() const;
  // Waits until ready() (under mu_), a failure, a timeout, or an interrupt.
  Result<void> wait_until(std::unique_lock<std::mutex>& lock, const std::function<bool()>& ready,
                          const Interrupt& interrupt);

  const InstanceUrl to_;
  const LegRequest request_;
  const LegLimits limits_;
  const Clock::time_point started_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::optional<LegHead> head_;
  std::deque<std::string> chunks_;
  std::optional<Status> failure_;
  Clock::time_point last_progress_;
  bool complete_ = false;  // the whole answer arrived
  bool finished_ = false;  // the thread is past the exchange (complete or failed)
  bool cancelled_ = false;
  bool upstream_done_ = false;
  int socket_ = -1;  // our duplicate of the connection's descriptor, for shutdown()
  std::thread thread_;
};

}  // namespace siesta::proxy
