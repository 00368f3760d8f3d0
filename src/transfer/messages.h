// Payloads of the side-channel frames (frame.h gives the framing). Each
// message has an encoder and a decoder; decoders refuse truncated input,
// trailing bytes and out-of-range fields, and never allocate more than the
// input's size.
//
//   GET_META   GetMetaMsg    → META (EngineMeta, engine_meta.h) or ERROR
//   INVALIDATE InvalidateMsg → ACK or ERROR (a stale epoch is refused)
//   NOTIFY     NotifyMsg     → ACK or ERROR (a stale epoch is refused)
//   MESSAGE    PeerMessage   → MESSAGE or ERROR (opaque to the engine)
//   HELLO      HelloMsg      → CHALLENGE or ERROR   } the handshake of an
//   AUTH       AuthMsg       (then the requests)    } authenticated connection (frame_auth.h)
#pragma once

#include <string>
#include <string_view>

#include "common/status.h"
#include "transfer/epoch.h"
#include "transfer/frame.h"

namespace siesta::transfer {

// "Send me your metadata; I listen at reply_address" (so I can be invalidated).
struct GetMetaMsg {
  std::string from_engine;
  std::string reply_address;
};

// "Drop your descriptor of engine_id at epoch (or older); ACK when nothing of
// mine is mapped or registered on your side any more."
struct InvalidateMsg {
  std::string engine_id;
  Epoch epoch;
};

struct AckMsg {
  std::string engine_id;  // who acknowledges
  Epoch epoch;            // the epoch acknowledged
};

// Sent by the initiator of a transfer after its data is complete at the target.
struct NotifyMsg {
  std::string from_engine;
  Epoch target_epoch;  // the target's epoch in the descriptor the transfer used
  std::string payload;
};

struct ErrorMsg {
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
};

// An opaque message for a handler the engine's user registers (TransferEngine::set_message_handler).
struct PeerMessage {
  std::string from_engine;
  std::string payload;
};

// Authentication (frame_auth.h says what the proofs are).
struct HelloMsg {
  std::string engine_id;  // the client's
  std::string nonce;      // kAuthNonceBytes
};

struct ChallengeMsg {
  std::string engine_id;  // the server's
  std::string nonce;
  std::string proof;      // the server knows the key
};

struct AuthMsg {
  std::string proof;      // the client knows the key
};

Frame to_frame(const HelloMsg& m);
Frame to_frame(const ChallengeMsg& m);
Frame to_frame(const AuthMsg& m);
Result<HelloMsg> decode_hello(std::string_view payload);
Result<ChallengeMsg> decode_challenge(std::string_view payload);
Result<AuthMsg> decode_auth(std::string_view payload);

Frame to_frame(const GetMetaMsg& m);
Frame to_frame(const InvalidateMsg& m);
Frame to_frame(const AckMsg& m);
Frame to_frame(const NotifyMsg& m);
Frame to_frame(const ErrorMsg& m);
Frame to_frame(const PeerMessage& m);
inline Frame error_frame(const Status& s) { return to_frame(ErrorMsg{s.code, s.message}); }

Result<GetMetaMsg> decode_get_meta(std::string_view payload);
Result<InvalidateMsg> decode_invalidate(std::string_view payload);
Result<AckMsg> decode_ack(std::string_view payload);
Result<NotifyMsg> decode_notify(std::string_view payload);
Result<ErrorMsg> decode_error(std::string_view payload);
Result<PeerMessage> decode_peer_message(std::string_view payload);

// The Status for an answer that is not the one a `request` frame expects: an
// ERROR frame becomes the Status it carries (prefixed with who sent it), any
// other frame type a kCorrupt "unexpected answer".
Status status_from_unexpected(const Frame& answer, FrameType request, std::string_view peer);

}  // namespace siesta::transfer
