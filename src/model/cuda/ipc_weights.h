// IpcWeightBuffers: the CUDA IPC buffers of a weight update (another
// process's device memory on this GPU, named by cudaIpcMemHandle_t), opened
// in this process's context for the life of the object.
//
//   SIESTA_ASSIGN_OR_RETURN(IpcWeightBuffers b, IpcWeightBuffers::open(update.buffers, device));
//   const std::byte* p = b.data(i);        // device address of buffer i (its `offset` applied)
//   ... copy from p ...; destroying b closes every handle (cudaIpcCloseMemHandle)
//
// open() makes sure each buffer lies inside the allocation its handle names
// (cuMemGetAddressRange of the opened address): a buffer described larger
// than its allocation is refused before anything reads it. The same handle
// given for several buffers is opened once (the driver maps an allocation
// once per context). Errors are kInvalidArgument naming the buffer and the
// CUDA error; nothing stays open after a failed open().
// Thread safety: one thread at a time (the model's owner).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "model/weight_update.h"

namespace siesta::cuda {

class IpcWeightBuffers {
 public:
  static Result<IpcWeightBuffers> open(std::span<const CudaIpcBuffer> buffers, int device);
  IpcWeightBuffers(IpcWeightBuffers&& other) noexcept;
  IpcWeightBuffers& operator=(IpcWeightBuffers&& other) noexcept;
  ~IpcWeightBuffers();

  const std::byte* data(size_t i) const { return starts_[i]; }
  // The bytes each buffer may be read at (as described, checked against its allocation).
  const std::vector<uint64_t>& sizes() const { return sizes_; }
  size_t handles_opened() const { return opened_.size(); }

 private:
  IpcWeightBuffers() = default;
  void close_all();

  int device_ = 0;
  std::vector<void*> opened_;  // one per distinct handle
  std::vector<const std::byte*> starts_;
  std::vector<uint64_t> sizes_;
};

}  // namespace siesta::cuda
