// The listening sockets of siesta's HTTP servers (the OpenAI server and the
// proxy) with a backlog that takes a burst of clients.
//
// cpp-httplib listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, compiled
// into Debian's shared library, so a define here cannot change it). A burst of
// clients connecting at once then overflows the accept queue while the accept
// thread is busy, and some connections stall or are reset. ListenBacklog takes
// the listening socket from httplib's socket-options hook and, once the server
// is bound, listens again with SOMAXCONN (Linux updates the backlog of a
// socket that already listens):
//
//   ListenBacklog backlog;
//   server.set_socket_options(backlog.socket_options());
//   server.bind_to_port(host, port);
//   SIESTA_TRY(backlog.raise());
#pragma once

#include <atomic>
#include <functional>
#include <memory>

#include "common/status.h"

namespace siesta {

class ListenBacklog {
 public:
  // For httplib::Server::set_socket_options (called on the listening socket
  // before it is bound): SO_REUSEADDR, and not SO_REUSEPORT (httplib's default),
  // which would let a second process bind the same port and take half of the
  // connections; and the socket is remembered for raise().
  std::function<void(int)> socket_options() const;
  // After the server is bound: its socket listens with a backlog of SOMAXCONN.
  Result<void> raise() const;
  // The remembered socket, or -1.
  int socket() const { return fd_->load(); }

 private:
  std::shared_ptr<std::atomic<int>> fd_ = std::make_shared<std::atomic<int>>(-1);
};

}  // namespace siesta
