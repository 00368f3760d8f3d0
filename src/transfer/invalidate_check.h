// Whether an INVALIDATE is plausible before an engine acts on it: it must come
// from the engine it names and name an epoch that follows the one we hold of
// that engine. An engine told to drop a peer's descriptor with an epoch far
// ahead would refuse every handshake with that peer until then; one told by a
// third party would drop a healthy peer.
//
//   SIESTA_TRY(check_invalidate(msg, from, held_epoch, known_address));
//
// `from` is who sent it: on an authenticated side channel the engine id the
// sender proved, which must be msg.engine_id; without authentication only its
// address, whose host must be the named engine's (when we know that engine's
// side channel by a numeric, specific address). `held` is the epoch of our
// descriptor of the named engine, if we hold one: an older epoch is stale
// (kConflict), one more than kInvalidateEpochSlack ahead is refused. A pure
// function.
#pragma once

#include <optional>
#include <string>

#include "common/status.h"
#include "transfer/epoch.h"
#include "transfer/messages.h"
#include "transfer/side_channel.h"

namespace siesta::transfer {

// Epochs move by one per region registered or deregistered; a peer invalidates
// at its current epoch, which is the one we fetched unless it changed its
// regions since. No engine changes its regions this often between a fetch
// and an invalidation.
inline constexpr uint64_t kInvalidateEpochSlack = 1024;

Result<void> check_invalidate(const InvalidateMsg& msg, const RequestOrigin& from, std::optional<Epoch> held,
                              const std::string& known_address);

// Whether a GET_META, NOTIFY or MESSAGE that says it comes from `claimed` was
// sent by that engine: on an authenticated side channel the id its sender
// proved must be `claimed` (a peer holding the key may not speak for another
// engine: register a reply address under its name, deliver notifications
// or P/D messages as it); without authentication there is nothing to compare.
Result<void> check_sender(FrameType type, const std::string& claimed, const RequestOrigin& from);

}  // namespace siesta::transfer
