// EngineMetrics: the engine's counters, gauges and latency histograms, in
// plain numbers. The engine loop records; any thread reads a consistent copy
// with snapshot() (the HTTP server renders it as Prometheus text).
//
//   EngineMetrics m;
//   m.record_first_token(ttft_seconds);  m.record_finish(FinishReason::kStop, e2e_seconds);
//   EngineMetricsSnapshot s = m.snapshot();
//
// Latencies are seconds. Histogram buckets follow vLLM's, with finer low
// buckets for inter-token latency (CPU engines decode in milliseconds).
// Thread safety: every member function may be called from any thread.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <vector>

#include "engine/engine_request.h"

namespace siesta {

struct Histogram {
  std::vector<double> bounds;     // upper bounds, ascending (le)
  std::vector<uint64_t> counts;   // per bucket, not cumulative; counts.back() is +Inf
  double sum = 0.0;
  uint64_t count = 0;

  explicit Histogram(std::vector<double> upper_bounds = {});
  void observe(double value);
};

struct EngineMetricsSnapshot {
  // gauges
  int32_t num_requests_running = 0;
  int32_t num_requests_waiting = 0;   // queued in the scheduler or held while paused
  double kv_cache_usage = 0.0;        // fraction of KV blocks in use, [0, 1]
  int32_t num_kv_blocks = 0;
  // counters
  uint64_t num_requests_submitted = 0;
  std::array<uint64_t, 3> num_requests_finished{};   // by FinishReason
  uint64_t prompt_tokens = 0;         // prompt tokens of requests that produced a first token
  uint64_t generation_tokens = 0;
  uint64_t prefix_cache_queries = 0;  // tokens looked up in the prefix cache
  uint64_t prefix_cache_hits = 0;     // of those, tokens found
  uint64_t num_preemptions = 0;
  // histograms (seconds)
  Histogram time_to_first_token;
  Histogram inter_token_latency;
  Histogram e2e_request_latency;

  uint64_t finished(FinishReason r) const { return num_requests_finished[static_cast<size_t>(r)]; }
};

class EngineMetrics {
 public:
  EngineMetrics();

  void record_submitted(uint64_t n);
  void record_first_token(int32_t num_prompt_tokens, double ttft);
  void record_token(double itl);      // a generated token after the first
  void record_generated(uint64_t n);  // generated tokens, first included
  void record_finish(FinishReason reason, double e2e);
  // The loop's view after a step.
  void set_state(int32_t running, int32_t waiting, double kv_usage, int32_t num_kv_blocks, uint64_t prefix_queries,
                 uint64_t prefix_hits, uint64_t preemptions);

  EngineMetricsSnapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  EngineMetricsSnapshot s_;
};

}  // namespace siesta
