#include "engine/engine_metrics.h"

#include <algorithm>

namespace siesta {
namespace {

std::vector<double> ttft_buckets() {
  return {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
          2.5,   5.0,   7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
}
std::vector<double> itl_buckets() {
  return {0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
          0.5,   0.75,   1.0,   2.5,    5.0,  7.5,   10.0, 20.0,  40.0, 80.0};
}
std::vector<double> e2e_buckets() {
  return {0.01, 0.025, 0.05, 0.1, 0.3,  0.5,  0.8,  1.0,   1.5,   2.0,   2.5,   5.0,   10.0,  15.0,
          20.0, 30.0,  40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
}

}  // namespace

std::vector<double> kv_transfer_buckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0};
}

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds(std::move(upper_bounds)), counts(bounds.size() + 1, 0) {}

void Histogram::observe(double value) {
  const size_t i = static_cast<size_t>(std::lower_bound(bounds.begin(), bounds.end(), value) - bounds.begin());
  ++counts[i];
  sum += value;
  ++count;
}

EngineMetrics::EngineMetrics() {
  s_.time_to_first_token = Histogram(ttft_buckets());
  s_.inter_token_latency = Histogram(itl_buckets());
  s_.e2e_request_latency = Histogram(e2e_buckets());
}

void EngineMetrics::record_submitted(uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.num_requests_submitted += n;
}

void EngineMetrics::record_first_token(int32_t num_prompt_tokens, double ttft) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.prompt_tokens += static_cast<uint64_t>(std::max(num_prompt_tokens, 0));
  s_.time_to_first_token.observe(ttft);
}

void EngineMetrics::record_token(double itl) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.inter_token_latency.observe(itl);
}

void EngineMetrics::record_generated(uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.generation_tokens += n;
}

void EngineMetrics::record_finish(FinishReason reason, double e2e) {
  std::lock_guard<std::mutex> lock(mu_);
  ++s_.num_requests_finished[static_cast<size_t>(reason)];
  s_.e2e_request_latency.observe(e2e);
}

void EngineMetrics::set_state(int32_t running, int32_t waiting, double kv_usage, int32_t num_kv_blocks,
                              uint64_t prefix_queries, uint64_t prefix_hits, uint64_t preemptions) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.num_requests_running = running;
  s_.num_requests_waiting = waiting;
  s_.kv_cache_usage = kv_usage;
  s_.num_kv_blocks = num_kv_blocks;
  s_.prefix_cache_queries = prefix_queries;
  s_.prefix_cache_hits = prefix_hits;
  s_.num_preemptions = preemptions;
}

void EngineMetrics::set_kv_blocks(int32_t in_use, int32_t held_for_remote, int32_t held_for_loads) {
  std::lock_guard<std::mutex> lock(mu_);
  s_.num_kv_blocks_in_use = in_use;
  s_.num_kv_blocks_held_for_remote = held_for_remote;
  s_.num_kv_blocks_held_for_loads = held_for_loads;
}

EngineMetricsSnapshot EngineMetrics::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  return s_;
}

}  // namespace siesta
