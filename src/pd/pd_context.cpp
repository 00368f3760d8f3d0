#include "pd/pd_context.h"

#include <fmt/format.h>

namespace siesta::pd {

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
