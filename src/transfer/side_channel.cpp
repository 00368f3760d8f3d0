#include "transfer/side_channel.h"

#include <asio.hpp>
#include <fmt/format.h>

#include <array>
#include <cstdlib>
#include <future>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/host_port.h"
#include "common/log.h"
#include "transfer/frame_auth.h"
#include "transfer/messages.h"

namespace siesta::transfer {

using asio::ip::tcp;

namespace {

constexpr size_t kReadChunk = 64 * 1024;
// Before it authenticates, a connection may send frames of this size only (a HELLO, an AUTH).
constexpr uint32_t kHandshakePayload = 4096;
// How often the listener looks for connections past their deadlines.
constexpr auto kSweepInterval = std::chrono::milliseconds(250);
// At most one warning about refused connections, and kWarnBurst about
// closed ones, per this interval.
constexpr auto kWarnInterval = std::chrono::seconds(10);
constexpr size_t kWarnBurst = 20;
// How long a caller waits past its deadline for the I/O thread to report the
// timeout it enforces itself, before giving up on it.
constexpr auto kDeadlineGrace = std::chrono::milliseconds(200);

std::string endpoint_text(const tcp::endpoint& ep) {
  if (ep.address().is_v6()) return fmt::format("[{}]:{}", ep.address().to_string(), ep.port());
  return fmt::format("{}:{}", ep.address().to_string(), ep.port());
}

// "host:port" or "[v6]:port".
Result<std::pair<std::string, std::string>> split_address(const std::string& address) {
  const std::optional<HostPort> hp = split_host_port(address);
  if (!hp || hp->host.empty() || hp->port.empty())
    return invalid_argument(fmt::format("side-channel address '{}' is not host:port", address));
  return std::make_pair(unbracketed(hp->host), hp->port);
}

}  // namespace

struct SideChannel::Pending::State {
  std::mutex mu;
  std::condition_variable cv;
  std::optional<Result<Frame>> result;
  Deadline deadline;
  SideChannel::AnswerCallback then;

  void finish(Result<Frame> r) {
    if (then) {
      AnswerCallback cb = std::move(then);
      then = nullptr;
      cb(std::move(r));
      return;
    }
    std::lock_guard<std::mutex> lock(mu);
    if (result) return;
    result.emplace(std::move(r));
    cv.notify_all();
  }
};

Result<Frame> SideChannel::Pending::wait() {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait_until(lock, state_->deadline + kDeadlineGrace, [&] { return state_->result.has_value(); });
  if (!state_->result) return timeout("no answer on the side channel before the deadline");
  return *state_->result;
}

namespace {

struct ServerConnection;
struct ClientCall;

// An idle client connection kept for reuse.
struct ClientConnection {
  explicit ClientConnection(asio::io_context& io, uint32_t max_payload) : socket(io), parser(max_payload) {}
  tcp::socket socket;
  FrameParser parser;
  std::optional<FrameSession> session;  // authenticated side channel, after the handshake
};

}  // namespace

struct SideChannel::Impl {
  SideChannelOptions options;
  RequestHandler handler;
  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> work{io.get_executor()};
  tcp::acceptor acceptor{io};
  asio::thread_pool handlers;
  std::thread io_thread;
  std::string address;
  std::atomic<bool> stopped{false};
  std::mutex stop_mu;

  // I/O-thread state.
  std::unordered_map<ServerConnection*, std::weak_ptr<ServerConnection>> connections;
  std::unordered_map<ClientCall*, std::weak_ptr<ClientCall>> calls;
  std::map<std::string, std::vector<std::unique_ptr<ClientConnection>>> idle;
  size_t buffered = 0;  // bytes of partial frames held for incoming connections
  asio::steady_timer sweep_timer{io};
  Clock::time_point next_warning{};
  size_t refused_since_warning = 0;
  // Lines about closed connections: at most kWarnBurst per kWarnInterval (a
  // flood of bad connections must not flood the log).
  Clock::time_point warn_window{};
  size_t warned_in_window = 0;
  size_t not_warned = 0;
  bool may_warn() {
    const Clock::time_point now = Clock::now();
    if (now - warn_window >= kWarnInterval) {
      if (not_warned > 0)
        SIESTA_LOG_WARN("side channel {}: {} more connections closed for protocol violations in the last {} s",
                        address, not_warned, std::chrono::duration_cast<std::chrono::seconds>(kWarnInterval).count());
      warn_window = now;
      warned_in_window = 0;
      not_warned = 0;
    }
    if (warned_in_window < kWarnBurst) {
      ++warned_in_window;
      return true;
    }
    ++not_warned;
    return false;
  }

