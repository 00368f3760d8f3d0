#include "transfer/ipc/unix_socket.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace siesta::transfer::ipc {

namespace {

Result<sockaddr_un> abstract_address(const std::string& name, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (name.size() + 1 > sizeof(addr.sun_path)) return invalid_argument("ipc socket name too long");
  addr.sun_path[0] = '\0';
  std::memcpy(addr.sun_path + 1, name.data(), name.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return addr;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

Result<int> listen_abstract(const std::string& name) {
  socklen_t len = 0;
  SIESTA_ASSIGN_OR_RETURN(sockaddr_un addr, abstract_address(name, &len));
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return io_error(fmt::format("ipc: socket(): {}", errno_text()));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 64) != 0) {
    std::string err = errno_text();
    close(fd);
    return io_error(fmt::format("ipc: cannot listen on the abstract socket @{}: {}", name, err));
  }
  return fd;
}

Result<int> connect_abstract(const std::string& name) {
  socklen_t len = 0;
  SIESTA_ASSIGN_OR_RETURN(sockaddr_un addr, abstract_address(name, &len));
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return io_error(fmt::format("ipc: socket(): {}", errno_text()));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    std::string err = errno_text();
    close(fd);
    return unavailable(fmt::format("ipc: cannot connect to the peer's socket @{}: {}; the ipc backend only reaches "
                                   "engines on this host (same network namespace): use the ucx backend across hosts",
                                   name, err));
  }
  return fd;
}

Ok send_packet(int sock, std::string_view bytes, std::span<const int> fds) {
  if (fds.size() > kMaxFdsPerPacket) return internal_error("too many descriptors for one ipc packet");
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerPacket)];
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cm), fds.data(), sizeof(int) * fds.size());
  }
  for (;;) {
    ssize_t n = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (n >= 0) return {};
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd p{sock, POLLOUT, 0};
      if (poll(&p, 1, 1000) <= 0) return timeout("ipc: the peer does not read its socket");
      continue;
    }
    return unavailable(fmt::format("ipc: sending to the peer failed: {}", errno_text()));
  }
}

Result<std::string> recv_packet(int sock, size_t max_bytes, std::vector<int>* fds, Deadline deadline) {
  std::string buf(max_bytes, '\0');
  for (;;) {
    pollfd p{sock, POLLIN, 0};
    int ready = poll(&p, 1, millis_left(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) return timeout("ipc: no answer from the peer before the deadline");
    if (ready < 0) return io_error(fmt::format("ipc: poll: {}", errno_text()));
    iovec iov{buf.data(), buf.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerPacket)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) return unavailable(fmt::format("ipc: receiving from the peer failed: {}", errno_text()));
    std::vector<int> got;
    for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
      if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        got.push_back(fd);
      }
    }
    if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0) {
      close_fds(got);
      return corrupt("ipc: the peer sent a message larger than expected");
    }
    if (n == 0 && got.empty()) return unavailable("ipc: the peer closed its socket");
    if (fds != nullptr) {
      fds->insert(fds->end(), got.begin(), got.end());
    } else {
      close_fds(got);
    }
    buf.resize(static_cast<size_t>(n));
    return buf;
  }
}

bool peer_hung_up(int sock) {
  pollfd p{sock, POLLIN | POLLRDHUP, 0};
  int ready = poll(&p, 1, 0);
  if (ready < 0) return errno != EINTR;
  return ready > 0 && (p.revents & (POLLIN | POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

void close_fds(std::vector<int>& fds) {
  for (int fd : fds)
    if (fd >= 0) close(fd);
  fds.clear();
}

}  // namespace siesta::transfer::ipc
