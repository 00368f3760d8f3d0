#include "proxy/client_aware_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <chrono>

namespace siesta::proxy {
namespace {

// The client connection the current worker thread serves; -1 elsewhere.
thread_local socket_t t_client_socket = -1;

}  // namespace

bool ClientAwareServer::client_hung_up() {
  if (t_client_socket < 0) return false;
  pollfd p{};
  p.fd = t_client_socket;
  p.events = POLLRDHUP;
  if (::poll(&p, 1, 0) <= 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) != 0;
}

bool ClientAwareServer::next_request_arrives(socket_t sock) const {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(keep_alive_timeout_sec_);
  while (svr_sock_ != INVALID_SOCKET) {
    pollfd p{};
    p.fd = sock;
    p.events = POLLIN;
    const int ready = ::poll(&p, 1, 10);
    if (ready < 0) return false;
    if (ready > 0) return (p.revents & POLLIN) != 0;
    if (std::chrono::steady_clock::now() >= deadline) return false;
  }
  return false;
}

bool ClientAwareServer::process_and_close_socket(socket_t sock) {
  t_client_socket = sock;
  bool ok = false;
  for (size_t left = keep_alive_max_count_; left > 0 && next_request_arrives(sock); --left) {
    const bool close_connection = left == 1;
    bool connection_closed = false;
    ok = httplib::detail::process_client_socket(
        sock, read_timeout_sec_, read_timeout_usec_, write_timeout_sec_, write_timeout_usec_,
        [&](httplib::Stream& stream) { return process_request(stream, close_connection, connection_closed, nullptr); });
    if (!ok || connection_closed) break;
  }
  t_client_socket = -1;
  ::shutdown(sock, SHUT_RDWR);
  httplib::detail::close_socket(sock);
  return ok;
}

}  // namespace siesta::proxy
