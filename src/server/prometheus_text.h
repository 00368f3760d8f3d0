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
// Built from one EngineMetricsSnapshot with prometheus-cpp's serializer.
// A pure function.
#pragma once

#include <string>

#include "engine/engine_metrics.h"

namespace siesta::server {

inline constexpr const char* kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

std::string render_prometheus(const EngineMetricsSnapshot& metrics, const std::string& model_name);

}  // namespace siesta::server
