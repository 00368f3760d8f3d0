// The engine's metrics as Prometheus text (exposition format 0.0.4), with
// vLLM's metric names under the `siesta:` prefix and a model_name label:
//   siesta:num_requests_running / _waiting, siesta:kv_cache_usage_perc (0..1)
//   siesta:prompt_tokens_total, siesta:generation_tokens_total
//   siesta:request_success_total{finished_reason="stop|length|abort"}
//   siesta:time_to_first_token_seconds, siesta:inter_token_latency_seconds,
//   siesta:e2e_request_latency_seconds (histograms)
//   siesta:prefix_cache_queries_total, siesta:prefix_cache_hits_total (tokens)
//   siesta:num_preemptions_total, siesta:kv_blocks_in_use
//   P/D (with a connector): siesta:kv_blocks_held_for_remote,
//   siesta:kv_blocks_held_for_loads, siesta:kv_transfers_total{outcome},
//   siesta:kv_transfer_bytes_total, siesta:kv_transfer_seconds,
//   siesta:kv_loads_total{outcome}, siesta:kv_load_bytes_total,
//   siesta:kv_load_seconds, siesta:kv_recomputed_requests_total,
//   siesta:kv_sends_total{outcome}
//   siesta:engine_sleep_state{sleep_state="awake|weights_offloaded|discard_all"}
//     (1 for the engine's state, as vLLM's gauge: awake 0 while asleep,
//     weights_offloaded 1 at level 1, discard_all 1 at level 2)
// With vllm_names, the families vLLM's dashboards chart appear a second time
// under vLLM's names (vllm:num_requests_running, vllm:kv_cache_usage_perc and
// its older vllm:gpu_cache_usage_perc, vllm:time_to_first_token_seconds,
// vllm:inter_token_latency_seconds and vllm:time_per_output_token_seconds,
// ...), with vLLM's engine="0" label.
// Built from one EngineMetricsSnapshot with prometheus-cpp's serializer.
// A pure function.
#pragma once

#include <string>

#include "engine/engine_metrics.h"
#include "engine/engine_state.h"

namespace siesta::server {

inline constexpr const char* kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

struct PrometheusOptions {
  EngineState state = EngineState::kRunning;  // for siesta:engine_sleep_state
  bool vllm_names = false;
};

std::string render_prometheus(const EngineMetricsSnapshot& metrics, const std::string& model_name,
                              const PrometheusOptions& options = {});

}  // namespace siesta::server
