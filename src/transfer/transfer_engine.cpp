#include "transfer/transfer_engine.h"

#include <fmt/format.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>

#include "common/log.h"
#include "transfer/invalidate_check.h"
#include "transfer/region_table.h"
#include "transfer/side_channel.h"
#include "transfer/transfer_backend.h"

namespace siesta::transfer {

namespace {

// How long shutdown waits for transfers to each peer before dropping its imports.
constexpr auto kShutdownDrain = std::chrono::milliseconds(2000);

struct RegionEntry {
  LocalRegion region;
  std::string backend_blob;
  size_t in_flight = 0;  // segments of unfinished transfers that use this region
};

// Our view of one remote engine.
struct Peer {
  std::string engine_id;
  std::string address;
  PeerState state = PeerState::kReady;
  Status last_failure;               // why it is in kError
  EngineMeta meta;                   // the descriptor: its regions at meta.epoch
  std::shared_ptr<BackendPeer> link;  // null once invalidated
  uint64_t generation = 0;           // bumped by every handshake
};

struct XferRecord {
  std::string peer;
  uint64_t peer_generation = 0;
  XferStatus status;
  Deadline deadline;
  std::vector<RegionId> local_regions;  // one per segment, for in_flight
  bool backend_done = false;
  bool reported = false;  // a final status was handed to the user
  Clock::time_point data_at{};  // the backend moved the bytes (before any notification)
  // submit_notify_later: the notification's payload, once set_notification
  // gave it; and, while the data is in place and the payload is not, where
  // the notification goes.
  bool notify_later = false;
  bool payload_given = false;
  std::optional<std::string> late_payload;
  bool data_waiting = false;
  std::string notify_address;
  Epoch notify_epoch;
};

bool add_overflows(uint64_t a, uint64_t b) { return a + b < a; }

}  // namespace

class TransferEngine::Impl {
 public:
  explicit Impl(const TransferConfig& c) : config(c) {}

  Result<std::string> handshake(const std::string& peer_address, Deadline deadline);
  Result<Frame> on_request(const Frame& request, const RequestOrigin& from);
  Result<Frame> on_get_meta(const Frame& request, const RequestOrigin& from);
  Result<Frame> on_invalidate(const Frame& request, const RequestOrigin& from);
  Result<Frame> on_notify(const Frame& request, const RequestOrigin& from);
  Result<Frame> on_message(const Frame& request, const RequestOrigin& from);

  EngineMeta metadata_locked() const;
  // The only place a peer's state changes.
  void transition_locked(Peer& peer, PeerEvent event, const Status* why);
  // The backend is done with the transfer's local memory (in_flight ends).
  void release_backend_locked(XferRecord& rec);
  void send_notify(XferId id, const std::string& peer_id, const std::string& address, Epoch target_epoch,
                   std::string payload, Deadline deadline);
  void on_data_done(XferId id, Ok result, std::optional<std::string> notify, std::string peer_id,
                    std::string address, Epoch target_epoch, XferOp op);
  void finish(XferId id, Ok result);
  // Applies the deadline; returns whether the status is final.
  bool settle_locked(XferRecord& rec);
  XferStatus consume_locked(std::unordered_map<XferId, XferRecord>::iterator it);
  void shutdown();

  TransferConfig config;
  std::unique_ptr<RegionTable> table;
  std::unique_ptr<TransferBackend> backend;
  std::unique_ptr<SideChannel> side_channel;
  std::string address;

  mutable std::mutex mu;
  std::condition_variable xfer_cv;
  std::condition_variable notify_cv;
  std::map<RegionId, RegionEntry> regions;
  uint64_t next_region_id = 1;
  std::unordered_map<std::string, Peer> peers;
  std::unordered_map<XferId, XferRecord> xfers;
  uint64_t next_xfer_id = 1;
  std::deque<Notification> notifications;
  std::map<std::string, std::string> fetchers;  // engine id → listener address
  // The newest epoch each peer invalidated: a handshake that fetched metadata
  // at that epoch or older (racing with the INVALIDATE) is not installed.
  std::unordered_map<std::string, Epoch> invalidated_at;
  // Set by invalidate_peers(): our regions are about to be deregistered, so no
  // new peer may import them. Cleared by the next change of regions.
  bool handshakes_closed = false;
  MessageHandler message_handler;
  TransferStats stats;  // epoch excluded: read from the table

