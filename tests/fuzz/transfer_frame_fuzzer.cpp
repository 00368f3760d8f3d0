// libFuzzer target: bytes from the network into the side channel's parser and
// the message decoders must never crash, leak or allocate without bound, and
// whatever decodes must encode back to the same bytes. The handshake of an
// authenticated side channel (frame_auth.h) on such bytes never completes,
// and no frame of them passes a session's MAC check.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "transfer/engine_meta.h"
#include "transfer/frame.h"
#include "transfer/frame_auth.h"
#include "transfer/messages.h"
#include "transfer/region_table.h"

using namespace siesta::transfer;

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

// Decodes a payload as its frame type says and checks the round trip.
void decode(const Frame& f) {
  switch (f.type) {
    case FrameType::kGetMeta:
      if (auto m = decode_get_meta(f.payload)) require(to_frame(*m).payload == f.payload);
      break;
    case FrameType::kMeta:
      if (auto m = decode_engine_meta(f.payload)) require(encode_engine_meta(*m) == f.payload);
      break;
    case FrameType::kInvalidate:
      if (auto m = decode_invalidate(f.payload)) require(to_frame(*m).payload == f.payload);
      break;
    case FrameType::kAck:
      if (auto m = decode_ack(f.payload)) require(to_frame(*m).payload == f.payload);
      break;
    case FrameType::kNotify:
      if (auto m = decode_notify(f.payload)) require(to_frame(*m).payload == f.payload);
      break;
    case FrameType::kError:
      if (auto m = decode_error(f.payload)) require(to_frame(*m).payload == f.payload);
      break;
    case FrameType::kMessage:
      if (auto m = decode_peer_message(f.payload)) require(to_frame(*m).payload == f.payload);
      break;
    case FrameType::kHello:
      if (auto m = decode_hello(f.payload)) require(to_frame(*m).payload == f.payload);
      break;
    case FrameType::kChallenge:
      if (auto m = decode_challenge(f.payload)) require(to_frame(*m).payload == f.payload);
      break;
    case FrameType::kAuth:
      if (auto m = decode_auth(f.payload)) require(to_frame(*m).payload == f.payload);
      break;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view in(reinterpret_cast<const char*>(data), size);
  // The stream parser, fed in two pieces (the first byte picks the split),
  // with a small limit so oversized frames are exercised too.
  size_t split = size == 0 ? 0 : static_cast<uint8_t>(in[0]) % (size + 1);
  FrameParser parser(2048);
  parser.feed(in.substr(0, split));
  for (int round = 0; round < 2; ++round) {
    for (;;) {
      auto f = parser.next();
      if (!f || !*f) break;
      require(encode_frame(**f).size() == kFrameHeaderBytes + (*f)->payload.size());
      decode(**f);
    }
    parser.feed(in.substr(split));
  }
  // Every decoder on the raw bytes as a payload.
  for (uint16_t t = 1; t <= 10; ++t) decode(Frame{static_cast<FrameType>(t), std::string(in)});
  // Authentication: a server never accepts these bytes as a HELLO then AUTH
  // without the key, and a session opens none of their frames.
  const std::string key = "fuzzing key, 32 bytes long......";
  ServerHandshake server(key, "server");
  if (server.challenge(Frame{FrameType::kHello, std::string(in)}))
    require(!server.verify(Frame{FrameType::kAuth, std::string(in)}));
  FrameSession session(key, key);
  FrameParser sealed(2048);
  sealed.expect(kAllFrameTypes, UINT32_MAX, kAuthMacBytes);
  sealed.feed(in);
  for (auto f = sealed.next(); f && *f; f = sealed.next()) require(!session.open(**f));
  // The region-table check on arbitrary words (what a ucx peer fetches).
  std::vector<uint64_t> words(size / 8 + 1, 0);
  for (size_t i = 0; i < size; ++i) words[i / 8] |= static_cast<uint64_t>(data[i]) << (8 * (i % 8));
  (void)check_region_live(words.data(), words.size(), size > 0 ? data[0] : 0, RegionId{size}, Epoch{size / 2});
  return 0;
}
