// CpuQwen3: the fp32 reference implementation of Model on the CPU.
//
//   memory::MemoryPool memory(memory::make_host_backend().value());
//   SIESTA_ASSIGN_OR_RETURN(auto model, CpuQwen3::load(model_dir, threads, memory, /*scratch_rows=*/2048));
//   model->forward(batch, kv_view, out);               // kv_view: the KV cache (engine_kv_cache.h)
//   model->reload_weights(other_dir);                  // in place, same shapes (engine loop, between steps)
//   auto up = model->prepare_weight_update(update);    // pushed tensors (shm) or a directory: checked
//   up.value()->apply();                               // ... then written (model/weight_update.h)
//   model.reset();                                     // frees its pool allocations; before the pool goes
//
// Memory. The weights are converted to fp32 at load into one pool allocation
// tagged `weights`; the activations of one forward live in one allocation
// tagged `scratch`, sized for `scratch_rows` tokens (a larger batch uses heap
// memory for that call). Both keep their addresses for the model's life, so
// the pool can sleep and wake them underneath: while the pool has them
// released the model must not run (the engine guarantees it), and after a
// wake that zero-filled the weights (sleep level 2) reload_weights puts the
// checkpoint back. load(model_dir, threads) without a pool makes a private
// host pool (siesta generate, tests).
//
// Every kernel computes each output element in a fixed order that depends only
// on that element's inputs, so a sequence's logits are bit-identical whatever
// else is in its batch and however its prompt is chunked. forward() uses the
// ThreadPool given at load.
//
// Thread safety: forward and reload_weights from one thread at a time (the
// engine loop); config() and kv_layout() from any thread.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <optional>
#include <span>
#include <vector>

#include "common/status.h"
#include "memory/memory_pool.h"
#include "model/config.h"
#include "model/forward.h"
#include "model/safetensors.h"
#include "model/weight_update.h"

namespace siesta {

class ThreadPool;

namespace cpu {

struct LayerWeights {
  const float* input_norm;   // [hidden]
  const float* q_proj;       // [q_dim, hidden]
  const float* k_proj;       // [kv_dim, hidden]
  const float* v_proj;       // [kv_dim, hidden]
  const float* o_proj;       // [hidden, q_dim]
  const float* q_norm;       // [head_dim]
  const float* k_norm;       // [head_dim]
  const float* post_norm;    // [hidden]
  const float* gate_proj;    // [intermediate, hidden]
  const float* up_proj;      // [intermediate, hidden]
  const float* down_proj;    // [hidden, intermediate]
};

// Where each tensor lives in the weights arena. The places depend only on the
// config, so a reload into the same arena keeps every pointer.
struct Weights {
  std::span<float> arena;
  const float* embed = nullptr;       // [vocab, hidden]
  std::vector<LayerWeights> layers;
  const float* final_norm = nullptr;  // [hidden]
  const float* lm_head = nullptr;     // [vocab, hidden]; == embed when tied
};

// One tensor of a Qwen3 checkpoint: its Hugging Face name and shape, and
// which pointer of a Weights it sets.
struct WeightSlot {
  std::string name;
  std::vector<int64_t> shape;
  const float** dest;
};
// Every tensor of a Qwen3 checkpoint with this config, in arena order, with
// its pointer in w (w.layers is sized to the config; lm_head only untied).
std::vector<WeightSlot> weight_slots(const ModelConfig& cfg, Weights& w);

// Floats the weights of a model with this config take.
size_t weights_numel(const ModelConfig& cfg);

// Where one checkpoint tensor lives in the arena.
struct TensorPlace {
  size_t offset = 0;  // floats from the arena's start
  size_t numel = 0;
};
// Every tensor of a Qwen3 checkpoint with this config, by Hugging Face name.
std::map<std::string, TensorPlace> tensor_places(const ModelConfig& cfg);

// Checks every Qwen3 tensor of `store` (presence, shape, dtype) against cfg,
// and only then converts them into `arena` (weights_numel(cfg) floats) and
// points `w` into it. A failed check leaves the arena untouched; errors name
// the tensor and file.
Result<void> load_weights(const ModelConfig& cfg, const TensorStore& store, std::span<float> arena, Weights& w);

// Floats of activation scratch one token (row) of a forward takes.
size_t scratch_numel_per_row(const ModelConfig& cfg);

// An in-place weight update of a CPU model (CpuQwen3, CpuQwen3Tp): one
// checked tensor's write into a weights arena, converted to fp32.
struct WeightWrite {
  TensorView view;
  std::span<float> dst;
};
// Where an update's tensors go: appends the writes of the tensor `name`,
// whose whole Hugging Face tensor `view` is, to `out`.
using WeightTargets =
    std::function<void(const std::string& name, const TensorView& view, std::vector<WeightWrite>& out)>;
// Whether the weights are mapped; errors open with `where`.
using ResidentCheck = std::function<Result<void>(const std::string& where)>;
// prepare_weight_update of the CPU models: checks `update` (a directory: the
// same architecture and every tensor's shape; shm: the pushed tensors, by
// check_pushed_tensors), then returns the writes `targets` names for each
// tensor, which apply() runs over `threads`. `call` opens the messages.
Result<std::unique_ptr<PreparedWeightUpdate>> prepare_weight_writes(const ModelConfig& cfg,
                                                                     const WeightUpdate& update,
                                                                     const std::string& call, ThreadPool& threads,
                                                                     const ResidentCheck& resident,
                                                                     const WeightTargets& targets);

}  // namespace cpu

class CpuQwen3 final : public Model {
 public:
  // Weights and scratch from `memory`, which must outlive the model.
  static Result<std::unique_ptr<CpuQwen3>> load(const std::filesystem::path& model_dir, ThreadPool& threads,
                                                memory::MemoryPool& memory, int32_t scratch_rows);
  // Weights and scratch from a host pool of the model's own.
  static Result<std::unique_ptr<CpuQwen3>> load(const std::filesystem::path& model_dir, ThreadPool& threads);
  ~CpuQwen3() override;
  CpuQwen3(const CpuQwen3&) = delete;
  CpuQwen3& operator=(const CpuQwen3&) = delete;