  // One handshake at a time (waited for with the caller's deadline).
  std::mutex handshake_mu;
  std::condition_variable handshake_cv;
  bool handshake_busy = false;
};

// ---------------------------------------------------------------------------
// creation and shutdown

TransferEngine::TransferEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<TransferEngine>> TransferEngine::create(const TransferConfig& config) {
  if (config.engine_id.empty()) return invalid_argument("transfer engine needs an engine_id");
  auto impl = std::make_unique<Impl>(config);
  SIESTA_ASSIGN_OR_RETURN(impl->table, RegionTable::create(config.max_regions, "siesta-region-table"));
  impl->table->set_epoch(first_epoch());
  SIESTA_ASSIGN_OR_RETURN(impl->backend, make_transfer_backend(config, *impl->table));
  if (config.sleep_mode && !impl->backend->supports_sleep())
    return invalid_argument(fmt::format("sleep mode needs a transfer backend that can re-register memory, and '{}' "
                                        "cannot; choose another backend or disable sleep mode",
                                        impl->backend->name()));
  Impl* raw = impl.get();
  SideChannelOptions side_channel = config.side_channel;
  side_channel.engine_id = config.engine_id;  // who the side channel's handshake says we are
  SIESTA_ASSIGN_OR_RETURN(impl->side_channel,
                          SideChannel::start(side_channel, [raw](const Frame& f, const RequestOrigin& from) {
                            return raw->on_request(f, from);
                          }));
  impl->address = impl->side_channel->address();
  SIESTA_LOG_INFO("transfer engine {}: backend {}, side channel {}", config.engine_id, impl->backend->name(),
                  impl->address);
  return std::unique_ptr<TransferEngine>(new TransferEngine(std::move(impl)));
}

TransferEngine::~TransferEngine() { impl_->shutdown(); }

void TransferEngine::Impl::shutdown() {
  side_channel->stop();
  std::vector<std::shared_ptr<BackendPeer>> links;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [id, peer] : peers)
      if (peer.link) links.push_back(std::move(peer.link));
  }
  Deadline drain = deadline_after(kShutdownDrain);
  for (auto& link : links) {
    Ok r = link->release(drain);
    if (!r) SIESTA_LOG_WARN("transfer engine {}: shutting down: {}", config.engine_id, r.error().message);
  }
  links.clear();
  backend.reset();  // joins backend threads; no completion runs after this
  std::lock_guard<std::mutex> lock(mu);
  for (auto& [id, rec] : xfers)
    if (rec.status.pending()) rec.status = XferStatus::make_failed(unavailable("the transfer engine shut down"));
  xfer_cv.notify_all();
}

const std::string& TransferEngine::engine_id() const { return impl_->config.engine_id; }
const std::string& TransferEngine::address() const { return impl_->address; }
bool TransferEngine::supports_sleep() const { return impl_->backend->supports_sleep(); }

// ---------------------------------------------------------------------------
// regions

Result<RegionId> TransferEngine::register_region(const RegionSpec& spec) {
  if (spec.base == nullptr || spec.bytes == 0) return invalid_argument("register_region needs a base and a size");
  std::lock_guard<std::mutex> lock(impl_->mu);
  RegionId id{impl_->next_region_id++};
  SIESTA_ASSIGN_OR_RETURN(uint32_t slot, impl_->table->claim_slot(id));
  RegionEntry entry{LocalRegion{id, slot, spec}, {}, 0};
  auto blob = impl_->backend->register_region(entry.region);
  if (!blob) {
    impl_->table->release_slot(slot);
    return blob.error().with_context(fmt::format("registering {} bytes of {} memory", spec.bytes,
                                                 memory_kind_name(spec.kind)));
  }
  entry.backend_blob = std::move(*blob);
  impl_->regions.emplace(id, std::move(entry));
  impl_->table->set_epoch(impl_->table->epoch().next());
  impl_->handshakes_closed = false;
  SIESTA_LOG_DEBUG("transfer engine {}: region {} registered ({} bytes, {}), epoch {}", impl_->config.engine_id,
                   id.value, spec.bytes, memory_kind_name(spec.kind), impl_->table->epoch().value);
  return id;
}

