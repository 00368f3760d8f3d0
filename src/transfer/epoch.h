// Epoch: a counter an engine bumps whenever its set of registered regions
// changes (register or deregister). Metadata, descriptors and notifications
// carry the epoch they were made under; anything naming an older epoch than
// the engine's current one is refused, so data is never trusted across a
// sleep/wake cycle.
//
// An engine's first epoch is the wall clock at its start in microseconds
// (first_epoch()), not 1: an engine restarted under the same engine_id and
// address starts far past any epoch its previous process reached, so a peer
// that still holds the old process's descriptor sees another epoch at the
// first message naming the new one and handshakes again, instead of using a
// descriptor of memory that no longer exists.
#pragma once

#include <chrono>
#include <compare>
#include <cstdint>

namespace siesta::transfer {

struct Epoch {
  uint64_t value = 0;

  Epoch next() const { return Epoch{value + 1}; }
  friend auto operator<=>(Epoch, Epoch) = default;
};

inline Epoch first_epoch() {
  const auto since_unix = std::chrono::system_clock::now().time_since_epoch();
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(since_unix).count();
  return Epoch{us > 0 ? static_cast<uint64_t>(us) : 1};
}

}  // namespace siesta::transfer