  explicit Impl(const SideChannelOptions& o, RequestHandler h)
      : options(o), handler(std::move(h)), handlers(o.handler_threads == 0 ? 1 : o.handler_threads) {}

  bool authenticated() const { return !options.auth_key.empty(); }
  void accept();
  // Room for a connection from `ip` (closing the oldest unauthenticated one if
  // need be); false when there is none.
  bool admit(const std::string& ip);
  void sweep();
  void start_call(std::shared_ptr<ClientCall> call);
  void shutdown_on_io_thread();
};

namespace {

struct ServerConnection : std::enable_shared_from_this<ServerConnection> {
  enum class Stage { kHello, kAuth, kReady };

  ServerConnection(SideChannel::Impl* o, tcp::socket s)
      : owner(o), socket(std::move(s)), parser(o->options.max_frame_payload) {
    asio::error_code ec;
    auto ep = socket.remote_endpoint(ec);
    remote = ec ? std::string("unknown") : endpoint_text(ep);
    ip = ec ? remote : ep.address().to_string();
    since = last_frame = Clock::now();
  }

  void start() {
    owner->connections[this] = weak_from_this();
    if (owner->authenticated()) {
      stage = Stage::kHello;
      handshake.emplace(owner->options.auth_key, owner->options.engine_id);
    } else {
      stage = Stage::kReady;
    }
    expect();
    read();
  }

  // What the parser accepts at this stage. Before authentication, requests
  // too (small: a peer without a key is told so, not cut off).
  void expect() {
    switch (stage) {
      case Stage::kHello:
        parser.expect(kRequestFrames | frame_types({FrameType::kHello}), kHandshakePayload);
        break;
      case Stage::kAuth:
        parser.expect(frame_types({FrameType::kAuth}), kHandshakePayload);
        break;
      case Stage::kReady:
        if (session) {
          parser.expect(kRequestFrames, UINT32_MAX, kAuthMacBytes);
        } else {
          parser.expect(kRequestFrames | frame_types({FrameType::kHello}));
        }
        break;
    }
  }

  void read() {
    auto self = shared_from_this();
    socket.async_read_some(asio::buffer(buf), [self](const asio::error_code& ec, size_t n) {
      if (ec) {
        self->close();
        return;
      }
      self->parser.feed(std::string_view(self->buf.data(), n));
      if (!self->account()) return;
      self->process();
    });
  }

  // Counts what the parser holds against the listener's budget; false (and
  // closed) when it would pass it.
  bool account() {
    owner->buffered -= counted;
    counted = parser.buffered();
    owner->buffered += counted;
    if (owner->buffered <= owner->options.max_buffered_bytes) return true;
    drop(unavailable(fmt::format("partial frames of all connections would hold more than {} bytes",
                                 owner->options.max_buffered_bytes)));
    return false;
  }

  void process() {
    auto next = parser.next();
    if (!next) {
      drop(next.error());
      return;
    }
    if (!account()) return;
    if (!*next) {
      read();
      return;
    }
    Frame frame = std::move(**next);
    last_frame = Clock::now();
    if (stage == Stage::kHello) return on_hello(frame);
    if (stage == Stage::kAuth) return on_auth(frame);
    if (frame.type == FrameType::kHello)  // a peer that authenticates, to a side channel without a key
      return refuse("this side channel has no auth key, and the peer offers one; configure the same "
                    "kv_connector_extra_config.auth_key on both engines (or on neither)");
    if (session) {
      if (Result<void> ok = session->open(frame); !ok) {
        drop(ok.error());
        return;
      }
    }
    busy = true;
    auto self = shared_from_this();
    asio::post(owner->handlers, [self, frame = std::move(frame)]() mutable {
      Result<Frame> answer = [&]() -> Result<Frame> {
        if (self->owner->stopped) return unavailable("the engine is shutting down");
        return self->owner->handler(frame, RequestOrigin{self->remote, self->peer_engine});
      }();
      asio::post(self->socket.get_executor(), [self, answer = std::move(answer)]() mutable {
        self->busy = false;
        if (!answer) {
          self->drop(answer.error());
          return;
        }
        self->write(self->session ? self->session->seal(*answer) : encode_frame(*answer));
      });
    });
  }

