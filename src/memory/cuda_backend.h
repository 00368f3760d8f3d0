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
//   offload    (OffloadMode::kStaged, the default) ordinary host memory
//              (anonymous mmap, transparent huge pages asked for), copied
//              through a ring of pinned staging slots allocated once per
//              backend (staged_copy.h): cuMemcpyDtoHAsync / HtoDAsync on the
//              backend's own stream, the host side split over copy threads;
//              (kPinned) pinned host memory of the allocation's size
//              (cuMemHostAlloc) per offload, cuMemcpyDtoH / HtoD
//   restore    (kStaged) host->device from pinned memory (the kept buffers'
//              pinned part, the staging slots) by the gather kernel
//              (gather/gather_copy.h) reading the host memory through its
//              device mapping (launched through the CUDA runtime in the
//              backend's context), or by cuMemcpyHtoDAsync
//              (host_to_device_copy.h); device->host always by
//              cuMemcpyDtoHAsync
//
// Why staged by default: on the H200 machine cuMemHostAlloc pins at ~2.1 GB/s
// against ~55 GB/s for the copy, so a pinned offload of 64 GiB took 38 s, of
// which 1.2 s was copying. bench/results/memory_cuda_offload_{staged,pinned}.json
// compare both.
//
// The driver is loaded at run time (see cuda_driver.h), so binaries built with
// CUDA start on machines without a GPU; make_cuda_backend then returns
// kUnavailable with the reason (no driver, no device, or a build without CUDA).
// The backend uses the device's primary context and makes it current on every
// call, so it may be driven from any one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "common/status.h"
#include "memory/backend.h"
#include "memory/host_to_device_copy.h"

namespace siesta::memory {

// Where offloaded contents (sleep level 1) go, and how they get there.
enum class OffloadMode : uint8_t {
  kStaged = 0,  // ordinary host memory, through a reusable pinned staging ring
  kPinned = 1,  // pinned host memory allocated per offload, copied directly
};

const char* offload_mode_name(OffloadMode mode);  // "staged", "pinned"

struct CudaBackendOptions {
  int device = 0;  // CUDA device ordinal (after CUDA_VISIBLE_DEVICES)
  OffloadMode offload = OffloadMode::kStaged;
  // The staging ring (kStaged): slots x slot bytes of pinned host memory,
  // allocated at the first staged copy and kept for the backend's life.
  size_t staging_slots = 4;
  size_t staging_slot_bytes = size_t{32} << 20;
  // Host threads that copy between the slots and host memory (and first
  // touch fresh host memory); 0: min(8, cores) (16 measured no faster on the
  // 16-core H200 machine: bench/results/memory_cuda_offload_threads.json).
  size_t copy_threads = 0;
  // kStaged: pin the host buffers a pool keeps between offloads
  // (PoolOptions::keep_offload_buffers), in the background, so that later
  // sleeps and wakes copy them by direct DMA.
  bool pin_kept_buffers = true;
  // kStaged: what copies pinned host memory to the device at wake (the kept
  // buffers' pinned part, the staging slots): the SMs (kKernel; the copy
  // engines where the build has no kernel code for the device) or the copy
  // engines. Unset: resolve_host_to_device_copy (SIESTA_HOST_TO_DEVICE_COPY,
  // else kKernel). kPinned copies with the copy engines either way.
  std::optional<HostToDeviceCopy> host_to_device;
};

Result<std::unique_ptr<MemoryBackend>> make_cuda_backend(CudaBackendOptions options = {});

}  // namespace siesta::memory
