// The CUDA backend: pool memory on one GPU through the driver's virtual memory
// management, with the same semantics as HostBackend.
//
//   reserve    cuMemAddressReserve (aligned to the allocation granularity)
//   map        per piece cuMemCreate (device memory; POSIX-FD handle type
//              requested where the device supports it, and gpuDirectRDMACapable
//              where CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
//              says so) and cuMemMap; one cuMemSetAccess (read/write for this
//              device) over the range; zero-filled with cuMemsetD8 when asked
//   release    cuMemUnmap, then cuMemRelease of every piece: the driver frees
//              the memory once no exported FD and no importer's mapping remain
//   export     cuMemExportToShareableHandle: one POSIX FD per piece
//   offload    pinned host memory (cuMemHostAlloc), cuMemcpyDtoH / HtoD
//
// The driver is loaded at run time (see cuda_driver.h), so binaries built with
// CUDA start on machines without a GPU; make_cuda_backend then returns
// kUnavailable with the reason (no driver, no device, or a build without CUDA).
// The backend uses the device's primary context and makes it current on every
// call, so it may be driven from any one thread at a time.
#pragma once

#include <memory>

#include "common/status.h"
#include "memory/backend.h"

namespace siesta::memory {

struct CudaBackendOptions {
  int device = 0;  // CUDA device ordinal (after CUDA_VISIBLE_DEVICES)
};

Result<std::unique_ptr<MemoryBackend>> make_cuda_backend(CudaBackendOptions options = {});

}  // namespace siesta::memory