  void on_hello(const Frame& frame) {
    if (frame.type != FrameType::kHello)
      return refuse(fmt::format("this side channel requires authentication and the peer did not offer it ({} before "
                                "HELLO); configure the same kv_connector_extra_config.auth_key on both engines",
                                frame_type_name(frame.type)));
    Result<Frame> challenge = handshake->challenge(frame);
    if (!challenge) return drop(challenge.error());
    stage = Stage::kAuth;
    expect();
    write(encode_frame(*challenge));
  }

  void on_auth(const Frame& frame) {
    Result<FrameSession> s = handshake->verify(frame);
    if (!s) {
      if (owner->may_warn())
        SIESTA_LOG_WARN("side channel {}: {} from {}: {}", owner->address, frame_type_name(frame.type), remote,
                        s.error().message);
      return refuse(s.error().message);
    }
    session.emplace(std::move(*s));
    peer_engine = handshake->client_engine_id();
    handshake.reset();
    stage = Stage::kReady;
    expect();
    process();  // the first request may have come with the AUTH
  }

  // An ERROR for the peer (not authenticated: it has no session), then the connection closes.
  void refuse(const std::string& why) {
    closing = true;
    write(encode_frame(error_frame(unavailable(why))));
  }

  void write(std::string bytes) {
    out = std::move(bytes);
    auto self = shared_from_this();
    asio::async_write(socket, asio::buffer(out), [self](const asio::error_code& ec, size_t) {
      if (ec || self->closing) {
        self->close();
        return;
      }
      self->last_frame = Clock::now();
      self->process();
    });
  }

  // A protocol violation: one log line, then the connection is closed.
  void drop(const Status& why) {
    if (!owner->stopped && owner->may_warn())
      SIESTA_LOG_WARN("side channel {}: closing the connection from {}: {}", owner->address, remote, why.message);
    close();
  }

  void close() {
    asio::error_code ignored;
    socket.shutdown(tcp::socket::shutdown_both, ignored);
    socket.close(ignored);
    owner->buffered -= counted;
    counted = 0;
    owner->connections.erase(this);
  }

  SideChannel::Impl* owner;
  tcp::socket socket;
  FrameParser parser;
  std::string remote;
  std::string ip;
  Stage stage = Stage::kReady;
  std::optional<ServerHandshake> handshake;
  std::optional<FrameSession> session;
  std::string peer_engine;  // proved in the handshake
  Clock::time_point since;
  Clock::time_point last_frame;
  bool busy = false;     // a request of this connection is with a handler
  bool closing = false;  // close once the write in flight is done
  size_t counted = 0;
  std::array<char, kReadChunk> buf{};
  std::string out;
};

struct ClientCall : std::enable_shared_from_this<ClientCall> {
  ClientCall(SideChannel::Impl* o, std::string addr, Frame req, std::shared_ptr<SideChannel::Pending::State> st)
      : owner(o), address(std::move(addr)), request(std::move(req)), state(std::move(st)), timer(o->io) {}

  void start() {
    owner->calls[this] = weak_from_this();
    timer.expires_at(state->deadline);
    auto self = shared_from_this();
    timer.async_wait([self](const asio::error_code& ec) {
      if (ec) return;  // cancelled: the call finished first
      self->fail(timeout(fmt::format("side channel {}: no answer before the deadline", self->address)));
    });
    auto& pool = owner->idle[address];
    if (!pool.empty()) {
      conn = std::move(pool.back());
      pool.pop_back();
      reused = true;
      send_request();
    } else {
      connect();
    }
  }

  // The request's bytes on this connection: sealed on an authenticated one.
  void send_request(std::string before = {}) {
    conn->parser.expect(kAnswerFrames, UINT32_MAX, conn->session ? kAuthMacBytes : 0);
    out = std::move(before);
    out += conn->session ? conn->session->seal(request) : encode_frame(request);
    send();
  }

