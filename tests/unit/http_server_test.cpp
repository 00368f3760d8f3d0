// HttpServer (common/http_server.h): requests reach a worker only whole, so
// slow clients hold no worker; deadlines, connection limits, refusals and
// keep-alive, over loopback sockets.
#include "common/http_server.h"

#include "common/listen_backlog.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace siesta {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

class Server {
 public:
  explicit Server(HttpServerOptions o) : http(o) {
    http.Get("/hello", [](const httplib::Request&, httplib::Response& res) { res.set_content("hi", "text/plain"); });
    http.Post("/echo", [](const httplib::Request&, httplib::Response& res, const httplib::ContentReader& read) {
      std::string body;
      read([&](const char* d, size_t n) {
        body.append(d, n);
        return true;
      });
      res.set_content(body, "text/plain");
    });
    http.Get("/wait", [this](const httplib::Request&, httplib::Response& res) {
      // Until the client hangs up (or 5 s).
      const auto end = Clock::now() + 5s;
      while (!HttpServer::client_hung_up() && Clock::now() < end) std::this_thread::sleep_for(5ms);
      saw_hang_up = HttpServer::client_hung_up();
      res.set_content("late", "text/plain");
    });
    http.set_socket_options(backlog.socket_options());
    port = http.bind_to_any_port("127.0.0.1");
    EXPECT_TRUE(backlog.raise());
    thread = std::thread([this] { http.listen_after_bind(); });
    while (!http.is_running()) std::this_thread::sleep_for(1ms);
  }
  ~Server() {
    http.stop();
    thread.join();
  }
  HttpServer http;
  ListenBacklog backlog;
  int port = 0;
  std::thread thread;
  std::atomic<bool> saw_hang_up{false};
};

HttpServerOptions quick() {
  HttpServerOptions o;
  o.worker_threads = 2;
  o.head_timeout = 300ms;
  o.body_timeout = 300ms;
  o.idle_timeout = 300ms;
  o.limits.max_body_bytes = 1000;
  o.limits.max_json_depth = 4;
  return o;
}

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  return fd;
}

void send_all(int fd, const std::string& s) { (void)::send(fd, s.data(), s.size(), MSG_NOSIGNAL); }

// Everything the server sends until it closes or `wait` passes.
std::string read_for(int fd, std::chrono::milliseconds wait) {
  std::string out;
  const auto end = Clock::now() + wait;
  for (;;) {
    const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now()).count());
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, left) <= 0) break;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

// One request on a fresh connection; the whole answer.
std::string round_trip(int port, const std::string& request, std::chrono::milliseconds wait = 2000ms) {
  const int fd = connect_to(port);
  send_all(fd, request);
  std::string out = read_for(fd, wait);
  ::close(fd);
  return out;
}

TEST(HttpServerTest, ServesKeepAliveAndPipelinedRequests) {
  Server s(quick());
  const int fd = connect_to(s.port);
  send_all(fd, "GET /hello HTTP/1.1\r\nHost: x\r\n\r\nPOST /echo HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc");
  std::string got = read_for(fd, 150ms);
  EXPECT_NE(got.find("\r\n\r\nhi"), std::string::npos) << got;
  EXPECT_NE(got.find("\r\n\r\nabc"), std::string::npos) << got;
  // The same connection again, chunked this time.
  send_all(fd, "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nde\r\n1\r\nf\r\n0\r\n\r\n");
  got = read_for(fd, 100ms);
  EXPECT_NE(got.find("\r\n\r\ndef"), std::string::npos) << got;
  ::close(fd);
}

TEST(HttpServerTest, AnswersExpectContinueBeforeTheBodyIsSent) {
  Server s(quick());
  const int fd = connect_to(s.port);
  send_all(fd, "POST /echo HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n");
  EXPECT_EQ(read_for(fd, 200ms), "HTTP/1.1 100 Continue\r\n\r\n");
  send_all(fd, "ok");
  const std::string got = read_for(fd, 200ms);
  EXPECT_NE(got.find("HTTP/1.1 200"), std::string::npos) << got;
  EXPECT_EQ(got.find("100 Continue"), std::string::npos) << got;  // once only
  ::close(fd);
}

