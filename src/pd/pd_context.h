// What the producer and consumer halves of SiestaConnector share: the
// configuration, the network (KvPort), the registered KV cache, the task
// runner, the clock and the metrics.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "common/clock.h"
#include "common/status.h"
#include "pd/kv_port.h"
#include "pd/pd_config.h"
#include "pd/pd_messages.h"
#include "pd/pd_metrics.h"
#include "transfer/engine_meta.h"
#include "transfer/region.h"

namespace siesta::pd {

// This engine's KV cache as registered with the transfer engine.
struct LocalKv {
  bool registered = false;
  transfer::RegionId region;
  uint64_t epoch = 0;
  int32_t num_blocks = 0;
  int32_t block_size = 0;
  uint64_t block_bytes = 0;
  std::string layout;

  // Blocks of a prompt of n tokens.
  int32_t blocks_for(int32_t num_tokens) const {
    return block_size > 0 ? (num_tokens + block_size - 1) / block_size : 0;
  }
  bool valid_block(int32_t id) const { return id >= 0 && id < num_blocks; }
};

class LocalKvState {
 public:
  LocalKv get() const {
    std::lock_guard<std::mutex> lock(mu_);
    return kv_;
  }
  void set(LocalKv kv) {
    std::lock_guard<std::mutex> lock(mu_);
    kv_ = std::move(kv);
  }

 private:
  mutable std::mutex mu_;
  LocalKv kv_;
};

struct PdContext {
  const PdConfig& config;
  KvPort& port;
  LocalKvState& kv;
  TaskRunner& tasks;
  PdMetrics& metrics;
  PdClock now;
  // Wakes the connector's ticker (a transfer to poll, a deadline to watch).
  std::function<void()> kick;
  // Tells the engine that poll() has news (a load ended, a hold can go); may
  // be called with the producer's or consumer's lock held (it takes only the
  // engine's inbox lock).
  std::function<void()> progress;

  Deadline message_deadline(Deadline limit) const { return std::min(limit, now() + config.message_timeout); }
};

// The one region a siesta peer registers (its KV cache), checked against a
// region id when given.
Result<transfer::RegionDesc> peer_kv_region(const transfer::EngineMeta& meta, std::optional<uint64_t> region);

// A bounded record of requests whose sends or loads ended, and why, so that
// a late message about one gets a precise answer. Not thread-safe.
class EndedRequests {
 public:
  explicit EndedRequests(size_t capacity = 8192) : capacity_(capacity) {}
  void add(const std::string& key, std::string why);
  const std::string* find(const std::string& key) const;

 private:
  size_t capacity_;
  std::unordered_map<std::string, std::string> why_;
  std::deque<std::string> order_;
};

}  // namespace siesta::pd
