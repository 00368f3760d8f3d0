#include "transfer/ucx/guarded_messages.h"

#include <string_view>

#include "transfer/wire.h"

namespace siesta::transfer::ucx {

namespace {
constexpr size_t kRangeBytes = 8 + 4 + 8 + 8;
}  // namespace

uint64_t GuardedRequest::bytes() const {
  uint64_t n = 0;
  for (const GuardedRange& r : ranges) n += r.bytes;
  return n;
}

std::string encode_guarded_request(const GuardedRequest& r) {
  WireWriter w;
  w.u64(r.initiator);
  w.u64(r.token);
  w.u64(r.epoch.value);
  w.u64(r.expires_unix_ms);
  w.u32(static_cast<uint32_t>(r.ranges.size()));
  for (const GuardedRange& g : r.ranges) {
    w.u64(g.region.value);
    w.u32(g.slot);
    w.u64(g.offset);
    w.u64(g.bytes);
  }
  return w.take();
}

Result<GuardedRequest> decode_guarded_request(const void* header, size_t bytes) {
  WireReader in(std::string_view(static_cast<const char*>(header), bytes));
  GuardedRequest r;
  r.initiator = in.u64();
  r.token = in.u64();
  r.epoch.value = in.u64();
  r.expires_unix_ms = in.u64();
  uint32_t n = in.count(kRangeBytes, kGuardedMaxRanges);
  r.ranges.resize(n);
  uint64_t total = 0;
  bool sane = n > 0;
  for (GuardedRange& g : r.ranges) {
    g.region.value = in.u64();
    g.slot = in.u32();
    g.offset = in.u64();
    g.bytes = in.u64();
    if (g.bytes == 0 || total + g.bytes < total) sane = false;
    total += g.bytes;
  }
  if (!in.done() || !sane) return corrupt("a malformed guarded-transfer request");
  return r;
}

}  // namespace siesta::transfer::ucx
