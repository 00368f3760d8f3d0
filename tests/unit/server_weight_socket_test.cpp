// The weight socket (server/weight_socket.h) with a fake handler: answers
// as {"status", "body"} packets, several requests on one connection, the
// descriptors closed after every request (also refused ones: too large, too
// many descriptors), a client that hangs up mid-request, the connection
// limit, stop() with clients connected, and the socket file: mode 0600,
// removed on stop, a stale one replaced, a live one or a non-socket refused.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "server/weight_socket.h"
#include "temp_dir.h"
#include "transfer/ipc/unix_socket.h"

namespace siesta::server {
namespace {

using nlohmann::json;
namespace ipc = transfer::ipc;

size_t open_fds() {
  size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// What the fake handler saw of each request.
struct Seen {
  std::atomic<int> calls{0};
  std::atomic<int> last_fds{-1};
  std::atomic<bool> last_fd_regular{false};
};

WeightSocketHandler echo_handler(Seen& seen, std::chrono::milliseconds delay = std::chrono::milliseconds(0)) {
  return [&seen, delay](const std::string& body, std::span<const int> fds) {
    seen.calls++;
    seen.last_fds = static_cast<int>(fds.size());
    struct stat st {};
    seen.last_fd_regular = !fds.empty() && ::fstat(fds[0], &st) == 0 && S_ISREG(st.st_mode);
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    return AdminAnswer{200, json{{"echo", body}, {"fds", fds.size()}}};
  };
}

int memfd_of(size_t bytes) {
  const int fd = ::memfd_create("weight-socket-test", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::ftruncate(fd, static_cast<off_t>(bytes)), 0);
  return fd;
}

// One request and its answer packet, parsed.
json exchange(int sock, const std::string& body, std::span<const int> fds = {}) {
  EXPECT_TRUE(ipc::send_packet(sock, body, fds));
  auto got = ipc::recv_packet(sock, 1 << 20, nullptr, deadline_after(std::chrono::seconds(10)));
  EXPECT_TRUE(got) << (got ? "" : got.error().message);
  return got ? json::parse(*got) : json();
}

class WeightSocketTest : public ::testing::Test {
 protected:
  testing::TempDir dir{"weight_socket_test"};
  std::filesystem::path path = dir.path() / "w.sock";
};

TEST_F(WeightSocketTest, AnswersEachPacketOfAConnectionAndClosesItsDescriptors) {
  Seen seen;
  auto ws = WeightSocket::listen(path, echo_handler(seen));
  ASSERT_TRUE(ws) << ws.error().message;
  (*ws)->start();
  struct stat st {};
  ASSERT_EQ(::lstat(path.c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  auto sock = ipc::connect_path(path);
  ASSERT_TRUE(sock) << sock.error().message;
  const int memfd = memfd_of(4096);
  EXPECT_EQ(exchange(*sock, "{}")["body"]["fds"], 0);  // the server has accepted the connection
  const size_t before = open_fds();
  for (int i = 0; i < 50; ++i) {
    const int fds[] = {memfd};
    json a = exchange(*sock, "{\"n\": " + std::to_string(i) + "}", fds);
    EXPECT_EQ(a["status"], 200);
    EXPECT_EQ(a["body"]["echo"], "{\"n\": " + std::to_string(i) + "}");
    EXPECT_EQ(a["body"]["fds"], 1);
    EXPECT_TRUE(seen.last_fd_regular.load());
  }
  EXPECT_EQ(seen.calls.load(), 51);
  // Every descriptor the server received was closed again (this process is both ends).
  EXPECT_EQ(open_fds(), before);
  ::close(*sock);
  ::close(memfd);
  (*ws)->stop();
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(path)));
}

TEST_F(WeightSocketTest, OversizedPacketsAndTooManyDescriptorsAreRefusedAndClosed) {
  Seen seen;
  WeightSocketOptions o;
  o.max_packet_bytes = 1000;
  auto ws = WeightSocket::listen(path, echo_handler(seen), o);
  ASSERT_TRUE(ws) << ws.error().message;
  (*ws)->start();
  auto sock = ipc::connect_path(path);
  ASSERT_TRUE(sock);
  const int memfd = memfd_of(4096);
  EXPECT_EQ(exchange(*sock, "{}")["status"], 200);  // the server has accepted the connection
  const size_t before = open_fds();

  const int one[] = {memfd};
  json a = exchange(*sock, std::string(1001, 'x'), one);
  EXPECT_EQ(a["status"], 413);
  EXPECT_NE(a["body"]["error"]["message"].get<std::string>().find("1000 bytes"), std::string::npos);
  EXPECT_EQ(a["body"]["error"]["code"], "request_too_large");
  EXPECT_EQ(exchange(*sock, std::string(1000, ' '), one)["status"], 200);  // the limit itself fits

  // More than one packet may carry (the kernel closes those it could not give).
  std::vector<int> many(ipc::kMaxFdsPerPacket + 1, memfd);
  // send_packet refuses more than kMaxFdsPerPacket, so this packet is built by hand.
  iovec iov{const_cast<char*>("{}"), 2};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * many.size()));
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  cmsghdr* cm = CMSG_FIRSTHDR(&msg);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int) * many.size());
  std::memcpy(CMSG_DATA(cm), many.data(), sizeof(int) * many.size());
  ASSERT_EQ(::sendmsg(*sock, &msg, 0), 2);
  auto got = ipc::recv_packet(*sock, 1 << 20, nullptr, deadline_after(std::chrono::seconds(10)));
  ASSERT_TRUE(got) << got.error().message;
  a = json::parse(*got);
  EXPECT_EQ(a["status"], 400);
  EXPECT_NE(a["body"]["error"]["message"].get<std::string>().find("more than 64 descriptors"), std::string::npos);

  EXPECT_EQ(seen.calls.load(), 2);  // only the packets that fit reached the handler
  EXPECT_EQ(exchange(*sock, "{}")["status"], 200);  // the connection still serves
  EXPECT_EQ(open_fds(), before);
  ::close(*sock);
  ::close(memfd);
}

