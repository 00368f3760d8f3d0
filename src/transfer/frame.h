// Side-channel frames: the unit every control message travels in.
//
//   offset 0  u32 magic   'S' 'I' 'E' 'S'
//          4  u16 version kFrameVersion
//          6  u16 type    FrameType
//          8  u32 length  payload bytes that follow (at most the receiver's limit)
//         12  payload     (layout per type: messages.h)
//
// A receiver parses with FrameParser, which rejects a wrong magic, another
// version, an unknown type or a length over its limit before reading (or
// allocating for) the payload. A rejected stream is not resynchronised: the
// connection is closed.
#pragma once

#include <cstdint>
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
};

const char* frame_type_name(FrameType type);

struct Frame {
  FrameType type = FrameType::kError;
  std::string payload;
};

// Header and payload, ready to write.
std::string encode_frame(FrameType type, std::string_view payload);
inline std::string encode_frame(const Frame& f) { return encode_frame(f.type, f.payload); }

// Incremental parser for a byte stream of frames.
class FrameParser {
 public:
  explicit FrameParser(uint32_t max_payload_bytes = kDefaultMaxFramePayload) : max_payload_(max_payload_bytes) {}

  void feed(std::string_view bytes) { buf_.append(bytes); }
  // The next complete frame; nullopt when more bytes are needed; an error
  // (kCorrupt) when the stream is malformed. After an error the parser stays
  // failed and returns the same error.
  Result<std::optional<Frame>> next();
  // Bytes received but not yet returned as a frame.
  size_t buffered() const { return buf_.size() - pos_; }

 private:
  std::string buf_;
  size_t pos_ = 0;
  uint32_t max_payload_;
  std::optional<Status> failed_;
};

}  // namespace siesta::transfer
