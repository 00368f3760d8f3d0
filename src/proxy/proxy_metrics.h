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

  std::string render(const InstanceSet& prefill, const InstanceSet& decode) const;

 private:
  std::atomic<uint64_t> completions_{0};
  std::atomic<uint64_t> chat_completions_{0};
  std::atomic<uint64_t> prefill_failures_{0};
  std::atomic<uint64_t> decode_failures_{0};
  std::atomic<uint64_t> client_disconnects_{0};
  std::atomic<uint64_t> admin_calls_{0};
};

}  // namespace siesta::proxy
