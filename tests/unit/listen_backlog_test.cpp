// ListenBacklog (common/listen_backlog.h): the socket options the HTTP servers
// get, and a backlog that holds a burst of connections nobody has accepted yet.
#include "common/listen_backlog.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <vector>

namespace siesta {
namespace {

// A TCP socket on 127.0.0.1, port chosen by the kernel, listening with `backlog`
// as httplib does; returns the socket and sets *port.
int listening_socket(const ListenBacklog& lb, int backlog, uint16_t* port) {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  lb.socket_options()(s);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  EXPECT_EQ(::listen(s, backlog), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len);
  *port = ntohs(addr.sin_port);
  return s;
}

// Starts n non-blocking connects to port and returns how many complete within
// `wait`, with nobody accepting them.
int connections_completed(uint16_t port, int n, std::chrono::milliseconds wait) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int c = ::socket(AF_INET, SOCK_STREAM, 0);
    ::fcntl(c, F_SETFL, ::fcntl(c, F_GETFL) | O_NONBLOCK);
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    to.sin_port = htons(port);
    ::connect(c, reinterpret_cast<sockaddr*>(&to), sizeof(to));
    fds.push_back(c);
  }
  // A connect is complete once the socket is writable with no error; one that
  // sits unacknowledged in a full queue is neither.
  const auto deadline = std::chrono::steady_clock::now() + wait;
  int done = 0;
  std::vector<bool> counted(n, false);
  while (done < n && std::chrono::steady_clock::now() < deadline) {
    for (int i = 0; i < n; ++i) {
      if (counted[i]) continue;
      pollfd p{fds[i], POLLOUT, 0};
      if (::poll(&p, 1, 0) == 1 && (p.revents & POLLOUT)) {
        int err = 0;
        socklen_t len = sizeof(err);
        ::getsockopt(fds[i], SOL_SOCKET, SO_ERROR, &err, &len);
        if (err == 0) {
          counted[i] = true;
          ++done;
        }
      }
    }
    ::usleep(1000);
  }
  for (int c : fds) ::close(c);
  return done;
}

TEST(ListenBacklog, RaiseBeforeASocketExistsIsAnError) {
  ListenBacklog lb;
  EXPECT_EQ(lb.socket(), -1);
  EXPECT_FALSE(lb.raise().has_value());
}

TEST(ListenBacklog, SocketOptionsReuseTheAddressButNotThePort) {
  ListenBacklog lb;
  uint16_t port = 0;
  const int s = listening_socket(lb, 5, &port);
  EXPECT_EQ(lb.socket(), s);
  int v = 0;
  socklen_t len = sizeof(v);
  ASSERT_EQ(::getsockopt(s, SOL_SOCKET, SO_REUSEADDR, &v, &len), 0);
  EXPECT_NE(v, 0);
  v = 1;
  ASSERT_EQ(::getsockopt(s, SOL_SOCKET, SO_REUSEPORT, &v, &len), 0);
  EXPECT_EQ(v, 0);
  // So a second listener on the same port is refused.
  const int t = ::socket(AF_INET, SOCK_STREAM, 0);
  lb.socket_options()(t);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  EXPECT_NE(::bind(t, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ::close(t);
  ::close(s);
}

// httplib listens with a backlog of 5; after raise(), a burst of 64 clients all
// get connected while nothing accepts (with a backlog of 1 only 2 would).
TEST(ListenBacklog, RaisedBacklogHoldsABurstOfConnections) {
  ListenBacklog lb;
  uint16_t port = 0;
  const int s = listening_socket(lb, 1, &port);
  ASSERT_TRUE(lb.raise().has_value());
  EXPECT_EQ(connections_completed(port, 64, std::chrono::milliseconds(3000)), 64);
  ::close(s);
}

}  // namespace
}  // namespace siesta
