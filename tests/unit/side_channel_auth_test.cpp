// The side channel's authentication (transfer/frame_auth.h, side_channel.h)
// and the checks an INVALIDATE passes (transfer/invalidate_check.h): a peer
// without the shared key can neither open a session nor steer transfers, a
// frame altered or replayed is refused, an INVALIDATE from anyone but the
// engine it names (or with an epoch that does not follow) changes nothing, and
// what an unauthenticated connection can make an engine hold stays small.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "transfer/frame_auth.h"
#include "transfer/invalidate_check.h"
#include "transfer/messages.h"
#include "transfer/side_channel.h"
#include "transfer/transfer_engine.h"
#include "transfer/wire.h"

namespace siesta::transfer {
namespace {

using namespace std::chrono_literals;

const std::string kKey = "0123456789abcdef0123456789abcdef";
const std::string kOtherKey = "fedcba9876543210fedcba9876543210";

// --- the handshake and sessions, without sockets ----------------------------

struct Pair {
  FrameSession client;
  FrameSession server;
  std::string server_saw;
};

Result<Pair> handshake(const std::string& client_key, const std::string& server_key) {
  ClientHandshake c(client_key, "decode-0");
  ServerHandshake s(server_key, "prefill-0");
  SIESTA_ASSIGN_OR_RETURN(Frame challenge, s.challenge(c.hello()));
  SIESTA_ASSIGN_OR_RETURN(Frame auth, c.answer(challenge));
  SIESTA_ASSIGN_OR_RETURN(FrameSession server, s.verify(auth));
  return Pair{c.session(), std::move(server), s.client_engine_id()};
}

// What a receiver parses from sealed bytes.
Frame received(const std::string& bytes) {
  FrameParser p;
  p.expect(kAllFrameTypes, UINT32_MAX, kAuthMacBytes);
  p.feed(bytes);
  auto f = p.next();
  EXPECT_TRUE(f && *f);
  return f && *f ? **f : Frame{};
}

TEST(SideChannelAuth, PeersWithTheKeyOpenASessionBothWays) {
  auto pair = handshake(kKey, kKey);
  ASSERT_TRUE(pair) << pair.error().message;
  EXPECT_EQ(pair->server_saw, "decode-0");
  for (int i = 0; i < 3; ++i) {
    const Frame request = to_frame(InvalidateMsg{"decode-0", Epoch{7}});
    Frame got = received(pair->client.seal(request));
    ASSERT_TRUE(pair->server.open(got)) << i;
    EXPECT_EQ(got.payload, request.payload);
    Frame answer = received(pair->server.seal(to_frame(AckMsg{"prefill-0", Epoch{7}})));
    ASSERT_TRUE(pair->client.open(answer)) << i;
  }
}

TEST(SideChannelAuth, AWrongKeyFailsTheHandshakeOnEitherSide) {
  // The client checks the server's proof first.
  auto wrong_server = handshake(kKey, kOtherKey);
  ASSERT_FALSE(wrong_server);
  EXPECT_NE(wrong_server.error().message.find("did not prove"), std::string::npos) << wrong_server.error().message;
  // A client without the key cannot forge AUTH: a proof of random bytes.
  ClientHandshake c(kKey, "mallory");
  ServerHandshake s(kKey, "prefill-0");
  ASSERT_TRUE(s.challenge(c.hello()));
  EXPECT_FALSE(s.verify(to_frame(AuthMsg{std::string(kAuthMacBytes, 'x')})));
}

TEST(SideChannelAuth, AlteredReplayedAndReorderedFramesAreRefused) {
  auto pair = handshake(kKey, kKey);
  ASSERT_TRUE(pair);
  const std::string first = pair->client.seal(to_frame(InvalidateMsg{"decode-0", Epoch{1}}));
  const std::string second = pair->client.seal(to_frame(InvalidateMsg{"decode-0", Epoch{2}}));
  // Reordered: the second first.
  EXPECT_FALSE(pair->server.open(received(second)));
  ASSERT_TRUE(pair->server.open(received(first)));
  // Replayed.
  EXPECT_FALSE(pair->server.open(received(first)));
  // Altered: one bit of the epoch.
  std::string altered = second;
  altered[altered.size() - kAuthMacBytes - 1] ^= 1;
  EXPECT_FALSE(pair->server.open(received(altered)));
  ASSERT_TRUE(pair->server.open(received(second)));
  // A frame of one session means nothing in another.
  auto other = handshake(kKey, kKey);
  ASSERT_TRUE(other);
  EXPECT_FALSE(other->server.open(received(first)));
}

TEST(SideChannelAuth, ShortKeysAreRefused) {
  EXPECT_FALSE(check_auth_key("short"));
  EXPECT_TRUE(check_auth_key(kKey));
  SideChannelOptions o;
  o.auth_key = "short";
  auto side = SideChannel::start(o, [](const Frame&, const RequestOrigin&) -> Result<Frame> { return Frame{}; });
  ASSERT_FALSE(side);
  EXPECT_NE(side.error().message.find("at least"), std::string::npos);
}

// --- side channels over loopback ---------------------------------------------

SideChannelOptions options(const std::string& engine, const std::string& key) {
  SideChannelOptions o;
  o.engine_id = engine;
  o.auth_key = key;
  return o;
}

// A side channel that answers every request with ACK, naming who it was from.
std::unique_ptr<SideChannel> echo_origin(SideChannelOptions o) {
  auto side = SideChannel::start(o, [](const Frame&, const RequestOrigin& from) -> Result<Frame> {
    return to_frame(AckMsg{from.engine_id.empty() ? "(anonymous)" : from.engine_id, Epoch{1}});
  });
  EXPECT_TRUE(side) << side.error().message;
  return side ? std::move(*side) : nullptr;
}

std::string answered_by(SideChannel& client, const std::string& address) {
  auto answer = client.request(address, to_frame(GetMetaMsg{"x", ""}), deadline_after(5000ms));
  if (!answer) return "failed: " + answer.error().message;
  if (answer->type != FrameType::kAck) return "refused: " + status_from_unexpected(*answer, FrameType::kGetMeta, "peer").message;
  return decode_ack(answer->payload)->engine_id;
}

TEST(SideChannelAuth, RequestsCarryTheEngineIdTheirSenderProved) {
  auto server = echo_origin(options("prefill-0", kKey));
  auto client = echo_origin(options("decode-0", kKey));
  ASSERT_TRUE(server && client);
  // Several, so that the pooled connection (and its counters) is reused.
  for (int i = 0; i < 5; ++i) EXPECT_EQ(answered_by(*client, server->address()), "decode-0") << i;
}

TEST(SideChannelAuth, PeersThatDisagreeOnTheKeyAreToldWhy) {
  auto keyed = echo_origin(options("prefill-0", kKey));
  auto open = echo_origin(options("open-0", ""));
  auto wrong = echo_origin(options("wrong-0", kOtherKey));
  ASSERT_TRUE(keyed && open && wrong);
  const std::string no_key = answered_by(*open, keyed->address());
  EXPECT_NE(no_key.find("requires authentication"), std::string::npos) << no_key;
  const std::string to_open = answered_by(*keyed, open->address());
  EXPECT_NE(to_open.find("no auth key"), std::string::npos) << to_open;
  const std::string wrong_key = answered_by(*wrong, keyed->address());
  EXPECT_NE(wrong_key.find("did not prove"), std::string::npos) << wrong_key;
  // The keyed side channel still serves its peers.
  auto friend_ = echo_origin(options("decode-0", kKey));
  EXPECT_EQ(answered_by(*friend_, keyed->address()), "decode-0");
}

int connect_to(const std::string& address) {
  const size_t colon = address.rfind(':');
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether the peer closed `fd` within `wait` (reading and dropping what it sent).
bool closed_within(int fd, std::chrono::milliseconds wait) {
  timeval tv{static_cast<time_t>(wait.count() / 1000), static_cast<suseconds_t>((wait.count() % 1000) * 1000)};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n == 0) return true;
    if (n < 0) return errno == ECONNRESET;
  }
}

std::string header(FrameType type, uint32_t length) { return encode_frame_header(type, length); }

TEST(SideChannelAuth, BeforeAuthenticatingAPeerCanMakeItHoldAFewKiBAtMost) {
  auto server = echo_origin(options("prefill-0", kKey));
  ASSERT_TRUE(server);
  // A 4 MiB MESSAGE announced before HELLO: refused at its header.
  int big = connect_to(server->address());
  std::string h = header(FrameType::kMessage, 4u << 20);
  ASSERT_EQ(::send(big, h.data(), h.size(), MSG_NOSIGNAL), static_cast<ssize_t>(h.size()));
  EXPECT_TRUE(closed_within(big, 2000ms));
  ::close(big);
  // A GET_META header claiming 1 MiB even after the handshake would be refused
  // too: control frames are small whoever sends them.
  FrameParser parser(4u << 20);
  parser.feed(header(FrameType::kGetMeta, 1u << 20));
  EXPECT_FALSE(parser.next());
  // A connection that never authenticates is closed after auth_timeout.
  SideChannelOptions quick = options("prefill-1", kKey);
  quick.auth_timeout = 300ms;
  auto impatient = echo_origin(quick);
  int silent = connect_to(impatient->address());
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(closed_within(silent, 3000ms));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2000ms);
  ::close(silent);
}

