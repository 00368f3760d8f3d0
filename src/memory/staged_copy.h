// Staged copies: device memory to and from ordinary (pageable) host memory
// through a small ring of pinned staging slots, so that offloading N bytes
// needs no pinned allocation of N bytes.
//
// Why: pinning host memory (cuMemHostAlloc) runs at ~2.1 GB/s on the H200
// machine, while the copy itself runs at ~55 GB/s; a sleep that pins a buffer
// the size of the weights spends almost all its time pinning. With a ring,
// the pinned memory is allocated once per backend (a few slots of tens of
// MiB) and reused by every sleep and wake.
//
//   to host:   device --DMA--> slot i --memcpy (host threads)--> destination
//   from host: source --memcpy (host threads)--> slot i --DMA--> device
// The DMA of the next slots runs while the host threads copy the current one.
//
//   StagingRing ring{slots, slot_bytes};                 // pinned memory, owned by the caller
//   SIESTA_TRY(staged_copy_to_host(dma, ring, threads, host_dst, device_src, bytes));
//
// The DMA side is an interface (StagingDma), so the pipeline is tested on the
// host with a fake; the CUDA backend implements it with one stream and one
// event per slot. Both calls return only when every copy has completed (also
// on error: nothing is left in flight on a slot).
#pragma once

#include <cstddef>
#include <vector>

#include "common/status.h"

namespace siesta {
class ThreadPool;
}

namespace siesta::memory {

// Pinned host slots; every slot holds slot_bytes.
struct StagingRing {
  std::vector<void*> slots;
  size_t slot_bytes = 0;
};

// The device side of a staged copy. Copies are asynchronous and ordered per
// slot; wait(slot) returns when the last copy issued on that slot is done.
class StagingDma {
 public:
  virtual ~StagingDma() = default;
  virtual Ok to_slot(size_t slot, const void* device_src, size_t bytes) = 0;
  virtual Ok from_slot(size_t slot, void* device_dst, size_t bytes) = 0;
  virtual Ok wait(size_t slot) = 0;
};

// Copies `bytes` from device memory to host memory (any host memory; fresh
// pageable memory is first touched by the copying threads, in parallel).
Ok staged_copy_to_host(StagingDma& dma, const StagingRing& ring, ThreadPool& threads, void* host_dst,
                       const void* device_src, size_t bytes);

// Copies `bytes` from host memory to device memory.
Ok staged_copy_from_host(StagingDma& dma, const StagingRing& ring, ThreadPool& threads, void* device_dst,
                         const void* host_src, size_t bytes);

// memcpy split over the pool's threads in pieces of at least 1 MiB.
void parallel_memcpy(ThreadPool& threads, void* dst, const void* src, size_t bytes);

}  // namespace siesta::memory
