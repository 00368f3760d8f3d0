#include "server/prometheus_text.h"

#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <limits>
#include <sstream>
#include <vector>

namespace siesta::server {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;

struct Families {
  std::vector<MetricFamily> all;
  std::string model;

  ClientMetric& add(const std::string& name, const std::string& help, MetricType type) {
    all.push_back(MetricFamily{name, help, type, {}});
    all.back().metric.emplace_back();
    all.back().metric.back().label = {{"model_name", model}};
    return all.back().metric.back();
  }
  void gauge(const std::string& name, const std::string& help, double v) {
    add(name, help, MetricType::Gauge).gauge.value = v;
  }
  void counter(const std::string& name, const std::string& help, double v) {
    add(name, help, MetricType::Counter).counter.value = v;
  }
  void labelled_counter(const std::string& name, const std::string& help, const std::string& label,
                        const std::vector<std::pair<std::string, uint64_t>>& values) {
    all.push_back(MetricFamily{name, help, MetricType::Counter, {}});
    for (const auto& [value, count] : values) {
      ClientMetric m;
      m.label = {{label, value}, {"model_name", model}};
      m.counter.value = static_cast<double>(count);
      all.back().metric.push_back(std::move(m));
    }
  }
  void histogram(const std::string& name, const std::string& help, const Histogram& h) {
    ClientMetric& m = add(name, help, MetricType::Histogram);
    m.histogram.sample_count = h.count;
    m.histogram.sample_sum = h.sum;
    uint64_t cumulative = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      cumulative += h.counts[i];
      m.histogram.bucket.push_back({cumulative, h.bounds[i]});
    }
    m.histogram.bucket.push_back({h.count, std::numeric_limits<double>::infinity()});
  }
};

// vLLM's names for the families its dashboards chart (siesta name -> vLLM names).
const std::vector<std::pair<std::string, std::vector<std::string>>>& vllm_aliases() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> kAliases = {
      {"siesta:num_requests_running", {"vllm:num_requests_running"}},
      {"siesta:num_requests_waiting", {"vllm:num_requests_waiting"}},
      {"siesta:kv_cache_usage_perc", {"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"}},
      {"siesta:prompt_tokens_total", {"vllm:prompt_tokens_total"}},
      {"siesta:generation_tokens_total", {"vllm:generation_tokens_total"}},
      {"siesta:request_success_total", {"vllm:request_success_total"}},
      {"siesta:prefix_cache_queries_total", {"vllm:prefix_cache_queries_total"}},
      {"siesta:prefix_cache_hits_total", {"vllm:prefix_cache_hits_total"}},
      {"siesta:num_preemptions_total", {"vllm:num_preemptions_total"}},
      {"siesta:time_to_first_token_seconds", {"vllm:time_to_first_token_seconds"}},
      {"siesta:inter_token_latency_seconds",
       {"vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"}},
      {"siesta:e2e_request_latency_seconds", {"vllm:e2e_request_latency_seconds"}},
      {"siesta:engine_sleep_state", {"vllm:engine_sleep_state"}},
  };
  return kAliases;
}

void add_sleep_state(Families& f, EngineState state) {
  f.all.push_back(MetricFamily{"siesta:engine_sleep_state",
                               "Engine sleep state; awake = 0 means the engine is sleeping; awake = 1 means it is "
                               "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                               MetricType::Gauge,
                               {}});
  const std::pair<const char*, bool> states[] = {{"awake", !engine_is_sleeping(state)},
                                                  {"weights_offloaded", state == EngineState::kSleepingLevel1},
                                                  {"discard_all", state == EngineState::kSleepingLevel2}};
  for (const auto& [name, on] : states) {
    ClientMetric m;
    m.label = {{"model_name", f.model}, {"sleep_state", name}};
    m.gauge.value = on ? 1 : 0;
    f.all.back().metric.push_back(std::move(m));
  }
}

}  // namespace

