// WeightUpload: host-to-device copies of checkpoint tensors at full speed.
//
//   SIESTA_ASSIGN_OR_RETURN(auto up, WeightUpload::create());
//   SIESTA_TRY(up->copy(device_dst, mmapped_tensor, bytes));   // returns when the copy is done
//   SIESTA_TRY(up->copy_files(pieces));                        // checkpoint files, read in parallel
//
// A tensor comes from a memory-mapped safetensors file: ordinary pageable
// memory whose pages fault in on first touch. A plain cudaMemcpy from it runs
// on one thread, faulting page by page. Here the copy goes through a small
// ring of pinned slots (memory/staged_copy.h): host threads copy (and fault
// in) slices of the tensor into the slots in parallel while the previous
// slots are copied to the device. Used at load and by
// CudaQwen3::reload_weights (sleep level 2, in-place weight updates).
//
// copy_files is the checkpoint's fast path: no mapping is touched. The pieces
// (file ranges and their device destinations) are cut into reads of up to
// one slot; each copy thread owns two pinned slots, a stream and an event per
// slot, and loops: wait until its slot's last copy is done, pread the next
// read straight into it (page cache -> pinned memory, no page faults), issue
// the slot's copies to the destinations in it, and take the next read while
// those run. Files are read in parallel (as many reads in flight as
// threads), and the copies of different threads overlap each other and the
// reads, so a checkpoint in the page cache arrives at about the smaller of
// the pinned host-to-device bandwidth and the threads' pread rate.
//
// The host-to-device copies out of the pinned slots (both paths) are made by
// the SMs: one launch of the gather kernel (gather/gather_copy.h) per slot,
// over every destination in it, reading the slot through its device mapping
// (cudaMallocHost memory is mapped under unified addressing; the pointer
// comes from cudaHostGetDevicePointer). The copy engines run host->device at
// ~23-29 GB/s on the H200 for seconds after a large device range was
// released and mapped again, as a level-2 wake does, where SM loads keep
// ~51 GB/s (memory/host_to_device_copy.h). With HostToDeviceCopy::kCopyEngine,
// or where the build has no kernel code for the device, one cudaMemcpyAsync
// per destination instead.
// Thread safety: one thread at a time (the model's owner).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "common/status.h"
#include "memory/host_to_device_copy.h"

namespace siesta::cuda {

class WeightUpload {
 public:
  // slots x slot_bytes of pinned host memory; copy_threads 0: min(8, cores)
  // (copy_files: min(12, cores), two slots of file_slot_bytes each, pinned
  // at its first call). `device`: the CUDA device the copies go to.
  // `host_to_device`: what copies out of the slots (unset:
  // memory::resolve_host_to_device_copy, the kernel unless
  // SIESTA_HOST_TO_DEVICE_COPY says otherwise).
  static Result<std::unique_ptr<WeightUpload>> create(size_t slots = 4, size_t slot_bytes = size_t{16} << 20,
                                                      size_t copy_threads = 0, int device = 0,
                                                      size_t file_slot_bytes = size_t{8} << 20,
                                                      std::optional<memory::HostToDeviceCopy> host_to_device = {});
  ~WeightUpload();
  WeightUpload(const WeightUpload&) = delete;
  WeightUpload& operator=(const WeightUpload&) = delete;

  Result<void> copy(void* device_dst, const void* host_src, size_t bytes);

  // What copies out of the slots: kKernel, or kCopyEngine (chosen so, or
  // the build has no kernel code for this device).
  memory::HostToDeviceCopy host_to_device() const;

  // `bytes` of file `path` from `offset` go to device_dst.
  struct FilePiece {
    std::string path;
    uint64_t offset = 0;
    void* device_dst = nullptr;
    size_t bytes = 0;
  };
  // Copies every piece (any order, any files) as the header says; returns when
  // every byte is on the device. An error (a short read, a CUDA error) names
  // the file; copies already issued are waited for first.
  Result<void> copy_files(std::span<const FilePiece> pieces);

  struct State;

 private:
  explicit WeightUpload(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace siesta::cuda