TEST(SideChannelAuth, UnauthenticatedConnectionsGiveWayToPeersThatAuthenticate) {
  SideChannelOptions o = options("prefill-0", kKey);
  o.max_connections_per_address = 8;
  auto server = echo_origin(o);
  auto client = echo_origin(options("decode-0", kKey));
  ASSERT_TRUE(server && client);
  std::vector<int> squatters;
  for (int i = 0; i < 40; ++i) squatters.push_back(connect_to(server->address()));
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(answered_by(*client, server->address()), "decode-0");
  for (int fd : squatters) ::close(fd);
}

// --- INVALIDATE plausibility --------------------------------------------------

TEST(InvalidateCheck, OnlyTheEngineNamedWithAnEpochThatFollows) {
  const InvalidateMsg msg{"decode-0", Epoch{5}};
  EXPECT_TRUE(check_invalidate(msg, RequestOrigin{"127.0.0.1:5000", "decode-0"}, Epoch{5}, "127.0.0.1:7000"));
  EXPECT_TRUE(check_invalidate(msg, RequestOrigin{"127.0.0.1:5000", "decode-0"}, std::nullopt, ""));
  // Another engine, even one holding the key.
  auto other = check_invalidate(msg, RequestOrigin{"127.0.0.1:5000", "mallory"}, Epoch{5}, "");
  ASSERT_FALSE(other);
  EXPECT_NE(other.error().message.find("comes from engine mallory"), std::string::npos);
  // Without authentication: another host than the named engine's.
  EXPECT_FALSE(check_invalidate(msg, RequestOrigin{"10.0.0.9:5000", ""}, Epoch{5}, "127.0.0.1:7000"));
  EXPECT_TRUE(check_invalidate(msg, RequestOrigin{"127.0.0.1:5000", ""}, Epoch{5}, "127.0.0.1:7000"));
  EXPECT_TRUE(check_invalidate(msg, RequestOrigin{"10.0.0.9:5000", ""}, Epoch{5}, "0.0.0.0:7000"));
  // Stale, and far ahead.
  auto stale = check_invalidate(msg, RequestOrigin{"", "decode-0"}, Epoch{6}, "");
  ASSERT_FALSE(stale);
  EXPECT_EQ(stale.error().code, ErrorCode::kConflict);
  EXPECT_NE(stale.error().message.find("stale"), std::string::npos);
  EXPECT_FALSE(check_invalidate(InvalidateMsg{"decode-0", Epoch{UINT64_MAX}}, RequestOrigin{"", "decode-0"}, Epoch{5},
                                ""));
  EXPECT_TRUE(check_invalidate(InvalidateMsg{"decode-0", Epoch{5 + kInvalidateEpochSlack}},
                               RequestOrigin{"", "decode-0"}, Epoch{5}, ""));
}

