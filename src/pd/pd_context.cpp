#include "pd/pd_context.h"

#include <fmt/format.h>

namespace siesta::pd {

Result<transfer::EngineMeta> ensure_peer(transfer::TransferEngine& transfers, const std::string& engine_id,
                                         const std::string& address, std::optional<uint64_t> epoch,
                                         Deadline deadline) {
  auto state = transfers.peer_state(engine_id);
  auto meta = transfers.peer_meta(engine_id);
  const bool usable = state && *state == transfer::PeerState::kReady && meta && (!epoch || meta->epoch.value == *epoch);
  if (usable) return *meta;
  auto connected = transfers.connect(address, deadline);
  if (!connected) return connected.error().with_context(fmt::format("handshake with {} at {}", engine_id, address));
  if (*connected != engine_id)
    return unavailable(fmt::format("the side channel at {} serves engine {}, not {} (restarted?)", address, *connected,
                                   engine_id));
  SIESTA_ASSIGN_OR_RETURN(transfer::EngineMeta fresh, transfers.peer_meta(engine_id));
  if (epoch && fresh.epoch.value != *epoch)
    return conflict(fmt::format("engine {} is at epoch {}, and the request was made at its epoch {} (its KV cache "
                                "was released and mapped again since)",
                                engine_id, fresh.epoch.value, *epoch));
  return fresh;
}

Result<transfer::RegionDesc> peer_kv_region(const transfer::EngineMeta& meta, std::optional<uint64_t> region) {
  if (region) {
    for (const transfer::RegionDesc& r : meta.regions)
      if (r.id.value == *region) return r;
    return not_found(fmt::format("engine {} has no region {} at epoch {}", meta.engine_id, *region, meta.epoch.value));
  }
  if (meta.regions.size() != 1)
    return not_found(fmt::format("engine {} registers {} regions at epoch {}, expected its KV cache alone",
                                 meta.engine_id, meta.regions.size(), meta.epoch.value));
  return meta.regions.front();
}

Result<Reply> send_pd_message(transfer::TransferEngine& transfers, const std::string& address, std::string payload,
                              Deadline deadline) {
  SIESTA_ASSIGN_OR_RETURN(std::string answer, transfers.send_message(address, std::move(payload), deadline));
  return decode_reply(answer);
}

void EndedRequests::add(const std::string& key, std::string why) {
  if (key.empty()) return;
  auto [it, inserted] = why_.insert_or_assign(key, std::move(why));
  if (!inserted) return;
  order_.push_back(key);
  while (order_.size() > capacity_) {
    why_.erase(order_.front());
    order_.pop_front();
  }
}

const std::string* EndedRequests::find(const std::string& key) const {
  auto it = why_.find(key);
  return it == why_.end() ? nullptr : &it->second;
}

}  // namespace siesta::pd