TEST(HttpServerTest, SlowClientsHoldNoWorker) {
  HttpServerOptions o = quick();  // two workers
  o.head_timeout = 2s;
  Server s(o);
  std::vector<int> slow;
  for (int i = 0; i < 50; ++i) {
    slow.push_back(connect_to(s.port));
    send_all(slow.back(), "GET /hel");
  }
  // Served while all fifty hold their connections (with two workers):
  EXPECT_NE(round_trip(s.port, "GET /hello HTTP/1.1\r\nConnection: close\r\n\r\n").find("200 OK"), std::string::npos);
  for (int fd : slow) {
    pollfd p{fd, POLLIN, 0};
    EXPECT_EQ(::poll(&p, 1, 0), 0) << "a slow client was answered before the normal one";
  }
  // each of them is answered 408 at its head deadline, and closed.
  for (int fd : slow) {
    const std::string got = read_for(fd, 4000ms);
    EXPECT_NE(got.find("408 Request Timeout"), std::string::npos) << got;
    EXPECT_NE(got.find("\"request_timeout\""), std::string::npos) << got;
    ::close(fd);
  }
}

TEST(HttpServerTest, ABodyMustArriveBeforeItsDeadline) {
  Server s(quick());
  const int fd = connect_to(s.port);
  send_all(fd, "POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nab");
  const std::string got = read_for(fd, 1500ms);
  EXPECT_NE(got.find("408"), std::string::npos) << got;
  EXPECT_NE(got.find("body"), std::string::npos) << got;
  ::close(fd);
}

TEST(HttpServerTest, RefusesOversizedBodiesAndDeepJsonWithOpenAiErrors) {
  Server s(quick());
  std::string got = round_trip(s.port, "POST /echo HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3e8\r\n" +
                                         std::string(1000, 'a') + "\r\n1\r\na\r\n");
  EXPECT_NE(got.find("413"), std::string::npos) << got;
  EXPECT_NE(got.find("Connection: close"), std::string::npos) << got;
  EXPECT_NE(got.find("{\"error\":{"), std::string::npos) << got;
  got = round_trip(s.port, "POST /echo HTTP/1.1\r\nContent-Length: 12\r\n\r\n{\"a\":[[[[]]]]}");
  EXPECT_NE(got.find("400"), std::string::npos) << got;
  EXPECT_NE(got.find("json_too_deep"), std::string::npos) << got;
  got = round_trip(s.port, "POST /echo HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx");
  EXPECT_NE(got.find("invalid_content_length"), std::string::npos) << got;
}

TEST(HttpServerTest, TheOldestWaitingConnectionsOfAnAddressGiveWay) {
  HttpServerOptions o = quick();
  o.idle_timeout = 10s;
  o.head_timeout = 10s;
  o.max_connections_per_address = 8;
  Server s(o);
  std::vector<int> idle;
  for (int i = 0; i < 20; ++i) idle.push_back(connect_to(s.port));
  std::this_thread::sleep_for(100ms);
  EXPECT_NE(round_trip(s.port, "GET /hello HTTP/1.1\r\n\r\n", 500ms).find("200 OK"), std::string::npos);
  int closed = 0;
  for (int fd : idle) {
    pollfd p{fd, POLLIN, 0};
    closed += ::poll(&p, 1, 0) > 0;  // readable: EOF
    ::close(fd);
  }
  EXPECT_GE(closed, 12);
  EXPECT_GE(s.http.counts().evicted, 12u);
}

TEST(HttpServerTest, AHandlerSeesItsClientHangUp) {
  Server s(quick());
  const int fd = connect_to(s.port);
  send_all(fd, "GET /wait HTTP/1.1\r\n\r\n");
  std::this_thread::sleep_for(100ms);
  ::close(fd);
  const auto end = Clock::now() + 3s;
  while (!s.saw_hang_up && Clock::now() < end) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(s.saw_hang_up);
}

}  // namespace
}  // namespace siesta
