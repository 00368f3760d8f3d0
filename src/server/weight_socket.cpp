#include "server/weight_socket.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <exception>
#include <utility>

#include "common/clock.h"
#include "common/exception_text.h"
#include "common/log.h"
#include "server/server_context.h"

namespace siesta::server {
namespace {

using transfer::ipc::kMaxFdsPerPacket;

// An answer packet at most: the sender's socket buffer (net.core.wmem_default,
// about 208 KiB) must hold it whole. Only a long error message comes near it.
constexpr size_t kMaxAnswerBytes = 128u << 10;
// How long a packet poll() said is there may take to read (it is already queued).
constexpr std::chrono::milliseconds kReadDeadline{1000};
// How often the thread looks at `stopping_` when nothing wakes it.
constexpr int kIdlePollMillis = 1000;

// The descriptors of one packet, closed on every way out.
struct PassedFds {
  std::vector<int> fds;
  ~PassedFds() { transfer::ipc::close_fds(fds); }
};

// The message of an OpenAI error body, or null.
nlohmann::json* error_message(nlohmann::json& body) {
  if (!body.is_object()) return nullptr;
  auto error = body.find("error");
  if (error == body.end() || !error->is_object()) return nullptr;
  auto message = error->find("message");
  return message != error->end() && message->is_string() ? &*message : nullptr;
}

std::string answer_text(const AdminAnswer& a) {
  nlohmann::json packet = {{"status", a.status}, {"body", a.body}};
  std::string text = dump_json(packet);
  if (text.size() <= kMaxAnswerBytes) return text;
  // An error message naming thousands of tensors: cut, so that the client still learns the status and why.
  if (nlohmann::json* message = error_message(packet["body"])) {
    std::string m = message->get<std::string>();
    const size_t over = text.size() - kMaxAnswerBytes + 64;
    if (over < m.size()) {
      m.resize(m.size() - over);
      *message = m + " ... (cut: the message is longer than an answer packet)";
      text = dump_json(packet);
      if (text.size() <= kMaxAnswerBytes) return text;
    }
  }
  return dump_json({{"status", 500},
                    {"body", ApiError{500, "server_error", "answer_too_large",
                                      "the answer is larger than an answer packet of the weight socket (" +
                                          std::to_string(kMaxAnswerBytes) + " bytes)",
                                      {}}
                                 .to_json()}});
}

}  // namespace

Result<std::unique_ptr<WeightSocket>> WeightSocket::listen(const std::filesystem::path& path,
                                                           WeightSocketHandler handler, WeightSocketOptions options) {
  SIESTA_ASSIGN_OR_RETURN(transfer::ipc::PathListener listener, transfer::ipc::listen_path(path));
  const int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    const std::string err = std::strerror(errno);
    transfer::ipc::remove_socket_file(listener);
    ::close(listener.fd);
    return io_error("the weight socket: eventfd: " + err);
  }
  return std::unique_ptr<WeightSocket>(new WeightSocket(std::move(listener), wake, std::move(handler), options));
}

WeightSocket::WeightSocket(transfer::ipc::PathListener listener, int wake, WeightSocketHandler handler,
                           WeightSocketOptions options)
    : listener_(std::move(listener)), wake_(wake), handler_(std::move(handler)), options_(options) {}

WeightSocket::~WeightSocket() {
  stop();
  if (wake_ >= 0) ::close(wake_);
}

void WeightSocket::start() {
  std::lock_guard<std::mutex> lock(stop_mu_);
  if (thread_.joinable() || stopping_.load() || listener_.fd < 0) return;
  thread_ = std::thread([this] { run(); });
}

void WeightSocket::stop() {
  std::lock_guard<std::mutex> lock(stop_mu_);
  stopping_.store(true);
  const uint64_t one = 1;
  if (wake_ >= 0 && ::write(wake_, &one, sizeof(one)) < 0 && errno != EAGAIN)
    SIESTA_LOG_WARN("weight socket: waking its thread: {}", std::strerror(errno));
  if (thread_.joinable()) thread_.join();
  if (listener_.fd >= 0) {
    transfer::ipc::remove_socket_file(listener_);
    ::close(listener_.fd);
    listener_.fd = -1;
  }
}

