// Side-channel frames: the unit every control message travels in.
//
//   offset 0  u32 magic   'S' 'I' 'E' 'S'
//          4  u16 version kFrameVersion
//          6  u16 type    FrameType
//          8  u32 length  payload bytes that follow (at most the receiver's limit)
//         12  payload     (layout per type: messages.h)
//
// A receiver parses with FrameParser, which rejects a wrong magic, another
// version, an unknown type, a type the stream may not carry now, or a length
// over what that type allows before reading (or allocating for) the payload:
// control frames are small (frame_payload_limit), only META, NOTIFY and
// MESSAGE may carry up to the receiver's bulk limit. A rejected stream is not
// resynchronised: the connection is closed.
//
// On an authenticated connection (frame_auth.h) every frame after the
// handshake (HELLO, CHALLENGE, AUTH) is followed by a 32-byte MAC of its
// header and payload, which the parser returns in Frame::mac.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace siesta::transfer {

inline constexpr uint32_t kFrameMagic = 0x53454953;  // "SIES" in little-endian byte order
inline constexpr uint16_t kFrameVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 12;
inline constexpr uint32_t kDefaultMaxFramePayload = 4u << 20;

enum class FrameType : uint16_t {
  kGetMeta = 1,     // request: GetMetaMsg; answer: kMeta
  kMeta = 2,        // answer: EngineMeta
  kInvalidate = 3,  // request: InvalidateMsg; answer: kAck or kError
  kAck = 4,         // answer: AckMsg
  kNotify = 5,      // request: NotifyMsg; answer: kAck or kError
  kError = 6,       // answer: ErrorMsg
  kMessage = 7,     // request and answer: PeerMessage, opaque to the engine (the P/D protocol)
  kHello = 8,       // authentication, client to server: HelloMsg
  kChallenge = 9,   // authentication, server to client: ChallengeMsg
  kAuth = 10,       // authentication, client to server: AuthMsg (then the requests)
};

const char* frame_type_name(FrameType type);

// A set of frame types (bit 1 << type).
using FrameTypes = uint32_t;
constexpr FrameTypes frame_types(std::initializer_list<FrameType> types) {
  FrameTypes set = 0;
  for (FrameType t : types) set |= FrameTypes{1} << static_cast<uint16_t>(t);
  return set;
}
inline constexpr FrameTypes kAllFrameTypes = ~FrameTypes{0};
// What a side channel's listener accepts, and what its requests are answered with.
inline constexpr FrameTypes kRequestFrames =
    frame_types({FrameType::kGetMeta, FrameType::kInvalidate, FrameType::kNotify, FrameType::kMessage});
inline constexpr FrameTypes kAnswerFrames =
    frame_types({FrameType::kMeta, FrameType::kAck, FrameType::kError, FrameType::kMessage});

// The most payload bytes a frame of `type` may carry: what its message can
// hold for control frames (a few KiB), `bulk_limit` for META, NOTIFY and MESSAGE.
uint32_t frame_payload_limit(FrameType type, uint32_t bulk_limit);

struct Frame {
  FrameType type = FrameType::kError;
  std::string payload;
  std::string mac;  // received on an authenticated connection: the MAC that followed
};

// Header and payload, ready to write.
std::string encode_frame(FrameType type, std::string_view payload);
// The 12 header bytes alone (what a MAC covers with the payload).
std::string encode_frame_header(FrameType type, size_t payload_bytes);
inline std::string encode_frame(const Frame& f) { return encode_frame(f.type, f.payload); }

// Incremental parser for a byte stream of frames.
class FrameParser {
 public:
  explicit FrameParser(uint32_t max_payload_bytes = kDefaultMaxFramePayload) : max_payload_(max_payload_bytes) {}

  void feed(std::string_view bytes) { buf_.append(bytes); }
  // From the next frame on: only `types` may come, each with at most
  // min(frame_payload_limit(type), max_payload) bytes of payload (the
  // constructor's limit stays the bulk limit), followed by mac_bytes of MAC.
  void expect(FrameTypes types, uint32_t max_payload = UINT32_MAX, size_t mac_bytes = 0);
  // The next complete frame; nullopt when more bytes are needed; an error
  // (kCorrupt) when the stream is malformed. After an error the parser stays
  // failed and returns the same error.
  Result<std::optional<Frame>> next();
  // Bytes received but not yet returned as a frame.
  size_t buffered() const { return buf_.size() - pos_; }
  // Bytes the parser's buffer holds allocated (what a peer costs us).
  size_t capacity() const { return buf_.capacity(); }

 private:
  std::string buf_;
  size_t pos_ = 0;
  uint32_t max_payload_;
  FrameTypes allowed_ = kAllFrameTypes;
  uint32_t cap_ = UINT32_MAX;
  size_t mac_bytes_ = 0;
  bool reserved_ = false;  // the buffer is sized for the frame whose header was checked
  std::optional<Status> failed_;
};

}  // namespace siesta::transfer
