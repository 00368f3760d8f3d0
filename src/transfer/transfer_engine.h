// TransferEngine: siesta's KV data plane. One per serving engine; it owns the
// side channel (control plane), the registered regions, its view of peers,
// and one backend (ipc or ucx) that moves the bytes.
//
// Lifecycle, in order:
//   1. create(config): listen on the side channel, start the backend.
//   2. register_region(spec) for each piece of memory peers may read or write
//      (the KV cache). Every register/deregister bumps the epoch.
//   3. Publish address() (and engine_id()) to peers, e.g. in kv_transfer_params.
//   4. connect(peer_address, deadline): GET_META, import the peer's regions.
//      The peer records us (and our address) as a fetcher of its metadata.
//   5. submit(peer, READ|WRITE, entries, notify, deadline) → XferId; then
//      poll(id) or wait(id, deadline) until done or failed. A notification,
//      if given, reaches the target after the data; the target collects it
//      with take_notifications() / wait_notifications().
//      Opaque messages (the P/D protocol) go with send_message(); a peer's
//      arrive at the handler set with set_message_handler().
//   6. Before freeing region memory (sleep): invalidate_peers(deadline), then
//      deregister_region(id). Every peer that ACKed has unmapped our memory.
//      After the memory is back: register_region again; peers handshake again
//      on their next use (they were left kInvalid).
//   7. Destruction: stops the side channel, fails transfers still pending and
//      releases everything imported from peers.
//
// Peers are ready / invalid / error (peer_state.h). Epochs (epoch.h) make a
// descriptor, notification or INVALIDATE from before a change of regions
// fail instead of touching the wrong bytes.
//
// Threads: every public method may be called from any thread, concurrently,
// except the destructor (no call may be in progress). Handlers given to
// set_message_handler run on side-channel threads and must not block past
// their own deadlines. Nothing here waits without a deadline.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "transfer/engine_meta.h"
#include "transfer/epoch.h"
#include "transfer/messages.h"
#include "transfer/peer_state.h"
#include "transfer/region.h"
#include "transfer/transfer_config.h"
#include "transfer/xfer.h"

namespace siesta::transfer {

// An engine that fetched our metadata, so it may hold our memory mapped.
struct MetaFetcher {
  std::string engine_id;
  std::string address;  // its side-channel listener
};

// Counters of the control plane, for metrics (stats()).
struct TransferStats {
  uint64_t invalidations_sent = 0;        // INVALIDATE frames we sent (one per fetcher per invalidate_peers)
  uint64_t invalidation_acks = 0;         // ... that the peer acknowledged
  uint64_t invalidations_unanswered = 0;  // ... that got no ACK before the deadline (or a refusal)
  uint64_t invalidations_received = 0;    // INVALIDATE frames peers sent us that we acknowledged
  uint64_t handshakes = 0;                // peer metadata fetched and installed (connect)
  uint64_t epoch = 0;                     // our current epoch
};

struct InvalidateReport {
  std::vector<std::string> acked;          // engine ids that dropped our memory
  std::vector<MetaFetcher> unanswered;     // no ACK before the deadline (or refused)
  std::vector<Status> why_unanswered;      // one per unanswered, same order
  bool all_acked() const { return unanswered.empty(); }
};

// Answers an opaque MESSAGE from a peer; an error is sent back as ERROR.
using MessageHandler = std::function<Result<std::string>(const PeerMessage& message)>;

class TransferEngine {
 public:
  static Result<std::unique_ptr<TransferEngine>> create(const TransferConfig& config);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  const std::string& engine_id() const;
  // host:port of our side channel.
  const std::string& address() const;
  bool supports_sleep() const;

  // --- regions (step 2 and 6) ---
  Result<RegionId> register_region(const RegionSpec& spec);
  // kConflict while transfers of ours still use the region; kNotFound for an
  // unknown id. Peers are not told: call invalidate_peers() first.
  Ok deregister_region(RegionId id);
  EngineMeta metadata() const;
  Epoch epoch() const;

  // --- peers (step 4) ---
  // Handshakes with the engine whose side channel listens at `address`;
  // returns its engine id. Also the way out of the error state.
  Result<std::string> connect(const std::string& address, Deadline deadline);
  Result<PeerState> peer_state(const std::string& engine_id) const;
  // The descriptor we hold of a peer (its metadata at its epoch).
  Result<EngineMeta> peer_meta(const std::string& engine_id) const;

  // --- transfers (step 5) ---
  // Validates `entries` (regions known, ranges in bounds) and starts the
  // transfer. A peer in the error state fails fast (kUnavailable); an invalid
  // peer is handshaken again first. The transfer fails if not done by `deadline`.
  Result<XferId> submit(const std::string& peer, XferOp op, const std::vector<XferEntry>& entries,
                        std::optional<std::string> notify, Deadline deadline);
  // As submit with a notification, whose payload set_notification(id, ...)
  // gives later (e.g. encoded while the bytes move): it goes out once the
  // bytes are in place and the payload is set. A transfer whose payload
  // never comes fails at its deadline.
  Result<XferId> submit_notify_later(const std::string& peer, XferOp op, const std::vector<XferEntry>& entries,
                                     Deadline deadline);
  // kNotFound when the transfer is not pending; kConflict when it was not
  // submitted with submit_notify_later or has its payload already.
  Result<void> set_notification(XferId id, std::string payload);
  // The transfer's status. A final status (done/failed) is reported once; the
  // id is forgotten afterwards (kNotFound on the next call).
  XferStatus poll(XferId id);
  // poll() until final or `deadline` (then kPending is returned and the id kept).
  XferStatus wait(XferId id, Deadline deadline);
  // Blocks until transfer `id` is final (true; the next poll() reports it)
  // or `deadline` (false). For a thread that polls several transfers and
  // wants to wake as soon as one of them ends. true for unknown ids.
  bool wait_final(XferId id, Deadline deadline);
  // Whether the backend may still be moving bytes of transfer `id`: true
  // while it is pending, and after poll() reported it failed at its deadline
  // until its copy or put really ends. Memory a transfer touches may be
  // reused only once this is false. false for ids it no longer knows.
  bool in_flight(XferId id) const;

  // Notifications peers sent us after their transfers' data arrived.
  std::vector<Notification> take_notifications();
  // Blocks until at least one notification is queued or `deadline`.
  std::vector<Notification> wait_notifications(Deadline deadline);

  // --- opaque messages (the P/D protocol) ---
  void set_message_handler(MessageHandler handler);
  Result<std::string> send_message(const std::string& address, std::string payload, Deadline deadline);

  // --- sleep (step 6) ---
  // Sends INVALIDATE{engine_id, epoch} to every engine that fetched our
  // metadata and waits for each ACK until `deadline`. Those that ACKed are
  // forgotten (they fetch again on next use); the rest are reported and kept.
  // From this call until the next register_region or deregister_region,
  // GET_META is answered kUnavailable: the regions are on their way out and
  // no new peer may import them.
  InvalidateReport invalidate_peers(Deadline deadline);

  TransferStats stats() const;

  class Impl;

 private:
  Result<XferId> submit_impl(const std::string& peer, XferOp op, const std::vector<XferEntry>& entries,
                             std::optional<std::string> notify, bool notify_later, Deadline deadline);
  explicit TransferEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace siesta::transfer