  void connect() {
    conn = std::make_unique<ClientConnection>(owner->io, owner->options.max_frame_payload);
    reused = false;
    auto parts = split_address(address);
    if (!parts) {
      fail(parts.error());
      return;
    }
    asio::error_code ec;
    auto ip = asio::ip::make_address(parts->first, ec);
    auto self = shared_from_this();
    if (!ec) {
      unsigned long port = std::strtoul(parts->second.c_str(), nullptr, 10);
      if (port == 0 || port > 65535) {
        fail(invalid_argument(fmt::format("side-channel address '{}' has no valid port", address)));
        return;
      }
      tcp::endpoint ep(ip, static_cast<uint16_t>(port));
      conn->socket.async_connect(ep, [self](const asio::error_code& ec2) { self->on_connect(ec2); });
      return;
    }
    resolver = std::make_unique<tcp::resolver>(owner->io);
    resolver->async_resolve(parts->first, parts->second,
                            [self](const asio::error_code& ec2, const tcp::resolver::results_type& results) {
                              if (ec2) {
                                self->fail(unavailable(fmt::format("cannot resolve side-channel address {}: {}",
                                                                   self->address, ec2.message())));
                                return;
                              }
                              asio::async_connect(self->conn->socket, results,
                                                  [self](const asio::error_code& ec3, const tcp::endpoint&) {
                                                    self->on_connect(ec3);
                                                  });
                            });
  }

  void on_connect(const asio::error_code& ec) {
    if (done) return;
    if (ec) {
      fail(unavailable(fmt::format("cannot connect to the side channel at {}: {} (is the peer engine running?)",
                                   address, ec.message())));
      return;
    }
    asio::error_code ignored;
    conn->socket.set_option(tcp::no_delay(true), ignored);
    if (!owner->authenticated()) {
      send_request();
      return;
    }
    // HELLO first; the request goes with the AUTH that answers the CHALLENGE.
    handshake.emplace(owner->options.auth_key, owner->options.engine_id);
    conn->parser.expect(frame_types({FrameType::kChallenge, FrameType::kError}), 64u << 10);
    out = encode_frame(handshake->hello());
    send();
  }

  // The server's first frame on a new authenticated connection.
  void on_challenge(const Frame& frame) {
    if (frame.type == FrameType::kError) {
      fail(status_from_unexpected(frame, FrameType::kHello, address));
      return;
    }
    Result<Frame> auth = handshake->answer(frame);
    if (!auth) {
      fail(auth.error().with_context(fmt::format("side channel {}", address)));
      return;
    }
    conn->session.emplace(handshake->session());
    handshake.reset();
    send_request(encode_frame(*auth));
  }

  void send() {
    auto self = shared_from_this();
    asio::async_write(conn->socket, asio::buffer(out), [self](const asio::error_code& ec, size_t) {
      if (self->done) return;
      if (ec) {
        self->lost(ec);
        return;
      }
      self->read();
    });
  }

  void read() {
    auto next = conn->parser.next();
    if (!next) {
      fail(next.error().with_context(fmt::format("answer from {}", address)));
      return;
    }
    if (*next) {
      if (conn->parser.buffered() != 0) {
        fail(corrupt(fmt::format("side channel {} sent more than one answer", address)));
        return;
      }
      Frame answer = std::move(**next);
      if (handshake) {
        on_challenge(answer);
        return;
      }
      if (conn->session) {
        if (Result<void> ok = conn->session->open(answer); !ok) {
          fail(ok.error().with_context(fmt::format("answer from {}", address)));
          return;
        }
      }
      finish_ok(std::move(answer));
      return;
    }
    auto self = shared_from_this();
    conn->socket.async_read_some(asio::buffer(buf), [self](const asio::error_code& ec, size_t n) {
      if (self->done) return;
      if (ec) {
        self->lost(ec);
        return;
      }
      self->got_bytes = true;
      self->conn->parser.feed(std::string_view(self->buf.data(), n));
      self->read();
    });
  }

  // The connection broke. A reused idle connection that the peer had closed
  // (it restarted, or shut down and came back) is retried once on a fresh one,
  // provided no answer byte had arrived.
  void lost(const asio::error_code& ec) {
    if (reused && !got_bytes) {
      close_conn();
      handshake.reset();
      connect();
      return;
    }
    fail(unavailable(fmt::format("side-channel connection to {} lost: {}", address, ec.message())));
  }

