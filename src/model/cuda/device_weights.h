// cuda::DeviceWeights: the model's weights in one device buffer (tag
// weights): where each checkpoint tensor and the RoPE tables sit
// (WeightsLayout, fixed by the config, so a reload writes the same places),
// the pointers a pass reads, and the writes that fill the buffer: checked
// host tensors (checkpoint files, shared memory), device tensors (CUDA IPC),
// and the RoPE table, recomputed after every write since a sleep that
// released the weights zeroes it too.
//
//   SIESTA_ASSIGN_OR_RETURN(DeviceWeights w, DeviceWeights::load(cfg, max_model_len, store, alloc, device));
//   w.layers[l].qkv ...                                  // a pass
//   w.write_host(items); w.write_rope();                 // an in-place update
//
// Host code of src/model/cuda only (not part of the model's interface).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/config.h"
#include "model/cuda/device_allocator.h"
#include "model/cuda/kernels.h"
#include "model/cuda/weight_upload.h"
#include "model/safetensors.h"

namespace siesta::cuda {

struct LayerWeights {
  bf16* qkv = nullptr;      // [q_dim + 2 kv_dim, hidden]: q_proj, k_proj, v_proj rows
  bf16* o = nullptr;        // [hidden, q_dim]
  bf16* gate_up = nullptr;  // [2 inter, hidden]: gate_proj, up_proj rows
  bf16* down = nullptr;     // [hidden, inter]
  bf16* input_norm = nullptr;
  bf16* post_norm = nullptr;
  bf16* q_norm = nullptr;
  bf16* k_norm = nullptr;
};

// Where each checkpoint tensor (and the RoPE tables) sits in the one weights
// buffer. Depends only on the config, so a reload writes the same places.
struct WeightSlot {
  std::string name;
  std::vector<int64_t> shape;
  size_t offset;  // bytes from the buffer's start
};
struct LayerOffsets {
  size_t qkv, o, gate_up, down, input_norm, post_norm, q_norm, k_norm;
};
struct WeightsLayout {
  std::vector<WeightSlot> slots;
  std::vector<LayerOffsets> layers;
  size_t embed = 0, final_norm = 0, lm_head = 0, inv_freq = 0, rope = 0, bytes = 0;
};

WeightsLayout weights_layout(const ModelConfig& cfg, int max_model_len);

// Every tensor of the layout from the store (shape and dtype checked), before
// anything is written.
Result<std::vector<TensorView>> checked_tensors(const WeightsLayout& L, const TensorStore& store);

// A checked tensor and where it goes: `offset` bytes into the weights buffer.
struct HostWrite {
  size_t offset;
  TensorView view;
};
struct DeviceWrite {
  size_t offset;
  const std::byte* src;  // device memory (an opened CUDA IPC buffer)
  DType dtype;
  size_t bytes;
};

class DeviceWeights {
 public:
  // Checks every tensor of `store`, then allocates the buffer and writes them.
  static Result<DeviceWeights> load(const ModelConfig& cfg, int max_model_len, const TensorStore& store,
                                    DeviceAllocator& alloc, int device);

  const WeightsLayout& layout() const { return layout_; }
  size_t bytes() const { return buffer_.bytes(); }

  // Host tensors (checkpoint files, shared memory) to their places, converted to bf16.
  Result<void> write_host(const std::vector<HostWrite>& items);
  // Device tensors (CUDA IPC) to their places: copied, or converted on the GPU (on `stream`).
  Result<void> write_device(const std::vector<DeviceWrite>& items, cudaStream_t stream);
  // inv_freq and the RoPE table, which live with the weights.
  Result<void> write_rope();

  bf16* embed = nullptr;
  bf16* final_norm = nullptr;
  bf16* lm_head = nullptr;
  float* inv_freq = nullptr;
  __nv_bfloat162* rope_table = nullptr;  // [max_model_len, head_dim / 2] (cos, sin)
  std::vector<LayerWeights> layers;

 private:
  ModelConfig cfg_;
  int max_model_len_ = 0;
  int device_ = 0;
  WeightsLayout layout_;
  DeviceBuffer buffer_;
  std::unique_ptr<WeightUpload> upload_;  // pinned staging for checkpoint copies
};

}  // namespace siesta::cuda