TEST_F(WeightSocketTest, AClientThatHangsUpMidRequestDoesNotWedgeTheSocket) {
  Seen seen;
  auto ws = WeightSocket::listen(path, echo_handler(seen, std::chrono::milliseconds(300)));
  ASSERT_TRUE(ws);
  (*ws)->start();
  const size_t before = open_fds();
  for (int i = 0; i < 5; ++i) {
    auto gone = ipc::connect_path(path);
    ASSERT_TRUE(gone);
    const int memfd = memfd_of(4096);
    const int fds[] = {memfd};
    ASSERT_TRUE(ipc::send_packet(*gone, "{}", fds));
    ::close(memfd);
    ::close(*gone);  // before the answer
  }
  auto sock = ipc::connect_path(path);
  ASSERT_TRUE(sock);
  EXPECT_EQ(exchange(*sock, "{\"after\": true}")["status"], 200);
  EXPECT_EQ(seen.calls.load(), 6);
  ::close(*sock);
  // The connections of the clients that left, and their descriptors, are closed.
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (open_fds() != before && std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(open_fds(), before);
}

TEST_F(WeightSocketTest, ConnectionsBeyondTheLimitAreAnswered503) {
  Seen seen;
  WeightSocketOptions o;
  o.max_connections = 2;
  auto ws = WeightSocket::listen(path, echo_handler(seen), o);
  ASSERT_TRUE(ws);
  (*ws)->start();
  auto a = ipc::connect_path(path);
  auto b = ipc::connect_path(path);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(exchange(*a, "{}")["status"], 200);
  EXPECT_EQ(exchange(*b, "{}")["status"], 200);
  auto c = ipc::connect_path(path);
  ASSERT_TRUE(c);
  auto refused = ipc::recv_packet(*c, 1 << 20, nullptr, deadline_after(std::chrono::seconds(10)));
  ASSERT_TRUE(refused) << refused.error().message;
  EXPECT_EQ(json::parse(*refused)["status"], 503);
  ::close(*c);
  ::close(*a);
  // A place is free again once the server has seen a connection close.
  int status = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (status != 200 && std::chrono::steady_clock::now() < end) {
    auto d = ipc::connect_path(path);
    ASSERT_TRUE(d);
    // A connection still refused may be closed before its request goes out or its answer is read.
    (void)ipc::send_packet(*d, "{}");
    auto got = ipc::recv_packet(*d, 1 << 20, nullptr, deadline_after(std::chrono::seconds(10)));
    status = got ? json::parse(*got)["status"].get<int>() : 0;
    ::close(*d);
    if (status != 200) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(status, 200);
  ::close(*b);
}

TEST_F(WeightSocketTest, StopEndsTheThreadWithClientsConnectedAndRemovesTheFile) {
  Seen seen;
  auto ws = WeightSocket::listen(path, echo_handler(seen));
  ASSERT_TRUE(ws);
  (*ws)->start();
  auto idle = ipc::connect_path(path);
  ASSERT_TRUE(idle);
  EXPECT_EQ(exchange(*idle, "{}")["status"], 200);
  const auto t0 = std::chrono::steady_clock::now();
  (*ws)->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::symlink_status(path)));
  // The client learns that the server went.
  auto after = ipc::recv_packet(*idle, 1 << 20, nullptr, deadline_after(std::chrono::seconds(5)));
  EXPECT_FALSE(after);
  ::close(*idle);
  (*ws)->stop();  // twice is fine
}

