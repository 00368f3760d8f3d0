// EngineModel: the model an Engine (or `siesta generate`) runs, on the device
// its options name, with the memory pool every byte of it comes from.
//
//   ThreadPool threads(options.threads);
//   SIESTA_ASSIGN_OR_RETURN(EngineModel m, load_engine_model(options, threads));
//   SIESTA_ASSIGN_OR_RETURN(uint64_t kv_bytes, kv_cache_budget(options, m));   // the KV cache's size
//   KvCacheMemory kv = KvCacheMemory::allocate(*m.memory, m.model->kv_layout(), blocks).value();
//   m.model->forward(batch, kv.view(), out);
//   auto up = m.prepare_update(update).value();     // in place (sleep level 2, weight updates):
//   up->apply();                                    // checked first, then written (model/weight_update.h)
//   // destroy the model (and the KV cache) before m.memory
//
// CPU: CpuQwen3 (fp32) with a host pool (memfd); with tensor_parallel_size
// N > 1, CpuQwen3Tp (N ranks in this process, each rank's shards and
// activations its own pool allocations, the same logits). CUDA: CudaQwen3 (bf16) on
// device 0 with a cuMem pool: weights tagged `weights` (256 MiB chunks),
// activations, workspaces and step metadata tagged `scratch`; the KV cache,
// allocated by the caller, is one `kv_cache` allocation. Without a GPU (or
// a build without CUDA) --device cuda fails with one line naming the reason.
// Thread safety: the values are used by one thread at a time (the engine loop).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>

#include "common/status.h"
#include "engine/engine_options.h"
#include "memory/memory_pool.h"
#include "model/forward.h"
#include "model/weight_update.h"

namespace siesta {

class ThreadPool;

struct EngineModel {
  std::unique_ptr<memory::MemoryPool> memory;  // declared first: outlives the model
  std::unique_ptr<Model> model;
  // Checks an in-place weight update (a checkpoint directory, host shared
  // memory, CUDA IPC buffers: what the model takes); apply() writes it.
  std::function<Result<std::unique_ptr<PreparedWeightUpdate>>(const WeightUpdate&)> prepare_update;
  uint64_t weights_bytes = 0;
  uint64_t scratch_bytes = 0;
  // The longest context the model was built for (CUDA: its RoPE table and
  // decode buffers); 0 when only the config bounds it.
  int32_t max_model_len = 0;
  // CUDA: device memory when the pool's context existed and after the model
  // loaded (what --gpu-memory-utilization is computed from).
  std::optional<memory::DeviceMemoryInfo> device_at_start;
  std::optional<memory::DeviceMemoryInfo> device_after_load;
};

// The pool's backend for a device: host (memfd) or CUDA device `cuda_device` (cuMem).
Result<std::unique_ptr<memory::MemoryBackend>> make_engine_backend(Device device, int cuda_device = 0);

// Makes the pool and loads options.model_dir into it. Uses
// max_num_batched_tokens and max_num_seqs (activation buffers),
// max_model_len (CUDA), batch_invariant (CUDA), threads (CPU) and
// tensor_parallel_size (checked first: validate_tensor_parallel_size).
Result<EngineModel> load_engine_model(const EngineOptions& options, ThreadPool& threads);

// The KV cache size in bytes when the options give none (CPU: 4 GiB; CUDA:
// what --gpu-memory-utilization leaves); the explicit size otherwise.
Result<uint64_t> kv_cache_budget(const EngineOptions& options, const EngineModel& model);

// The CUDA half of load_engine_model (engine_model_cuda.cpp; a build without
// CUDA answers kUnavailable).
Result<EngineModel> load_cuda_engine_model(const EngineOptions& options, std::unique_ptr<memory::MemoryPool> pool);

}  // namespace siesta