Ok TransferEngine::deregister_region(RegionId id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->regions.find(id);
  if (it == impl_->regions.end()) return not_found(fmt::format("region {} is not registered", id.value));
  if (it->second.in_flight > 0)
    return conflict(fmt::format("region {} is used by {} transfer segments still in flight; wait for them (or their "
                                "deadline) before deregistering",
                                id.value, it->second.in_flight));
  impl_->backend->deregister_region(id);
  impl_->table->release_slot(it->second.region.slot);
  impl_->regions.erase(it);
  impl_->table->set_epoch(impl_->table->epoch().next());
  impl_->handshakes_closed = false;
  SIESTA_LOG_DEBUG("transfer engine {}: region {} deregistered, epoch {}", impl_->config.engine_id, id.value,
                   impl_->table->epoch().value);
  return {};
}

EngineMeta TransferEngine::Impl::metadata_locked() const {
  EngineMeta meta;
  meta.engine_id = config.engine_id;
  meta.epoch = table->epoch();
  meta.side_channel_address = address;
  meta.backend = std::string(backend->name());
  meta.backend_blob = backend->engine_blob();
  for (const auto& [id, entry] : regions) {
    const RegionSpec& s = entry.region.spec;
    meta.regions.push_back(RegionDesc{id, entry.region.slot, reinterpret_cast<uint64_t>(s.base), s.bytes, s.kind,
                                      entry.backend_blob});
  }
  return meta;
}

EngineMeta TransferEngine::metadata() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->metadata_locked();
}

Epoch TransferEngine::epoch() const { return impl_->table->epoch(); }

// ---------------------------------------------------------------------------
// peers

void TransferEngine::Impl::transition_locked(Peer& peer, PeerEvent event, const Status* why) {
  PeerState from = peer.state;
  peer.state = next_peer_state(from, event);
  if (peer.state == PeerState::kError && from != PeerState::kError && why != nullptr) peer.last_failure = *why;
  if (from != peer.state) {
    if (peer.state == PeerState::kError)
      SIESTA_LOG_WARN("transfer engine {}: peer {} {} -> {} ({}): {}", config.engine_id, peer.engine_id,
                      peer_state_name(from), peer_state_name(peer.state), peer_event_name(event),
                      why ? why->message : std::string("no detail"));
    else
      SIESTA_LOG_INFO("transfer engine {}: peer {} {} -> {} ({})", config.engine_id, peer.engine_id,
                      peer_state_name(from), peer_state_name(peer.state), peer_event_name(event));
  }
}

Result<std::string> TransferEngine::connect(const std::string& address, Deadline deadline) {
  {
    std::unique_lock<std::mutex> lock(impl_->handshake_mu);
    if (!impl_->handshake_cv.wait_until(lock, deadline, [&] { return !impl_->handshake_busy; }))
      return timeout(fmt::format("handshake with {}: another handshake did not finish before the deadline", address));
    impl_->handshake_busy = true;
  }
  struct HandshakeDone {
    Impl* impl;
    ~HandshakeDone() {
      std::lock_guard<std::mutex> lock(impl->handshake_mu);
      impl->handshake_busy = false;
      impl->handshake_cv.notify_one();
    }
  } done{impl_.get()};
  // A peer that changes its regions between our GET_META and the backend's
  // import answers kConflict: fetch its metadata again (a few times).
  for (int attempt = 0;; ++attempt) {
    auto peer = impl_->handshake(address, deadline);
    if (peer || peer.error().code != ErrorCode::kConflict || attempt == 2 || expired(deadline)) return peer;
  }
}

