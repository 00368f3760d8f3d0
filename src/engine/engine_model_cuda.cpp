// load_cuda_engine_model: CudaQwen3 on the engine's cuMem pool (compiled when
// the build has CUDA; engine_model_cuda_absent.cpp otherwise).
#include <utility>

#include "common/log.h"
#include "engine/engine_model.h"
#include "model/cuda/pool_allocator.h"
#include "model/cuda/qwen3_cuda.h"

namespace siesta {

Result<EngineModel> load_cuda_engine_model(const EngineOptions& options, std::unique_ptr<memory::MemoryPool> pool) {
  EngineModel m;
  auto at_start = pool->backend().memory_info();
  if (!at_start) return at_start.error().with_context("--device cuda: reading the device's free memory");
  m.device_at_start = *at_start;

  CudaModelOptions mo;
  mo.device = options.cuda_device;
  mo.max_batch_tokens = std::max(1, options.max_num_batched_tokens);
  mo.max_seqs = std::max(1, options.max_num_seqs);
  mo.max_model_len = options.max_model_len.value_or(0);  // 0: the model's default
  mo.batch_invariant = options.batch_invariant;
  auto model = CudaQwen3::load(options.model_dir, std::make_unique<cuda::PoolDeviceAllocator>(*pool), mo);
  if (!model) return model.error().with_context("loading the model from " + options.model_dir.string() + " on CUDA");
  // Kernels and cuBLASLt's plans load here, not in the first request.
  if (Result<void> warm = (*model)->warm_up(); !warm) return warm.error().with_context("warming up the CUDA model");
  auto after = pool->backend().memory_info();
  if (!after) return after.error().with_context("--device cuda: reading the device's free memory");
  m.device_after_load = *after;

  CudaQwen3* cuda_model = model->get();
  m.weights_bytes = cuda_model->weight_bytes();
  m.scratch_bytes = cuda_model->scratch_bytes();
  m.max_model_len = cuda_model->options().max_model_len;
  m.prepare_update = [cuda_model](const WeightUpdate& u) { return cuda_model->prepare_weight_update(u); };
  m.model = std::move(*model);
  m.memory = std::move(pool);
  return m;
}

}  // namespace siesta
