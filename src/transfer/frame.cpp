#include "transfer/frame.h"

#include <fmt/format.h>

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
  }
  return "UNKNOWN";
}

static bool known_frame_type(uint16_t t) {
  return t >= static_cast<uint16_t>(FrameType::kGetMeta) && t <= static_cast<uint16_t>(FrameType::kMessage);
}

std::string encode_frame(FrameType type, std::string_view payload) {
  WireWriter w;
  w.u32(kFrameMagic);
  w.u16(kFrameVersion);
  w.u16(static_cast<uint16_t>(type));
  w.u32(static_cast<uint32_t>(payload.size()));
  w.raw(payload);
  return w.take();
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
  } else if (length > max_payload_) {
    failed_ = corrupt(fmt::format("side-channel frame of {} bytes exceeds the limit of {} bytes", length, max_payload_));
  }
  if (failed_) return *failed_;
  if (buffered() < kFrameHeaderBytes + length) return std::optional<Frame>{};
  Frame f;
  f.type = static_cast<FrameType>(type);
  f.payload = buf_.substr(pos_ + kFrameHeaderBytes, length);
  pos_ += kFrameHeaderBytes + length;
  if (pos_ == buf_.size()) {
    buf_.clear();
    pos_ = 0;
  } else if (pos_ > (1u << 16) && pos_ > buf_.size() / 2) {
    buf_.erase(0, pos_);
    pos_ = 0;
  }
  return std::optional<Frame>{std::move(f)};
}

}  // namespace siesta::transfer
