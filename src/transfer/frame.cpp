#include "transfer/frame.h"

#include <fmt/format.h>

#include <algorithm>

#include "transfer/wire.h"

namespace siesta::transfer {

const char* frame_type_name(FrameType type) {
  switch (type) {
    case FrameType::kGetMeta: return "GET_META";
    case FrameType::kMeta: return "META";
    case FrameType::kInvalidate: return "INVALIDATE";
    case FrameType::kAck: return "ACK";
    case FrameType::kNotify: return "NOTIFY";
    case FrameType::kError: return "ERROR";
    case FrameType::kMessage: return "MESSAGE";
    case FrameType::kHello: return "HELLO";
    case FrameType::kChallenge: return "CHALLENGE";
    case FrameType::kAuth: return "AUTH";
  }
  return "UNKNOWN";
}

static bool known_frame_type(uint16_t t) {
  return t >= static_cast<uint16_t>(FrameType::kGetMeta) && t <= static_cast<uint16_t>(FrameType::kAuth);
}

uint32_t frame_payload_limit(FrameType type, uint32_t bulk_limit) {
  switch (type) {
    case FrameType::kMeta:
    case FrameType::kNotify:
    case FrameType::kMessage:
      return bulk_limit;
    case FrameType::kError:
      return std::min<uint32_t>(bulk_limit, 64u << 10);
    case FrameType::kGetMeta:
    case FrameType::kInvalidate:
    case FrameType::kAck:
    case FrameType::kHello:
    case FrameType::kChallenge:
    case FrameType::kAuth:
      break;
  }
  return std::min<uint32_t>(bulk_limit, 4096);  // two ids of at most 1 KiB and a few words
}

std::string encode_frame_header(FrameType type, size_t payload_bytes) {
  WireWriter w;
  w.u32(kFrameMagic);
  w.u16(kFrameVersion);
  w.u16(static_cast<uint16_t>(type));
  w.u32(static_cast<uint32_t>(payload_bytes));
  return w.take();
}

std::string encode_frame(FrameType type, std::string_view payload) {
  std::string out = encode_frame_header(type, payload.size());
  out.append(payload);
  return out;
}

void FrameParser::expect(FrameTypes types, uint32_t max_payload, size_t mac_bytes) {
  allowed_ = types;
  cap_ = max_payload;
  mac_bytes_ = mac_bytes;
}

Result<std::optional<Frame>> FrameParser::next() {
  if (failed_) return *failed_;
  if (buffered() < kFrameHeaderBytes) return std::optional<Frame>{};
  WireReader r(std::string_view(buf_).substr(pos_, kFrameHeaderBytes));
  uint32_t magic = r.u32();
  uint16_t version = r.u16();
  uint16_t type = r.u16();
  uint32_t length = r.u32();
  if (magic != kFrameMagic) {
    failed_ = corrupt(fmt::format("not a siesta side-channel stream (magic {:#010x}); is another service on this port?", magic));
  } else if (version != kFrameVersion) {
    failed_ = corrupt(fmt::format("side-channel version {} (this build speaks {}); run the same siesta version on both engines",
                                  version, kFrameVersion));
  } else if (!known_frame_type(type)) {
    failed_ = corrupt(fmt::format("unknown side-channel frame type {}", type));
  } else if ((allowed_ & (FrameTypes{1} << type)) == 0) {
    failed_ = corrupt(fmt::format("a {} frame is not expected here", frame_type_name(static_cast<FrameType>(type))));
  } else if (const uint32_t limit = std::min(frame_payload_limit(static_cast<FrameType>(type), max_payload_), cap_);
             length > limit) {
    failed_ = corrupt(fmt::format("side-channel {} frame of {} bytes exceeds the limit of {} bytes for its type",
                                  frame_type_name(static_cast<FrameType>(type)), length, limit));
  }
  if (failed_) return *failed_;
  const size_t frame_bytes = kFrameHeaderBytes + length + mac_bytes_;
  if (buffered() < frame_bytes) {
    // Room for this frame once, now that its length is known to be allowed
    // (appending would grow the buffer to twice what it needs).
    if (!reserved_ && frame_bytes > (64u << 10)) {
      if (pos_ > 0) {
        buf_.erase(0, pos_);
        pos_ = 0;
      }
      buf_.reserve(frame_bytes);
      reserved_ = true;
    }
    return std::optional<Frame>{};
  }
  Frame f;
  f.type = static_cast<FrameType>(type);
  f.payload = buf_.substr(pos_ + kFrameHeaderBytes, length);
  if (mac_bytes_ > 0) f.mac = buf_.substr(pos_ + kFrameHeaderBytes + length, mac_bytes_);
  pos_ += frame_bytes;
  reserved_ = false;
  if (pos_ == buf_.size()) {
    buf_.clear();
    pos_ = 0;
    // A large frame's buffer goes back once the frame is out.
    if (buf_.capacity() > (256u << 10)) buf_.shrink_to_fit();
  } else if (pos_ > (1u << 16) && pos_ > buf_.size() / 2) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  return std::optional<Frame>{std::move(f)};
}

}  // namespace siesta::transfer