  void finish_ok(Frame answer) {
    if (done) return;
    done = true;
    timer.cancel();
    auto& pool = owner->idle[address];
    if (!owner->stopped && pool.size() < owner->options.idle_connections_per_address) {
      pool.push_back(std::move(conn));
    } else {
      close_conn();
    }
    owner->calls.erase(this);
    state->finish(std::move(answer));
  }

  void fail(Status why) {
    if (done) return;
    done = true;
    timer.cancel();
    close_conn();
    owner->calls.erase(this);
    state->finish(std::move(why));
  }

  void close_conn() {
    if (!conn) return;
    asio::error_code ignored;
    conn->socket.close(ignored);
    conn.reset();
  }

  SideChannel::Impl* owner;
  std::string address;
  Frame request;
  std::string out;
  std::optional<ClientHandshake> handshake;  // a new authenticated connection, until its CHALLENGE
  std::shared_ptr<SideChannel::Pending::State> state;
  asio::steady_timer timer;
  std::unique_ptr<ClientConnection> conn;
  std::unique_ptr<tcp::resolver> resolver;
  std::array<char, kReadChunk> buf{};
  bool reused = false;
  bool got_bytes = false;
  bool done = false;
};

}  // namespace

void SideChannel::Impl::accept() {
  acceptor.async_accept([this](const asio::error_code& ec, tcp::socket socket) {
    if (ec) {
      if (ec == asio::error::operation_aborted || stopped) return;
      SIESTA_LOG_WARN("side channel {}: accept failed: {}", address, ec.message());
    } else {
      asio::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      auto conn = std::make_shared<ServerConnection>(this, std::move(socket));
      if (admit(conn->ip)) {
        conn->start();
      } else {
        conn->socket.close(ignored);
        ++refused_since_warning;
        if (Clock::now() >= next_warning) {
          SIESTA_LOG_WARN("side channel {}: refused {} connection(s) (from {} and maybe others): {} open, at most {} "
                          "and {} per address, every one authenticated",
                          address, refused_since_warning, conn->ip, connections.size(), options.max_connections,
                          options.max_connections_per_address);
          refused_since_warning = 0;
          next_warning = Clock::now() + kWarnInterval;
        }
      }
    }
    accept();
  });
}

bool SideChannel::Impl::admit(const std::string& ip) {
  for (;;) {
    size_t from_ip = 0;
    for (auto& [ptr, weak] : connections)
      if (ptr->ip == ip) ++from_ip;
    const bool ip_full = from_ip >= options.max_connections_per_address;
    const bool all_full = connections.size() >= options.max_connections;
    if (!ip_full && !all_full) return true;
    // Make room by closing the oldest connection that has not authenticated
    // (of that address when its share is what is full).
    ServerConnection* oldest = nullptr;
    for (auto& [ptr, weak] : connections) {
      if (ptr->stage == ServerConnection::Stage::kReady) continue;
      if (ip_full && ptr->ip != ip) continue;
      if (!oldest || ptr->since < oldest->since) oldest = ptr;
    }
    if (!oldest) return false;
    if (auto c = connections[oldest].lock()) {
      c->close();
    } else {
      connections.erase(oldest);
    }
  }
}

void SideChannel::Impl::sweep() {
  const Clock::time_point now = Clock::now();
  std::vector<std::shared_ptr<ServerConnection>> due;
  for (auto& [ptr, weak] : connections) {
    auto c = weak.lock();
    if (!c) continue;
    if (c->stage != ServerConnection::Stage::kReady) {
      if (now - c->since >= options.auth_timeout) due.push_back(c);
    } else if (!c->busy && now - c->last_frame >= options.idle_timeout) {
      due.push_back(c);
    }
  }
  for (auto& c : due) {
    if (c->stage != ServerConnection::Stage::kReady) {
      c->drop(timeout(fmt::format("it did not authenticate within {} ms", options.auth_timeout.count())));
    } else {
      c->close();  // idle: the peer opens a new one when it needs it
    }
  }
  sweep_timer.expires_after(kSweepInterval);
  sweep_timer.async_wait([this](const asio::error_code& ec) {
    if (!ec && !stopped) sweep();
  });
}

void SideChannel::Impl::shutdown_on_io_thread() {
  asio::error_code ignored;
  acceptor.close(ignored);
  sweep_timer.cancel();
  auto conns = connections;
  for (auto& [ptr, weak] : conns)
    if (auto c = weak.lock()) c->close();
  connections.clear();
  auto pending = calls;
  for (auto& [ptr, weak] : pending)
    if (auto c = weak.lock()) c->fail(unavailable("the engine's side channel is shutting down"));
  calls.clear();
  for (auto& [addr, pool] : idle)
    for (auto& c : pool) c->socket.close(ignored);
  idle.clear();
}

namespace {

void start_call(SideChannel::Impl* impl, const std::string& address, const Frame& request,
                const std::shared_ptr<SideChannel::Pending::State>& state) {
  if (impl->stopped) {
    state->finish(unavailable("the engine's side channel is stopped"));
    return;
  }
  auto call = std::make_shared<ClientCall>(impl, address, request, state);
  asio::post(impl->io, [call] { call->start(); });
}

}  // namespace

SideChannel::SideChannel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<SideChannel>> SideChannel::start(const SideChannelOptions& options, RequestHandler handler) {
  auto impl = std::make_unique<Impl>(options, std::move(handler));
  asio::error_code ec;
  auto ip = asio::ip::make_address(options.host, ec);
  if (ec)
    return invalid_argument(fmt::format("side-channel host '{}' is not an IP address; give the address to listen on",
                                        options.host));
  tcp::endpoint ep(ip, options.port);
  impl->acceptor.open(ep.protocol(), ec);
  if (!ec) impl->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(ep, ec);
  if (!ec) impl->acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec)
    return io_error(fmt::format("cannot listen for the side channel on {}: {}; pick a free port (0 lets the OS choose)",
                                endpoint_text(ep), ec.message()));
  impl->address = endpoint_text(impl->acceptor.local_endpoint());
  if (impl->authenticated()) SIESTA_TRY(check_auth_key(impl->options.auth_key));
  impl->accept();
  impl->sweep();
  Impl* raw = impl.get();
  impl->io_thread = std::thread([raw] { raw->io.run(); });
  return std::unique_ptr<SideChannel>(new SideChannel(std::move(impl)));
}

