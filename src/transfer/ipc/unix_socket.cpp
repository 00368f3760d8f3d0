#include "transfer/ipc/unix_socket.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

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

Result<sockaddr_un> path_address(const std::filesystem::path& path, socklen_t* len) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string& p = path.native();
  if (p.empty()) return invalid_argument("the Unix socket path is empty");
  if (p.find('\0') != std::string::npos) return invalid_argument("the Unix socket path has a NUL byte");
  if (p.size() + 1 > sizeof(addr.sun_path))
    return invalid_argument(fmt::format("the Unix socket path {} is {} bytes long; at most {} fit (choose a shorter "
                                        "path)",
                                        p, p.size(), sizeof(addr.sun_path) - 1));
  std::memcpy(addr.sun_path, p.data(), p.size());
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + p.size() + 1);
  return addr;
}

// A socket file at `path` that no one listens on is removed; one someone
// listens on (or that cannot be probed) is refused.
Ok clear_stale_socket(const std::filesystem::path& path, const sockaddr_un& addr, socklen_t len) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return {};
    return io_error(fmt::format("cannot look at {}: {}", path.native(), errno_text()));
  }
  if (!S_ISSOCK(st.st_mode))
    return invalid_argument(
        fmt::format("{} exists and is not a socket; remove it or choose another path", path.native()));
  // Non-blocking, so that a listener whose backlog is full answers EAGAIN rather than holding us.
  int probe = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (probe < 0) return io_error(fmt::format("ipc: socket(): {}", errno_text()));
  const int rc = connect(probe, reinterpret_cast<const sockaddr*>(&addr), len);
  const int err = errno;
  close(probe);
  if (rc == 0 || err == EAGAIN || err == EINPROGRESS || err == EPROTOTYPE)
    return conflict(fmt::format("another process listens on the socket {}; stop it or choose another path",
                                path.native()));
  if (err != ECONNREFUSED && err != ENOENT)
    return io_error(fmt::format("cannot probe the socket {}: {}", path.native(), std::strerror(err)));
  // Left by a process that is gone.
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    return io_error(fmt::format("cannot remove the stale socket {}: {}", path.native(), errno_text()));
  return {};
}

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

Result<PathListener> listen_path(const std::filesystem::path& path) {
  socklen_t len = 0;
  SIESTA_ASSIGN_OR_RETURN(sockaddr_un addr, path_address(path, &len));
  SIESTA_TRY(clear_stale_socket(path, addr, len));
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return io_error(fmt::format("ipc: socket(): {}", errno_text()));
  auto fail = [&](Status st, bool bound) -> Result<PathListener> {
    close(fd);
    if (bound) ::unlink(path.c_str());
    return st;
  };
  // The file bind() makes takes the socket's mode (less the umask): 0600 from the start, no window open to
  // others. Where the kernel does not take a socket's mode, the chmod below still sets it.
  (void)fchmod(fd, S_IRUSR | S_IWUSR);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    if (errno == EADDRINUSE)
      return fail(conflict(fmt::format("another process took the socket {} meanwhile; choose another path",
                                       path.native())),
                  false);
    return fail(io_error(fmt::format("cannot create the socket {}: {}", path.native(), errno_text())), false);
  }
  struct stat st {};
  if (::chmod(path.c_str(), S_IRUSR | S_IWUSR) != 0 || ::lstat(path.c_str(), &st) != 0)
    return fail(io_error(fmt::format("cannot set the mode of the socket {}: {}", path.native(), errno_text())), true);
  if (listen(fd, 64) != 0)
    return fail(io_error(fmt::format("cannot listen on the socket {}: {}", path.native(), errno_text())), true);
  return PathListener{fd, path, static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino)};
}

void remove_socket_file(const PathListener& listener) {
  struct stat st {};
  if (listener.path.empty() || ::lstat(listener.path.c_str(), &st) != 0) return;
  if (static_cast<uint64_t>(st.st_dev) == listener.dev && static_cast<uint64_t>(st.st_ino) == listener.ino)
    ::unlink(listener.path.c_str());
}

Result<int> connect_path(const std::filesystem::path& path) {
  socklen_t len = 0;
  SIESTA_ASSIGN_OR_RETURN(sockaddr_un addr, path_address(path, &len));
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return io_error(fmt::format("ipc: socket(): {}", errno_text()));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    std::string err = errno_text();
    close(fd);
    return unavailable(fmt::format("cannot connect to the socket {}: {}", path.native(), err));
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

Result<ReceivedPacket> recv_whole_packet(int sock, size_t max_bytes, Deadline deadline) {
  ReceivedPacket out;
  out.bytes.assign(max_bytes, '\0');
  for (;;) {
    pollfd p{sock, POLLIN, 0};
    int ready = poll(&p, 1, millis_left(deadline));
    if (ready < 0 && errno == EINTR) continue;
    if (ready == 0) return timeout("ipc: no answer from the peer before the deadline");
    if (ready < 0) return io_error(fmt::format("ipc: poll: {}", errno_text()));
    iovec iov{out.bytes.data(), out.bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerPacket)];
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) return unavailable(fmt::format("ipc: receiving from the peer failed: {}", errno_text()));
    for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
      if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
      size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        out.fds.push_back(fd);
      }
    }
    out.bytes_cut = (msg.msg_flags & MSG_TRUNC) != 0;
    out.fds_cut = (msg.msg_flags & MSG_CTRUNC) != 0;
    if (n == 0 && out.fds.empty() && !out.fds_cut) return unavailable("ipc: the peer closed its socket");
    out.bytes.resize(std::min(static_cast<size_t>(n), max_bytes));
    return out;
  }
}

Result<std::string> recv_packet(int sock, size_t max_bytes, std::vector<int>* fds, Deadline deadline) {
  SIESTA_ASSIGN_OR_RETURN(ReceivedPacket got, recv_whole_packet(sock, max_bytes, deadline));
  if (got.bytes_cut || got.fds_cut) {
    close_fds(got.fds);
    return corrupt(got.bytes_cut ? "ipc: the peer sent a message larger than expected"
                                 : "ipc: the peer sent more descriptors in one message than expected");
  }
  if (fds != nullptr) {
    fds->insert(fds->end(), got.fds.begin(), got.fds.end());
  } else {
    close_fds(got.fds);
  }
  return std::move(got.bytes);
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
