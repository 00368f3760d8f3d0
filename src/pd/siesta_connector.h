// SiestaConnector: siesta's P/D connector, the KvConnector the engine calls
// (engine/engine_connector.h), over one TransferEngine (src/transfer).
//
// Lifecycle
//   auto c = SiestaConnector::create(config, sleep_mode).value();  // side channel listening
//   nlohmann::json info = c->info();          // engine id, side channel: for /kv_transfer_info
//   Engine::create(options, std::move(c));    // the engine registers its KV cache
//                                             // (on_kv_cache_mapped) and calls the rest
//   ... sleep: release_transfer_kv (deregistered), wake: on_kv_cache_mapped again
//   engine destroyed -> connector destroyed: threads joined, transfer engine shut down
//
// Roles (PdConfig::role): a producer holds the blocks of requests with
// kv_transfer_params.do_remote_decode after their prefill and answers with
// vLLM's do_remote_prefill parameters (producer.h); a consumer loads the KV of
// requests with do_remote_prefill (consumer.h); kv_both does both.
//
// Threads: the engine loop calls the KvConnector methods; a task queue
// (config.worker_threads) does the blocking work; a ticker thread watches
// deadlines and transfers in flight; a notification thread takes the
// producers' "written" notifications; the transfer engine's side-channel
// threads run the message handler. metrics() and info() from any thread.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "engine/engine_connector.h"
#include "pd/consumer.h"
#include "pd/kv_port.h"
#include "pd/pd_config.h"
#include "pd/pd_context.h"
#include "pd/producer.h"
#include "pd/task_queue.h"
#include "transfer/transfer_engine.h"

namespace siesta::pd {

class SiestaConnector final : public KvConnector {
 public:
  // Starts the transfer engine (side channel, backend). sleep_mode: the
  // engine will release and map its KV cache again (refused with a backend
  // that cannot re-register).
  static Result<std::unique_ptr<SiestaConnector>> create(const PdConfig& config, bool sleep_mode);
  ~SiestaConnector() override;
  SiestaConnector(const SiestaConnector&) = delete;
  SiestaConnector& operator=(const SiestaConnector&) = delete;

  // {"engine_id", "side_channel_address", "side_channel_host", "side_channel_port",
  //  "backend", "kv_role", "mode"}
  nlohmann::json info() const;
  const std::string& engine_id() const { return transfers_->engine_id(); }
  const std::string& side_channel_address() const { return transfers_->address(); }

  // KvConnector
  Result<void> on_kv_cache_mapped(const KvCacheRegion& region) override;
  ConnectorPlan on_request_added(const EngineRequest& request) override;
  void start_load(const RequestId& id, const RemoteKvTarget& target) override;
  void on_load_skipped(const RequestId& id) override;
  ConnectorUpdates poll() override;
  nlohmann::json on_request_finished(const EngineRequest& request, const RequestOutput& output) override;
  void on_request_aborted(const RequestId& id) override;
  void on_request_dropped(const EngineRequest& request) override;
  Result<KvReleaseReport> release_transfer_kv(KvReleaseScope scope, Deadline deadline) override;
  KvTransferMetrics metrics() const override;
  void set_progress_callback(std::function<void()> progress) override;

 private:
  SiestaConnector(PdConfig config, std::unique_ptr<transfer::TransferEngine> transfers);

  Result<std::string> on_message(const transfer::PeerMessage& message);
  void run_ticker();
  void run_notifications();
  void kick();
  void report_progress();

  // Waits, ticking both halves, until no transfer of ours touches our blocks.
  Result<void> drain_own_transfers(Deadline deadline);

  PdConfig config_;
  std::unique_ptr<transfer::TransferEngine> transfers_;
  std::unique_ptr<KvPort> port_;
  LocalKvState kv_;
  PdMetrics metrics_;
  std::unique_ptr<TaskQueue> tasks_;
  std::unique_ptr<PdContext> ctx_;
  std::unique_ptr<Producer> producer_;
  std::unique_ptr<Consumer> consumer_;

  std::atomic<bool> stopping_{false};
  std::mutex tick_mu_;
  std::condition_variable tick_cv_;
  bool kicked_ = false;
  std::thread ticker_;
  std::thread notifications_;
  std::mutex progress_mu_;
  std::function<void()> progress_;  // the engine's (set_progress_callback)
};

}  // namespace siesta::pd
