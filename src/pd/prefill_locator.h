// PrefillLocator: WRITE mode's way from the prefill instance's HTTP URL
// (kv_transfer_params.remote_prefill_url, set by `siesta proxy --mode
// concurrent`) to its side channel: GET URL/kv_transfer_info once, then from
// a cache. A lookup that later proves stale (the message fails) is forgotten.
// On a serve with --api-key the lookup sends that key (a keyed prefill
// instance requires it on /kv_transfer_info; the proxy gives both the same).
// Thread-safe; resolve() blocks up to its deadline (call it off the engine loop).
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/clock.h"
#include "common/status.h"

namespace siesta::pd {

struct PrefillSideChannel {
  std::string engine_id;
  std::string address;  // host:port
};

class PrefillLocator {
 public:
  // How long an answer is trusted without a failure; the API key to send (empty: none).
  explicit PrefillLocator(std::string api_key = {}, std::chrono::seconds ttl = std::chrono::seconds(60))
      : api_key_(std::move(api_key)), ttl_(ttl) {}

  Result<PrefillSideChannel> resolve(const std::string& url, Deadline deadline);
  void forget(const std::string& url);

 private:
  struct Entry {
    PrefillSideChannel side_channel;
    Clock::time_point fetched;
  };
  std::string api_key_;
  std::chrono::seconds ttl_;
  std::mutex mu_;
  std::unordered_map<std::string, Entry> cache_;
};

}  // namespace siesta::pd
