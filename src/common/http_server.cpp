#include "common/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/log.h"

namespace siesta {

using Clock = std::chrono::steady_clock;

// One client connection, owned by the intake while it waits for a request and
// by a worker while one is served.
struct IntakeConnection {
  enum class Phase { kIdle, kReading, kServing, kDraining };

  IntakeConnection(int socket, FramerLimits limits) : fd(socket), framer(limits) {}

  int fd;
  std::string address;  // the client's numeric address: the unit of the per-address limit
  int remote_port = 0;
  std::string local_address;
  int local_port = 0;
  RequestFramer framer;
  Phase phase = Phase::kIdle;
  Clock::time_point since;     // the phase began (waiting connections are evicted oldest first)
  Clock::time_point deadline;  // of the phase
  bool head_timed = false;     // deadline is the body's
  bool continue_sent = false;
  bool peer_closed = false;    // the client shut its side: serve what came, then close
  size_t held = 0;             // bytes counted in the intake's buffered total
  size_t drained = 0;
  size_t served = 0;
};

namespace {

thread_local int t_client_socket = -1;

constexpr auto kSweepInterval = std::chrono::milliseconds(100);
constexpr auto kLinger = std::chrono::milliseconds(1000);
constexpr size_t kLingerBytes = 1u << 20;
constexpr size_t kReadPerWake = 256u << 10;
constexpr auto kSummaryInterval = std::chrono::seconds(10);

const char* reason_phrase(int status) {
  switch (status) {
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 417: return "Expectation Failed";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Error";
  }
}

// An answer the intake gives itself, in OpenAI's error shape, closing the connection.
std::string error_answer(int status, const std::string& code, const std::string& message) {
  const char* type = status == 503 ? "service_unavailable" : status >= 500 ? "server_error" : "invalid_request_error";
  nlohmann::json error{{"message", message}, {"type", type}, {"param", nullptr}, {"code", code}};
  const std::string body =
      nlohmann::json{{"error", std::move(error)}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) +
         "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n\r\n" + body;
}

// Best effort on a non-blocking socket: what does not fit now is dropped.
void send_now(int fd, const std::string& bytes) { (void)::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT); }

bool address_of(int fd, bool peer, std::string& host, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  const int rc = peer ? ::getpeername(fd, reinterpret_cast<sockaddr*>(&addr), &len)
                      : ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  if (rc != 0) return false;
  char text[NI_MAXHOST];
  char service[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, text, sizeof(text), service, sizeof(service),
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  host = text;
  port = std::atoi(service);
  return true;
}

std::string seconds_text(std::chrono::milliseconds ms) {
  const double s = static_cast<double>(ms.count()) / 1000.0;
  std::string t = std::to_string(s);
  t.erase(t.find_last_not_of('0') + 1);
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t + " s";
}

// The request as httplib reads it: the bytes the intake framed, then the end
// of the stream; answers go straight to the socket.
class RequestStream : public httplib::Stream {
 public:
  RequestStream(const IntakeConnection& c, const std::string& request, int write_timeout_ms)
      : conn_(c), request_(request), write_timeout_ms_(write_timeout_ms) {}

  bool is_readable() const override { return pos_ < request_.size(); }
  bool is_writable() const override {
    pollfd p{conn_.fd, POLLOUT, 0};
    return ::poll(&p, 1, write_timeout_ms_) > 0 && (p.revents & (POLLERR | POLLHUP | POLLNVAL)) == 0;
  }
  ssize_t read(char* ptr, size_t size) override {
    const size_t n = std::min(size, request_.size() - pos_);
    std::memcpy(ptr, request_.data() + pos_, n);
    pos_ += n;
    return static_cast<ssize_t>(n);
  }
  ssize_t write(const char* ptr, size_t size) override {
    for (;;) {
      const ssize_t n = ::send(conn_.fd, ptr, size, MSG_NOSIGNAL);
      if (n >= 0) return n;
      if (errno == EINTR) continue;
      if ((errno == EAGAIN || errno == EWOULDBLOCK) && is_writable()) continue;
      return -1;
    }
  }
  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = conn_.address;
    port = conn_.remote_port;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    ip = conn_.local_address;
    port = conn_.local_port;
  }
  socket_t socket() const override { return conn_.fd; }

 private:
  const IntakeConnection& conn_;
  const std::string& request_;
  size_t pos_ = 0;
  int write_timeout_ms_;
};

}  // namespace