std::string render_prometheus(const EngineMetricsSnapshot& s, const std::string& model_name,
                              const PrometheusOptions& options) {
  Families f{{}, model_name};
  f.gauge("siesta:num_requests_running", "Number of requests in model execution batches.", s.num_requests_running);
  f.gauge("siesta:num_requests_waiting", "Number of requests waiting to be processed.", s.num_requests_waiting);
  f.gauge("siesta:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage);
  f.counter("siesta:prompt_tokens_total", "Number of prefill tokens processed.", static_cast<double>(s.prompt_tokens));
  f.counter("siesta:generation_tokens_total", "Number of generation tokens processed.",
            static_cast<double>(s.generation_tokens));
  {
    f.all.push_back(MetricFamily{"siesta:request_success_total", "Count of finished requests by finish reason.",
                                 MetricType::Counter, {}});
    for (FinishReason r : {FinishReason::kStop, FinishReason::kLength, FinishReason::kAbort}) {
      ClientMetric m;
      m.label = {{"finished_reason", finish_reason_name(r)}, {"model_name", model_name}};
      m.counter.value = static_cast<double>(s.finished(r));
      f.all.back().metric.push_back(std::move(m));
    }
  }
  f.counter("siesta:num_requests_submitted_total", "Number of requests accepted by the engine.",
            static_cast<double>(s.num_requests_submitted));
  f.counter("siesta:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
            static_cast<double>(s.prefix_cache_queries));
  f.counter("siesta:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.",
            static_cast<double>(s.prefix_cache_hits));
  f.counter("siesta:num_preemptions_total", "Cumulative number of preemptions from the engine.",
            static_cast<double>(s.num_preemptions));
  f.gauge("siesta:num_kv_blocks", "Number of KV-cache blocks.", s.num_kv_blocks);
  f.histogram("siesta:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
              s.time_to_first_token);
  f.histogram("siesta:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
              s.inter_token_latency);
  f.histogram("siesta:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
              s.e2e_request_latency);
  f.gauge("siesta:kv_blocks_in_use", "KV-cache blocks referenced by a request or a hold.", s.num_kv_blocks_in_use);
  add_sleep_state(f, options.state);
  // The lifecycle state by name (running, draining, paused, sleeping_level_1, ...), one series at 1: what
  // `siesta proxy` reads to route around engines that are asleep, paused or draining.
  f.all.push_back(MetricFamily{"siesta:engine_state", "Engine lifecycle state; the series labelled with the current "
                               "state is 1.", MetricType::Gauge, {}});
  {
    ClientMetric m;
    m.label = {{"model_name", f.model}, {"state", engine_state_name(options.state)}};
    m.gauge.value = 1;
    f.all.back().metric.push_back(std::move(m));
  }
  const KvTransferMetrics& kv = s.kv_transfer;
  if (kv.enabled) {
    f.gauge("siesta:kv_blocks_held_for_remote", "KV-cache blocks a prefill engine holds for remote readers.",
            s.num_kv_blocks_held_for_remote);
    f.gauge("siesta:kv_blocks_held_for_loads",
            "KV-cache blocks a decode engine keeps while a peer may still write them.",
            s.num_kv_blocks_held_for_loads);
    f.labelled_counter("siesta:kv_transfers_total", "KV transfers this engine started, by outcome.", "outcome",
                       {{"done", kv.transfers_done}, {"failed", kv.transfers_failed}});
    f.counter("siesta:kv_transfer_bytes_total", "Bytes of KV moved by transfers this engine started.",
              static_cast<double>(kv.transfer_bytes));
    f.histogram("siesta:kv_transfer_seconds",
                "Histogram of KV transfer time (submit to done: a write's notification acknowledged) in seconds.",
                kv.transfer_seconds);
    f.histogram("siesta:kv_transfer_data_seconds",
                "Histogram of the time from a KV transfer's submit to its bytes in place, in seconds.",
                kv.transfer_data_seconds);
    f.labelled_counter("siesta:kv_loads_total", "Requests that asked for remote KV, by outcome.", "outcome",
                       {{"loaded", kv.loads_done}, {"failed", kv.load_failures}});
    f.counter("siesta:kv_loads_with_logits_total",
              "Loads that brought the prefill engine's logits of the prompt's last position: the first token was "
              "sampled from them and no prompt token was computed here.",
              static_cast<double>(kv.loads_with_logits));
    f.counter("siesta:kv_load_bytes_total", "Bytes of KV loaded into this engine from prefill engines.",
              static_cast<double>(kv.load_bytes));
    f.histogram("siesta:kv_load_seconds", "Histogram of the time from a load's start to its KV in place, in seconds.",
                kv.load_seconds);
    f.counter("siesta:kv_recomputed_requests_total",
              "Requests that asked for remote KV and computed their prompt here instead.",
              static_cast<double>(kv.recomputed_requests));
    f.labelled_counter("siesta:kv_sends_total", "Prefill holds for remote readers that ended, by outcome.", "outcome",
                       {{"sent", kv.sends_done},
                        {"expired", kv.sends_expired},
                        {"aborted", kv.sends_aborted},
                        {"failed", kv.sends_failed}});
    f.counter("siesta:kv_invalidations_sent_total",
              "INVALIDATE messages sent to peers that imported this engine's KV cache, before it was released.",
              static_cast<double>(kv.invalidations_sent));
    f.counter("siesta:kv_invalidation_acks_total",
              "INVALIDATE messages a peer acknowledged (it dropped this engine's memory).",
              static_cast<double>(kv.invalidation_acks));
    f.counter("siesta:kv_invalidations_unanswered_total",
              "INVALIDATE messages not acknowledged before the deadline; the peer was skipped.",
              static_cast<double>(kv.invalidations_unanswered));
    f.counter("siesta:kv_invalidations_received_total",
              "INVALIDATE messages from peers that this engine acknowledged.",
              static_cast<double>(kv.invalidations_received));
    f.counter("siesta:kv_peer_handshakes_total",
              "Peer metadata fetched: at a peer's first use and again after each of its sleeps.",
              static_cast<double>(kv.peer_handshakes));
    f.gauge("siesta:kv_epoch", "This engine's transfer epoch: bumped by every registration of its KV cache.",
            static_cast<double>(kv.epoch));
  }
  if (options.vllm_names) {
    std::vector<MetricFamily> copies;
    for (const auto& [ours, theirs] : vllm_aliases()) {
      for (const MetricFamily& fam : f.all) {
        if (fam.name != ours) continue;
        for (const std::string& name : theirs) {
          MetricFamily c = fam;
          c.name = name;
          for (ClientMetric& m : c.metric) m.label.push_back({"engine", "0"});
          copies.push_back(std::move(c));
        }
      }
    }
    for (MetricFamily& c : copies) f.all.push_back(std::move(c));
  }
  std::ostringstream out;
  prometheus::TextSerializer().Serialize(out, f.all);
  return out.str();
}

}  // namespace siesta::server
