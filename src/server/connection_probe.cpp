#include "server/connection_probe.h"

#include <dirent.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdlib>

#include "common/http_server.h"

namespace siesta::server {
namespace {

int port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return -1;
}

// The numeric host, as cpp-httplib writes Request::remote_addr.
std::string host_of(const sockaddr_storage& a, socklen_t len) {
  char host[NI_MAXHOST];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) != 0)
    return {};
  return host;
}

}  // namespace

ConnectionProbe ConnectionProbe::find(int local_port, const std::string& remote_addr, int remote_port) {
  ConnectionProbe probe;
  // On a worker of siesta's HttpServer the socket is known.
  if (const int fd = HttpServer::client_socket(); fd >= 0) {
    probe.fd_ = fd;
    return probe;
  }
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return probe;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(dir)) continue;
    sockaddr_storage peer{};
    socklen_t peer_len = sizeof(peer);
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&peer), &peer_len) != 0) continue;
    if (port_of(peer) != remote_port) continue;
    sockaddr_storage local{};
    socklen_t local_len = sizeof(local);
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &local_len) != 0) continue;
    if (port_of(local) != local_port || host_of(peer, peer_len) != remote_addr) continue;
    probe.fd_ = static_cast<int>(fd);
    break;
  }
  closedir(dir);
  return probe;
}

bool ConnectionProbe::client_gone() const {
  if (fd_ < 0) return false;
  char c;
  const ssize_t n = recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) return true;
  if (n > 0) return false;  // the client sent more (a pipelined request): still there
  return errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR;
}

}  // namespace siesta::server