TEST(InvalidateCheck, AnAuthenticatedSenderSpeaksOnlyForItself) {
  EXPECT_TRUE(check_sender(FrameType::kNotify, "decode-0", RequestOrigin{"127.0.0.1:5000", "decode-0"}));
  // Without authentication there is no proved id to compare.
  EXPECT_TRUE(check_sender(FrameType::kNotify, "decode-0", RequestOrigin{"127.0.0.1:5000", ""}));
  for (FrameType t : {FrameType::kGetMeta, FrameType::kNotify, FrameType::kMessage}) {
    auto other = check_sender(t, "decode-0", RequestOrigin{"127.0.0.1:5000", "mallory"});
    ASSERT_FALSE(other);
    EXPECT_EQ(other.error().code, ErrorCode::kInvalidArgument);
    EXPECT_NE(other.error().message.find(frame_type_name(t)), std::string::npos) << other.error().message;
    EXPECT_NE(other.error().message.find("proved engine mallory"), std::string::npos) << other.error().message;
  }
}

// Two engines in this process, with memfd regions (ipc backend).
struct Memfd {
  explicit Memfd(size_t n) : bytes(n) {
    fd = memfd_create("side-channel-auth-test", MFD_CLOEXEC);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(n)), 0);
    data = static_cast<char*>(mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  }
  ~Memfd() {
    munmap(data, bytes);
    close(fd);
  }
  RegionSpec spec() const {
    RegionSpec s;
    s.base = data;
    s.bytes = bytes;
    s.kind = MemoryKind::kHost;
    s.export_fd = fd;
    return s;
  }
  int fd = -1;
  char* data = nullptr;
  size_t bytes;
};