Result<std::string> TransferEngine::Impl::handshake(const std::string& peer_address, Deadline deadline) {
  GetMetaMsg ask{config.engine_id, address};
  SIESTA_ASSIGN_OR_RETURN(Frame answer, side_channel->request(peer_address, to_frame(ask), deadline));
  if (answer.type != FrameType::kMeta) return status_from_unexpected(answer, FrameType::kGetMeta, peer_address);
  auto meta = decode_engine_meta(answer.payload);
  if (!meta) return meta.error().with_context(fmt::format("metadata from {}", peer_address));
  if (meta->engine_id == config.engine_id)
    return invalid_argument(fmt::format("{} is this engine's own side channel (engine id {}); engine ids must be "
                                        "unique",
                                        peer_address, meta->engine_id));
  if (meta->backend != backend->name())
    return invalid_argument(fmt::format("peer {} at {} uses the '{}' transfer backend and this engine '{}'; "
                                        "configure both engines with the same backend",
                                        meta->engine_id, peer_address, meta->backend, backend->name()));
  std::string peer_id = meta->engine_id;
  auto link = backend->connect(*meta, deadline);
  if (!link)
    return link.error().with_context(fmt::format("importing the regions of peer {} at {}", peer_id, peer_address));
  std::shared_ptr<BackendPeer> old;
  {
    std::unique_lock<std::mutex> lock(mu);
    auto inv = invalidated_at.find(peer_id);
    if (inv != invalidated_at.end() && meta->epoch <= inv->second) {
      invalidated_at.erase(inv);  // it guards this handshake only: the next one fetches anew
      lock.unlock();
      (void)(*link)->release(deadline);
      return unavailable(fmt::format("peer {} invalidated its epoch {} during our handshake; connect again once it "
                                     "has registered its regions again",
                                     peer_id, meta->epoch.value));
    }
    Peer& peer = peers[peer_id];
    peer.engine_id = peer_id;
    peer.address = peer_address;
    old = std::move(peer.link);
    peer.link = std::move(*link);
    peer.meta = std::move(*meta);
    peer.generation++;
    ++stats.handshakes;
    transition_locked(peer, PeerEvent::kHandshake, nullptr);
    SIESTA_LOG_DEBUG("transfer engine {}: handshake with {} at {}: epoch {}, {} regions", config.engine_id, peer_id,
                     peer_address, peer.meta.epoch.value, peer.meta.regions.size());
  }
  if (old) {
    Ok r = old->release(deadline);
    if (!r) SIESTA_LOG_WARN("transfer engine {}: dropping an old descriptor: {}", config.engine_id, r.error().message);
  }
  return peer_id;
}

Result<PeerState> TransferEngine::peer_state(const std::string& engine_id) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->peers.find(engine_id);
  if (it == impl_->peers.end()) return not_found(fmt::format("no handshake with peer {} yet", engine_id));
  return it->second.state;
}

Result<EngineMeta> TransferEngine::peer_meta(const std::string& engine_id) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->peers.find(engine_id);
  if (it == impl_->peers.end()) return not_found(fmt::format("no handshake with peer {} yet", engine_id));
  return it->second.meta;
}

// ---------------------------------------------------------------------------
// transfers

Result<XferId> TransferEngine::submit(const std::string& peer_id, XferOp op, const std::vector<XferEntry>& entries,
                                      std::optional<std::string> notify, Deadline deadline) {
  return submit_impl(peer_id, op, entries, std::move(notify), false, deadline);
}

Result<XferId> TransferEngine::submit_notify_later(const std::string& peer_id, XferOp op,
                                                   const std::vector<XferEntry>& entries, Deadline deadline) {
  return submit_impl(peer_id, op, entries, std::nullopt, true, deadline);
}

Result<void> TransferEngine::set_notification(XferId id, std::string payload) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  auto it = impl_->xfers.find(id);
  if (it == impl_->xfers.end() || it->second.reported || !it->second.status.pending())
    return not_found(fmt::format("transfer {} is not pending (unknown, or already final)", id.value));
  XferRecord& rec = it->second;
  if (!rec.notify_later || rec.payload_given)
    return conflict(fmt::format("transfer {} takes no late notification, or has one already", id.value));
  rec.payload_given = true;
  if (!rec.data_waiting) {
    rec.late_payload = std::move(payload);
    return {};
  }
  rec.data_waiting = false;
  const std::string peer_id = rec.peer, address = rec.notify_address;
  const Epoch epoch = rec.notify_epoch;
  const Deadline deadline = rec.deadline;
  lock.unlock();
  impl_->send_notify(id, peer_id, address, epoch, std::move(payload), deadline);
  return {};
}

