#include "transfer/ucx/staged_messages.h"

#include <string_view>

#include "transfer/wire.h"

namespace siesta::transfer::ucx {

namespace {
constexpr size_t kMaxMessageBytes = 1024;
constexpr uint8_t kOkCode = 0xff;
}  // namespace

std::string encode_staged_request(const StagedRequest& r) {
  WireWriter w;
  w.u64(r.initiator);
  w.u64(r.token);
  w.u64(r.region.value);
  w.u32(r.slot);
  w.u64(r.epoch.value);
  w.u64(r.offset);
  w.u64(r.bytes);
  w.u32(r.deadline_ms);
  return w.take();
}

Result<StagedRequest> decode_staged_request(const void* header, size_t bytes) {
  WireReader in(std::string_view(static_cast<const char*>(header), bytes));
  StagedRequest r;
  r.initiator = in.u64();
  r.token = in.u64();
  r.region.value = in.u64();
  r.slot = in.u32();
  r.epoch.value = in.u64();
  r.offset = in.u64();
  r.bytes = in.u64();
  r.deadline_ms = in.u32();
  if (!in.done()) return corrupt("a malformed staged-transfer request");
  return r;
}

std::string encode_staged_reply(const StagedReply& r) {
  WireWriter w;
  w.u64(r.token);
  if (r.result) {
    w.u8(kOkCode);
    w.bytes("");
  } else {
    w.u8(static_cast<uint8_t>(r.result.error().code));
    w.bytes(std::string_view(r.result.error().message).substr(0, kMaxMessageBytes));
  }
  return w.take();
}

Result<StagedReply> decode_staged_reply(const void* header, size_t bytes) {
  WireReader in(std::string_view(static_cast<const char*>(header), bytes));
  StagedReply r;
  r.token = in.u64();
  uint8_t code = in.u8();
  std::string message = in.bytes(kMaxMessageBytes);
  if (!in.done() || (code != kOkCode && code > static_cast<uint8_t>(ErrorCode::kInternal)))
    return corrupt("a malformed staged-transfer reply");
  if (code != kOkCode) r.result = Status{static_cast<ErrorCode>(code), std::move(message)};
  return r;
}

std::string encode_staged_hello(const StagedHello& h) {
  WireWriter w;
  w.u64(h.key);
  h.identity.encode(w);
  return w.take();
}

Result<StagedHello> decode_staged_hello(const void* header, size_t bytes) {
  WireReader in(std::string_view(static_cast<const char*>(header), bytes));
  StagedHello h;
  h.key = in.u64();
  h.identity = ProcessIdentity::decode(in);
  if (!in.done()) return corrupt("a malformed staged-transfer hello");
  return h;
}

std::string encode_initiator_key(uint64_t key) {
  WireWriter w;
  w.u64(key);
  return w.take();
}

Result<uint64_t> decode_initiator_key(const void* header, size_t bytes) {
  WireReader in(std::string_view(static_cast<const char*>(header), bytes));
  uint64_t key = in.u64();
  if (!in.done()) return corrupt("a malformed staged-transfer bye");
  return key;
}

}  // namespace siesta::transfer::ucx
