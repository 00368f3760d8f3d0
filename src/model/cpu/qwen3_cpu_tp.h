// CpuQwen3Tp: the fp32 CPU model run as a tensor-parallel group of `tp`
// ranks in one process, with TP=1's logits bit for bit.
//
//   memory::MemoryPool memory(memory::make_host_backend().value());
//   SIESTA_ASSIGN_OR_RETURN(auto model, CpuQwen3Tp::load(model_dir, /*tp=*/2, threads, memory, 2048));
//   model->forward(batch, kv_view, out);               // the same KvCacheView as CpuQwen3's
//   model->reload_weights(dir);  model->prepare_weight_update(update);   // as CpuQwen3
//   model.reset();                                     // frees its pool allocations; before the pool goes
//
// Layout (model/tensor_parallel.h). Rank r holds only its shard of every
// tensor, as tensor_shard says: QKV and gate/up by output rows, O and down by
// input columns, the embedding and LM head by vocabulary rows (one shard when
// tied), norms whole. Each rank's weights are one pool allocation tagged
// `weights` ("weights (rank r)"), its activations one tagged `scratch`
// ("activations (rank r)": its replica of the residual stream, its heads'
// q/k/v and attention output, its intermediate columns); the group's chain
// buffer is one more `scratch` allocation. So the engine's sleep levels see
// every byte, and reload_weights / prepare_weight_update write each rank's
// shards of the full tensors they read, in place.
//
// The forward, per layer: every rank normalises its residual replica and
// runs its column-parallel QKV; the ranks write their KV heads into the one
// KV cache the engine hands over (a replicated head by its first replica
// only; the others read it and skip its K/V projections); each rank attends
// with its query heads; the O projection is a row-parallel chain
// (cpu/tp_collective.h) whose result every rank adds to its residual; the
// same for gate/up (column-parallel) and down (row-parallel). The embedding
// row of a token is broadcast from the rank that holds it, and the LM head's
// vocabulary slices are gathered into full rows. Column-parallel outputs are
// whole dot products on one rank, the chain keeps dot()'s lane order across
// the K split, and every other step is elementwise, so the logits equal
// CpuQwen3's bit for bit for every tp plan_tensor_parallel accepts (TP=1's
// batch and chunk invariance carries over).
//
// Ranks take turns on the calling thread (TpCollective): the group does the
// work of TP=1 (plus each rank's norms), not faster; it is the CPU model of
// a sharded engine, for checking the layout end to end.
//
// Thread safety: as CpuQwen3 (forward and the weight calls from one thread).
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "memory/memory_pool.h"
#include "model/config.h"
#include "model/cpu/qwen3_cpu.h"
#include "model/cpu/tp_collective.h"
#include "model/forward.h"
#include "model/tensor_parallel.h"
#include "model/weight_update.h"

namespace siesta {

class ThreadPool;

class CpuQwen3Tp final : public Model {
 public:
  // Weights and scratch from `memory`, which must outlive the model. A tp the
  // config does not divide into is kInvalidArgument (plan_tensor_parallel's message).
  static Result<std::unique_ptr<CpuQwen3Tp>> load(const std::filesystem::path& model_dir, int tp,
                                                  ThreadPool& threads, memory::MemoryPool& memory,
                                                  int32_t scratch_rows);
  // Weights and scratch from a host pool of the model's own.
  static Result<std::unique_ptr<CpuQwen3Tp>> load(const std::filesystem::path& model_dir, int tp,
                                                  ThreadPool& threads);
  ~CpuQwen3Tp() override;
  CpuQwen3Tp(const CpuQwen3Tp&) = delete;
  CpuQwen3Tp& operator=(const CpuQwen3Tp&) = delete;

  const ModelConfig& config() const override { return cfg_; }
  KvCacheLayout kv_layout() const override { return KvCacheLayout::for_model(cfg_, sizeof(float)); }
  Result<void> forward(std::span<const SequenceChunk> batch, const KvCacheView& kv, ForwardOutput& out) override;

  // As CpuQwen3's: every rank's shards of the checkpoint's (or the pushed)
  // full tensors, checked first, written in place.
  Result<void> reload_weights(const std::filesystem::path& model_dir);
  Result<std::unique_ptr<PreparedWeightUpdate>> prepare_weight_update(const WeightUpdate& update);

  const TensorParallelLayout& layout() const { return layout_; }
  uint64_t weights_bytes() const;  // every rank's
  uint64_t scratch_bytes() const;  // every rank's and the chain buffer
  // Floats of rank r's shards (its weights allocation holds them, rounded up to pages).
  size_t rank_weights_numel(int rank) const { return ranks_.at(static_cast<size_t>(rank)).numel; }

 private:
  struct Rank {
    std::optional<memory::Allocation> weights;
    cpu::Weights w;
    size_t numel = 0;
    std::map<std::string, cpu::TensorPlace> places;  // shard of each Hugging Face tensor in w.arena
    std::vector<TensorShard> shards;                 // by arena order
    std::optional<memory::Allocation> scratch;
    std::vector<float> heap;    // activations of a batch larger than the scratch
    std::vector<float> logits;  // this rank's vocabulary slice of the wanted rows
  };

  CpuQwen3Tp(ModelConfig cfg, TensorParallelLayout layout, std::unique_ptr<memory::MemoryPool> own_memory,
             memory::MemoryPool& memory, ThreadPool& threads);
  Result<void> reserve_memory(const std::filesystem::path& model_dir, int32_t scratch_rows);
  Result<void> require_resident_weights(const std::string& where) const;
  Result<std::unique_ptr<PreparedWeightUpdate>> prepare_update(const WeightUpdate& update, const std::string& call);
  size_t rank_scratch_numel_per_row() const;

  ModelConfig cfg_;
  TensorParallelLayout layout_;
  std::unique_ptr<memory::MemoryPool> own_memory_;  // set when load() made the pool
  memory::MemoryPool& memory_;
  ThreadPool& threads_;
  std::vector<Rank> ranks_;
  std::optional<memory::Allocation> chain_alloc_;
  std::optional<cpu::TpCollective> group_;
  size_t scratch_rows_ = 0;
  std::vector<float> inv_freq_;
};

}  // namespace siesta
