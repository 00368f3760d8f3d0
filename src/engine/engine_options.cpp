#include "engine/engine_options.h"

#include <algorithm>

#include <fmt/format.h>

#include "common/log.h"

namespace siesta {
namespace {

std::string num(int64_t v) { return std::to_string(v); }
std::string num(uint64_t v) { return std::to_string(v); }

}  // namespace

Result<EngineLimits> resolve_engine_limits(const EngineOptions& o, const ModelConfig& cfg, const KvCacheLayout& layout) {
  if (o.max_num_seqs < 1) return invalid_argument("--max-num-seqs must be at least 1, got " + num(int64_t{o.max_num_seqs}));
  if (o.max_num_batched_tokens < 1)
    return invalid_argument("--max-num-batched-tokens must be at least 1, got " + num(int64_t{o.max_num_batched_tokens}));
  if (!(o.max_held_seconds > 0) || o.max_held_seconds > 86400 * 7)
    return invalid_argument("--max-held-seconds must be in (0, 604800], got " + std::to_string(o.max_held_seconds));
  if (o.max_held_requests < 0)
    return invalid_argument("--max-held-requests must be at least 0, got " + num(int64_t{o.max_held_requests}));
  if (o.max_model_len && *o.max_model_len < 2)
    return invalid_argument("--max-model-len must be at least 2 (one prompt token and one generated), got " +
                            num(int64_t{*o.max_model_len}));
  if (cfg.max_position_embeddings > 0 && o.max_model_len && *o.max_model_len > cfg.max_position_embeddings)
    return invalid_argument("--max-model-len " + num(int64_t{*o.max_model_len}) +
                            " is larger than the model's max_position_embeddings (" +
                            num(int64_t{cfg.max_position_embeddings}) + ")");

  EngineLimits l;
  l.block_size = layout.block_size;
  l.max_num_seqs = o.max_num_seqs;
  l.max_num_batched_tokens = o.max_num_batched_tokens;
  l.vocab_size = cfg.vocab_size;
  l.enable_prefix_caching = o.enable_prefix_caching;
  const uint64_t block_bytes = layout.block_bytes();
  if (block_bytes == 0) return invalid_argument("the model's KV cache layout has 0 bytes per block");

  int64_t blocks = 0;
  if (o.num_kv_blocks) {
    if (*o.num_kv_blocks < 1) return invalid_argument("--num-kv-blocks must be at least 1, got " + num(int64_t{*o.num_kv_blocks}));
    blocks = *o.num_kv_blocks;
  } else {
    const uint64_t bytes = o.kv_cache_memory_bytes.value_or(kDefaultCpuKvCacheBytes);
    blocks = static_cast<int64_t>(bytes / block_bytes);
    if (blocks < 1)
      return invalid_argument("--kv-cache-memory-bytes " + num(bytes) + " is less than one KV block of this model (" +
                              num(block_bytes) + " bytes = " + num(int64_t{layout.block_size}) + " tokens)");
  }
  blocks = std::min<int64_t>(blocks, INT32_MAX);
  l.num_kv_blocks = static_cast<int32_t>(blocks);
  l.kv_cache_bytes = static_cast<uint64_t>(blocks) * block_bytes;

  const int64_t capacity_tokens = blocks * layout.block_size;
  if (o.max_model_len) {
    if (*o.max_model_len > capacity_tokens)
      return invalid_argument("--max-model-len " + num(int64_t{*o.max_model_len}) + " needs " +
                              num((int64_t{*o.max_model_len} + layout.block_size - 1) / layout.block_size) +
                              " KV blocks for one request, but the KV cache has " + num(blocks) + " blocks (" +
                              num(capacity_tokens) + " tokens, " + num(l.kv_cache_bytes) +
                              " bytes); lower --max-model-len or raise --kv-cache-memory-bytes");
    l.max_model_len = *o.max_model_len;
  } else {
    const int64_t model_max = cfg.max_position_embeddings > 0 ? cfg.max_position_embeddings : capacity_tokens;
    l.max_model_len = static_cast<int32_t>(std::min(model_max, capacity_tokens));
    if (l.max_model_len < model_max)
      SIESTA_LOG_WARN(
          "engine: the KV cache ({} blocks, {} tokens) cannot hold the model's max_position_embeddings ({}); "
          "max_model_len set to {}. Raise --kv-cache-memory-bytes to serve longer requests",
          blocks, capacity_tokens, model_max, l.max_model_len);
    if (l.max_model_len < 2)
      return invalid_argument("the KV cache holds " + num(capacity_tokens) +
                              " tokens, too few for one request; raise --kv-cache-memory-bytes");
  }
  return l;
}

const char* device_name(Device device) {
  switch (device) {
    case Device::kCpu: return "cpu";
    case Device::kCuda: return "cuda";
  }
  return "unknown";
}

Result<Device> parse_device(std::string_view text) {
  if (text == "cpu") return Device::kCpu;
  if (text == "cuda") return Device::kCuda;
  return invalid_argument("--device must be cpu or cuda, got '" + std::string(text) + "'");
}

Result<DeviceSpec> parse_device_spec(std::string_view text) {
  if (text.rfind("cuda:", 0) == 0) {
    std::string_view n = text.substr(5);
    int ordinal = 0;
    bool digits = !n.empty() && n.size() <= 4;
    for (char c : n) {
      if (c < '0' || c > '9') digits = false;
      else ordinal = ordinal * 10 + (c - '0');
    }
    if (!digits)
      return invalid_argument("--device: expected cpu, cuda or cuda:N (a device ordinal), got '" + std::string(text) +
                              "'");
    return DeviceSpec{Device::kCuda, ordinal};
  }
  auto d = parse_device(text);
  if (!d)
    return invalid_argument("--device: expected cpu, cuda or cuda:N, got '" + std::string(text) + "'");
  return DeviceSpec{*d, 0};
}

Result<void> validate_tensor_parallel_size(const EngineOptions& options) {
  const int32_t tp = options.tensor_parallel_size;
  if (tp < 1) return invalid_argument(fmt::format("--tensor-parallel-size must be at least 1, got {}", tp));
  if (options.device == Device::kCuda && tp != 1)
    return invalid_argument(fmt::format(
        "--tensor-parallel-size {}: tensor parallelism on CUDA is not built yet; use --tensor-parallel-size 1 "
        "with --device cuda (the CPU model runs sharded with --device cpu)",
        tp));
  return {};
}

Result<void> validate_gpu_memory_utilization(double u) {
  if (!(u > 0.0 && u <= 1.0))
    return invalid_argument("--gpu-memory-utilization must be in (0, 1] (a fraction of the device's memory, "
                            "default 0.9), got " + std::to_string(u));
  return {};
}

Result<uint64_t> kv_cache_bytes_for_utilization(double u, const memory::DeviceMemoryInfo& at_start,
                                                const memory::DeviceMemoryInfo& now) {
  SIESTA_TRY(validate_gpu_memory_utilization(u));
  auto gib = [](uint64_t b) { return fmt::format("{:.2f} GiB", static_cast<double>(b) / (1 << 30)); };
  const uint64_t requested = static_cast<uint64_t>(u * static_cast<double>(at_start.total_bytes));
  if (at_start.free_bytes < requested)
    return out_of_memory(fmt::format(
        "--gpu-memory-utilization {} asks for {} of the device's {}, but only {} was free at startup (other "
        "processes hold the rest); lower --gpu-memory-utilization or set --kv-cache-memory-bytes",
        u, gib(requested), gib(at_start.total_bytes), gib(at_start.free_bytes)));
  const uint64_t taken = at_start.free_bytes > now.free_bytes ? at_start.free_bytes - now.free_bytes : 0;
  if (taken >= requested)
    return out_of_memory(fmt::format(
        "the weights and activation buffers take {}, which leaves nothing for the KV cache within "
        "--gpu-memory-utilization {} ({} of {}); raise --gpu-memory-utilization, lower --max-num-batched-tokens / "
        "--max-num-seqs, or set --kv-cache-memory-bytes",
        gib(taken), u, gib(requested), gib(at_start.total_bytes)));
  return requested - taken;
}

}  // namespace siesta
