// Side-channel framing and message codecs: what a peer (or anything else that
// connects to the port) can send us must never crash the parser, and every
// message survives a round trip.
#include <gtest/gtest.h>

#include <random>

#include "transfer/engine_meta.h"
#include "transfer/frame.h"
#include "transfer/messages.h"
#include "transfer/peer_state.h"
#include "transfer/wire.h"

namespace siesta::transfer {
namespace {

Frame parse_one(const std::string& bytes) {
  FrameParser p;
  p.feed(bytes);
  auto f = p.next();
  EXPECT_TRUE(f.has_value());
  EXPECT_TRUE(f->has_value());
  return **f;
}

TEST(TransferFrame, RoundTripsEveryMessage) {
  auto gm = decode_get_meta(parse_one(encode_frame(to_frame(GetMetaMsg{"d0", "127.0.0.1:9"}))).payload);
  ASSERT_TRUE(gm);
  EXPECT_EQ(gm->from_engine, "d0");
  EXPECT_EQ(gm->reply_address, "127.0.0.1:9");

  auto inv = decode_invalidate(parse_one(encode_frame(to_frame(InvalidateMsg{"p0", Epoch{7}}))).payload);
  ASSERT_TRUE(inv);
  EXPECT_EQ(inv->engine_id, "p0");
  EXPECT_EQ(inv->epoch, Epoch{7});

  auto ack = decode_ack(parse_one(encode_frame(to_frame(AckMsg{"d0", Epoch{7}}))).payload);
  ASSERT_TRUE(ack);
  EXPECT_EQ(ack->epoch, Epoch{7});

  std::string binary("\0\1\2payload", 10);
  auto n = decode_notify(parse_one(encode_frame(to_frame(NotifyMsg{"p0", Epoch{3}, binary}))).payload);
  ASSERT_TRUE(n);
  EXPECT_EQ(n->payload, binary);
  EXPECT_EQ(n->target_epoch, Epoch{3});

  auto e = decode_error(parse_one(encode_frame(error_frame(conflict("stale")))).payload);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code, ErrorCode::kConflict);
  EXPECT_EQ(e->message, "stale");

  auto m = decode_peer_message(parse_one(encode_frame(to_frame(PeerMessage{"d0", "hello"}))).payload);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->payload, "hello");
}

TEST(TransferFrame, MetadataRoundTripAndRejectsTrailingBytes) {
  EngineMeta meta;
  meta.engine_id = "prefill-0";
  meta.epoch = Epoch{42};
  meta.side_channel_address = "127.0.0.1:5555";
  meta.backend = "ucx";
  meta.backend_blob = std::string("\x01\x02\x00\x03", 4);
  meta.regions.push_back(RegionDesc{RegionId{1}, 0, 0x7f0000001000, 1 << 20, MemoryKind::kHost, "rkey"});
  meta.regions.push_back(RegionDesc{RegionId{9}, 3, 0x7f0000200000, 4096, MemoryKind::kCuda, ""});
  std::string bytes = encode_engine_meta(meta);
  auto back = decode_engine_meta(bytes);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->engine_id, meta.engine_id);
  EXPECT_EQ(back->epoch, meta.epoch);
  ASSERT_EQ(back->regions.size(), 2u);
  EXPECT_EQ(back->regions[1].id, RegionId{9});
  EXPECT_EQ(back->regions[1].slot, 3u);
  EXPECT_EQ(back->regions[1].kind, MemoryKind::kCuda);
  EXPECT_EQ(back->regions[0].backend_blob, "rkey");
  EXPECT_FALSE(decode_engine_meta(bytes + "x"));
  for (size_t cut = 0; cut < bytes.size(); ++cut) EXPECT_FALSE(decode_engine_meta(bytes.substr(0, cut))) << cut;
}

TEST(TransferFrame, ParsesFramesSplitAtEveryByte) {
  std::string stream = encode_frame(to_frame(PeerMessage{"a", "first"})) + encode_frame(to_frame(AckMsg{"b", Epoch{1}}));
  FrameParser p;
  std::vector<Frame> got;
  for (char c : stream) {
    p.feed(std::string_view(&c, 1));
    for (;;) {
      auto f = p.next();
      ASSERT_TRUE(f);
      if (!*f) break;
      got.push_back(**f);
    }
  }
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].type, FrameType::kMessage);
  EXPECT_EQ(got[1].type, FrameType::kAck);
  EXPECT_EQ(p.buffered(), 0u);
}