// ---------------------------------------------------------------------------

class HttpServer::Intake {
 public:
  Intake(HttpServer& server, const HttpServerOptions& options) : server_(server), options_(options) {
    rlimit fds{};
    max_open_ = options.max_connections;
    if (::getrlimit(RLIMIT_NOFILE, &fds) == 0 && fds.rlim_cur != RLIM_INFINITY)
      max_open_ = std::min<size_t>(max_open_, std::max<size_t>(16, fds.rlim_cur / 2));
  }
  ~Intake() { shutdown(); }

  void start() {
    epoll_ = ::epoll_create1(EPOLL_CLOEXEC);
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = wake_;
    ::epoll_ctl(epoll_, EPOLL_CTL_ADD, wake_, &ev);
    workers_ = std::make_unique<httplib::ThreadPool>(std::max<size_t>(1, options_.worker_threads));
    running_ = true;
    thread_ = std::thread([this] { run(); });
  }

  // From httplib's accept thread.
  void admit(int fd) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!stopping_) {
        admitted_.push_back(fd);
        fd = -1;
      }
    }
    if (fd >= 0) {
      ::close(fd);
      return;
    }
    wake();
  }

  // From a worker, when its request is answered.
  void give_back(IntakeConnection* conn, bool keep) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (running_) {
        returned_.emplace_back(conn, keep);
        conn = nullptr;
      }
    }
    if (conn) {
      ::close(conn->fd);
      delete conn;
      return;
    }
    wake();
  }

  // Stops the intake thread (closing every connection it holds), then waits
  // for the workers to answer what they serve.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    if (thread_.joinable()) {
      wake();
      thread_.join();
    }
    if (workers_) workers_->shutdown();
    // Connections the workers gave back after the intake thread ended.
    std::vector<std::pair<IntakeConnection*, bool>> left;
    {
      std::lock_guard<std::mutex> lock(mu_);
      left.swap(returned_);
      for (int fd : admitted_) ::close(fd);
      admitted_.clear();
    }
    for (auto& [conn, keep] : left) {
      ::close(conn->fd);
      delete conn;
    }
    if (epoll_ >= 0) ::close(epoll_);
    if (wake_ >= 0) ::close(wake_);
    epoll_ = wake_ = -1;
  }

  HttpIntakeCounts counts() const {
    HttpIntakeCounts c;
    c.accepted = accepted_.load();
    c.requests = requests_.load();
    c.refused = refused_.load();
    c.timed_out = timed_out_.load();
    c.evicted = evicted_.load();
    return c;
  }

 private:
  void wake() {
    const uint64_t one = 1;
    (void)!::write(wake_, &one, sizeof(one));
  }

  void run();
  void on_new(int fd);
  void on_returned(IntakeConnection* conn, bool keep);
  void on_readable(IntakeConnection& c);
  void process(IntakeConnection& c);
  void refuse(IntakeConnection& c, int status, const std::string& code, const std::string& message);
  void close(IntakeConnection& c);
  void sweep(Clock::time_point now);
  bool make_room(const std::string& address);
  void watch(IntakeConnection& c);
  void sync_held(IntakeConnection& c) {
    buffered_ += c.framer.buffered();
    buffered_ -= c.held;
    c.held = c.framer.buffered();
  }

  HttpServer& server_;
  HttpServerOptions options_;
  size_t max_open_;
  int epoll_ = -1;
  int wake_ = -1;
  std::thread thread_;
  std::unique_ptr<httplib::ThreadPool> workers_;

  std::mutex mu_;
  bool stopping_ = false;
  bool running_ = false;  // the intake thread takes connections back
  std::vector<int> admitted_;
  std::vector<std::pair<IntakeConnection*, bool>> returned_;

  // Intake thread only.
  std::unordered_map<int, std::unique_ptr<IntakeConnection>> resident_;
  std::unordered_map<std::string, size_t> per_address_;
  size_t open_ = 0;  // resident and served
  size_t buffered_ = 0;
  HttpIntakeCounts logged_;
  Clock::time_point next_summary_ = Clock::now() + kSummaryInterval;

  std::atomic<uint64_t> accepted_{0}, requests_{0}, refused_{0}, timed_out_{0}, evicted_{0};
};

