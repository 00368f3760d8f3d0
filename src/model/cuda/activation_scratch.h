// cuda::ActivationScratch: every buffer a pass writes and reads back, in one
// device allocation (tag scratch) sized for the largest pass the options
// allow, plus the pinned host memory of the step image and of the chosen
// tokens. Scratch holds nothing from one call to the next, so a sleep may
// release it and give it back zero-filled at the same addresses.
//
// Host code of src/model/cuda only (not part of the model's interface).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"
#include "model/config.h"
#include "model/cuda/device_allocator.h"
#include "model/cuda/kernels.h"

namespace siesta::cuda {

struct ScratchSizes {
  int max_batch_tokens = 0;
  int max_seqs = 0;
  int max_model_len = 0;
  int partial_parts = 0;   // decode attention partitions per (sequence, head)
  size_t trace_bytes = 0;  // the instrumentation's timelines (0: none)
  size_t gemm_workspace_bytes = 0;
};

class ActivationScratch {
 public:
  static Result<ActivationScratch> allocate(const ModelConfig& cfg, const ScratchSizes& sizes, DeviceAllocator& alloc);
  ActivationScratch() = default;
  ActivationScratch(ActivationScratch&& other) noexcept;
  ActivationScratch& operator=(ActivationScratch&& other) noexcept;
  ActivationScratch(const ActivationScratch&) = delete;
  ActivationScratch& operator=(const ActivationScratch&) = delete;
  ~ActivationScratch();

  size_t bytes() const { return buffer_.bytes(); }

  bf16 *x = nullptr, *h = nullptr, *qkv = nullptr, *q = nullptr, *attn = nullptr, *proj = nullptr;
  bf16 *gu = nullptr, *act = nullptr, *hn = nullptr;
  float* logits = nullptr;
  float* partial_out = nullptr;
  float* partial_ml = nullptr;
  void* gemm_ws = nullptr;
  std::byte* meta = nullptr;            // the step image on the device
  unsigned long long* trace = nullptr;  // ScratchSizes::trace_bytes of it, or null
  size_t meta_capacity = 0;
  int logits_rows_cap = 0;

  std::byte* host_meta = nullptr;  // pinned: the step image
  // Pinned and mapped: the chosen tokens, which the sampling kernel writes
  // there itself (through `chosen`, the device's address of it), so that no
  // copy follows it in the stream (bench/results/cuda_choices.md).
  int32_t* host_chosen = nullptr;
  int32_t* chosen = nullptr;

 private:
  void release();
  DeviceBuffer buffer_;
};

}  // namespace siesta::cuda
