// HoldKey: who holds blocks in the BlockPool beyond their requests' own
// references (BlockPool::hold). The scheduler makes two kinds of hold, both
// for P/D: a finished request's blocks kept for the decode engine that reads
// them (kSend), and the blocks of a request aborted while a peer may still be
// writing its KV, kept until the P/D layer knows the write has ended (kLoad).
#pragma once

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace siesta {

using RequestId = std::string;

enum class HoldKind : uint8_t { kSend, kLoad };

struct HoldKey {
  HoldKind kind = HoldKind::kSend;
  RequestId request;
  auto operator<=>(const HoldKey&) const = default;
};

inline HoldKey send_hold_owner(const RequestId& id) { return {HoldKind::kSend, id}; }
inline HoldKey load_hold_owner(const RequestId& id) { return {HoldKind::kLoad, id}; }

// "send:ID" / "load:ID": how messages and logs name a hold.
inline std::string to_string(const HoldKey& key) {
  return (key.kind == HoldKind::kSend ? "send:" : "load:") + key.request;
}

struct HoldKeyHasher {
  size_t operator()(const HoldKey& key) const {
    return std::hash<std::string>{}(key.request) * 2 + static_cast<size_t>(key.kind);
  }
};

}  // namespace siesta