TEST(TransferFrame, RefusesOversizedFrameBeforeItsPayloadArrives) {
  WireWriter w;
  w.u32(kFrameMagic);
  w.u16(kFrameVersion);
  w.u16(static_cast<uint16_t>(FrameType::kMessage));
  w.u32(1u << 30);
  FrameParser p(1 << 20);
  p.feed(w.data());
  auto f = p.next();
  ASSERT_FALSE(f);
  EXPECT_EQ(f.error().code, ErrorCode::kCorrupt);
  EXPECT_NE(f.error().message.find("exceeds the limit"), std::string::npos);
  EXPECT_FALSE(p.next());  // stays failed
}

TEST(TransferFrame, RefusesWrongMagicVersionAndType) {
  std::string good = encode_frame(to_frame(AckMsg{"x", Epoch{1}}));
  std::string bad_magic = good;
  bad_magic[0] = 'G';
  std::string bad_version = good;
  bad_version[4] = 9;
  std::string bad_type = good;
  bad_type[6] = 99;
  for (const std::string& s : {bad_magic, bad_version, bad_type}) {
    FrameParser p;
    p.feed(s);
    EXPECT_FALSE(p.next());
  }
  FrameParser http;
  http.feed("GET / HTTP/1.1\r\n\r\n");
  auto f = http.next();
  ASSERT_FALSE(f);
  EXPECT_NE(f.error().message.find("not a siesta side-channel stream"), std::string::npos);
}

TEST(TransferFrame, DecodersRefuseTruncatedAndHostileLengths) {
  EXPECT_FALSE(decode_get_meta(""));
  EXPECT_FALSE(decode_invalidate(std::string("\x05\x00\x00\x00ab", 6)));
  EXPECT_FALSE(decode_error(std::string("\x63\x00\x00\x00\x00", 5)));  // unknown error code
  WireWriter w;
  w.bytes("e");
  w.u64(1);
  w.bytes("x");
  w.raw("trailing");
  EXPECT_FALSE(decode_notify(w.data()));
  // A region count of 2^32-1 with no bytes behind it must not allocate.
  WireWriter m;
  m.bytes("e");
  m.u64(1);
  m.bytes("a");
  m.bytes("ipc");
  m.bytes("");
  m.u32(0xffffffffu);
  EXPECT_FALSE(decode_engine_meta(m.data()));
}

TEST(TransferFrame, RandomBytesNeverCrash) {
  std::mt19937 rng(1234);
  for (int i = 0; i < 2000; ++i) {
    std::string junk(rng() % 64, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    // Sometimes start with a valid header so the payload decoders get exercised.
    if (i % 2 == 0) junk = encode_frame(static_cast<FrameType>(1 + rng() % 7), junk);
    FrameParser p(1024);
    p.feed(junk);
    auto f = p.next();
    if (f && *f) {
      (void)decode_get_meta((*f)->payload);
      (void)decode_invalidate((*f)->payload);
      (void)decode_ack((*f)->payload);
      (void)decode_notify((*f)->payload);
      (void)decode_error((*f)->payload);
      (void)decode_peer_message((*f)->payload);
      (void)decode_engine_meta((*f)->payload);
    }
  }
}

TEST(TransferPeerState, TransitionTableMatchesTheDocumentedOne) {
  using S = PeerState;
  using E = PeerEvent;
  struct Row {
    S from;
    E event;
    S to;
  } rows[] = {
      {S::kReady, E::kHandshake, S::kReady},       {S::kReady, E::kInvalidated, S::kInvalid},
      {S::kReady, E::kTransferFailed, S::kError},  {S::kInvalid, E::kHandshake, S::kReady},
      {S::kInvalid, E::kInvalidated, S::kInvalid}, {S::kInvalid, E::kTransferFailed, S::kInvalid},
      {S::kError, E::kHandshake, S::kReady},       {S::kError, E::kInvalidated, S::kError},
      {S::kError, E::kTransferFailed, S::kError},
  };
  for (const Row& r : rows)
    EXPECT_EQ(next_peer_state(r.from, r.event), r.to)
        << peer_state_name(r.from) << " + " << peer_event_name(r.event);
}

}  // namespace
}  // namespace siesta::transfer