Result<XferId> TransferEngine::submit_impl(const std::string& peer_id, XferOp op, const std::vector<XferEntry>& entries,
                                           std::optional<std::string> notify, bool notify_later, Deadline deadline) {
  if (entries.empty()) return invalid_argument("a transfer needs at least one entry");
  for (int attempt = 0;; ++attempt) {
    std::unique_lock<std::mutex> lock(impl_->mu);
    auto pit = impl_->peers.find(peer_id);
    if (pit == impl_->peers.end())
      return not_found(fmt::format("unknown peer {}: connect() to its side-channel address first", peer_id));
    Peer& peer = pit->second;
    if (peer.state == PeerState::kError)
      return unavailable(fmt::format("peer {} is in the error state after: {}; call connect(\"{}\") to handshake "
                                     "again",
                                     peer_id, peer.last_failure.message, peer.address));
    if (peer.state == PeerState::kInvalid || !peer.link) {
      if (attempt > 0)
        return unavailable(fmt::format("peer {} was invalidated again during the handshake; retry later", peer_id));
      std::string address = peer.address;
      lock.unlock();
      SIESTA_ASSIGN_OR_RETURN(std::string again, connect(address, deadline));
      if (again != peer_id)
        return unavailable(fmt::format("the side channel at {} now serves engine {}, not {}", address, again, peer_id));
      continue;
    }

    XferPlan plan;
    plan.op = op;
    plan.deadline = deadline;
    plan.segments.reserve(entries.size());
    std::vector<RegionId> used;
    used.reserve(entries.size());
    for (const XferEntry& e : entries) {
      auto rit = impl_->regions.find(e.local_region);
      if (rit == impl_->regions.end())
        return not_found(fmt::format("local region {} is not registered", e.local_region.value));
      const RegionSpec& local = rit->second.region.spec;
      if (e.bytes == 0) return invalid_argument("a transfer entry of 0 bytes");
      if (add_overflows(e.local_offset, e.bytes) || e.local_offset + e.bytes > local.bytes)
        return invalid_argument(fmt::format("local range [{}, +{}) is outside region {} ({} bytes)", e.local_offset,
                                            e.bytes, e.local_region.value, local.bytes));
      size_t remote_index = peer.meta.regions.size();
      for (size_t i = 0; i < peer.meta.regions.size(); ++i)
        if (peer.meta.regions[i].id == e.remote_region) remote_index = i;
      if (remote_index == peer.meta.regions.size())
        return not_found(fmt::format("peer {} has no region {} in its metadata at epoch {} (deregistered, or named "
                                     "from before its last sleep); use ids from its current metadata",
                                     peer_id, e.remote_region.value, peer.meta.epoch.value));
      const RegionDesc& remote = peer.meta.regions[remote_index];
      if (add_overflows(e.remote_offset, e.bytes) || e.remote_offset + e.bytes > remote.bytes)
        return invalid_argument(fmt::format("remote range [{}, +{}) is outside region {} of peer {} ({} bytes)",
                                            e.remote_offset, e.bytes, remote.id.value, peer_id, remote.bytes));
      plan.segments.push_back(XferSegment{e.local_region, static_cast<char*>(local.base) + e.local_offset, local.kind,
                                          remote_index, e.remote_offset, e.bytes});
      used.push_back(e.local_region);
    }
    for (RegionId r : used) impl_->regions[r].in_flight++;
    XferId id{impl_->next_xfer_id++};
    XferRecord rec;
    rec.peer = peer_id;
    rec.peer_generation = peer.generation;
    rec.deadline = deadline;
    rec.local_regions = std::move(used);
    rec.notify_later = notify_later;
    impl_->xfers.emplace(id, std::move(rec));
    std::shared_ptr<BackendPeer> link = peer.link;
    std::string address = peer.address;
    Epoch target_epoch = peer.meta.epoch;
    lock.unlock();

    Impl* impl = impl_.get();
    link->post(std::move(plan), [impl, id, notify = std::move(notify), peer_id, address, target_epoch, op](Ok r) mutable {
      impl->on_data_done(id, std::move(r), std::move(notify), std::move(peer_id), std::move(address), target_epoch, op);
    });
    return id;
  }
}

void TransferEngine::Impl::on_data_done(XferId id, Ok result, std::optional<std::string> notify, std::string peer_id,
                                        std::string peer_address, Epoch target_epoch, XferOp op) {
  if (!result) {
    finish(id, result.error().with_context(fmt::format("{} with peer {}", xfer_op_name(op), peer_id)));
    return;
  }
  Deadline deadline;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = xfers.find(id);
    deadline = it == xfers.end() ? Clock::now() : it->second.deadline;
    if (it != xfers.end()) {
      XferRecord& rec = it->second;
      rec.data_at = Clock::now();
      if (rec.notify_later) {
        if (!rec.late_payload) {
          // set_notification sends it when the payload comes. The backend is
          // done with our memory already.
          rec.data_waiting = true;
          rec.notify_address = peer_address;
          rec.notify_epoch = target_epoch;
          release_backend_locked(rec);
          if (rec.reported) xfers.erase(it);  // failed at its deadline and reported: nothing will come
          xfer_cv.notify_all();
          return;
        }
        notify = std::move(rec.late_payload);
        rec.late_payload.reset();
      }
    }
  }
  if (!notify) {
    finish(id, {});
    return;
  }
  send_notify(id, peer_id, peer_address, target_epoch, std::move(*notify), deadline);
}

