// WeightUpload: host-to-device copies of checkpoint tensors at full speed.
//
//   SIESTA_ASSIGN_OR_RETURN(auto up, WeightUpload::create());
//   SIESTA_TRY(up->copy(device_dst, mmapped_tensor, bytes));   // returns when the copy is done
//
// A tensor comes from a memory-mapped safetensors file: ordinary pageable
// memory whose pages fault in on first touch. A plain cudaMemcpy from it runs
// on one thread, faulting page by page. Here the copy goes through a small
// ring of pinned slots (memory/staged_copy.h): host threads copy (and fault
// in) slices of the tensor into the slots in parallel while the DMA engine
// moves the previous slots to the device. Used at load and by
// CudaQwen3::reload_weights (sleep level 2, in-place weight updates).
// Thread safety: one thread at a time (the model's owner).
#pragma once

#include <cstddef>
#include <memory>

#include "common/status.h"

namespace siesta::cuda {

class WeightUpload {
 public:
  // slots x slot_bytes of pinned host memory; copy_threads 0: min(8, cores).
  static Result<std::unique_ptr<WeightUpload>> create(size_t slots = 4, size_t slot_bytes = size_t{16} << 20,
                                                      size_t copy_threads = 0);
  ~WeightUpload();
  WeightUpload(const WeightUpload&) = delete;
  WeightUpload& operator=(const WeightUpload&) = delete;

  Result<void> copy(void* device_dst, const void* host_src, size_t bytes);

  struct State;

 private:
  explicit WeightUpload(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace siesta::cuda
