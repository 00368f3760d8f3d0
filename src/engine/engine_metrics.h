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

// Buckets for KV transfer and load times (seconds): 100 us to 10 s.
std::vector<double> kv_transfer_buckets();

// What a P/D connector counts (KvConnector::metrics). "Transfers" are the
// ones this engine started (a producer's writes, a consumer's reads); "loads"
// are a consumer's requests that asked for remote KV, whichever side moved it.
struct KvTransferMetrics {
  bool enabled = false;                 // a connector is configured
  uint64_t transfers_done = 0;
  uint64_t transfers_failed = 0;
  uint64_t transfer_bytes = 0;          // of transfers done
  Histogram transfer_seconds = Histogram(kv_transfer_buckets());  // submit to done
  Histogram transfer_data_seconds = Histogram(kv_transfer_buckets());  // submit to the bytes in place
  uint64_t loads_done = 0;              // KV arrived
  uint64_t loads_with_logits = 0;       // ... with the producer's logits: the first token sampled from them,
                                        // no prompt token computed here (else the last one is)
  uint64_t load_failures = 0;           // a load that ended without usable KV (failed, late, lease lost, ended by sleep)
  uint64_t load_bytes = 0;              // bytes of KV loaded into this engine
  Histogram load_seconds = Histogram(kv_transfer_buckets());      // start of the load to its KV in place
  uint64_t recomputed_requests = 0;     // asked for remote KV, computed the prompt here instead
  uint64_t sends_done = 0;              // holds whose reader got the KV
  uint64_t sends_expired = 0;           // holds that ran out before a reader came
  uint64_t sends_aborted = 0;           // holds ended by an abort on either side (or by sleep)
  uint64_t sends_failed = 0;            // a write to the reader failed
  // The transfer engine's control plane (sleep and wake of this engine and its peers).
  uint64_t invalidations_sent = 0;        // INVALIDATE sent to peers that imported our KV cache
  uint64_t invalidation_acks = 0;         // ... acknowledged (the peer dropped our memory)
  uint64_t invalidations_unanswered = 0;  // ... not acknowledged before the deadline (peer skipped)
  uint64_t invalidations_received = 0;    // INVALIDATE from peers, acknowledged
  uint64_t peer_handshakes = 0;           // peer metadata fetched (first use, and after each peer's wake)
  uint64_t epoch = 0;                     // this engine's current transfer epoch
};

struct EngineMetricsSnapshot {
  // gauges
  int32_t num_requests_running = 0;
  int32_t num_requests_waiting = 0;   // queued in the scheduler or held while paused
  double kv_cache_usage = 0.0;        // fraction of KV blocks in use, [0, 1]
  int32_t num_kv_blocks = 0;
  int32_t num_kv_blocks_in_use = 0;           // referenced by a request or a hold
  int32_t num_kv_blocks_held_for_remote = 0;  // held for remote readers (send holds)
  int32_t num_kv_blocks_held_for_loads = 0;   // held while a peer may still write them (load holds)
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
  KvTransferMetrics kv_transfer;      // P/D connector (enabled false without one)

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
  void set_kv_blocks(int32_t in_use, int32_t held_for_remote, int32_t held_for_loads);

  EngineMetricsSnapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  EngineMetricsSnapshot s_;
};

}  // namespace siesta
