#include "pd/siesta_connector.h"

#include <fmt/format.h>

#include <random>
#include <thread>
#include <variant>

#include "common/host_port.h"
#include "common/log.h"

namespace siesta::pd {
namespace {

// How often the ticker looks at deadlines when nothing is in flight, and
// while transfers are (poll).
constexpr auto kIdleTick = std::chrono::milliseconds(20);
constexpr auto kBusyTick = std::chrono::milliseconds(1);
constexpr auto kNotificationWait = std::chrono::milliseconds(100);

std::string random_engine_id() {
  std::random_device rd;
  std::mt19937_64 gen((static_cast<uint64_t>(rd()) << 32) ^ rd());
  return fmt::format("siesta-{:012x}", gen() & 0xffffffffffffull);
}

}  // namespace

Result<std::unique_ptr<SiestaConnector>> SiestaConnector::create(const PdConfig& config, bool sleep_mode) {
  transfer::TransferConfig tc = config.transfer;
  if (tc.engine_id.empty()) tc.engine_id = random_engine_id();
  tc.side_channel.handler_threads = 2;
  tc.sleep_mode = sleep_mode;
  tc.max_regions = 16;
  auto transfers = transfer::TransferEngine::create(tc);
  if (!transfers) return transfers.error().with_context("starting the KV transfer engine");
  return std::unique_ptr<SiestaConnector>(new SiestaConnector(config, std::move(*transfers)));
}

SiestaConnector::SiestaConnector(PdConfig config, std::unique_ptr<transfer::TransferEngine> transfers)
    : config_(std::move(config)), transfers_(std::move(transfers)) {
  tasks_ = std::make_unique<TaskQueue>(config_.worker_threads, "pd tasks");
  port_ = make_transfer_kv_port(*transfers_, config_.http_api_key);
  ctx_ = std::unique_ptr<PdContext>(new PdContext{config_, *port_, kv_, *tasks_, metrics_, [] { return Clock::now(); },
                                                  [this] { kick(); }, [this] { report_progress(); }});
  producer_ = std::make_unique<Producer>(*ctx_);
  consumer_ = std::make_unique<Consumer>(*ctx_);
  transfers_->set_message_handler([this](const transfer::PeerMessage& m) { return on_message(m); });
  ticker_ = std::thread([this] { run_ticker(); });
  notifications_ = std::thread([this] { run_notifications(); });
  SIESTA_LOG_INFO("pd: {} engine {} ({} backend, {} mode), side channel {}", kv_role_name(config_.role),
                  transfers_->engine_id(), transfer::backend_kind_name(config_.transfer.backend),
                  transfer_mode_name(config_.mode), transfers_->address());
}

SiestaConnector::~SiestaConnector() {
  stopping_.store(true);
  kick();
  if (ticker_.joinable()) ticker_.join();
  if (notifications_.joinable()) notifications_.join();
  tasks_->stop();
  // The side channel's handlers call into the producer and consumer: stop it first.
  transfers_.reset();
}

nlohmann::json SiestaConnector::info() const {
  const std::string& address = transfers_->address();
  const HostPort hp = split_host_port(address).value_or(HostPort{address, "0"});
  return nlohmann::json{{"engine_id", transfers_->engine_id()},
                        {"side_channel_address", address},
                        {"side_channel_host", hp.host},
                        {"side_channel_port", std::stoi(hp.port)},
                        {"backend", transfer::backend_kind_name(config_.transfer.backend)},
                        {"kv_role", kv_role_name(config_.role)},
                        {"mode", transfer_mode_name(config_.mode)}};
}

KvTransferMetrics SiestaConnector::metrics() const {
  KvTransferMetrics m = metrics_.snapshot();
  const transfer::TransferStats t = transfers_->stats();
  m.invalidations_sent = t.invalidations_sent;
  m.invalidation_acks = t.invalidation_acks;
  m.invalidations_unanswered = t.invalidations_unanswered;
  m.invalidations_received = t.invalidations_received;
  m.peer_handshakes = t.handshakes;
  m.epoch = t.epoch;
  return m;
}

void SiestaConnector::set_progress_callback(std::function<void()> progress) {
  std::lock_guard<std::mutex> lock(progress_mu_);
  progress_ = std::move(progress);
}

void SiestaConnector::report_progress() {
  std::function<void()> progress;
  {
    std::lock_guard<std::mutex> lock(progress_mu_);
    progress = progress_;
  }
  if (progress) progress();
}

void SiestaConnector::kick() {
  {
    std::lock_guard<std::mutex> lock(tick_mu_);
    kicked_ = true;
  }
  tick_cv_.notify_one();
}

void SiestaConnector::run_ticker() {
  while (!stopping_.load()) {
    const auto now = Clock::now();
    std::optional<transfer::XferId> in_flight;
    bool busy = producer_->tick(now, &in_flight);
    busy = consumer_->tick(now, &in_flight) || busy;
    // A transfer in flight: wake the moment it ends (its end is on a
    // request's path to its first token), or after a busy tick for the rest.
    if (in_flight) {
      transfers_->wait_final(*in_flight, now + kBusyTick);
      continue;
    }
    std::unique_lock<std::mutex> lock(tick_mu_);
    tick_cv_.wait_for(lock, busy ? kBusyTick : kIdleTick, [&] { return kicked_ || stopping_.load(); });
    kicked_ = false;
  }
}

void SiestaConnector::run_notifications() {
  while (!stopping_.load()) {
    for (transfer::Notification& n : transfers_->wait_notifications(Clock::now() + kNotificationWait)) {
      auto written = decode_written(n.payload);
      if (!written) {
        SIESTA_LOG_WARN("pd: a notification from {} could not be read: {}", n.from_engine, written.error().message);
        continue;
      }
      if (config_.consumes()) consumer_->on_written(*written, n.from_engine);
    }
  }
}

Result<std::string> SiestaConnector::on_message(const transfer::PeerMessage& message) {
  SIESTA_ASSIGN_OR_RETURN(PdMessage m, decode_message(message.payload));
  const std::string not_producer = fmt::format("engine {} is not a producer (kv_role {})", transfers_->engine_id(),
                                               kv_role_name(config_.role));
  const std::string not_consumer = fmt::format("engine {} is not a consumer (kv_role {})", transfers_->engine_id(),
                                               kv_role_name(config_.role));
  if (auto* w = std::get_if<WriteRequest>(&m))
    return config_.produces() ? producer_->on_write(*w) : encode_refusal(not_producer);
  if (auto* c = std::get_if<CancelRequest>(&m))
    return config_.produces() ? producer_->on_cancel(*c) : encode_refusal(not_producer);
  if (auto* s = std::get_if<ReadStart>(&m))
    return config_.produces() ? producer_->on_read_start(*s) : encode_refusal(not_producer);
  if (auto* d = std::get_if<ReadDone>(&m))
    return config_.produces() ? producer_->on_read_done(*d) : encode_refusal(not_producer);
  if (auto* f = std::get_if<LoadFailed>(&m))
    return config_.consumes() ? consumer_->on_load_failed(*f) : encode_refusal(not_consumer);
  return invalid_argument("unhandled P/D message");
}

// ---- KvConnector ------------------------------------------------------------------------

Result<void> SiestaConnector::on_kv_cache_mapped(const KvCacheRegion& region) {
  if (config_.transfer.backend == transfer::BackendKind::kIpc && region.export_fd < 0)
    return invalid_argument(
        "the ipc transfer backend maps the KV cache through an exported file descriptor, and this KV cache could "
        "not be exported (see the log); use \"backend\": \"ucx\" in kv_connector_extra_config");
  const LocalKv old = kv_.get();
  if (old.registered) {
    if (auto ok = transfers_->deregister_region(old.region); !ok)
      SIESTA_LOG_WARN("pd: deregistering the old KV cache region: {}", ok.error().message);
  }
  transfer::RegionSpec spec;
  spec.base = region.base;
  spec.bytes = region.bytes;
  spec.kind = region.cuda ? transfer::MemoryKind::kCuda : transfer::MemoryKind::kHost;
  spec.export_fd = region.export_fd;
  spec.export_offset = region.export_offset;
  spec.export_bytes = region.export_bytes;
  spec.cuda_device = region.cuda_device;
  SIESTA_ASSIGN_OR_RETURN(transfer::RegionId id, transfers_->register_region(spec));
  LocalKv kv;
  kv.registered = true;
  kv.region = id;
  kv.epoch = transfers_->epoch().value;
  kv.num_blocks = region.num_blocks;
  kv.block_size = region.block_size;
  kv.block_bytes = region.block_bytes;
  kv.layout = region.layout;
  kv_.set(kv);
  SIESTA_LOG_INFO("pd: KV cache registered: {} blocks of {} bytes ({} memory), epoch {}", kv.num_blocks,
                  kv.block_bytes, region.cuda ? "cuda" : "host", kv.epoch);
  return {};
}

ConnectorPlan SiestaConnector::on_request_added(const EngineRequest& request) {
  ConnectorPlan plan;
  if (config_.produces()) plan.hold_blocks_for_remote_reader = producer_->on_added(request).hold_blocks_for_remote_reader;
  if (config_.consumes()) plan.load_remote_kv = consumer_->on_added(request).load_remote_kv;
  return plan;
}

void SiestaConnector::start_load(const RequestId& id, const RemoteKvTarget& target) {
  consumer_->start_load(id, target);
}

void SiestaConnector::on_load_skipped(const RequestId& id) { consumer_->on_skipped(id); }

ConnectorUpdates SiestaConnector::poll() {
  ConnectorUpdates u;
  producer_->collect(u);
  consumer_->collect(u);
  return u;
}

nlohmann::json SiestaConnector::on_request_finished(const EngineRequest& request, const RequestOutput& output) {
  if (!config_.produces()) return nullptr;
  return producer_->on_finished(request, output);
}

void SiestaConnector::on_request_aborted(const RequestId& id) {
  producer_->on_aborted(id);
  consumer_->on_aborted(id);
}

void SiestaConnector::on_request_dropped(const EngineRequest& request) {
  if (config_.consumes()) consumer_->on_dropped(request);
}

Result<void> SiestaConnector::drain_own_transfers(Deadline deadline) {
  for (;;) {
    const auto now = Clock::now();
    producer_->tick(now);
    consumer_->tick(now);
    const size_t writes = producer_->writes_in_flight();
    const size_t reads = consumer_->reads_in_flight();
    if (writes == 0 && reads == 0) return {};
    if (now >= deadline)
      return timeout(fmt::format("{} writes to decode engines and {} reads from prefill engines still touched this "
                                 "engine's KV blocks at the deadline",
                                 writes, reads));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

Result<KvReleaseReport> SiestaConnector::release_transfer_kv(KvReleaseScope scope, Deadline deadline) {
  const LocalKv kv = kv_.get();
  KvReleaseReport report;
  // From here no request is offered for transfers and no message is served
  // from the KV cache.
  LocalKv closed = kv;
  closed.registered = false;
  kv_.set(closed);
  const char* why = scope == KvReleaseScope::kMemory
                        ? "the KV cache is being released (sleep); the request recomputes"
                        : "the KV cache is being reset; the request recomputes";
  report.loads_ended = consumer_->end_all(why);
  report.sends_ended = producer_->end_all();
  if (auto ok = drain_own_transfers(deadline); !ok) {
    kv_.set(kv);
    return ok.error();
  }
  if (scope == KvReleaseScope::kReset || !kv.registered) {
    // The memory stays: the loads we ended become quiet as their producers
    // answer our cancels; the engine waits for their blocks.
    kv_.set(kv);
    if (report.loads_ended + report.sends_ended > 0)
      SIESTA_LOG_INFO("pd: KV transfers ended for a reset of the KV cache ({} loads, {} sends)", report.loads_ended,
                      report.sends_ended);
    return report;
  }
  // Peers that imported our memory drop it (each ACK says so); a peer that
  // does not answer in time is skipped: ours is deregistered
  // next, so whatever it kept names memory we no longer use.
  // A peer answers once its own transfers to us ended (each bounded by transfer_timeout_s).
  transfer::InvalidateReport inv = transfers_->invalidate_peers(
      std::min(deadline, Clock::now() + config_.message_timeout + config_.transfer_timeout));
  for (const std::string& id : inv.acked) report.invalidated.push_back(id);
  for (const transfer::MetaFetcher& f : inv.unanswered) report.invalidated.push_back(f.engine_id);
  report.acked = inv.acked;
  for (size_t i = 0; i < inv.unanswered.size(); ++i) {
    report.unanswered.push_back(inv.unanswered[i].engine_id);
    SIESTA_LOG_WARN("pd: peer {} at {} did not acknowledge INVALIDATE ({}); releasing the KV cache anyway",
                    inv.unanswered[i].engine_id, inv.unanswered[i].address, inv.why_unanswered[i].message);
  }
  consumer_->peers_invalidated(nullptr);
  for (;;) {
    auto ok = transfers_->deregister_region(kv.region);
    if (ok) break;
    if (ok.error().code != ErrorCode::kConflict || Clock::now() >= deadline) {
      kv_.set(kv);
      return ok.error().with_context("deregistering the KV cache");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  kv_.set(LocalKv{});
  report.deregistered = true;
  SIESTA_LOG_INFO("pd: KV cache deregistered for release ({} loads and {} sends ended; {} peers invalidated, {} "
                  "acknowledged, {} unanswered)",
                  report.loads_ended, report.sends_ended, report.invalidated.size(), report.acked.size(),
                  report.unanswered.size());
  return report;
}

}  // namespace siesta::pd
