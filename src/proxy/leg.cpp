#include "proxy/leg.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <httplib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>

#include "common/log.h"

namespace siesta::proxy {
namespace {

// How often a wait looks at its Interrupt.
constexpr std::chrono::milliseconds kSlice{20};

std::string seconds(std::chrono::milliseconds d) { return fmt::format("{:.1f} s", d.count() / 1000.0); }

template <class Duration>
void split(Duration d, time_t& sec, time_t& usec) {
  const auto us = std::max<int64_t>(std::chrono::duration_cast<std::chrono::microseconds>(d).count(), 1000);
  sec = static_cast<time_t>(us / 1'000'000);
  usec = static_cast<time_t>(us % 1'000'000);
}

}  // namespace

std::unique_ptr<Leg> Leg::start(InstanceUrl to, LegRequest request, LegLimits limits) {
  std::unique_ptr<Leg> leg(new Leg(std::move(to), std::move(request), limits));
  leg->thread_ = std::thread([raw = leg.get()] { raw->run(); });
  return leg;
}

Leg::Leg(InstanceUrl to, LegRequest request, LegLimits limits)
    : to_(std::move(to)),
      request_(std::move(request)),
      limits_(limits),
      started_(Clock::now()),
      last_progress_(started_) {}

Leg::~Leg() {
  std::unique_lock lock(mu_);
  cancelled_ = true;
  // A shutdown that lands after the socket exists but before connect() has
  // finished does nothing, so repeat it until the thread is past the exchange.
  while (!finished_) {
    if (socket_ >= 0) ::shutdown(socket_, SHUT_RDWR);
    cv_.wait_for(lock, std::chrono::milliseconds(10));
  }
  lock.unlock();
  if (thread_.joinable()) thread_.join();
}

void Leg::cancel() {
  std::lock_guard lock(mu_);
  cancelled_ = true;
  if (socket_ >= 0) ::shutdown(socket_, SHUT_RDWR);
  cv_.notify_all();
}

bool Leg::failed() const {
  std::lock_guard lock(mu_);
  return failure_.has_value();
}

void Leg::upstream_done() {
  std::lock_guard lock(mu_);
  upstream_done_ = true;
  last_progress_ = Clock::now();
}

std::chrono::milliseconds Leg::allowed_silence() const {
  return upstream_done_ ? limits_.idle : limits_.idle + limits_.upstream;
}

void Leg::adopt_socket(int fd) {
  // httplib closes its descriptor when the exchange ends; ours keeps the
  // number from being reused while another thread may still shut it down.
  std::lock_guard lock(mu_);
  if (socket_ >= 0) ::close(socket_);
  socket_ = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
}

Status Leg::failure_from(int httplib_error) {
  // Called with mu_ held.
  const auto error = static_cast<httplib::Error>(httplib_error);
  const Clock::time_point now = Clock::now();
  if (cancelled_) return unavailable("cancelled");
  if (limits_.total && now - started_ >= *limits_.total - kSlice)
    return timeout("no complete answer within " + seconds(*limits_.total));
  if (error == httplib::Error::Read && now - last_progress_ >= allowed_silence() - kSlice)
    return timeout("no answer within " + seconds(allowed_silence()));
  switch (error) {
    case httplib::Error::Connection:
      return unavailable("cannot connect");
    case httplib::Error::ConnectionTimeout:
      return timeout("cannot connect within " + seconds(limits_.connect));
    case httplib::Error::Read:
      return unavailable("connection closed before the answer was complete");
    case httplib::Error::Write:
      return unavailable("connection closed while sending the request");
    default:
      return unavailable(httplib::to_string(error));
  }
}

void Leg::run() {
  std::optional<httplib::Error> error;
  std::optional<LegHead> head;
  try {
    httplib::Client client(to_.host, to_.port);
    client.set_keep_alive(false);
    client.set_tcp_nodelay(true);
    time_t sec = 0;
    time_t usec = 0;
    split(limits_.connect, sec, usec);
    client.set_connection_timeout(sec, usec);
    // Each read may wait as long as the longest allowed silence, but not past
    // the end of the whole answer; the waits below enforce the exact limits.
    auto per_read = limits_.idle + limits_.upstream;
    if (limits_.total) per_read = std::min(per_read, *limits_.total);
    split(per_read, sec, usec);
    client.set_read_timeout(sec, usec);
    client.set_write_timeout(sec, usec);
    client.set_socket_options([this](socket_t fd) { adopt_socket(fd); });

    httplib::Request req;
    req.method = request_.method;
    req.path = request_.target;
    for (const auto& [name, value] : request_.headers) req.set_header(name, value);
    // Compressed answers would hold back streamed chunks.
    req.set_header("Accept-Encoding", "identity");
    if (!request_.body.empty()) {
      req.body = request_.body;
      req.set_header("Content-Type", request_.content_type);
    }
    req.response_handler = [this](const httplib::Response& res) {
      std::lock_guard lock(mu_);
      head_ = LegHead{res.status, res.get_header_value("Content-Type")};
      last_progress_ = Clock::now();
      cv_.notify_all();
      return !cancelled_;
    };
    req.content_receiver = [this](const char* data, size_t size, uint64_t, uint64_t) {
      std::lock_guard lock(mu_);
      if (cancelled_) return false;
      const Clock::time_point now = Clock::now();
      if (limits_.total && now - started_ >= *limits_.total) return false;
      chunks_.emplace_back(data, size);
      last_progress_ = now;
      cv_.notify_all();
      return true;
    };
    httplib::Result res = client.send(req);
    if (!res) {
      error = res.error();
    } else {
      head = LegHead{res->status, res->get_header_value("Content-Type")};
    }
  } catch (const std::exception& e) {
    error = httplib::Error::Unknown;
    SIESTA_LOG_WARN("proxy: request to {} threw: {}", to_.text, e.what());
  }
  std::lock_guard lock(mu_);
  if (socket_ >= 0) ::close(socket_);
  socket_ = -1;
  if (error) {
    if (!failure_) failure_ = failure_from(static_cast<int>(*error));
  } else {
    if (!head_) head_ = head;  // no body (204): no response handler call
    complete_ = true;
  }
  finished_ = true;
  cv_.notify_all();
}

Result<void> Leg::wait_until(std::unique_lock<std::mutex>& lock, const std::function<bool()>& ready,
                             const Interrupt& interrupt) {
  while (true) {
    if (ready()) return {};
    if (failure_) return *failure_;
    const Clock::time_point now = Clock::now();
    Clock::time_point limit = last_progress_ + allowed_silence();
    if (limits_.total) limit = std::min(limit, started_ + *limits_.total);
    if (now >= limit) {
      const bool whole = limits_.total && now >= started_ + *limits_.total;
      failure_ = timeout(whole ? "no complete answer within " + seconds(*limits_.total)
                               : "no answer within " + seconds(allowed_silence()));
      cancelled_ = true;
      if (socket_ >= 0) ::shutdown(socket_, SHUT_RDWR);
      return *failure_;
    }
    if (interrupt) {
      lock.unlock();
      std::optional<Status> stop = interrupt();
      lock.lock();
      if (stop) return *stop;
      if (ready()) return {};
    }
    cv_.wait_until(lock, std::min(limit, Clock::now() + kSlice));
  }
}

Result<LegHead> Leg::wait_head(const Interrupt& interrupt) {
  std::unique_lock lock(mu_);
  SIESTA_TRY(wait_until(
      lock, [this] { return head_.has_value(); }, interrupt));
  return *head_;
}

Result<std::string> Leg::wait_body(const Interrupt& interrupt) {
  std::unique_lock lock(mu_);
  SIESTA_TRY(wait_until(
      lock, [this] { return complete_; }, interrupt));
  std::string body;
  for (const std::string& piece : chunks_) body += piece;
  chunks_.clear();
  return body;
}

Result<std::optional<std::string>> Leg::next_chunk(const Interrupt& interrupt) {
  std::unique_lock lock(mu_);
  SIESTA_TRY(wait_until(
      lock, [this] { return !chunks_.empty() || complete_; }, interrupt));
  if (chunks_.empty()) return std::optional<std::string>();
  std::string piece = std::move(chunks_.front());
  chunks_.pop_front();
  return std::optional<std::string>(std::move(piece));
}

}  // namespace siesta::proxy