void TransferEngine::Impl::send_notify(XferId id, const std::string& peer_id, const std::string& peer_address,
                                       Epoch target_epoch, std::string payload, Deadline deadline) {
  NotifyMsg msg{config.engine_id, target_epoch, std::move(payload)};
  side_channel->request_then(peer_address, to_frame(msg), deadline, [this, id, peer_id](Result<Frame> answer) {
    if (!answer) {
      finish(id, answer.error().with_context(fmt::format("notifying peer {} (its data is in place)", peer_id)));
    } else if (answer->type != FrameType::kAck) {
      finish(id, status_from_unexpected(*answer, FrameType::kNotify, peer_id)
                     .with_context("the notification was refused"));
    } else {
      finish(id, {});
    }
  });
}

void TransferEngine::Impl::release_backend_locked(XferRecord& rec) {
  rec.backend_done = true;
  for (RegionId r : rec.local_regions) {
    auto rit = regions.find(r);
    if (rit != regions.end() && rit->second.in_flight > 0) rit->second.in_flight--;
  }
  rec.local_regions.clear();
}

void TransferEngine::Impl::finish(XferId id, Ok result) {
  std::lock_guard<std::mutex> lock(mu);
  auto it = xfers.find(id);
  if (it == xfers.end()) return;
  XferRecord& rec = it->second;
  release_backend_locked(rec);
  if (rec.status.pending()) {
    if (result) {
      rec.status = XferStatus::make_done();
    } else {
      rec.status = XferStatus::make_failed(result.error());
      auto pit = peers.find(rec.peer);
      if (pit != peers.end() && pit->second.generation == rec.peer_generation)
        transition_locked(pit->second, PeerEvent::kTransferFailed, &result.error());
    }
    rec.status.finished_at = Clock::now();
    rec.status.data_at = rec.data_at == Clock::time_point{} ? rec.status.finished_at : rec.data_at;
  }
  if (rec.reported) {
    xfers.erase(it);
  }
  xfer_cv.notify_all();
}

bool TransferEngine::Impl::settle_locked(XferRecord& rec) {
  if (rec.status.pending() && expired(rec.deadline)) {
    Status why = timeout(fmt::format("transfer with peer {} did not finish before its deadline", rec.peer));
    rec.status = XferStatus::make_failed(why);
    rec.status.finished_at = Clock::now();
    auto pit = peers.find(rec.peer);
    if (pit != peers.end() && pit->second.generation == rec.peer_generation)
      transition_locked(pit->second, PeerEvent::kTransferFailed, &why);
  }
  return !rec.status.pending();
}

XferStatus TransferEngine::Impl::consume_locked(std::unordered_map<XferId, XferRecord>::iterator it) {
  XferStatus status = it->second.status;
  it->second.reported = true;
  if (it->second.backend_done) xfers.erase(it);
  return status;
}

XferStatus TransferEngine::poll(XferId id) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->xfers.find(id);
  if (it == impl_->xfers.end() || it->second.reported)
    return XferStatus::make_failed(not_found(fmt::format("unknown transfer {} (or its final status was already "
                                                         "reported)",
                                                         id.value)));
  if (!impl_->settle_locked(it->second)) return XferStatus::make_pending();
  return impl_->consume_locked(it);
}

XferStatus TransferEngine::wait(XferId id, Deadline deadline) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  for (;;) {
    auto it = impl_->xfers.find(id);
    if (it == impl_->xfers.end() || it->second.reported)
      return XferStatus::make_failed(not_found(fmt::format("unknown transfer {} (or its final status was already "
                                                           "reported)",
                                                           id.value)));
    if (impl_->settle_locked(it->second)) return impl_->consume_locked(it);
    if (expired(deadline)) return XferStatus::make_pending();
    impl_->xfer_cv.wait_until(lock, earlier(deadline, it->second.deadline));
  }
}

bool TransferEngine::wait_final(XferId id, Deadline deadline) {
  std::unique_lock<std::mutex> lock(impl_->mu);
  for (;;) {
    auto it = impl_->xfers.find(id);
    if (it == impl_->xfers.end() || it->second.reported) return true;
    if (impl_->settle_locked(it->second)) return true;
    if (expired(deadline)) return false;
    impl_->xfer_cv.wait_until(lock, earlier(deadline, it->second.deadline));
  }
}

bool TransferEngine::in_flight(XferId id) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->xfers.find(id);
  return it != impl_->xfers.end() && !it->second.backend_done;
}