SideChannel::~SideChannel() { stop(); }

const std::string& SideChannel::address() const { return impl_->address; }

SideChannel::Pending SideChannel::request_async(const std::string& address, const Frame& request, Deadline deadline) {
  auto state = std::make_shared<Pending::State>();
  state->deadline = deadline;
  start_call(impl_.get(), address, request, state);
  return Pending(state);
}

void SideChannel::request_then(const std::string& address, const Frame& request, Deadline deadline,
                               AnswerCallback done) {
  auto state = std::make_shared<Pending::State>();
  state->deadline = deadline;
  state->then = std::move(done);
  start_call(impl_.get(), address, request, state);
}



Result<Frame> SideChannel::request(const std::string& address, const Frame& request, Deadline deadline) {
  return request_async(address, request, deadline).wait();
}

void SideChannel::stop() {
  std::lock_guard<std::mutex> lock(impl_->stop_mu);
  if (impl_->stopped.exchange(true)) return;
  std::promise<void> closed;
  Impl* impl = impl_.get();
  asio::post(impl->io, [impl, &closed] {
    impl->shutdown_on_io_thread();
    closed.set_value();
  });
  // The I/O thread never blocks, so this is quick; the bound is a backstop.
  if (closed.get_future().wait_for(std::chrono::seconds(10)) != std::future_status::ready)
    SIESTA_LOG_ERROR("side channel {}: the I/O thread did not close its connections within 10 s", impl->address);
  impl->handlers.join();  // running handlers end by their own deadlines
  // Handlers may have posted answers for connections that are now closed;
  // close again, then stop: what is left queued is destroyed, not run.
  asio::post(impl->io, [impl] {
    impl->shutdown_on_io_thread();
    impl->io.stop();
  });
  impl->work.reset();
  if (impl->io_thread.joinable()) impl->io_thread.join();
}

}  // namespace siesta::transfer
