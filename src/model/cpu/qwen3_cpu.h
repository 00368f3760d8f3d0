// CpuQwen3: the fp32 reference implementation of Model on the CPU.
//
//   SIESTA_ASSIGN_OR_RETURN(auto model, CpuQwen3::load(model_dir, pool));
//   std::vector<float> kv(num_blocks * model->kv_layout().block_elems());
//   model->forward(batch, KvCacheView{kv.data(), num_blocks, model->kv_layout()}, out);
//
// Weights are converted to fp32 at load. Every kernel computes each output
// element in a fixed order that depends only on that element's inputs, so a
// sequence's logits are bit-identical whatever else is in its batch and however
// its prompt is chunked. forward() uses the ThreadPool given at load; call it
// from one thread at a time.
#pragma once

#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/config.h"
#include "model/forward.h"

namespace siesta {

class ThreadPool;
class TensorStore;

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

struct Weights {
  std::vector<float> arena;  // every tensor below points into it
  const float* embed = nullptr;    // [vocab, hidden]
  std::vector<LayerWeights> layers;
  const float* final_norm = nullptr;  // [hidden]
  const float* lm_head = nullptr;     // [vocab, hidden]; == embed when tied
};

// Reads and converts every Qwen3 tensor; errors name the tensor and file.
Result<Weights> load_weights(const ModelConfig& cfg, const TensorStore& store);

}  // namespace cpu

class CpuQwen3 final : public Model {
 public:
  static Result<std::unique_ptr<CpuQwen3>> load(const std::filesystem::path& model_dir, ThreadPool& pool);
  CpuQwen3(ModelConfig cfg, cpu::Weights weights, ThreadPool& pool);

  const ModelConfig& config() const override { return cfg_; }
  KvCacheLayout kv_layout() const override { return KvCacheLayout::for_model(cfg_, sizeof(float)); }
  Result<void> forward(std::span<const SequenceChunk> batch, const KvCacheView& kv, ForwardOutput& out) override;

 private:
  ModelConfig cfg_;
  cpu::Weights w_;
  ThreadPool& pool_;
  std::vector<float> inv_freq_;  // [head_dim / 2]
};

}  // namespace siesta