// ---------------------------------------------------------------------------
// notifications and messages

std::vector<Notification> TransferEngine::take_notifications() {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<Notification> out(std::make_move_iterator(impl_->notifications.begin()),
                                std::make_move_iterator(impl_->notifications.end()));
  impl_->notifications.clear();
  return out;
}

std::vector<Notification> TransferEngine::wait_notifications(Deadline deadline) {
  {
    std::unique_lock<std::mutex> lock(impl_->mu);
    impl_->notify_cv.wait_until(lock, deadline, [&] { return !impl_->notifications.empty(); });
  }
  return take_notifications();
}

void TransferEngine::set_message_handler(MessageHandler handler) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->message_handler = std::move(handler);
}

Result<std::string> TransferEngine::send_message(const std::string& address, std::string payload, Deadline deadline) {
  PeerMessage msg{impl_->config.engine_id, std::move(payload)};
  SIESTA_ASSIGN_OR_RETURN(Frame answer, impl_->side_channel->request(address, to_frame(msg), deadline));
  if (answer.type != FrameType::kMessage) return status_from_unexpected(answer, FrameType::kMessage, address);
  SIESTA_ASSIGN_OR_RETURN(PeerMessage reply, decode_peer_message(answer.payload));
  return std::move(reply.payload);
}

// ---------------------------------------------------------------------------
// invalidation

InvalidateReport TransferEngine::invalidate_peers(Deadline deadline) {
  std::map<std::string, std::string> targets;
  Epoch epoch;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    targets = impl_->fetchers;
    epoch = impl_->table->epoch();
    impl_->handshakes_closed = true;
  }
  InvalidateMsg msg{impl_->config.engine_id, epoch};
  std::vector<std::pair<MetaFetcher, SideChannel::Pending>> pending;
  for (const auto& [id, address] : targets)
    pending.emplace_back(MetaFetcher{id, address}, impl_->side_channel->request_async(address, to_frame(msg), deadline));
  InvalidateReport report;
  for (auto& [fetcher, call] : pending) {
    Result<Frame> answer = call.wait();
    Status why;
    bool acked = false;
    if (!answer) {
      why = answer.error();
    } else if (answer->type != FrameType::kAck) {
      why = status_from_unexpected(*answer, FrameType::kInvalidate, fetcher.engine_id);
    } else {
      acked = true;
    }
    if (acked) {
      report.acked.push_back(fetcher.engine_id);
    } else {
      SIESTA_LOG_WARN("transfer engine {}: peer {} at {} did not acknowledge INVALIDATE (epoch {}): {}",
                      impl_->config.engine_id, fetcher.engine_id, fetcher.address, epoch.value, why.message);
      report.unanswered.push_back(fetcher);
      report.why_unanswered.push_back(why);
    }
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats.invalidations_sent += targets.size();
  impl_->stats.invalidation_acks += report.acked.size();
  impl_->stats.invalidations_unanswered += report.unanswered.size();
  for (const std::string& id : report.acked) {
    auto it = impl_->fetchers.find(id);
    // A fetch that raced with this invalidation re-registered a newer address: keep it.
    if (it != impl_->fetchers.end() && it->second == targets[id]) impl_->fetchers.erase(it);
  }
  return report;
}

TransferStats TransferEngine::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  TransferStats s = impl_->stats;
  s.epoch = impl_->table->epoch().value;
  return s;
}

// ---------------------------------------------------------------------------
// side-channel requests from peers

Result<Frame> TransferEngine::Impl::on_request(const Frame& request, const RequestOrigin& from) {
  switch (request.type) {
    case FrameType::kGetMeta: return on_get_meta(request, from);
    case FrameType::kInvalidate: return on_invalidate(request, from);
    case FrameType::kNotify: return on_notify(request, from);
    case FrameType::kMessage: return on_message(request, from);
    case FrameType::kMeta:
    case FrameType::kAck:
    case FrameType::kError:
    case FrameType::kHello:
    case FrameType::kChallenge:
    case FrameType::kAuth:
      break;
  }
  return corrupt(fmt::format("{} sent a {} frame, which is not a request", from.address,
                             frame_type_name(request.type)));
}

namespace {

// The answer to a request whose sender spoke for another engine (check_sender).
Frame refused_sender(const Status& why, const RequestOrigin& from) {
  SIESTA_LOG_WARN("transfer engine: refused a request from {}: {}", from.address, why.message);
  return error_frame(why);
}

}  // namespace

