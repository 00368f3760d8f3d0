// Epoch: a counter an engine bumps whenever its set of registered regions
// changes (register or deregister). Metadata, descriptors and notifications
// carry the epoch they were made under; anything naming an older epoch than
// the engine's current one is refused, so data is never trusted across a
// sleep/wake cycle.
#pragma once

#include <compare>
#include <cstdint>

namespace siesta::transfer {

struct Epoch {
  uint64_t value = 0;

  Epoch next() const { return Epoch{value + 1}; }
  friend auto operator<=>(Epoch, Epoch) = default;
};

}  // namespace siesta::transfer
