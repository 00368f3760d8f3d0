// PrefillLocator: WRITE mode's way from the prefill instance's HTTP URL
// (kv_transfer_params.remote_prefill_url, set by `siesta proxy --mode
// concurrent`) to its side channel: GET URL/kv_transfer_info once, then from
// a cache. A lookup that later proves stale (the message fails) is forgotten.
// Thread-safe; resolve() blocks up to its deadline (call it off the engine loop).
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <unordered_map>

#include "common/status.h"
#include "transfer/deadline.h"

namespace siesta::pd {

struct PrefillSideChannel {
  std::string engine_id;
  std::string address;  // host:port
};

class PrefillLocator {
 public:
  // How long an answer is trusted without a failure.
  explicit PrefillLocator(std::chrono::seconds ttl = std::chrono::seconds(60)) : ttl_(ttl) {}

  Result<PrefillSideChannel> resolve(const std::string& url, transfer::Deadline deadline);
  void forget(const std::string& url);

 private:
  struct Entry {
    PrefillSideChannel side_channel;
    transfer::Clock::time_point fetched;
  };
  std::chrono::seconds ttl_;
  std::mutex mu_;
  std::unordered_map<std::string, Entry> cache_;
};

}  // namespace siesta::pd