void HttpServer::Intake::run() {
  std::vector<epoll_event> events(256);
  Clock::time_point next_sweep = Clock::now() + kSweepInterval;
  for (;;) {
    const int timeout = resident_.empty() ? -1 : static_cast<int>(kSweepInterval.count());
    const int n = ::epoll_wait(epoll_, events.data(), static_cast<int>(events.size()), timeout);
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_) {
        uint64_t v;
        while (::read(wake_, &v, sizeof(v)) > 0) {
        }
        continue;
      }
      auto it = resident_.find(fd);
      if (it != resident_.end()) on_readable(*it->second);
    }
    std::vector<int> admitted;
    std::vector<std::pair<IntakeConnection*, bool>> returned;
    bool stop = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop = stopping_;
      if (stop) running_ = false;
      admitted.swap(admitted_);
      returned.swap(returned_);
    }
    for (auto& [conn, keep] : returned) on_returned(conn, stop ? false : keep);
    if (stop) {
      for (int fd : admitted) ::close(fd);
      break;
    }
    for (int fd : admitted) on_new(fd);
    const Clock::time_point now = Clock::now();
    if (now >= next_sweep) {
      sweep(now);
      next_sweep = now + kSweepInterval;
    }
  }
  std::vector<int> fds;
  for (auto& [fd, conn] : resident_) fds.push_back(fd);
  for (int fd : fds) close(*resident_.at(fd));
}

bool HttpServer::Intake::make_room(const std::string& address) {
  for (;;) {
    const auto pa = per_address_.find(address);
    const bool address_full = pa != per_address_.end() && pa->second >= options_.max_connections_per_address;
    const bool all_full = open_ >= max_open_;
    if (!address_full && !all_full) return true;
    IntakeConnection* oldest = nullptr;
    for (auto& [fd, conn] : resident_) {
      if (conn->phase == IntakeConnection::Phase::kServing) continue;
      if (address_full && conn->address != address) continue;
      if (!oldest || conn->since < oldest->since) oldest = conn.get();
    }
    if (!oldest) return false;
    SIESTA_LOG_DEBUG("http: closing a waiting connection from {} to make room for a new one", oldest->address);
    evicted_++;
    close(*oldest);
  }
}

void HttpServer::Intake::on_new(int fd) {
  accepted_++;
  auto conn = std::make_unique<IntakeConnection>(fd, options_.limits);
  if (!address_of(fd, true, conn->address, conn->remote_port) ||
      !address_of(fd, false, conn->local_address, conn->local_port)) {
    ::close(fd);
    return;
  }
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  if (!make_room(conn->address)) {
    refused_++;
    const bool address_full = per_address_[conn->address] >= options_.max_connections_per_address;
    send_now(fd, error_answer(503, "too_many_connections",
                              address_full ? "too many connections from " + conn->address + " (the limit is " +
                                                 std::to_string(options_.max_connections_per_address) +
                                                 ", all in use); retry later"
                                           : "the server has too many connections open (" + std::to_string(max_open_) +
                                                 ", all in use); retry later"));
    if (per_address_[conn->address] == 0) per_address_.erase(conn->address);
    ::close(fd);
    return;
  }
  open_++;
  per_address_[conn->address]++;
  const Clock::time_point now = Clock::now();
  conn->since = now;
  conn->deadline = now + options_.idle_timeout;
  IntakeConnection& c = *conn;
  resident_.emplace(fd, std::move(conn));
  watch(c);
}

void HttpServer::Intake::watch(IntakeConnection& c) {
  epoll_event ev{};
  ev.events = EPOLLIN | EPOLLRDHUP;
  ev.data.fd = c.fd;
  ::epoll_ctl(epoll_, EPOLL_CTL_ADD, c.fd, &ev);
}