  const ModelConfig& config() const override { return cfg_; }
  KvCacheLayout kv_layout() const override { return KvCacheLayout::for_model(cfg_, sizeof(float)); }
  Result<void> forward(std::span<const SequenceChunk> batch, const KvCacheView& kv, ForwardOutput& out) override;

  // Reads the weights of `model_dir` into the weights allocation in place (an
  // in-place weight update: same addresses). The checkpoint must have this
  // model's architecture (kInvalidArgument listing what differs); the weights
  // must be resident (kConflict otherwise). A checkpoint that fails its checks
  // changes nothing.
  Result<void> reload_weights(const std::filesystem::path& model_dir);
  // An in-place update from a directory (as reload_weights) or host shared
  // memory (kShm: bf16/f16/f32 tensors converted to fp32). kCudaIpc is
  // refused: it needs the CUDA model. Everything is checked here; apply()
  // writes. Same preconditions as reload_weights.
  Result<std::unique_ptr<PreparedWeightUpdate>> prepare_weight_update(const WeightUpdate& update);

  uint64_t weights_bytes() const { return weights_alloc_ ? weights_alloc_->bytes : 0; }
  uint64_t scratch_bytes() const { return scratch_alloc_ ? scratch_alloc_->bytes : 0; }

 private:
  CpuQwen3(ModelConfig cfg, std::unique_ptr<memory::MemoryPool> own_memory, memory::MemoryPool& memory,
           ThreadPool& threads);
  // Allocates the weights (and scratch for scratch_rows tokens) and reads the checkpoint.
  Result<void> reserve_memory(const std::filesystem::path& model_dir, int32_t scratch_rows);
  Result<void> require_resident_weights(const std::string& where) const;
  // prepare_weight_update, with `call` opening its messages.
  Result<std::unique_ptr<PreparedWeightUpdate>> prepare_update(const WeightUpdate& update, const std::string& call);

  ModelConfig cfg_;
  std::unique_ptr<memory::MemoryPool> own_memory_;  // set when load() made the pool
  memory::MemoryPool& memory_;
  ThreadPool& threads_;
  std::optional<memory::Allocation> weights_alloc_;
  cpu::Weights w_;
  std::optional<memory::Allocation> scratch_alloc_;
  size_t scratch_rows_ = 0;
  std::vector<float> inv_freq_;  // [head_dim / 2]
};

}  // namespace siesta
