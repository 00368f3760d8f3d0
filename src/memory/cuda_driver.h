// CudaDriver: the CUDA driver API functions the CUDA backend calls, loaded at
// run time (dlopen of libcuda.so.1, then cuGetProcAddress for the versions that
// match the headers we compiled against).
//
// Why not link libcuda: every siesta binary links the memory library, and a
// binary linked against libcuda does not even start on a machine without the
// NVIDIA driver (CI, the development machines). Loaded at run time, the same
// binary runs everywhere; only make_cuda_backend fails, with a message.
//
// Private to src/memory (it includes cuda.h, which public headers must not).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace siesta::memory {

// X(name, version) for every function used: the member is typed with the
// driver's typedef for that exact version (cudaTypedefs.h) and resolved with
// cuGetProcAddress at that version. Asking for CUDA_VERSION instead would hand
// back whatever the newest ABI of a name is: with CUDA 13 headers
// "cuCtxSynchronize" resolves to cuCtxSynchronize_v2(CUcontext), and calling
// it through a (void) pointer passes a garbage context.
#define SIESTA_CUDA_DRIVER_FUNCTIONS(X)                                                                  \
  X(cuInit, 2000) X(cuDriverGetVersion, 2020) X(cuGetErrorName, 6000) X(cuGetErrorString, 6000)          \
  X(cuDeviceGetCount, 2000) X(cuDeviceGet, 2000) X(cuDeviceGetName, 2000) X(cuDeviceGetAttribute, 2000)  \
  X(cuDeviceTotalMem, 3020) X(cuDevicePrimaryCtxRetain, 7000) X(cuDevicePrimaryCtxRelease, 11000)        \
  X(cuCtxSetCurrent, 4000) X(cuCtxSynchronize, 2000) X(cuMemGetInfo, 3020)                               \
  X(cuMemGetAllocationGranularity, 10020) X(cuMemAddressReserve, 10020) X(cuMemAddressFree, 10020)       \
  X(cuMemCreate, 10020) X(cuMemRelease, 10020) X(cuMemMap, 10020) X(cuMemUnmap, 10020)                   \
  X(cuMemSetAccess, 10020) X(cuMemExportToShareableHandle, 10020)                                        \
  X(cuMemImportFromShareableHandle, 10020) X(cuMemHostAlloc, 2020) X(cuMemFreeHost, 2000)                \
  X(cuMemcpyHtoD, 3020) X(cuMemcpyDtoH, 3020) X(cuMemsetD8, 3020) X(cuMemcpyHtoDAsync, 3020)               \
  X(cuMemcpyDtoHAsync, 3020) X(cuStreamCreate, 2000) X(cuStreamDestroy, 4000) X(cuEventCreate, 2000)     \
  X(cuEventRecord, 2000) X(cuEventSynchronize, 2000) X(cuEventDestroy, 4000) X(cuMemHostRegister, 6050)      \
  X(cuMemHostUnregister, 4000) X(cuMemHostGetDevicePointer, 3020)

struct CudaDriver {
#define SIESTA_CUDA_DECLARE_(name, version) PFN_##name##_v##version name = nullptr;
  SIESTA_CUDA_DRIVER_FUNCTIONS(SIESTA_CUDA_DECLARE_)
#undef SIESTA_CUDA_DECLARE_

  int driver_version = 0;  // e.g. 13000

  // Loads the driver and calls cuInit. kUnavailable when there is no driver
  // or no device, with a message that says which.
  static Result<std::unique_ptr<CudaDriver>> load();

  // "CUDA_ERROR_OUT_OF_MEMORY (out of memory)".
  std::string error_text(CUresult result) const;

  // Ok, or a Status "<what>: <error text>": kOutOfMemory for out-of-memory
  // results, kIo for other refusals by the driver.
  Ok check(CUresult result, std::string_view what) const;
};

}  // namespace siesta::memory
