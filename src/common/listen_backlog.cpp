#include "common/listen_backlog.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace siesta {

std::function<void(int)> ListenBacklog::socket_options() const {
  return [fd = fd_](int sock) {
    const int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    fd->store(sock);
  };
}

Result<void> ListenBacklog::raise() const {
  const int sock = fd_->load();
  if (sock < 0) return internal_error("listen backlog: the server's socket was never created");
  if (::listen(sock, SOMAXCONN) != 0)
    return io_error(std::string("listen backlog: listen(SOMAXCONN) failed: ") + std::strerror(errno));
  return {};
}

}  // namespace siesta