TEST_F(WeightSocketTest, TheSocketFileStaleReplacedLiveOrForeignRefused) {
  // A stale socket file (its process gone: bound, never unlinked) is replaced.
  {
    auto stale = ipc::listen_path(path);
    ASSERT_TRUE(stale) << stale.error().message;
    ::close(stale->fd);
  }
  ASSERT_TRUE(std::filesystem::exists(std::filesystem::symlink_status(path)));
  Seen seen;
  auto ws = WeightSocket::listen(path, echo_handler(seen));
  ASSERT_TRUE(ws) << ws.error().message;
  (*ws)->start();
  // A second server on the same live socket is refused, and the first keeps its file.
  auto second = WeightSocket::listen(path, echo_handler(seen));
  ASSERT_FALSE(second);
  EXPECT_EQ(second.error().code, ErrorCode::kConflict);
  EXPECT_NE(second.error().message.find("another process listens"), std::string::npos);
  auto sock = ipc::connect_path(path);
  ASSERT_TRUE(sock);
  EXPECT_EQ(exchange(*sock, "{}")["status"], 200);
  ::close(*sock);
  (*ws)->stop();

  // Not a socket: refused, and left alone.
  const std::filesystem::path file = dir.path() / "plain";
  std::ofstream(file) << "data";
  auto not_socket = WeightSocket::listen(file, echo_handler(seen));
  ASSERT_FALSE(not_socket);
  EXPECT_EQ(not_socket.error().code, ErrorCode::kInvalidArgument);
  EXPECT_NE(not_socket.error().message.find("exists and is not a socket"), std::string::npos);
  EXPECT_TRUE(std::filesystem::is_regular_file(file));
  // Too long for a sockaddr_un, or in a directory that does not exist.
  EXPECT_FALSE(WeightSocket::listen(dir.path() / std::string(120, 'a'), echo_handler(seen)));
  auto missing = WeightSocket::listen(dir.path() / "no" / "w.sock", echo_handler(seen));
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message.find("no/w.sock"), std::string::npos);
}

TEST_F(WeightSocketTest, AFileReplacedUnderTheServerIsNotRemovedByIt) {
  Seen seen;
  auto ws = WeightSocket::listen(path, echo_handler(seen));
  ASSERT_TRUE(ws);
  std::filesystem::remove(path);
  std::ofstream(path) << "someone else's";
  (*ws)->stop();
  EXPECT_TRUE(std::filesystem::is_regular_file(path));
}

}  // namespace
}  // namespace siesta::server
