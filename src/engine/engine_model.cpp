#include "engine/engine_model.h"

#include <algorithm>
#include <string>
#include <utility>

#include "common/log.h"
#include "common/thread_pool.h"
#include "memory/cuda_backend.h"
#include "memory/host_backend.h"
#include "model/cpu/qwen3_cpu.h"
#include "model/cpu/qwen3_cpu_tp.h"
#include "model/tensor_parallel.h"

namespace siesta {

Result<std::unique_ptr<memory::MemoryBackend>> make_engine_backend(Device device, int cuda_device) {
  if (device == Device::kCpu) {
    auto backend = memory::make_host_backend();
    if (!backend) return backend.error().with_context("creating the host memory pool");
    return std::move(*backend);
  }
  auto backend = memory::make_cuda_backend({.device = cuda_device});
  if (!backend) return backend.error().with_context("--device cuda");
  return std::move(*backend);
}

namespace {

// The engine's model around a CPU model (CpuQwen3 or CpuQwen3Tp) loaded into `pool`.
// `pool` is taken by reference: a by-value parameter could be moved into before the
// load in the first argument, which allocates from *pool, is evaluated.
template <class CpuModel>
Result<EngineModel> cpu_engine_model(Result<std::unique_ptr<CpuModel>> cpu, const EngineOptions& options,
                                     std::unique_ptr<memory::MemoryPool>&& pool) {
  if (!cpu) return cpu.error().with_context("loading the model from " + options.model_dir.string());
  EngineModel m;
  m.memory = std::move(pool);
  CpuModel* model = cpu->get();
  m.weights_bytes = model->weights_bytes();
  m.scratch_bytes = model->scratch_bytes();
  m.prepare_update = [model](const WeightUpdate& u) { return model->prepare_weight_update(u); };
  m.model = std::move(*cpu);
  return m;
}

// The CPU model as a tensor-parallel group (CpuQwen3Tp) of options.tensor_parallel_size ranks.
Result<EngineModel> load_cpu_tp_model(const EngineOptions& options, ThreadPool& threads,
                                      std::unique_ptr<memory::MemoryPool> pool) {
  SIESTA_ASSIGN_OR_RETURN(const ModelConfig cfg, ModelConfig::load(options.model_dir));
  if (auto planned = plan_tensor_parallel(cfg, options.tensor_parallel_size); !planned)
    return planned.error().with_context("--tensor-parallel-size " + std::to_string(options.tensor_parallel_size));
  return cpu_engine_model(CpuQwen3Tp::load(options.model_dir, options.tensor_parallel_size, threads, *pool,
                                           std::max(0, options.max_num_batched_tokens)),
                          options, std::move(pool));
}

}  // namespace

Result<EngineModel> load_engine_model(const EngineOptions& options, ThreadPool& threads) {
  SIESTA_TRY(validate_tensor_parallel_size(options));
  SIESTA_ASSIGN_OR_RETURN(std::unique_ptr<memory::MemoryBackend> backend, make_engine_backend(options.device, options.cuda_device));
  memory::PoolOptions po;
  po.keep_offload_buffers = options.device == Device::kCuda && options.keep_offload_buffers;
  auto pool = std::make_unique<memory::MemoryPool>(std::move(backend), po);
  if (options.device == Device::kCuda) {
    SIESTA_ASSIGN_OR_RETURN(EngineModel m, load_cuda_engine_model(options, std::move(pool)));
    // A sleep-mode engine's first level-1 sleep copies the weights into a host
    // buffer made and pinned now, in the background, not into fresh pages.
    if (options.enable_sleep_mode && options.keep_offload_buffers) {
      Result<uint64_t> made = m.memory->prepare_offload_buffers(memory::TagSet{memory::Tag::kWeights});
      if (!made) return made.error().with_context("--enable-sleep-mode");
    }
    return m;
  }

  if (options.tensor_parallel_size > 1) return load_cpu_tp_model(options, threads, std::move(pool));
  return cpu_engine_model(
      CpuQwen3::load(options.model_dir, threads, *pool, std::max(0, options.max_num_batched_tokens)), options,
      std::move(pool));
}

Result<uint64_t> kv_cache_budget(const EngineOptions& options, const EngineModel& model) {
  if (options.kv_cache_memory_bytes) return *options.kv_cache_memory_bytes;
  if (options.device == Device::kCpu || !model.device_at_start || !model.device_after_load)
    return kDefaultCpuKvCacheBytes;
  return kv_cache_bytes_for_utilization(options.gpu_memory_utilization, *model.device_at_start,
                                        *model.device_after_load);
}

}  // namespace siesta