void WeightSocket::run() {
  std::vector<int> conns;
  std::vector<pollfd> polled;
  while (!stopping_.load()) {
    polled.clear();
    polled.push_back({wake_, POLLIN, 0});
    polled.push_back({listener_.fd, POLLIN, 0});
    for (int c : conns) polled.push_back({c, POLLIN, 0});
    const int ready = ::poll(polled.data(), polled.size(), kIdlePollMillis);
    if (ready < 0 && errno != EINTR) {
      SIESTA_LOG_ERROR("weight socket: poll: {}; it stops answering", std::strerror(errno));
      break;
    }
    if (ready <= 0) continue;
    if (polled[0].revents != 0 || stopping_.load()) break;
    std::vector<int> open;
    for (size_t i = 2; i < polled.size(); ++i) {
      const int c = polled[i].fd;
      bool keep = true;
      if ((polled[i].revents & POLLIN) != 0) {
        keep = answer_one(c);
      } else if ((polled[i].revents & (POLLHUP | POLLERR | POLLNVAL)) != 0) {
        keep = false;
      }
      if (keep) {
        open.push_back(c);
      } else {
        ::close(c);
      }
      if (stopping_.load()) {
        for (size_t j = i + 1; j < polled.size(); ++j) open.push_back(polled[j].fd);
        break;
      }
    }
    conns = std::move(open);
    if ((polled[1].revents & POLLIN) != 0 && !stopping_.load()) accept_all(conns);
  }
  for (int c : conns) ::close(c);
}

void WeightSocket::accept_all(std::vector<int>& conns) {
  for (;;) {
    const int c = ::accept4(listener_.fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (c < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        SIESTA_LOG_WARN("weight socket: accept: {}", std::strerror(errno));
      return;
    }
    if (conns.size() >= options_.max_connections) {
      const AdminAnswer busy = AdminAnswer::refusal(
          ApiError{503, "server_error", "too_many_connections",
                   "the weight socket has " + std::to_string(conns.size()) +
                       " connections open, its limit; close one (a connection may send several requests in turn)",
                   {}});
      (void)transfer::ipc::send_packet(c, answer_text(busy));
      // A request already queued is dropped (its descriptors closed), so that the close does not reset the
      // connection and lose the answer with it.
      while (auto dropped = transfer::ipc::recv_whole_packet(c, 64, Clock::now()))
        transfer::ipc::close_fds(dropped->fds);
      ::close(c);
      continue;
    }
    conns.push_back(c);
  }
}

bool WeightSocket::answer_one(int conn) {
  auto got = transfer::ipc::recv_whole_packet(conn, options_.max_packet_bytes, deadline_after(kReadDeadline));
  if (!got) return false;  // the client closed, or the socket failed
  PassedFds passed{std::move(got->fds)};
  AdminAnswer answer;
  if (got->bytes_cut) {
    answer = AdminAnswer::refusal(ApiError{413, "invalid_request_error", "request_too_large",
                                           "the packet is larger than the limit of " +
                                               std::to_string(options_.max_packet_bytes) + " bytes",
                                           {}});
  } else if (got->fds_cut) {
    answer = AdminAnswer::refusal(
        bad_request("the packet carried more than " + std::to_string(kMaxFdsPerPacket) +
                    " descriptors; send exactly the descriptors its body names (one: \"fd\": 0)"));
  } else {
    try {
      answer = handler_(got->bytes, passed.fds);
    } catch (...) {
      const std::string what = exception_text(std::current_exception());
      SIESTA_LOG_ERROR("weight socket: update_weights: {}", what);
      answer = AdminAnswer::refusal(ApiError{500, "server_error", "internal_error", "internal error: " + what, {}});
    }
  }
  transfer::ipc::close_fds(passed.fds);
  if (const nlohmann::json* message = error_message(answer.body)) {
    SIESTA_LOG_INFO("weight socket: update_weights: {} {}", answer.status, message->get<std::string>());
  } else {
    SIESTA_LOG_INFO("weight socket: update_weights: {}", answer.status);
  }
  auto sent = transfer::ipc::send_packet(conn, answer_text(answer));
  if (!sent) {
    SIESTA_LOG_WARN("weight socket: the client did not take its answer ({}); its connection is closed",
                    sent.error().message);
    return false;
  }
  return true;
}

}  // namespace siesta::server