TransferConfig engine_config(const std::string& id, const std::string& key) {
  TransferConfig c;
  c.engine_id = id;
  c.backend = BackendKind::kIpc;
  c.side_channel.auth_key = key;
  c.invalidate_drain_timeout = 1000ms;
  return c;
}

TEST(SideChannelAuth, SpoofedInvalidatesChangeNothingAndTheRealOneWorks) {
  Memfd p_mem(1 << 16), d_mem(1 << 16);
  auto p = TransferEngine::create(engine_config("prefill-0", kKey));
  auto d = TransferEngine::create(engine_config("decode-0", kKey));
  ASSERT_TRUE(p && d) << (p ? d.error().message : p.error().message);
  auto p_region = (*p)->register_region(p_mem.spec());
  auto d_region = (*d)->register_region(d_mem.spec());
  ASSERT_TRUE(p_region && d_region);
  ASSERT_TRUE((*p)->connect((*d)->address(), deadline_after(5000ms)));
  const Epoch held = (*p)->peer_meta("decode-0")->epoch;
  auto write_works = [&] {
    std::memset(p_mem.data, 'w', 64);
    auto id = (*p)->submit("decode-0", XferOp::kWrite, {XferEntry{*p_region, 0, *d_region, 0, 64}}, std::nullopt,
                           deadline_after(5000ms));
    return id && (*p)->wait(*id, deadline_after(5000ms)).done() && d_mem.data[63] == 'w';
  };
  ASSERT_TRUE(write_works());
  const Frame spoof = to_frame(InvalidateMsg{"decode-0", Epoch{UINT64_MAX}});

  // 1. No key: the frame never reaches the engine.
  auto anonymous = echo_origin(options("anonymous", ""));
  ASSERT_TRUE(anonymous);
  auto a1 = anonymous->request((*p)->address(), spoof, deadline_after(5000ms));
  ASSERT_TRUE(a1);
  EXPECT_EQ(a1->type, FrameType::kError);
  // 2. The key, but another engine's name.
  auto mallory = echo_origin(options("mallory", kKey));
  ASSERT_TRUE(mallory);
  auto a2 = mallory->request((*p)->address(), spoof, deadline_after(5000ms));
  ASSERT_TRUE(a2);
  ASSERT_EQ(a2->type, FrameType::kError);
  EXPECT_NE(decode_error(a2->payload)->message.find("comes from engine mallory"), std::string::npos);
  // 3. The key and D's name, but an epoch that does not follow.
  auto impostor = echo_origin(options("decode-0", kKey));
  ASSERT_TRUE(impostor);
  auto a3 = impostor->request((*p)->address(), spoof, deadline_after(5000ms));
  ASSERT_TRUE(a3);
  ASSERT_EQ(a3->type, FrameType::kError);
  EXPECT_NE(decode_error(a3->payload)->message.find("does not follow"), std::string::npos);
  EXPECT_EQ(*(*p)->peer_state("decode-0"), PeerState::kReady);
  EXPECT_EQ((*p)->peer_meta("decode-0")->epoch, held);
  EXPECT_TRUE(write_works());
  // 4. The key, speaking for D in the other requests: a notification P would
  // hand its connector as D's, a reply address registered under D's name.
  // (The sender is checked before the notification's epoch.)
  for (const Frame& f : {to_frame(NotifyMsg{"decode-0", Epoch{0}, "spoofed"}),
                         to_frame(GetMetaMsg{"decode-0", "10.0.0.9:1"}), to_frame(PeerMessage{"decode-0", "spoofed"})}) {
    auto answer = mallory->request((*p)->address(), f, deadline_after(5000ms));
    ASSERT_TRUE(answer);
    ASSERT_EQ(answer->type, FrameType::kError) << frame_type_name(f.type);
    EXPECT_NE(decode_error(answer->payload)->message.find("speaks only for itself"), std::string::npos);
  }
  EXPECT_TRUE((*p)->take_notifications().empty());
  EXPECT_EQ(*(*p)->peer_state("decode-0"), PeerState::kReady);
  EXPECT_TRUE(write_works());

  // D's own INVALIDATE (it sleeps): P drops the descriptor, and handshakes
  // again once D's regions are back.
  ASSERT_TRUE((*d)->invalidate_peers(deadline_after(5000ms)).all_acked());
  EXPECT_EQ(*(*p)->peer_state("decode-0"), PeerState::kInvalid);
  ASSERT_TRUE((*d)->deregister_region(*d_region));
  d_region = (*d)->register_region(d_mem.spec());
  ASSERT_TRUE(d_region);
  EXPECT_TRUE(write_works());
}

}  // namespace
}  // namespace siesta::transfer
