// ProxyMetrics: the proxy's own counters, rendered with the instances'
// health as Prometheus text for GET /metrics.
//
// Threads: counters are atomics, safe to bump from any thread; render() reads
// a consistent-enough snapshot (each counter on its own).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "proxy/instance_set.h"
#include "proxy/pd_request.h"

namespace siesta::proxy {

class ProxyMetrics {
 public:
  void count_request(Endpoint endpoint);
  void count_prefill_failure() { prefill_failures_.fetch_add(1, std::memory_order_relaxed); }
  void count_decode_failure() { decode_failures_.fetch_add(1, std::memory_order_relaxed); }
  void count_client_disconnect() { client_disconnects_.fetch_add(1, std::memory_order_relaxed); }
  void count_admin_call() { admin_calls_.fetch_add(1, std::memory_order_relaxed); }
  void count_retry() { retries_.fetch_add(1, std::memory_order_relaxed); }
  // A request held while an instance of `role` woke up, for `seconds`.
  void record_wake_wait(Role role, double seconds);
  void count_wake_timeout(Role role) { wake_timeouts_[static_cast<int>(role)].fetch_add(1); }

  std::string render(const InstanceSet& prefill, const InstanceSet& decode) const;

 private:
  std::atomic<uint64_t> completions_{0};
  std::atomic<uint64_t> chat_completions_{0};
  std::atomic<uint64_t> prefill_failures_{0};
  std::atomic<uint64_t> decode_failures_{0};
  std::atomic<uint64_t> client_disconnects_{0};
  std::atomic<uint64_t> admin_calls_{0};
  std::atomic<uint64_t> retries_{0};
  // Per role: a histogram of wake waits (bucket counts, cumulative at render), their sum in microseconds.
  static constexpr double kWakeBuckets[] = {0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
  static constexpr size_t kNumBuckets = sizeof(kWakeBuckets) / sizeof(kWakeBuckets[0]);
  std::atomic<uint64_t> wake_wait_buckets_[2][kNumBuckets + 1] = {};
  std::atomic<uint64_t> wake_wait_us_[2] = {};
  std::atomic<uint64_t> wake_timeouts_[2] = {};
};

}  // namespace siesta::proxy