void HttpServer::Intake::on_returned(IntakeConnection* raw, bool keep) {
  std::unique_ptr<IntakeConnection> conn(raw);
  IntakeConnection& c = *conn;
  resident_.emplace(c.fd, std::move(conn));
  if (!keep || c.peer_closed) {
    close(c);
    return;
  }
  const Clock::time_point now = Clock::now();
  c.phase = IntakeConnection::Phase::kIdle;
  c.since = now;
  c.deadline = now + options_.idle_timeout;
  c.head_timed = false;
  c.continue_sent = false;
  watch(c);
  // A pipelined request may have come with the last one.
  if (c.framer.buffered() > 0) process(c);
}

void HttpServer::Intake::on_readable(IntakeConnection& c) {
  char buf[64 * 1024];
  size_t got = 0;
  while (got < kReadPerWake) {
    const ssize_t n = ::recv(c.fd, buf, sizeof(buf), 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
      if (c.phase == IntakeConnection::Phase::kDraining) {
        c.drained += static_cast<size_t>(n);
        if (c.drained > kLingerBytes) return close(c);
        continue;
      }
      c.framer.append(std::string_view(buf, static_cast<size_t>(n)));
      sync_held(c);
      if (buffered_ > options_.max_buffered_bytes) {
        SIESTA_LOG_WARN("http: request bytes held while they arrive reached {} bytes; refusing one from {}",
                        options_.max_buffered_bytes, c.address);
        return refuse(c, 503, "server_busy",
                      "the server is receiving too many request bodies at once; retry later");
      }
      continue;
    }
    if (n == 0) {
      c.peer_closed = true;
      break;
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) break;
    return close(c);  // reset
  }
  if (c.phase == IntakeConnection::Phase::kDraining) {
    if (c.peer_closed) close(c);
    return;
  }
  process(c);
}

void HttpServer::Intake::process(IntakeConnection& c) {
  const FramerState state = c.framer.advance();
  const Clock::time_point now = Clock::now();
  if (state == FramerState::kRefused) {
    const FramerRefusal& r = c.framer.refusal();
    return refuse(c, r.status, r.code, r.message);
  }
  if (state == FramerState::kNeedMore) {
    if (c.peer_closed) return close(c);  // the client left part-way
    if (c.phase == IntakeConnection::Phase::kIdle && c.framer.started()) {
      c.phase = IntakeConnection::Phase::kReading;
      c.since = now;
      c.deadline = now + options_.head_timeout;
    }
    if (c.framer.head_complete() && !c.head_timed) {
      c.head_timed = true;
      c.deadline = now + options_.body_timeout;
    }
    if (c.framer.expects_continue() && !c.continue_sent) {
      c.continue_sent = true;
      send_now(c.fd, "HTTP/1.1 100 Continue\r\n\r\n");
    }
    return;
  }
  // Complete: to a worker.
  std::string request = c.framer.take_request();
  sync_held(c);
  ::epoll_ctl(epoll_, EPOLL_CTL_DEL, c.fd, nullptr);
  c.phase = IntakeConnection::Phase::kServing;
  std::unique_ptr<IntakeConnection> owned = std::move(resident_.at(c.fd));
  resident_.erase(c.fd);
  requests_++;
  buffered_ -= owned->held;  // the worker owns what is left until it gives the connection back
  owned->held = 0;
  IntakeConnection* raw = owned.release();
  auto shared_request = std::make_shared<std::string>(std::move(request));
  workers_->enqueue([this, raw, shared_request] { server_.serve_request(raw, std::move(*shared_request)); });
}

void HttpServer::Intake::refuse(IntakeConnection& c, int status, const std::string& code, const std::string& message) {
  refused_++;
  if (status == 408) timed_out_++;
  SIESTA_LOG_DEBUG("http: {} {} to {}: {}", status, code, c.address, message);
  send_now(c.fd, error_answer(status, code, message));
  ::shutdown(c.fd, SHUT_WR);
  // Drop what was buffered; read and drop what still comes for a moment, so
  // that the client reads the answer instead of a reset.
  c.framer = RequestFramer(options_.limits);
  sync_held(c);
  c.phase = IntakeConnection::Phase::kDraining;
  c.deadline = Clock::now() + kLinger;
  if (c.peer_closed) close(c);
}