Result<Frame> TransferEngine::Impl::on_get_meta(const Frame& request, const RequestOrigin& from) {
  SIESTA_ASSIGN_OR_RETURN(GetMetaMsg msg, decode_get_meta(request.payload));
  if (Result<void> sender = check_sender(request.type, msg.from_engine, from); !sender)
    return refused_sender(sender.error(), from);
  std::lock_guard<std::mutex> lock(mu);
  if (handshakes_closed)
    return error_frame(unavailable(fmt::format("engine {} is releasing its memory (it invalidated its peers); "
                                               "handshake again after it registers its regions",
                                               config.engine_id)));
  if (!msg.reply_address.empty()) fetchers[msg.from_engine] = msg.reply_address;
  return Frame{FrameType::kMeta, encode_engine_meta(metadata_locked())};
}

Result<Frame> TransferEngine::Impl::on_invalidate(const Frame& request, const RequestOrigin& from) {
  SIESTA_ASSIGN_OR_RETURN(InvalidateMsg msg, decode_invalidate(request.payload));
  std::shared_ptr<BackendPeer> link;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = peers.find(msg.engine_id);
    // From the engine it names, with an epoch that follows ours of it (invalidate_check.h).
    std::optional<Epoch> held;
    std::string known_address;
    if (it != peers.end()) {
      held = it->second.meta.epoch;
      known_address = it->second.meta.side_channel_address;
    } else if (auto f = fetchers.find(msg.engine_id); f != fetchers.end()) {
      known_address = f->second;
    }
    if (Result<void> plausible = check_invalidate(msg, from, held, known_address); !plausible) {
      if (plausible.error().code != ErrorCode::kConflict)
        SIESTA_LOG_WARN("transfer engine {}: refused an INVALIDATE from {}: {}", config.engine_id, from.address,
                        plausible.error().message);
      return error_frame(plausible.error());
    }
    Epoch& newest = invalidated_at[msg.engine_id];
    if (newest < msg.epoch) newest = msg.epoch;
    if (it != peers.end()) {
      Peer& peer = it->second;
      transition_locked(peer, PeerEvent::kInvalidated, nullptr);
      link = std::move(peer.link);
    }
  }
  if (link) {
    Ok released = link->release(deadline_after(config.invalidate_drain_timeout));
    if (!released) {
      SIESTA_LOG_WARN("transfer engine {}: INVALIDATE from {}: {}", config.engine_id, msg.engine_id,
                      released.error().message);
      return error_frame(released.error().with_context("our transfers to you did not end in time"));
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    ++stats.invalidations_received;
  }
  return to_frame(AckMsg{config.engine_id, msg.epoch});
}

Result<Frame> TransferEngine::Impl::on_notify(const Frame& request, const RequestOrigin& from) {
  SIESTA_ASSIGN_OR_RETURN(NotifyMsg msg, decode_notify(request.payload));
  if (Result<void> sender = check_sender(request.type, msg.from_engine, from); !sender)
    return refused_sender(sender.error(), from);
  std::lock_guard<std::mutex> lock(mu);
  Epoch now = table->epoch();
  if (msg.target_epoch != now)
    return error_frame(conflict(fmt::format("notification from {} was made with our epoch {} but we are at epoch {}; "
                                            "its data is not trusted: handshake again and repeat the transfer",
                                            msg.from_engine, msg.target_epoch.value, now.value)));
  notifications.push_back(Notification{std::move(msg.from_engine), std::move(msg.payload)});
  notify_cv.notify_all();
  return to_frame(AckMsg{config.engine_id, now});
}

Result<Frame> TransferEngine::Impl::on_message(const Frame& request, const RequestOrigin& from) {
  SIESTA_ASSIGN_OR_RETURN(PeerMessage msg, decode_peer_message(request.payload));
  if (Result<void> sender = check_sender(request.type, msg.from_engine, from); !sender)
    return refused_sender(sender.error(), from);
  MessageHandler handler;
  {
    std::lock_guard<std::mutex> lock(mu);
    handler = message_handler;
  }
  if (!handler)
    return error_frame(unavailable(fmt::format("engine {} has no handler for peer messages", config.engine_id)));
  Result<std::string> reply = handler(msg);
  if (!reply) return error_frame(reply.error());
  return to_frame(PeerMessage{config.engine_id, std::move(*reply)});
}

}  // namespace siesta::transfer
