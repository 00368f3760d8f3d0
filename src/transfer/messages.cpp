#include "transfer/messages.h"

#include <fmt/format.h>

#include "transfer/wire.h"

namespace siesta::transfer {

namespace {
constexpr size_t kMaxIdBytes = 1024;

Status truncated(FrameType t) { return corrupt(fmt::format("malformed {} payload", frame_type_name(t))); }
}  // namespace

Frame to_frame(const GetMetaMsg& m) {
  WireWriter w;
  w.bytes(m.from_engine);
  w.bytes(m.reply_address);
  return {FrameType::kGetMeta, w.take()};
}

Frame to_frame(const InvalidateMsg& m) {
  WireWriter w;
  w.bytes(m.engine_id);
  w.u64(m.epoch.value);
  return {FrameType::kInvalidate, w.take()};
}

Frame to_frame(const AckMsg& m) {
  WireWriter w;
  w.bytes(m.engine_id);
  w.u64(m.epoch.value);
  return {FrameType::kAck, w.take()};
}

Frame to_frame(const NotifyMsg& m) {
  WireWriter w;
  w.bytes(m.from_engine);
  w.u64(m.target_epoch.value);
  w.bytes(m.payload);
  return {FrameType::kNotify, w.take()};
}

Frame to_frame(const ErrorMsg& m) {
  WireWriter w;
  w.u8(static_cast<uint8_t>(m.code));
  w.bytes(m.message);
  return {FrameType::kError, w.take()};
}

Frame to_frame(const PeerMessage& m) {
  WireWriter w;
  w.bytes(m.from_engine);
  w.bytes(m.payload);
  return {FrameType::kMessage, w.take()};
}

Result<GetMetaMsg> decode_get_meta(std::string_view payload) {
  WireReader r(payload);
  GetMetaMsg m{r.bytes(kMaxIdBytes), r.bytes(kMaxIdBytes)};
  if (!r.done() || m.from_engine.empty()) return truncated(FrameType::kGetMeta);
  return m;
}

Result<InvalidateMsg> decode_invalidate(std::string_view payload) {
  WireReader r(payload);
  InvalidateMsg m;
  m.engine_id = r.bytes(kMaxIdBytes);
  m.epoch.value = r.u64();
  if (!r.done() || m.engine_id.empty()) return truncated(FrameType::kInvalidate);
  return m;
}

Result<AckMsg> decode_ack(std::string_view payload) {
  WireReader r(payload);
  AckMsg m;
  m.engine_id = r.bytes(kMaxIdBytes);
  m.epoch.value = r.u64();
  if (!r.done()) return truncated(FrameType::kAck);
  return m;
}

Result<NotifyMsg> decode_notify(std::string_view payload) {
  WireReader r(payload);
  NotifyMsg m;
  m.from_engine = r.bytes(kMaxIdBytes);
  m.target_epoch.value = r.u64();
  m.payload = r.bytes();
  if (!r.done() || m.from_engine.empty()) return truncated(FrameType::kNotify);
  return m;
}

Result<ErrorMsg> decode_error(std::string_view payload) {
  WireReader r(payload);
  uint8_t code = r.u8();
  ErrorMsg m;
  m.message = r.bytes();
  if (!r.done() || code > static_cast<uint8_t>(ErrorCode::kInternal)) return truncated(FrameType::kError);
  m.code = static_cast<ErrorCode>(code);
  return m;
}

Result<PeerMessage> decode_peer_message(std::string_view payload) {
  WireReader r(payload);
  PeerMessage m;
  m.from_engine = r.bytes(kMaxIdBytes);
  m.payload = r.bytes();
  if (!r.done()) return truncated(FrameType::kMessage);
  return m;
}

namespace {
constexpr size_t kNonceBytes = 16;
constexpr size_t kProofBytes = 32;
}  // namespace

Frame to_frame(const HelloMsg& m) {
  WireWriter w;
  w.bytes(m.engine_id);
  w.bytes(m.nonce);
  return {FrameType::kHello, w.take()};
}

Frame to_frame(const ChallengeMsg& m) {
  WireWriter w;
  w.bytes(m.engine_id);
  w.bytes(m.nonce);
  w.bytes(m.proof);
  return {FrameType::kChallenge, w.take()};
}

Frame to_frame(const AuthMsg& m) {
  WireWriter w;
  w.bytes(m.proof);
  return {FrameType::kAuth, w.take()};
}

Result<HelloMsg> decode_hello(std::string_view payload) {
  WireReader r(payload);
  HelloMsg m;
  m.engine_id = r.bytes(kMaxIdBytes);
  m.nonce = r.bytes(kNonceBytes);
  if (!r.done() || m.engine_id.empty() || m.nonce.size() != kNonceBytes) return truncated(FrameType::kHello);
  return m;
}

Result<ChallengeMsg> decode_challenge(std::string_view payload) {
  WireReader r(payload);
  ChallengeMsg m;
  m.engine_id = r.bytes(kMaxIdBytes);
  m.nonce = r.bytes(kNonceBytes);
  m.proof = r.bytes(kProofBytes);
  if (!r.done() || m.engine_id.empty() || m.nonce.size() != kNonceBytes || m.proof.size() != kProofBytes)
    return truncated(FrameType::kChallenge);
  return m;
}

Result<AuthMsg> decode_auth(std::string_view payload) {
  WireReader r(payload);
  AuthMsg m;
  m.proof = r.bytes(kProofBytes);
  if (!r.done() || m.proof.size() != kProofBytes) return truncated(FrameType::kAuth);
  return m;
}

Status status_from_unexpected(const Frame& answer, FrameType request, std::string_view peer) {
  if (answer.type == FrameType::kError) {
    auto e = decode_error(answer.payload);
    if (!e) return e.error().with_context(fmt::format("peer {}", peer));
    return Status{e->code, fmt::format("peer {}: {}", peer, e->message)};
  }
  return corrupt(fmt::format("peer {} answered {} with {}", peer, frame_type_name(request), frame_type_name(answer.type)));
}

}  // namespace siesta::transfer