void HttpServer::Intake::close(IntakeConnection& c) {
  const int fd = c.fd;
  ::epoll_ctl(epoll_, EPOLL_CTL_DEL, fd, nullptr);
  ::close(fd);
  buffered_ -= c.held;
  auto pa = per_address_.find(c.address);
  if (pa != per_address_.end() && --pa->second == 0) per_address_.erase(pa);
  open_--;
  resident_.erase(fd);  // destroys c
}

void HttpServer::Intake::sweep(Clock::time_point now) {
  std::vector<IntakeConnection*> due;
  for (auto& [fd, conn] : resident_)
    if (conn->deadline <= now) due.push_back(conn.get());
  for (IntakeConnection* c : due) {
    switch (c->phase) {
      case IntakeConnection::Phase::kIdle:
        close(*c);
        break;
      case IntakeConnection::Phase::kReading:
        refuse(*c, 408, "request_timeout",
               c->head_timed ? "the request body did not arrive within " + seconds_text(options_.body_timeout) +
                                   " of its head"
                             : "the request head did not arrive within " + seconds_text(options_.head_timeout) +
                                   " of its first byte");
        break;
      case IntakeConnection::Phase::kDraining:
      case IntakeConnection::Phase::kServing:
        close(*c);
        break;
    }
  }
  if (now >= next_summary_) {
    next_summary_ = now + kSummaryInterval;
    const HttpIntakeCounts c = counts();
    if (c.refused != logged_.refused || c.evicted != logged_.evicted)
      SIESTA_LOG_INFO("http: in the last {} s: {} requests refused ({} timed out), {} waiting connections closed "
                      "for newer ones; {} connections open",
                      kSummaryInterval.count(), c.refused - logged_.refused, c.timed_out - logged_.timed_out,
                      c.evicted - logged_.evicted, open_);
    logged_ = c;
  }
}

// ---------------------------------------------------------------------------

namespace {

// httplib's task queue: each accepted socket goes to the intake at once, on
// the accept thread; shutdown (httplib's, when listening ends) stops the
// intake and waits for the workers.
class IntakeQueue : public httplib::TaskQueue {
 public:
  explicit IntakeQueue(std::shared_ptr<HttpServer::Intake> intake) : intake_(std::move(intake)) {}
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override { intake_->shutdown(); }

 private:
  std::shared_ptr<HttpServer::Intake> intake_;
};

}  // namespace

HttpServer::HttpServer(HttpServerOptions options)
    : options_(std::move(options)), intake_(std::make_shared<Intake>(*this, options_)) {
  set_payload_max_length(options_.limits.max_body_bytes);
  new_task_queue = [this] {
    intake_->start();
    return new IntakeQueue(intake_);
  };
}

HttpServer::~HttpServer() {
  stop();
  intake_->shutdown();
}

HttpIntakeCounts HttpServer::counts() const { return intake_->counts(); }

int HttpServer::client_socket() { return t_client_socket; }

bool HttpServer::client_hung_up() {
  if (t_client_socket < 0) return false;
  pollfd p{};
  p.fd = t_client_socket;
  p.events = POLLRDHUP;
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

bool HttpServer::process_and_close_socket(socket_t sock) {
  intake_->admit(sock);
  return true;
}

void HttpServer::serve_request(IntakeConnection* conn, std::string request) {
  const int write_timeout_ms = static_cast<int>(write_timeout_sec_ * 1000 + write_timeout_usec_ / 1000);
  RequestStream stream(*conn, request, write_timeout_ms > 0 ? write_timeout_ms : 5000);
  const bool last = ++conn->served >= options_.max_requests_per_connection || svr_sock_ == INVALID_SOCKET;
  bool connection_closed = false;
  t_client_socket = conn->fd;
  const bool ok = process_request(stream, last, connection_closed, nullptr);
  t_client_socket = -1;
  intake_->give_back(conn, ok && !connection_closed && !last && svr_sock_ != INVALID_SOCKET);
}

}  // namespace siesta
