// EngineOptions: how an Engine is built (model, KV cache size, scheduler
// limits), and EngineLimits: the numbers it runs with once the model is known.
//
//   EngineOptions o;  o.model_dir = "models/tiny-qwen3";  o.max_num_seqs = 64;
//   Result<EngineLimits> l = resolve_engine_limits(o, model.config(), model.kv_layout());
//
// The KV cache is sized by bytes (--kv-cache-memory-bytes, vLLM's flag; CPU
// default kDefaultCpuKvCacheBytes) or by a block count that overrides it.
// max_model_len defaults to the model's max_position_embeddings; when the KV
// cache cannot hold that many tokens for one request, the default is lowered to
// what fits (with a warning), while an explicit max_model_len that does not fit
// is an error naming both numbers. A plain value; no threads involved.
//
// Device: the CPU engine (fp32 reference model, host memory pool) or the CUDA
// engine (bf16 model, cuMem pool on device 0). On CUDA without an explicit KV
// size, the KV cache gets what --gpu-memory-utilization leaves after the
// weights and the activations (kv_cache_bytes_for_utilization).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"
#include "engine/step_record.h"
#include "memory/backend.h"
#include "model/config.h"
#include "model/forward.h"

namespace siesta {

inline constexpr uint64_t kDefaultCpuKvCacheBytes = uint64_t{4} << 30;
inline constexpr double kDefaultGpuMemoryUtilization = 0.9;

enum class Device : uint8_t {
  kCpu = 0,   // CpuQwen3, host memory pool
  kCuda = 1,  // CudaQwen3 on CUDA device 0, cuMem memory pool
};

const char* device_name(Device device);  // "cpu", "cuda"
// "cpu" or "cuda"; anything else is kInvalidArgument naming both.
Result<Device> parse_device(std::string_view text);

// "cpu", "cuda" (device 0) or "cuda:N": the device and the CUDA ordinal.
struct DeviceSpec {
  Device device = Device::kCpu;
  int cuda_device = 0;
};
Result<DeviceSpec> parse_device_spec(std::string_view text);

struct EngineOptions {
  std::filesystem::path model_dir;
  size_t threads = 0;                         // CPU threads for the model (0: all cores)
  int32_t max_num_seqs = 256;                 // requests running at once
  int32_t max_num_batched_tokens = 2048;      // tokens per step (prefill chunks + decodes)
  std::optional<int32_t> max_model_len;       // prompt + output tokens of one request
  std::optional<uint64_t> kv_cache_memory_bytes;
  std::optional<int32_t> num_kv_blocks;       // overrides kv_cache_memory_bytes
  bool enable_prefix_caching = true;
  std::optional<uint64_t> seed;               // the generator of requests without a seed (default: random)
  // sleep, wake_up and release_kv_cache_memory (--enable-sleep-mode). The
  // memory comes from the sleep-capable pool either way.
  bool enable_sleep_mode = false;
  // Requests that arrive while the engine is paused or asleep wait, up to this
  // many; beyond, submit answers kUnavailable (HTTP 503).
  int32_t max_held_requests = 1024;
  // ... and at most this long: a request held longer ends with an error
  // (kUnavailable) that names the state, and how to get out of it.
  double max_held_seconds = 600.0;
  Device device = Device::kCpu;
  // --tensor-parallel-size (vLLM's name, also -tp): the model runs as this
  // many ranks, each holding its shard of every tensor (model/tensor_parallel.h).
  // CPU: CpuQwen3Tp, ranks in this process over the one KV cache, logits
  // identical to 1. CUDA: only 1 (tensor parallelism on CUDA is not built).
  int32_t tensor_parallel_size = 1;
  int cuda_device = 0;  // --device cuda:N: the CUDA device ordinal (after CUDA_VISIBLE_DEVICES)
  // --device cuda: the fraction of the device's total memory this engine may
  // take (vLLM's --gpu-memory-utilization); the KV cache gets what it leaves
  // after weights and activations. kv_cache_memory_bytes or num_kv_blocks,
  // when set, take precedence.
  double gpu_memory_utilization = kDefaultGpuMemoryUtilization;
  // --device cuda: a request's tokens do not depend on what else is batched
  // with it, nor on how its prompt was chunked (fixed-order GEMMs and one
  // attention arithmetic per row). Off (--no-batch-invariant): cuBLASLt and
  // split-KV decode attention, faster at some shapes, rounding that changes
  // with the batch. The CPU model is batch-invariant always.
  bool batch_invariant = true;
  // --device cuda: tokens are chosen on the device and only they come back
  // (run_step). Off: every row of logits comes back and the host sampler
  // picks; the tokens are the same either way (for comparing the two).
  bool sample_on_device = true;
  // --device cuda: the host buffer a level-1 sleep copies the weights into is
  // kept after the wake and pinned in the background, so that later level-1
  // sleeps and wakes copy at the pinned DMA bandwidth instead of faulting in
  // fresh pages (memory/README.md). With sleep mode the buffer is made at
  // start (and pinned in the background), so that the first level-1 sleep is
  // as fast as the later ones. Costs host memory the size of the weights while
  // awake (GET /memory: kept_host_bytes); a level-2 sleep drops it.
  bool keep_offload_buffers = true;
  // Called on the loop thread after every step that computed something,
  // with its batch and times (step_record.h); for benchmarks. Must return
  // quickly and must not call the engine.
  StepObserver step_observer;
};

struct EngineLimits {
  int32_t num_kv_blocks = 0;
  int32_t block_size = kBlockSize;
  uint64_t kv_cache_bytes = 0;                // num_kv_blocks * bytes per block
  int32_t max_model_len = 0;
  int32_t max_num_seqs = 0;
  int32_t max_num_batched_tokens = 0;
  int32_t vocab_size = 0;
  bool enable_prefix_caching = true;
};

// Checks the options against the model and sizes the KV cache. Errors name
// the option, its value and what would work.
Result<EngineLimits> resolve_engine_limits(const EngineOptions& options, const ModelConfig& config,
                                           const KvCacheLayout& layout);

// Checks --tensor-parallel-size before the model loads: at least 1, and 1 on
// CUDA. Whether the model's shapes divide is plan_tensor_parallel's check.
Result<void> validate_tensor_parallel_size(const EngineOptions& options);

// Checks --gpu-memory-utilization: in (0, 1].
Result<void> validate_gpu_memory_utilization(double utilization);

// The KV cache bytes --gpu-memory-utilization leaves, as vLLM computes them:
// utilization x total device memory, minus what this engine took since its
// CUDA context existed (`at_start`, measured before the model loaded; `now`,
// after its weights and activation buffers). Other processes' memory is not
// counted against it, but the device must have had that much free at start.
// Errors name the numbers and the flag to change.
Result<uint64_t> kv_cache_bytes_for_utilization(double utilization, const memory::DeviceMemoryInfo& at_start,
                                                const memory::DeviceMemoryInfo& now);

}  // namespace siesta
