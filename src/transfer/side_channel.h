// SideChannel: an engine's control plane over TCP (standalone Asio).
//
// Lifecycle:
//   1. start(options, handler) binds host:port (port 0: the OS picks one;
//      address() reports it) and starts one I/O thread and a small pool of
//      handler threads.
//   2. Incoming connections carry request frames; each is answered by
//      `handler` on a handler thread, one request at a time per connection.
//   3. request(address, frame, deadline) sends a frame to another engine and
//      returns its answer; connections are kept and reused per address.
//   4. stop() (or the destructor) closes the listener and every connection,
//      fails outstanding requests, and joins the threads; it waits for
//      handlers that are running, so handlers must respect their own deadlines.
//
// A malformed, oversized or unexpected frame closes that connection only and
// logs one line naming the remote address; other connections are unaffected.
//
// With options.auth_key every connection authenticates first (frame_auth.h:
// HELLO, CHALLENGE, AUTH, then a MAC on every frame), in both directions: a
// peer without the key gets an ERROR and the connection closes, and the
// handler learns the engine id each request's sender proved
// (RequestOrigin::engine_id). Without a key nothing is authenticated; a peer
// that offers authentication is told the two ends disagree.
// What an incoming connection may cost is bounded: before it authenticates it
// may send only a HELLO (and AUTH) of a few KiB, within auth_timeout; control
// frames are refused past their small sizes at their header; partial frames
// of all connections together are held up to max_buffered_bytes; a
// connection without a frame for idle_timeout closes; at most max_connections
// are open, max_connections_per_address from one address, and a new one
// closes the oldest that has not authenticated when these are reached (it is
// refused when every open one has).
//
// Thread safety: request() from any thread, concurrently. The handler runs on
// handler threads and may itself call request() (the I/O thread never runs
// handlers). address() is constant after start().
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/clock.h"
#include "common/status.h"
#include "transfer/frame.h"

namespace siesta::transfer {

struct SideChannelOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  uint32_t max_frame_payload = kDefaultMaxFramePayload;
  size_t handler_threads = 2;
  size_t idle_connections_per_address = 4;
  // The engine this side channel speaks for (named in the handshake).
  std::string engine_id = "side-channel";
  // The shared secret of every engine that may talk to this one (at least
  // kMinAuthKeyBytes); empty: no authentication.
  std::string auth_key;
  // Incoming connections.
  size_t max_connections = 256;
  size_t max_connections_per_address = 64;
  std::chrono::milliseconds auth_timeout{5'000};
  std::chrono::milliseconds idle_timeout{120'000};
  size_t max_buffered_bytes = 64u << 20;
};

// Who sent a request.
struct RequestOrigin {
  std::string address;    // the connection's remote ip:port
  std::string engine_id;  // the engine id it proved (authenticated side channel); empty otherwise
};

// Answers one request. Return the answer frame (an ERROR frame for a refusal),
// or an error Status for a protocol violation (undecodable payload, a frame
// type that is not a request): the connection is then closed.
using RequestHandler = std::function<Result<Frame>(const Frame& request, const RequestOrigin& from)>;

class SideChannel {
 public:
  static Result<std::unique_ptr<SideChannel>> start(const SideChannelOptions& options, RequestHandler handler);
  ~SideChannel();
  SideChannel(const SideChannel&) = delete;
  SideChannel& operator=(const SideChannel&) = delete;

  // host:port this side channel listens on.
  const std::string& address() const;

  // Sends `request` to the side channel at `address` ("host:port") and waits
  // for one answer frame until `deadline` (kTimeout after it). Connection
  // failures are kUnavailable.
  Result<Frame> request(const std::string& address, const Frame& request, Deadline deadline);

  // The same without waiting: wait() on the result gives the answer.
  class Pending;
  Pending request_async(const std::string& address, const Frame& request, Deadline deadline);

  // The same with a callback, called once with the answer (or the failure) on
  // the I/O thread, or inline when the side channel is already stopped. It
  // must not block.
  using AnswerCallback = std::function<void(Result<Frame>)>;
  void request_then(const std::string& address, const Frame& request, Deadline deadline, AnswerCallback done);

  void stop();

  struct Impl;

 private:
  explicit SideChannel(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class SideChannel::Pending {
 public:
  struct State;
  explicit Pending(std::shared_ptr<State> state) : state_(std::move(state)) {}
  // Blocks until the answer, the request's deadline, or stop().
  Result<Frame> wait();

 private:
  std::shared_ptr<State> state_;
};

}  // namespace siesta::transfer
