#include "pd/kv_port.h"

#include <fmt/format.h>

#include "transfer/transfer_engine.h"

namespace siesta::pd {
namespace {

class TransferKvPort final : public KvPort {
 public:
  TransferKvPort(transfer::TransferEngine& transfers, std::string http_api_key)
      : transfers_(transfers), locator_(std::move(http_api_key)) {}

  const std::string& engine_id() const override { return transfers_.engine_id(); }
  const std::string& address() const override { return transfers_.address(); }

  Result<transfer::EngineMeta> peer(const std::string& engine_id, const std::string& address,
                                    std::optional<uint64_t> epoch, Deadline deadline) override {
    auto state = transfers_.peer_state(engine_id);
    auto meta = transfers_.peer_meta(engine_id);
    const bool usable =
        state && *state == transfer::PeerState::kReady && meta && (!epoch || meta->epoch.value == *epoch);
    if (usable) return *meta;
    auto connected = transfers_.connect(address, deadline);
    if (!connected) return connected.error().with_context(fmt::format("handshake with {} at {}", engine_id, address));
    if (*connected != engine_id)
      return unavailable(fmt::format("the side channel at {} serves engine {}, not {} (restarted?)", address,
                                     *connected, engine_id));
    SIESTA_ASSIGN_OR_RETURN(transfer::EngineMeta fresh, transfers_.peer_meta(engine_id));
    if (epoch && fresh.epoch.value != *epoch)
      return conflict(fmt::format("engine {} is at epoch {}, and the request was made at its epoch {} (its KV cache "
                                  "was released and mapped again since)",
                                  engine_id, fresh.epoch.value, *epoch));
    return fresh;
  }

  Result<transfer::XferId> submit(const std::string& peer, transfer::XferOp op,
                                  const std::vector<transfer::XferEntry>& entries,
                                  Deadline deadline) override {
    return transfers_.submit(peer, op, entries, std::nullopt, deadline);
  }
  Result<transfer::XferId> submit_notify_later(const std::string& peer, const std::vector<transfer::XferEntry>& entries,
                                               Deadline deadline) override {
    return transfers_.submit_notify_later(peer, transfer::XferOp::kWrite, entries, deadline);
  }
  Result<void> set_notification(transfer::XferId id, std::string payload) override {
    return transfers_.set_notification(id, std::move(payload));
  }
  transfer::XferStatus poll(transfer::XferId id) override { return transfers_.poll(id); }
  bool in_flight(transfer::XferId id) const override { return transfers_.in_flight(id); }

  Result<Reply> send(const std::string& address, std::string payload, Deadline deadline) override {
    SIESTA_ASSIGN_OR_RETURN(std::string answer, transfers_.send_message(address, std::move(payload), deadline));
    return decode_reply(answer);
  }

  Result<PrefillSideChannel> resolve_prefill(const std::string& url, Deadline deadline) override {
    return locator_.resolve(url, deadline);
  }
  void forget_prefill(const std::string& url) override { locator_.forget(url); }

 private:
  transfer::TransferEngine& transfers_;
  PrefillLocator locator_;
};

}  // namespace

std::unique_ptr<KvPort> make_transfer_kv_port(transfer::TransferEngine& transfers, std::string http_api_key) {
  return std::make_unique<TransferKvPort>(transfers, std::move(http_api_key));
}

}  // namespace siesta::pd
