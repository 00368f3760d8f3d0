// CUDA pieces of the ipc backend: mapping a peer's cuMem allocation (exported
// as a POSIX file descriptor) into this process, and exportable allocations
// for benchmarks and tests; piece_copy.h copies. Compiled when the build has
// CUDA (SIESTA_HAVE_CUDA); without it every call fails with a message that
// says so. Host-memory transfers never call into this file.
//
// The driver API is reached through the CUDA runtime's entry-point lookup
// (cudaGetDriverEntryPointByVersion), never linked: a binary linked against
// libcuda does not start on a machine without the NVIDIA driver.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace siesta::transfer::ipc {

// A peer's allocation mapped here. On this process's device: read/write for
// it. On another GPU of the host: read/write for this device too when it has
// peer access to the owner (`direct`), else for the owner only, and copies
// are staged by the CUDA runtime.
struct CudaImport {
  uint64_t address = 0;  // CUdeviceptr of the mapping
  size_t size = 0;       // mapped bytes (the whole allocation, rounded to the granularity)
  uint64_t handle = 0;   // CUmemGenericAllocationHandle
  int owner_device = -1;  // where the memory lives (this process's ordinal)
  bool direct = true;     // this device reads and writes it without staging
};

bool cuda_compiled();

// Imports the allocation behind `fd` (cuMemImportFromShareableHandle), reserves
// address space, maps `bytes` of it and grants access as CudaImport says.
// The caller keeps (and closes) fd.
Result<CudaImport> cuda_import(int fd, size_t bytes, int device);
// Unmaps and releases; safe on an empty import.
void cuda_release(CudaImport& import);

// Device memory exportable as a POSIX FD (cuMemCreate with that handle type,
// mapped here). For benchmarks and tests: engines take their memory from the
// memory pool.
struct CudaExportable {
  void* base = nullptr;
  size_t bytes = 0;  // rounded up to the allocation granularity
  int fd = -1;       // exported handle; closed by cuda_free_exportable
  uint64_t handle = 0;
};
Result<CudaExportable> cuda_alloc_exportable(size_t bytes, int device);
void cuda_free_exportable(CudaExportable& memory);

}  // namespace siesta::transfer::ipc
